"""The paradigm study's tables and plots (after run.sh): curves on one compute axis, their fits,
reward over-optimization, test-time scaling.

    python experiments/paradigms/analyze.py ROOT

Reads every run ROOT/ROW_sSEED (`metrics.jsonl`: held-out pass@1 and the training reward
against `compute/flops`) and, where run.sh made them, ROOT/test_time_{sft,final}.json
(`rlscale.main.evaluate --best_of`) and ROOT/step_search_{sft,final}.json (`--step_search`).
Prints Markdown:

1. one row per paradigm: seeds, final pass@1 (mean [min, max]), its peak, the FLOPs at
   which it first reaches 0.6 and 0.7 (mean over the seeds that do; how many do), and the
   ScaleRL sigmoid fitted to every seed's evaluations together (A with its bootstrap 95%
   interval over those pooled points, which leaves out the seed-to-seed spread, B, C_mid,
   and every parameter on a bound of the fit: `SigmoidFit.at_bounds`; R0 the shared warm
   start's pass@1); a row whose mean end lies more than `FALL` below its mean peak is fitted
   up to each seed's peak (marked);
2. the reward-model runs' training reward against their held-out pass@1 (over-optimization:
   the reward the run optimizes keeps rising while the pass rate it was meant to buy falls);
3. test-time scaling of the warm start and online seed 0's policy: pass@N and best-of-N under
   each scorer for N = 1 ... 64, and each scorer's within-prompt ranking AUC (how often a
   correct sample outscores an incorrect one of the same problem);
4. PRM-guided step search (beam 4, 4 expansions per step) against best-of-N from the same
   evaluation, with the tokens each samples per problem.

Writes ROOT/paradigms.json (everything printed) and ROOT/paradigms.png (pass@1 against
FLOPs, each seed a thin line, the pooled fit dashed).
"""

import argparse
import collections
import glob
import json
import os
import re

import numpy as np

from rlscale.eval import best_of_n, step_search
from rlscale.scaling import fit, runs

ROWS = ("online", "offline_dpo", "iterative_dpo", "distill", "rm_rl", "prm_rl")
LEVELS = (0.6, 0.7)
FALL = 0.05  # A row whose mean end is this far below its mean peak is fitted up to the peak.
X, Y = "compute/flops", "eval/pass@1"


def read(workdir):
    """(flops [E], pass@1 [E]) of the run's evaluations, and (flops, train reward) per step."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    evals = np.array([(x[X], x[Y]) for x in lines if Y in x])
    train = np.array([(x[X], x["train/reward_mean"]) for x in lines if "train/reward_mean" in x])
    return evals, train


def first_reach(evals, level):
    hit = np.flatnonzero(evals[:, 1] >= level)
    return float(evals[hit[0], 0]) if len(hit) else None


def row_summary(curves):
    ends = [c[-1, 1] for c in curves]
    out = {
        "seeds": len(curves),
        "end": [float(np.mean(ends)), float(min(ends)), float(max(ends))],
        "peak": float(np.mean([c[:, 1].max() for c in curves])),
        "flops_end": float(np.mean([c[-1, 0] for c in curves])),
    }
    for level in LEVELS:
        reached = [r for r in (first_reach(c, level) for c in curves) if r is not None]
        out[f"flops_to_{level}"] = [float(np.mean(reached)) if reached else None, len(reached)]
    # Every seed's evaluations but their shared step 0 (R0) together; a row that falls from
    # its peak (over-optimization) is fitted up to each seed's peak: the sigmoid describes a
    # rise to an asymptote, not a fall.
    out["falls"] = out["peak"] - out["end"][0] > FALL
    ends = [int(np.argmax(c[:, 1])) + 1 if out["falls"] else len(c) for c in curves]
    x = np.concatenate([c[1:e, 0] for c, e in zip(curves, ends)])
    y = np.concatenate([c[1:e, 1] for c, e in zip(curves, ends)])
    r0 = float(np.mean([c[0, 1] for c in curves]))
    order = np.argsort(x, kind="stable")  # The seeds' points merged in compute order.
    f = fit.fit_sigmoid(x[order], y[order], r0=r0, n_boot=200)
    out["fit"] = {"A": f.A, "A_interval": f.A_interval, "B": f.B, "C_mid": f.C_mid, "r2": f.r2}
    out["fit"]["at_bounds"] = list(f.at_bounds)
    out["fit"]["points"] = f.n_points
    return out


def fmt_flops(v):
    return "never" if v[0] is None else f"{v[0]:.2e} ({v[1]})"


def over_optimization(train, evals):
    """The training reward (mean of the first and last 5 steps) and the held-out pass@1 at
    its peak and at the end."""
    peak = int(np.argmax(evals[:, 1]))
    return {
        "train_reward_first5": float(train[:5, 1].mean()),
        "train_reward_last5": float(train[-5:, 1].mean()),
        "pass@1_peak": float(evals[peak, 1]),
        "pass@1_peak_flops": float(evals[peak, 0]),
        "pass@1_end": float(evals[-1, 1]),
    }


def within_prompt_auc(rewards_BG, scores_BG) -> float:
    """P(a correct sample outscores an incorrect one of the same prompt), ties counting half:
    how well a scorer ranks, whatever the N of best-of-N."""
    num = den = 0.0
    for r, s in zip(np.asarray(rewards_BG), np.asarray(scores_BG, np.float64)):
        good, bad = s[r > 0], s[r <= 0]
        num += (good[:, None] > bad).sum() + 0.5 * (good[:, None] == bad).sum()
        den += len(good) * len(bad)
    return num / den


def plot(groups, fits, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, curves) in enumerate(groups.items()):
        color = f"C{i}"
        for j, c in enumerate(curves):  # Step 0 (no compute yet) is off the log axis.
            ax.plot(
                c[1:, 0], c[1:, 1], color=color, lw=0.8, alpha=0.6, label=name if not j else None
            )
        f = fits[name]
        xs = np.geomspace(min(c[1, 0] for c in curves), max(c[:, 0].max() for c in curves), 100)
        r0 = float(np.mean([c[0, 1] for c in curves]))
        ax.plot(xs, fit.sigmoid(xs, f["A"], f["B"], f["C_mid"], r0), color=color, ls="--", lw=1.5)
    ax.set_xscale("log")
    ax.set_xlabel("training compute (FLOPs: sampling, updates, pairs and reward models)")
    ax.set_ylabel("held-out pass@1")
    r0 = float(np.mean([c[0, 1] for v in groups.values() for c in v]))
    ax.axhline(r0, color="grey", lw=0.8, ls=":", label=f"warm start ({r0:.3f})")
    ax.set_title("Paradigms on one compute axis (thin: seeds; dashed: sigmoid fit)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    a = p.parse_args()
    groups, trains = collections.defaultdict(list), collections.defaultdict(list)
    for d in sorted(glob.glob(os.path.join(a.root, "*_s*"))):
        m = re.fullmatch(r"(.+)_s(\d+)", os.path.basename(d))
        if m and m[1] in ROWS and os.path.exists(os.path.join(d, "summary.json")):
            evals, train = read(d)
            groups[m[1]].append(evals)
            trains[m[1]].append((train, evals))
    groups = {k: groups[k] for k in ROWS if k in groups}
    report = {"rows": {k: row_summary(v) for k, v in groups.items()}}
    print(
        "| paradigm | seeds | end pass@1 [min, max] | peak | FLOPs at end | FLOPs to 0.6 (seeds)"
        " | FLOPs to 0.7 (seeds) | A [95%] | B | C_mid | on a bound |"
    )
    print("|" + " --- |" * 11)
    for name, r in report["rows"].items():
        f = r["fit"]
        lo, hi = f["A_interval"] or (float("nan"), float("nan"))
        print(
            f"| {name} | {r['seeds']} | {r['end'][0]:.3f} [{r['end'][1]:.3f}, {r['end'][2]:.3f}]"
            f" | {r['peak']:.3f} | {r['flops_end']:.2e} | {fmt_flops(r['flops_to_0.6'])} | "
            f"{fmt_flops(r['flops_to_0.7'])} | {f['A']:.3f} [{lo:.3f}, {hi:.3f}]"
            f"{' (to the peak)' if r['falls'] else ''} | "
            f"{f['B']:.2f} | {f['C_mid']:.2e} | {', '.join(f['at_bounds']) or '-'} |"
        )
    if "rm_rl" in trains:
        print(
            "\n| reward-model run | train reward, steps 1-5 | steps 76-80 | pass@1 peak (FLOPs)"
            " | pass@1 end |"
        )
        print("|" + " --- |" * 5)
        report["over_optimization"] = []
        for i, (train, evals) in enumerate(trains["rm_rl"]):
            o = over_optimization(train, evals)
            report["over_optimization"].append(o)
            first, last = o["train_reward_first5"], o["train_reward_last5"]
            peak = f"{o['pass@1_peak']:.3f} ({o['pass@1_peak_flops']:.2e})"
            print(f"| rm_rl seed {i} | {first:.2f} | {last:.2f} | {peak} | {o['pass@1_end']:.3f} |")
    report["test_time"], report["step_search"] = {}, {}
    for ckpt, label in (("sft", "warm start"), ("final", "online seed 0 (RL-trained)")):
        path = os.path.join(a.root, f"test_time_{ckpt}.json")
        if os.path.exists(path):
            with open(path) as f:
                ev = json.load(f)
            c, per = ev["test_time"], ev["per_prompt"]
            auc = {k: within_prompt_auc(per["rewards"], v) for k, v in per["scores"].items()}
            report["test_time"][ckpt] = {**c, "within_prompt_auc": auc}
            aucs = ", ".join(f"{k} {v:.3f}" for k, v in auc.items())
            print(f"\nTest-time scaling, {label}:\n```\n{best_of_n.table(c)}\n```")
            print(f"Within-prompt ranking AUC of each scorer: {aucs}")
        path = os.path.join(a.root, f"step_search_{ckpt}.json")
        if os.path.exists(path):
            with open(path) as f:
                s = json.load(f)["step_search"]
            report["step_search"][ckpt] = {k: v for k, v in s.items() if k != "per_problem"}
            print(f"\nStep search, {label}:\n```\n{step_search.table(s)}\n```")
    if groups:
        fits = {k: r["fit"] for k, r in report["rows"].items()}
        print("\nplot:", plot(groups, fits, os.path.join(a.root, "paradigms.png")))
    runs.write_json(os.path.join(a.root, "paradigms.json"), report)


if __name__ == "__main__":
    main()
