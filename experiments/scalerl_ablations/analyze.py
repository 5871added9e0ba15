"""Seed statistics of the ScaleRL comparisons (after run.sh): which differences exceed seed noise.

    python experiments/scalerl_ablations/analyze.py ROOT [--baseline full]

Reads every run ROOT/NAME_sSEED (its `scaling/fit.json`: the sigmoid on all evaluations, and
`metrics.jsonl`: the final held-out pass@1) and prints, in Markdown, one row per run and then
one row per variant: the mean and standard deviation over its seeds of the final pass@1, A, B
and log10 C_mid, and each mean's difference from the baseline's in units of their combined
standard error (sqrt(s_a^2 / n_a + s_b^2 / n_b)); |difference| > 2 standard errors is marked
as exceeding seed noise. A sits at a fit bound (1, or its floor) in some runs: those are
marked, and such an A is not an asymptote the data determined.
"""

import argparse
import collections
import glob
import json
import os
import re

import numpy as np

KEYS = ("end", "A", "B", "log10 C_mid")


def load(workdir):
    with open(os.path.join(workdir, "scaling", "fit.json")) as f:
        fit = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        evals = [r["eval/pass@1"] for r in map(json.loads, f) if "eval/pass@1" in r]
    bound = bool(np.isclose(fit["A"], 1.0, atol=1e-6))
    values = dict(end=evals[-1], A=fit["A"], B=fit["B"], **{"log10 C_mid": np.log10(fit["C_mid"])})
    return values, fit["A_interval"], bound


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--baseline", default="full")
    a = p.parse_args()
    runs = collections.defaultdict(list)
    print("| run | end pass@1 | A [95%] | B | C_mid |")
    print("| --- | --- | --- | --- | --- |")
    for d in sorted(glob.glob(os.path.join(a.root, "*_s*"))):
        m = re.fullmatch(r"(.+)_s(\d+)", os.path.basename(d))
        if not (m and os.path.exists(os.path.join(d, "summary.json"))):
            continue
        values, (lo, hi), bound = load(d)
        runs[m[1]].append(values)
        print(
            f"| {m[1]} s{m[2]} | {values['end']:.3f} | {values['A']:.3f} [{lo:.3f}, {hi:.3f}]"
            f"{' (at bound)' if bound else ''} | {values['B']:.2f} | "
            f"{10 ** values['log10 C_mid']:.3g} |"
        )
    print()
    print("| variant | seeds | " + " | ".join(f"{k}: mean +- sd (diff / se)" for k in KEYS) + " |")
    print("|" + " --- |" * (len(KEYS) + 2))
    base = runs.get(a.baseline)
    for name, rows in runs.items():
        cells = []
        for k in KEYS:
            v = np.array([r[k] for r in rows])
            sd = v.std(ddof=1) if v.size > 1 else float("nan")
            cell = f"{v.mean():.3f} +- {sd:.3f}"
            if base and name != a.baseline and v.size > 1 and len(base) > 1:
                b = np.array([r[k] for r in base])
                se = np.sqrt(v.var(ddof=1) / v.size + b.var(ddof=1) / b.size)
                z = (v.mean() - b.mean()) / se
                cell += f" ({z:+.1f}{' *' if abs(z) > 2 else ''})"
            cells.append(cell)
        print(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    print("\n* : the difference from the baseline exceeds 2 standard errors of the seed means.")


if __name__ == "__main__":
    main()
