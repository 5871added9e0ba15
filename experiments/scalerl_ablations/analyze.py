"""Seed statistics of the ScaleRL comparisons (after run.sh): which differences exceed seed noise.

    python experiments/scalerl_ablations/analyze.py ROOT [--baseline full]

Reads every run ROOT/NAME_sSEED (its `scaling/fit.json`: the sigmoid on all evaluations, and
`metrics.jsonl`: the final held-out pass@1) and prints, in Markdown:

1. one row per run: the final pass@1, A [95% interval], B, C_mid, and every parameter of
   the fit on a bound (`SigmoidFit.at_bounds`; a fit.json written before fits named them is
   refitted): such a parameter is the bound's, not a value the data determined;
2. one row per variant: the mean and standard deviation over its seeds of the final pass@1,
   A, B and log10 C_mid, and how many of its runs have a parameter on a bound;
3. every variant against the baseline on each of those four quantities: the difference of
   means, Welch's t-test over seeds and Holm's correction across all the table's tests
   (`rlscale.scaling.stats`), and the seeds per arm that would detect the observed
   difference with power 0.8 at the two arms' pooled sd. A variant with one seed is
   listed without a test.
"""

import argparse
import collections
import glob
import json
import os
import re

import numpy as np

from rlscale.scaling import fit as fit_lib
from rlscale.scaling import runs as runs_lib
from rlscale.scaling import stats

KEYS = ("end", "A", "B", "log10 C_mid")


def load(workdir):
    """(values, A interval, parameters on a bound) of one run."""
    with open(os.path.join(workdir, "scaling", "fit.json")) as f:
        fit = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        evals = [r["eval/pass@1"] for r in map(json.loads, f) if "eval/pass@1" in r]
    bounds = fit.get("at_bounds")
    if bounds is None:  # Written before fits named their bounds: the same fit again.
        curve = runs_lib.read_curve(workdir, fit.get("x", runs_lib.DEFAULT_X), fit["y"])
        bounds = fit_lib.fit_sigmoid(curve.compute, curve.reward, r0=fit["R0"]).at_bounds
    values = dict(end=evals[-1], A=fit["A"], B=fit["B"], **{"log10 C_mid": np.log10(fit["C_mid"])})
    return values, fit["A_interval"], list(bounds)


def comparisons(runs, baseline):
    """Markdown rows of every variant against `baseline` on every key, Holm across them."""
    tests = []
    for name, rows in runs.items():
        if name == baseline or len(rows) < 2 or len(runs[baseline]) < 2:
            continue
        for k in KEYS:
            a, b = [r[k] for r in rows], [r[k] for r in runs[baseline]]
            tests.append((name, k, a, b, stats.welch(a, b, names=(name, baseline))))
    if not tests:
        return ["(no variant and baseline with 2 seeds each: nothing to test)"]
    holm = stats.holm([t[-1].p for t in tests])
    out = [
        "| variant | quantity | diff | Welch t | df | p | Holm p | seeds per arm for this diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (name, k, a, b, w), p_holm in zip(tests, holm):
        sd = stats.pooled_sd({name: a, baseline: b})
        n = stats.seeds_per_arm(w.diff, sd) if w.diff and sd > 0 else "-"
        out.append(
            f"| {name} | {k} | {w.diff:+.4g} | {w.t:.2f} | {w.df:.1f} | {w.p:.3f} | "
            f"{p_holm:.3f} | {n} |"
        )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--baseline", default="full")
    a = p.parse_args()
    runs, on_bound = collections.defaultdict(list), collections.Counter()
    print("| run | end pass@1 | A [95%] | B | C_mid | on a bound |")
    print("| --- | --- | --- | --- | --- | --- |")
    for d in sorted(glob.glob(os.path.join(a.root, "*_s*"))):
        m = re.fullmatch(r"(.+)_s(\d+)", os.path.basename(d))
        if not (m and os.path.exists(os.path.join(d, "summary.json"))):
            continue
        values, (lo, hi), bounds = load(d)
        runs[m[1]].append(values)
        on_bound[m[1]] += bool(bounds)
        print(
            f"| {m[1]} s{m[2]} | {values['end']:.3f} | {values['A']:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{values['B']:.2f} | {10 ** values['log10 C_mid']:.3g} | {', '.join(bounds) or '-'} |"
        )
    print()
    print(
        "| variant | seeds | runs with a parameter on a bound | "
        + " | ".join(f"{k}: mean +- sd" for k in KEYS)
        + " |"
    )
    print("|" + " --- |" * (len(KEYS) + 3))
    for name, rows in runs.items():
        cells = []
        for k in KEYS:
            v = np.array([r[k] for r in rows])
            sd = v.std(ddof=1) if v.size > 1 else float("nan")
            cells.append(f"{v.mean():.3f} +- {sd:.3f}")
        print(f"| {name} | {len(rows)} | {on_bound[name]} | " + " | ".join(cells) + " |")
    if a.baseline not in runs:
        print(f"\nno run of the baseline {a.baseline!r}: no comparisons")
        return
    print(f"\nAgainst {a.baseline!r} (Welch's t over seeds, Holm across every test below):\n")
    print("\n".join(comparisons(runs, a.baseline)))


if __name__ == "__main__":
    main()
