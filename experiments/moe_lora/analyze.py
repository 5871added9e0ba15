"""The MoE/LoRA study's analysis, as protocol.md registers it: (a) MoE against dense at equal
active parameters (final pass@1, each run's sigmoid against samples, the first half's
prediction of the second beside the flat and log-linear baselines), (b) router replay on
against off under k = 8 staleness with a bfloat16 generator (final pass@1, logprob gap,
routing disagreement), (c) LoRA ranks 1, 8, 64 against full fine-tuning (a learning-rate
sweep on seeds 0-1 picks each method's rate; fresh seeds at that rate are compared); the
primary family of five Welch tests with Holm's correction.

    python experiments/moe_lora/analyze.py [--plot experiments/moe_lora/curves.png]
    python experiments/moe_lora/analyze.py --select r8   # the sweep's learning rate for r8

Reads only the stored evidence experiments/moe_lora/runs/NAME.jsonl (`rlscale.scaling.
evidence`; names: a_dense_sS, a_moe_sS, b_replay_on_sS, b_replay_off_sS,
c_sweep_METHOD_lrLR_sS, c_confirm_METHOD_lrLR_sS with METHOD full, r1, r8 or r64) and writes
results.json (`--study DIR` reads another copy, `--results PATH` writes elsewhere). With no
stored run it says so and writes nothing.
"""

import math
import os
import re
import sys

import numpy as np

from rlscale.scaling import baselines, evidence, stats
from rlscale.scaling import fit as scaling_fit

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("full", "r1", "r8", "r64")
# The primary family (protocol.md): (name, arm, against).
FAMILY = (
    ("a.moe", "a_moe", "a_dense"),
    ("b.replay", "b_replay_on", "b_replay_off"),
    ("c.r1", "c_confirm_r1", "c_confirm_full"),
    ("c.r8", "c_confirm_r8", "c_confirm_full"),
    ("c.r64", "c_confirm_r64", "c_confirm_full"),
)
EVAL_SAMPLES = 500 * 4  # Held-out problems x samples per evaluation (the testbed's).
ROUTING = re.compile(r"train/\w*rout\w*")
RUN = re.compile(r"(?P<arm>.+?)(_lr(?P<lr>[0-9.e+-]+))?_s(?P<seed>\d+)")


def parse(name: str) -> tuple[str, str | None]:
    """(arm, learning-rate string or None) of a run name; the confirm and sweep arms drop
    the rate from the arm (a method's confirm runs all share the selected one)."""
    m = RUN.fullmatch(name)
    if not m:
        raise ValueError(f"run {name!r} is not named ARM[_lrLR]_sSEED")
    return m.group("arm"), m.group("lr")


def final(run: evidence.StoredRun) -> float:
    return float(run.evals()[3][-1])


def early_half(run: evidence.StoredRun) -> dict:
    """The sigmoid fitted on the evaluations up to half the run's samples (R0: step 0),
    scored on the rest beside the flat and log-linear baselines; noise: one evaluation's
    binomial standard error at the final pass@1 over `EVAL_SAMPLES` samples. `beats`: the
    half-fit is identified and beats both baselines by more than the noise."""
    _, _, samples, acc = run.evals()
    x, y = np.asarray(samples, float), np.asarray(acc, float)
    keep = x > 0
    try:
        ex = scaling_fit.extrapolation_check(x[keep], y[keep], fit_until=x[-1] / 2, r0=y[0])
    except ValueError as e:
        return {"error": str(e)}
    noise = baselines.binomial_se(float(y[-1]), EVAL_SAMPLES)
    return {
        "mae": ex.mae,
        "flat_mae": ex.baselines.flat_mae,
        "line_mae": ex.baselines.line_mae,
        "noise": noise,
        # Good only off every bound and beating both baselines by more than the noise.
        "beats": float(
            not ex.fit.at_bounds and baselines.beats_baselines(ex.mae, ex.baselines, noise)
        ),
        "half_at_bounds": ", ".join(ex.fit.at_bounds),
    }


def study_a(runs: dict, numbers: dict) -> str:
    """(a): per run, the final pass@1, the sigmoid on all evaluations against samples (its
    parameters on a bound) and the first half's prediction; fills `numbers`."""
    head = "| run | final | A | B | C_mid (samples) | on a bound | half: MAE | flat | line | "
    lines = [head + "beats both by > noise |", "| --- " * 10 + "|"]
    for name, run in sorted(runs.items()):
        _, _, samples, acc = run.evals()
        x, y = np.asarray(samples, float), np.asarray(acc, float)
        try:
            fit = scaling_fit.fit_sigmoid(x[x > 0], y[x > 0], r0=float(y[0]))
            cells = (
                f"{fit.A:.3f} | {fit.B:.2f} | {fit.C_mid:.3g} | {', '.join(fit.at_bounds) or '-'}"
            )
            numbers[f"{name}.A"], numbers[f"{name}.n_at_bounds"] = fit.A, float(len(fit.at_bounds))
        except ValueError as e:
            cells = f"no fit: {e} | | |"
        half = early_half(run)
        numbers[f"{name}.final"] = final(run)
        numbers.update({f"{name}.half.{k}": v for k, v in half.items() if k != "error"})
        numbers.pop(f"{name}.half.half_at_bounds", None)
        if "error" in half:
            pred = f"no fit: {half['error']} | | | |"
        else:
            pred = (
                f"{half['mae']:.4f} | {half['flat_mae']:.4f} | {half['line_mae']:.4f} | "
                f"{'yes' if half['beats'] else 'no'}"
                + (
                    f" (half on a bound: {half['half_at_bounds']})"
                    if half["half_at_bounds"]
                    else ""
                )
            )
        lines.append(f"| {name} | {final(run):.4f} | {cells} | {pred} |")
    for arm in ("a_dense", "a_moe"):
        halves = [early_half(r) for n, r in runs.items() if parse(n)[0] == arm]
        halves = [h for h in halves if "error" not in h]
        for k in ("mae", "flat_mae", "line_mae", "beats"):
            if halves:
                numbers[f"{arm}.half.mean_{k}"] = float(np.mean([h[k] for h in halves]))
    return "\n".join(lines)


def step_mean(run: evidence.StoredRun, pattern) -> dict:
    keys = sorted({k for line in run.lines for k in line if pattern.fullmatch(k)})
    return {k: float(np.mean(run.series(k)[1])) for k in keys}


def study_b(runs: dict, numbers: dict) -> str:
    """(b): per arm, the final pass@1, the mean logprob gap and routing disagreement."""
    gap = re.compile(r"train/(logp_gap_abs|trainer_logp_gap)|pipeline/staleness_mean")
    lines = ["| arm | seeds | final (mean +- se) | metric | mean over steps and seeds |"]
    lines.append("| --- " * 5 + "|")
    for arm in ("b_replay_on", "b_replay_off"):
        arm_runs = [r for n, r in sorted(runs.items()) if parse(n)[0] == arm]
        if not arm_runs:
            continue
        v = [final(r) for r in arm_runs]
        se = float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
        means = {}
        for r in arm_runs:
            for k, x in {**step_mean(r, gap), **step_mean(r, ROUTING)}.items():
                means.setdefault(k, []).append(x)
        head = f"| {arm} | {len(v)} | {np.mean(v):.4f} +- {se:.4f} |"
        numbers[f"{arm}.final"] = float(np.mean(v))
        for k, xs in sorted(means.items()):
            numbers[f"{arm}.{k}"] = float(np.mean(xs))
            lines.append(f"{head} {k} | {np.mean(xs):.3e} |")
            head = "| | | |"
        if not means:
            lines.append(f"{head} - | - |")
    return "\n".join(lines)


def sweep(runs: dict) -> dict:
    """{method: {lr string: [final per sweep seed]}} of the c_sweep_ runs."""
    out = {}
    for name, run in runs.items():
        arm, lr = parse(name)
        if arm.startswith("c_sweep_"):
            out.setdefault(arm[len("c_sweep_") :], {}).setdefault(lr, []).append(final(run))
    return out


def select(cells: dict) -> str:
    """The learning rate of the highest mean final pass@1 (to 4 decimals; ties: the lower)."""
    return min(cells, key=lambda lr: (-round(float(np.mean(cells[lr])), 4), float(lr)))


def study_c(runs: dict, numbers: dict) -> str:
    """(c): the sweep's table (mean final per method and rate, the selected rate, whether it
    is at an edge of the grid) and the confirm runs' rates checked against the selection."""
    lines = ["| method | lr | sweep seeds | sweep final (mean) | selected |", "| --- " * 5 + "|"]
    for method, cells in sorted(sweep(runs).items()):
        chosen, grid = select(cells), sorted(cells, key=float)
        edge = chosen in (grid[0], grid[-1]) and len(grid) > 1
        numbers[f"c.{method}.selected_lr"] = float(chosen)
        numbers[f"c.{method}.selected_at_edge"] = float(edge)
        for lr in grid:
            numbers[f"c.sweep.{method}.lr{lr}.mean"] = float(np.mean(cells[lr]))
            mark = ("yes, at the grid's edge" if edge else "yes") if lr == chosen else ""
            lines.append(
                f"| {method} | {lr} | {len(cells[lr])} | {np.mean(cells[lr]):.4f} | {mark} |"
            )
    for name in sorted(runs):
        arm, lr = parse(name)
        method = arm[len("c_confirm_") :]
        key = f"c.{method}.selected_lr"
        if arm.startswith("c_confirm_") and key in numbers and float(lr) != numbers[key]:
            lines.append(f"| {method} | {lr} | confirm run {name} is not at the selected rate | |")
    return "\n".join(lines)


def tests(runs: dict, numbers: dict) -> str:
    """The primary family's Welch tests on final pass@1, each on the seeds both of its arms
    have (protocol.md's stopping rule), Holm-adjusted across the tests present."""
    values = {}
    for name, run in runs.items():
        values.setdefault(parse(name)[0], {})[RUN.fullmatch(name).group("seed")] = final(run)
    pairs = []
    for key, a, b in FAMILY:
        common = sorted(set(values.get(a, {})) & set(values.get(b, {})), key=int)
        if len(common) >= 2:
            pairs.append(
                (key, a, b, [values[a][s] for s in common], [values[b][s] for s in common])
            )
    numbers["family.tests"] = float(len(pairs))
    lines = ["| test | arm | against | seeds | difference | t | df | p | Holm p |"]
    lines.append("| --- " * 9 + "|")
    if not pairs:
        return "\n".join(lines + ["| (no pair of arms with 2 common seeds) |"])
    results = [stats.welch(va, vb, names=(a, b)) for _, a, b, va, vb in pairs]
    for (key, a, b, _, _), w, p_holm in zip(pairs, results, stats.holm([w.p for w in results])):
        numbers.update({f"test.{key}.diff": w.diff, f"test.{key}.p": w.p})
        numbers[f"test.{key}.holm"] = p_holm
        lines.append(
            f"| {key} | {a} | {b} | {w.n_a} / {w.n_b} | {w.diff:+.4f} | {w.t:.2f} | "
            f"{w.df:.1f} | {w.p:.4f} | {p_holm:.4f} |"
        )
    return "\n".join(lines)


def analyze(runs: dict) -> tuple[dict, dict]:
    """(numbers, tables) of the study from the stored runs {NAME: StoredRun}."""
    numbers = {}
    part = {p: {n: r for n, r in runs.items() if n.startswith(p + "_")} for p in "abc"}
    tables = {"tests": tests(runs, numbers)}
    if part["a"]:
        tables["a"] = study_a(part["a"], numbers)
    if part["b"]:
        tables["b"] = study_b(part["b"], numbers)
    if part["c"]:
        tables["c"] = study_c(part["c"], numbers)
    return numbers, tables


def main(argv=None):
    parser = evidence.study_parser(HERE)
    parser.add_argument("--select", default="", help="print METHOD's selected rate and exit")
    args = parser.parse_args(argv)
    runs = evidence.read_study(args.study)
    if args.select:
        cells = sweep(runs).get(args.select)
        if not cells:
            sys.exit(f"no stored sweep runs c_sweep_{args.select}_lr*_s* to select from")
        print(select(cells))
        return select(cells)
    if not runs:
        print(f"no stored runs yet in {os.path.join(args.study, 'runs')}: nothing to analyze")
        return {"runs": {}, "numbers": {}, "tables": {}}
    results = evidence.report(args, *analyze(runs))
    if args.plot:
        plot(runs, args.plot)
    return results


def plot(runs: dict, path: str) -> None:
    """Held-out pass@1 against samples: (a), (b) and (c)'s confirm runs, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for ax, prefix, title in zip(axes, ("a_", "b_", "c_confirm_"), ("(a)", "(b)", "(c)")):
        colours = {}
        for name, run in sorted(runs.items()):
            if not name.startswith(prefix):
                continue
            arm = parse(name)[0]
            label = None if arm in colours else arm
            colour = colours.setdefault(arm, f"C{len(colours) % 10}")
            _, _, samples, acc = run.evals()
            ax.plot(samples, acc, "-", color=colour, alpha=0.6, label=label)
        ax.set_title(title)
        ax.set_xlabel("samples")
        if colours:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out pass@1")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
