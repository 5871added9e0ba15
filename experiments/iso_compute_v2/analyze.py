"""The iso-compute study's analysis, as protocol.md registers it: per budget the final pass@1
of every (n, B_p) over its seeds, n* and the n*(C) law with intervals from resampling the
seeds, and B_p = 32 against B_p = 8 at each budget (Welch, Holm across budgets).

    python experiments/iso_compute_v2/analyze.py [--study DIR] [--results PATH]

Reads only the stored evidence `runs/C{C}__n{n}__B{B_p}__M{M}__seed_{S}.jsonl`
(`rlscale.scaling.evidence`; a cell's value is its final pass@1, which must be at step M) and
writes results.json (`--study DIR` reads another copy, `--results PATH` writes elsewhere).
It first checks that protocol.md was committed before every stored run.
"""

import glob
import os
import re

import numpy as np

from rlscale.scaling import allocation, evidence, stats

HERE = os.path.dirname(os.path.abspath(__file__))
N_BOOT = 2000  # Seed resamples (protocol.md).
NAME = re.compile(r"C(\d+)__n(\d+)__B(\d+)__M(\d+)__seed_(\d+)")


def cells_of(runs: dict) -> tuple[list, list]:
    """(cells, final pass@1) of the stored runs, one entry per run (seeds repeat cells)."""
    cells, finals = [], []
    for name, run in sorted(runs.items()):
        m = NAME.fullmatch(name)
        if not m:
            raise ValueError(f"run {name!r} is not named C..__n..__B..__M..__seed_..")
        C, n, B, M, _ = map(int, m.groups())
        steps, _, _, acc = run.evals()
        if steps[-1] != M:
            raise ValueError(f"run {name!r}: its last evaluation is at step {steps[-1]}, not M={M}")
        cells.append(allocation.Cell(C, n, B, M, 1, 0))
        finals.append(float(acc[-1]))
    return cells, finals


def by_prompts(cells, finals, numbers: dict) -> str:
    """Per budget: B_p = 32 against B_p = 8, each at its best n (mean over seeds), Welch over
    seeds, Holm across the budgets."""
    groups: dict = {}
    for cell, r in zip(cells, finals):
        groups.setdefault((cell.budget, cell.prompts, cell.rollouts), []).append(r)
    tests = []
    for C in sorted({c.budget for c in cells}):
        best = {}
        for B in (8, 32):
            options = {n: v for (c, b, n), v in groups.items() if (c, b) == (C, B)}
            if options:
                best[B] = max(options.items(), key=lambda kv: np.mean(kv[1]))
        if len(best) == 2 and min(len(v) for _, v in best.values()) >= 2:
            w = stats.welch(best[32][1], best[8][1], names=("B_p=32", "B_p=8"))
            tests.append((C, best[32][0], best[8][0], w))
    if not tests:
        return "(no budget with both B_p and 2 seeds each)"
    rows = [
        "| C | best n at B_p=32 | at B_p=8 | diff | p | Holm p |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (C, n32, n8, w), ph in zip(tests, stats.holm([t[-1].p for t in tests])):
        numbers.update({f"C{C}.bp_diff": w.diff, f"C{C}.bp_p": w.p, f"C{C}.bp_holm": ph})
        rows.append(f"| {C} | {n32} | {n8} | {w.diff:+.4f} | {w.p:.3f} | {ph:.3f} |")
    return "\n".join(rows)


def analyze(runs: dict) -> tuple[dict, dict]:
    cells, finals = cells_of(runs)
    numbers, tables = {}, {}
    optima = allocation.optimal_rollouts(cells, finals)
    scaling = allocation.fit_optimal_rollouts(
        [o.budget for o in optima], [o.n_star for o in optima]
    )
    boot = allocation.bootstrap_optimal_rollouts(cells, finals, n_boot=N_BOOT)
    for o, (lo, hi) in zip(optima, boot.n_star_interval):
        C = o.budget
        numbers.update({f"C{C}.best_n": o.best_rollouts, f"C{C}.n_star": o.n_star})
        numbers.update({f"C{C}.n_star_lo": lo, f"C{C}.n_star_hi": hi})
    numbers.update({"b": scaling.b, "a": scaling.a, "b_lo": boot.b_interval[0]})
    numbers.update({"b_hi": boot.b_interval[1], "grows": float(boot.b_interval[0] > 0)})
    tables["optima"] = allocation.format_allocation_table(optima, scaling)
    tables["bootstrap"] = allocation.format_bootstrap(boot)
    tables["prompts"] = by_prompts(cells, finals, numbers)
    return numbers, tables


def main(argv=None):
    args = evidence.study_parser(HERE).parse_args(argv)
    runs = evidence.read_study(args.study)
    if not runs:
        print(f"no stored runs yet in {os.path.join(args.study, 'runs')}: nothing to analyze")
        return {"runs": {}, "numbers": {}, "tables": {}}
    stored = glob.glob(os.path.join(HERE, "runs", "*.jsonl"))
    evidence.check_preregistered(os.path.join(HERE, "protocol.md"), stored)
    return evidence.report(args, *analyze(runs))


if __name__ == "__main__":
    main()
