"""The long-completion testbed's analysis, as protocol.md registers it: the warm start's
ceiling (pass@1, pass@64), the full recipe's sigmoid per seed and across seeds with every
parameter on a bound, and each seed's first half predicting its second beside the flat and
log-linear baselines; the protocol's gates, each passed or not. It first checks that
protocol.md was committed before every stored result (`evidence.check_preregistered`).

    python experiments/long_testbed/analyze.py [--plot experiments/long_testbed/curves.png]

Reads only the stored evidence: `ceiling.json` (the warm start's evaluation report, with its
per-prompt rewards) and `runs/full_sSEED.jsonl` (`rlscale.scaling.evidence`); writes
results.json (`--study DIR` reads another copy, `--results PATH` writes elsewhere).
"""

import glob
import json
import os

import numpy as np

from rlscale.eval import estimators
from rlscale.scaling import baselines, evidence, seeds
from rlscale.scaling import fit as scaling_fit

HERE = os.path.dirname(os.path.abspath(__file__))
EVAL_PROMPTS = 500  # Held-out problems per evaluation (protocol.md).
K = 64  # The ceiling's samples per problem.
GATES = dict(pass1_low=0.05, pass1_high=0.6, gap=0.3, sd_A=0.02)


def ceiling(study: str, numbers: dict) -> str:
    """The warm start's pass@1 and pass@64, recomputed from the per-prompt rewards."""
    path = os.path.join(study, "ceiling.json")
    if not os.path.exists(path):
        return "(no ceiling.json yet)"
    with open(path) as f:
        rewards = np.asarray(json.load(f)["per_prompt"]["rewards"], float)
    correct = (rewards > 0).sum(1)
    p1, pk = (float(estimators.pass_at_k(K, correct, j).mean()) for j in (1, K))
    numbers.update({"ceiling.pass@1": p1, f"ceiling.pass@{K}": pk, "ceiling.prompts": len(rewards)})
    g = GATES
    numbers["gate.ceiling"] = float(g["pass1_low"] <= p1 <= g["pass1_high"] and pk - p1 >= g["gap"])
    return (
        f"| problems | pass@1 | pass@{K} | gap | gate |\n| --- | --- | --- | --- | --- |\n"
        f"| {len(rewards)} | {p1:.3f} | {pk:.3f} | {pk - p1:.3f} | "
        f"{'passed' if numbers['gate.ceiling'] else 'failed'} |"
    )


def curves(runs: dict, numbers: dict) -> str:
    """Per seed and pooled sigmoid fits (R0: the seeds' mean step-0 pass@1), the spread of A,
    the bounds, and the first half's prediction against the baselines."""
    full = {name: run for name, run in sorted(runs.items()) if name.startswith("full_s")}
    if len(full) < 2:
        return f"({len(full)} full-recipe run(s) stored: the fits need 2 seeds)"
    pts = {n: tuple(np.asarray(v, float) for v in r.evals()[1::2]) for n, r in full.items()}
    r0 = float(np.mean([acc[0] for _, acc in pts.values()]))
    fits = seeds.fit_seeds({n: (c[1:], a[1:]) for n, (c, a) in pts.items()}, r0=r0)
    rows = [
        "| run | final pass@1 | A | B | C_mid (FLOPs) | on a bound | half: MAE | flat | line "
        "| noise | beats both |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    beats = []
    for (name, (c, a)), f in zip(pts.items(), fits.per_seed):
        ex = scaling_fit.extrapolation_check(c[1:], a[1:], fit_until=c[-1] / 2, r0=r0)
        noise = baselines.binomial_se(float(np.mean(a[1:][c[1:] > c[-1] / 2])), EVAL_PROMPTS)
        good = not ex.fit.at_bounds and baselines.beats_baselines(ex.mae, ex.baselines, noise)
        beats.append(good)
        b = ex.baselines
        numbers.update(
            {f"{name}.final": float(a[-1]), f"{name}.A": f.A, f"{name}.half.mae": ex.mae},
        )
        numbers.update({f"{name}.half.flat_mae": b.flat_mae, f"{name}.half.line_mae": b.line_mae})
        rows.append(
            f"| {name} | {a[-1]:.3f} | {f.A:.3f} | {f.B:.2f} | {f.C_mid:.3g} | "
            f"{', '.join(f.at_bounds) or '-'} | {ex.mae:.4f} | {b.flat_mae:.4f} | "
            f"{b.line_mae:.4f} | {noise:.4f} | {'yes' if good else 'no'} |"
        )
    A = fits.params["A"]
    numbers.update(
        {
            "R0": r0,
            "A.mean": A.mean,
            "A.sd": A.sd,
            "A.pooled": A.pooled,
            "A.lo": A.interval[0],
            "A.hi": A.interval[1],
            "seeds": len(full),
            "half.beats": float(np.mean(beats)),
            "gate.A_off_bounds": float(set(A.on_bound) <= {"pooled"}),  # Every seed off.
            "gate.sd_A": float(A.sd <= GATES["sd_A"]),
        }
    )
    for key in ("mae", "flat_mae", "line_mae"):
        numbers[f"half.{key}"] = float(np.mean([numbers[f"{n}.half.{key}"] for n in full]))
    rows.append(
        f"\nA over {len(full)} seeds: {A.mean:.3f} +- {A.sd:.3f} (sd); pooled {A.pooled:.3f} "
        f"[{A.interval[0]:.3f}, {A.interval[1]:.3f}] (bootstrap over seeds); on a bound: "
        f"{', '.join(fits.flagged()) or 'none'}"
    )
    return "\n".join(rows)


def analyze(study: str) -> tuple[dict, dict]:
    numbers: dict = {}
    tables = {"ceiling": ceiling(study, numbers)}
    tables["curves"] = curves(evidence.read_study(study), numbers)
    return numbers, tables


def main(argv=None):
    args = evidence.study_parser(HERE).parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.study, "runs", "*.jsonl")))
    files += glob.glob(os.path.join(args.study, "ceiling.json"))
    if not files:
        print(f"nothing stored yet in {args.study}: nothing to analyze")
        return {"runs": {}, "numbers": {}, "tables": {}}
    # The protocol must predate every result stored in the repository (whichever copy is
    # analyzed): raises naming both otherwise.
    stored = glob.glob(os.path.join(HERE, "runs", "*.jsonl")) + [os.path.join(HERE, "ceiling.json")]
    pre = evidence.check_preregistered(os.path.join(HERE, "protocol.md"), stored)
    numbers, tables = analyze(args.study)
    numbers["protocol_time"] = pre["protocol_time"]
    results = evidence.report(args, numbers, tables)
    if args.plot:
        plot(evidence.read_study(args.study), args.plot)
    return results


def plot(runs: dict, path: str) -> None:
    """Held-out pass@1 against FLOPs, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in sorted(runs.items()):
        _, flops, _, acc = run.evals()
        ax.plot(np.asarray(flops[1:], float), acc[1:], "-o", ms=3, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs")
    ax.set_ylabel("held-out pass@1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
