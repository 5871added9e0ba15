"""Tool-integrated RL on `tool_arithmetic` (configs/tool_rl.py): the tool and no-tool arms,
and ZeroTIR's relation between training steps, code-execution frequency and accuracy used to
predict a run's final accuracy from its first third.

    python experiments/tool_rl/analyze.py [--plot experiments/tool_rl/curves.png]

Reads experiments/tool_rl/runs/NAME/metrics.jsonl (run.sh writes them) and prints every
figure the README quotes.

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
extrapolated to the run's final compute; and a flat baseline (the first third's last
evaluation). The final accuracy is the mean of the last two evaluations.
"""

import argparse
import glob
import json
import os

import numpy as np
from scipy import optimize

from rlscale.scaling import fit as scaling_fit

HERE = os.path.dirname(os.path.abspath(__file__))


def read(path):
    lines = [json.loads(x) for x in open(path)]
    evals = [x for x in lines if "eval/pass@1" in x]
    train = [x for x in lines if "env/episodes_with_calls" in x]
    return {
        "eval_step": np.array([x["step"] for x in evals], float),
        "eval_acc": np.array([x["eval/pass@1"] for x in evals]),
        "eval_calls": np.array([x.get("eval/episodes_with_calls", np.nan) for x in evals]),
        "eval_flops": np.array([x["compute/flops"] for x in evals], float),
        "step": np.array([x["step"] for x in train], float),
        "freq": np.array([x["env/episodes_with_calls"] for x in train]),
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", default="")
    args = parser.parse_args()
    runs = {
        os.path.basename(os.path.dirname(p)): read(p)
        for p in sorted(glob.glob(os.path.join(HERE, "runs", "*", "metrics.jsonl")))
    }
    print("run         steps  acc@0  final  calls@0  calls@end")
    for name, r in runs.items():
        final = float(r["eval_acc"][-2:].mean())
        calls = r["eval_calls"]
        print(
            f"{name:<11} {int(r['eval_step'][-1]):5d}  {r['eval_acc'][0]:.3f}  {final:.3f}"
            f"  {calls[0]:7.3f}  {calls[-1]:9.3f}"
        )
    print("\nfinal accuracy predicted from the first third (|error| in brackets)")
    print("run         final  power law       logistic        sigmoid         flat")
    errors = {"power law": [], "logistic": [], "sigmoid": [], "flat": []}
    for name, r in runs.items():
        if not len(r["step"]):  # The no-tool arm runs no code: no law to fit.
            continue
        final = float(r["eval_acc"][-2:].mean())
        cut = r["eval_step"][-1] / 3
        z, zp = zerotir_predict(r, cut)
        zl, _ = zerotir_predict(r, cut, logistic)
        s, _ = sigmoid_predict(r, cut)
        flat = float(r["eval_acc"][r["eval_step"] <= cut][-1])
        row = {"power law": z, "logistic": zl, "sigmoid": s, "flat": flat}
        for k, v in row.items():
            if np.isfinite(v):
                errors[k].append(abs(v - final))
        cells = "  ".join(f"{v:.3f} ({abs(v - final):.3f})" for v in row.values())
        print(f"{name:<11} {final:.3f}  {cells}   power law f0={zp[0]:.2f} alpha={zp[1]:.2f}")
    print("mean |error|: " + "  ".join(f"{k} {np.mean(v):.3f}" for k, v in errors.items() if v))
    if args.plot:
        plot(runs, args.plot)


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
