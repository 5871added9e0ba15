"""Tool-integrated RL on `tool_arithmetic` (configs/tool_rl.py): the tool and no-tool arms,
and ZeroTIR's relation between training steps, code-execution frequency and accuracy used to
predict a run's final accuracy from its first third.

    python experiments/tool_rl/analyze.py [--plot experiments/tool_rl/curves.png]

Reads the stored evidence experiments/tool_rl/runs/NAME.jsonl (`rlscale.scaling.evidence`:
each evaluation's step, FLOPs, samples, pass@1, plus the code-execution frequencies), prints
every figure the README quotes and writes experiments/tool_rl/results.json, which
tests/test_experiments.py checks the README against (`--study DIR` reads another copy of the
study, `--results PATH` writes elsewhere).

The law (after Mai et al. 2025, "Agent RL Scaling Law", arXiv 2505.07773, who find code
frequency, response length and accuracy rising together and predictably with training steps):

* code-execution frequency f (`env/episodes_with_calls`, each training step's fraction of
  episodes that ran code) rises as a saturating power law of the step t,
  f(t) = 1 - (1 - f0) (1 + t)^(-alpha);
* held-out accuracy (`eval/pass@1`) is linear in the frequency at that step,
  acc = a + b f(t).

Fitted on the first third of a run's steps, the two give acc(T) = a + b f(T) at its last
step T. The comparison: the ScaleRL sigmoid fitted on the same first third of the evaluation
curve (against compute, `rlscale.scaling.fit.fit_sigmoid`, R0 the step-0 evaluation) and
extrapolated to the run's final compute; and the two baselines every prediction is scored
beside: flat (the first third's last evaluation held) and a straight line in log-compute
fitted to the first third's evaluations. The final accuracy is the mean of the last two
evaluations.
"""

import os

import numpy as np
from scipy import optimize

from rlscale.scaling import evidence
from rlscale.scaling import fit as scaling_fit

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("power_law", "logistic", "sigmoid", "flat", "log-linear")


def read(run):
    """A `evidence.StoredRun` as the arrays the analysis uses."""
    step, flops, _, acc = run.evals()
    _, _, _, calls = run.evals("eval/episodes_with_calls")
    train_step, freq = run.series("env/episodes_with_calls")
    return {
        "eval_step": np.array(step, float),
        "eval_acc": np.array(acc, float),
        "eval_calls": np.array([np.nan if c is None else c for c in calls], float),
        "eval_flops": np.array(flops, float),
        "step": np.array(train_step, float),
        "freq": np.array(freq, float),
    }


def frequency(t, f0, alpha):
    return 1.0 - (1.0 - f0) * (1.0 + t) ** (-alpha)


def logistic(t, t_mid, width, f_lo):
    return f_lo + (1.0 - f_lo) / (1.0 + np.exp(-(t - t_mid) / width))


def zerotir_predict(run, cut, law=frequency):
    """acc(T) from the steps <= cut: f(t) (`law`) fitted on the training steps, acc = a + b f
    on the evaluations (f at an evaluation's step from the fit)."""
    early = run["step"] <= cut
    t, f = run["step"][early], run["freq"][early]
    if law is frequency:
        p0, bounds = (0.3, 0.5), ([0, 0], [1, 10])
    else:  # The floor: the first steps' frequency, before the rise.
        p0, bounds = (cut, 2.0, f[:3].mean()), ([0, 0.1, 0], [10 * cut, 10 * cut, 1])
    params, _ = optimize.curve_fit(law, t, f, p0=p0, bounds=bounds, maxfev=20000)
    e = run["eval_step"] <= cut
    b, a = np.polyfit(law(run["eval_step"][e], *params), run["eval_acc"][e], 1)
    return float(a + b * law(run["eval_step"][-1], *params)), params


def sigmoid_predict(run, cut):
    """The sigmoid's acc(T) from the evaluations at steps <= cut (NaN where they are too few
    for a fit: it names why)."""
    e = (run["eval_step"] <= cut) & (run["eval_flops"] > 0)
    try:
        fit = scaling_fit.fit_sigmoid(
            run["eval_flops"][e], run["eval_acc"][e], r0=float(run["eval_acc"][0])
        )
    except ValueError as err:
        print(f"  sigmoid: {err}")
        return float("nan"), None
    return float(fit.predict(run["eval_flops"][-1])), fit


def loglinear_predict(run, cut):
    """The straight line acc = a + b log(FLOPs) fitted on the evaluations at steps <= cut
    (compute > 0), at the run's final compute."""
    e = (run["eval_step"] <= cut) & (run["eval_flops"] > 0)
    b, a = np.polyfit(np.log(run["eval_flops"][e]), run["eval_acc"][e], 1)
    return float(a + b * np.log(run["eval_flops"][-1]))


def predictions(name, r, numbers):
    """Each method's final accuracy predicted from the first third; fills `numbers`."""
    final = float(r["eval_acc"][-2:].mean())
    cut = r["eval_step"][-1] / 3
    z, zp = zerotir_predict(r, cut)
    zl, _ = zerotir_predict(r, cut, logistic)
    s, sigmoid_fit = sigmoid_predict(r, cut)
    flat = float(r["eval_acc"][r["eval_step"] <= cut][-1])
    row = dict(zip(METHODS, (z, zl, s, flat, loglinear_predict(r, cut))))
    for k, v in row.items():
        numbers[f"{name}.predicted.{k}"] = v
        numbers[f"{name}.error.{k}"] = abs(v - final)
    f0, alpha = map(float, zp)
    # The f0 the model uses: it enters as 1 - f0, so an f0 under float64's resolution at 1
    # (a fit on its bound at 0, whose last digits differ between machines) is 0.
    numbers[f"{name}.power_law.f0"] = 1.0 - (1.0 - f0)
    numbers[f"{name}.power_law.alpha"] = alpha
    # Every sigmoid parameter on a bound of its fit: there the prediction is the bound's.
    bounds = sigmoid_fit.at_bounds if sigmoid_fit else ()
    numbers[f"{name}.sigmoid.n_at_bounds"] = float(len(bounds))
    return final, row, bounds


def analyze(runs):
    """(numbers, tables) of the study: every figure the README quotes."""
    numbers = {}
    rows = ["| run | held-out pass@1, step 0 | final (mean of the last 2 evaluations) | "
            "episodes that ran code, step 0 -> 40 |", "| --- | --- | --- | --- |"]  # fmt: skip
    for name, r in runs.items():
        final, calls = float(r["eval_acc"][-2:].mean()), r["eval_calls"]
        numbers.update({f"{name}.acc0": float(r["eval_acc"][0]), f"{name}.final": final})
        code = f"{calls[0]:.3f} -> {calls[-1]:.3f}" if np.isfinite(calls[0]) else "-"
        rows.append(f"| {name} | {r['eval_acc'][0]:.3f} | {final:.3f} | {code} |")
    head = " | ".join(k.replace("_", " ") for k in METHODS)
    pred = [f"| run | final | {head} | sigmoid on a bound |", "| --- " * (len(METHODS) + 3) + "|"]
    errors = {k: [] for k in METHODS}
    for name, r in runs.items():
        if not len(r["step"]):  # The no-tool arm runs no code: no law to fit.
            continue
        final, row, bounds = predictions(name, r, numbers)
        for k, v in row.items():
            if np.isfinite(v):
                errors[k].append(abs(v - final))
        cells = " | ".join(f"{v:.3f} ({abs(v - final):.3f})" for v in row.values())
        pred.append(f"| {name} | {final:.3f} | {cells} | {', '.join(bounds) or '-'} |")
    for k, v in errors.items():
        numbers[f"mean_error.{k}"] = float(np.mean(v))
    return numbers, {"runs": "\n".join(rows), "prediction": "\n".join(pred)}


def main(argv=None):
    args = evidence.study_parser(HERE).parse_args(argv)
    runs = {name: read(run) for name, run in evidence.read_study(args.study).items()}
    numbers, tables = analyze(runs)
    print(tables["runs"] + "\n\nfinal accuracy predicted from the first third (|error|)")
    print(tables["prediction"])
    print("mean |error|: " + "  ".join(f"{k} {numbers[f'mean_error.{k}']:.3f}" for k in METHODS))
    path = args.results or os.path.join(args.study, "results.json")
    results = evidence.write_results(path, args.study, numbers, tables)
    print(f"wrote {path}")
    if args.plot:
        plot(runs, args.plot)
    return results


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, r in runs.items():
        ls = "-" if name.startswith("tool") else "--"
        ax0.plot(r["eval_step"], r["eval_acc"], ls, marker="o", ms=3, label=name)
        if len(r["step"]):
            ax1.plot(r["step"], r["freq"], ls, label=name)
    ax0.set_xlabel("step")
    ax0.set_ylabel("held-out pass@1")
    ax1.set_xlabel("step")
    ax1.set_ylabel("episodes that ran code")
    ax0.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
