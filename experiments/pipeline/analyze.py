"""The table and the wall-clock plot of experiments/pipeline (after run.sh).

    python experiments/pipeline/analyze.py ROOT [--out experiments/pipeline]

Reads ROOT/NAME_sSEED/metrics.jsonl and ROOT/fits/fits.json (tools/fit_scaling.py) and prints
one Markdown row per run: final held-out pass@1; A [95% interval], B, C_mid of the run's fit
and every parameter of it on a bound (`at_bounds`: such a value is the bound's, not the
data's; "?" for a fits.json written before fits named them);
training wall seconds (the sum of `time/step_s`: evaluations excluded) in all and until
held-out pass@1 first reaches each threshold; the staleness, logprob-match, utilization and
idle diagnostics averaged over the run's steps. Writes OUT/wall.png: pass@1 against training
wall seconds, every run.
"""

import argparse
import glob
import json
import os

import numpy as np

THRESHOLDS = (0.5, 0.7)


def lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def curve(records):
    """(training wall seconds at each evaluation, pass@1 there)."""
    wall, xs, ys = 0.0, [], []
    for r in records:
        wall += r.get("time/step_s", 0.0)
        if "eval/pass@1" in r:
            xs.append(wall)
            ys.append(r["eval/pass@1"])
    return np.array(xs), np.array(ys)


def mean(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return float(np.mean(values)) if values else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    a = p.parse_args()
    fits = {}
    fits_path = os.path.join(a.root, "fits", "fits.json")
    if os.path.exists(fits_path):
        with open(fits_path) as f:
            fits = {rec["name"]: rec for rec in json.load(f)}
    header = (
        "| run | end pass@1 | A [95%] | B | C_mid | on a bound | train wall s | "
        + " | ".join(f"s to {t}" for t in THRESHOLDS)
        + " | staleness mean / max | in flight / in queue | logp gap | prob r | util | idle |"
    )
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for workdir in sorted(glob.glob(os.path.join(a.root, "*_s*"))):
        name = os.path.basename(workdir)
        if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
            continue
        records = lines(workdir)
        steps = [r for r in records if "time/step_s" in r]
        xs, ys = curve(records)
        reach = []
        for t in THRESHOLDS:
            hit = np.flatnonzero(ys >= t)
            reach.append(f"{xs[hit[0]]:.0f}" if hit.size else "-")
        nan = float("nan")
        fit = fits.get(name, {})
        A, B, C_mid = (fit.get(k, nan) for k in ("A", "B", "C_mid"))
        ci = fit.get("A_interval") or [nan, nan]
        bounds = fit.get("at_bounds")
        bounds = "?" if bounds is None else (", ".join(bounds) or "-")
        print(
            f"| {name} | {ys[-1]:.3f} | {A:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | {B:.2f} | {C_mid:.2e}"
            f" | {bounds} | {xs[-1]:.0f} | " + " | ".join(reach) + " | "
            f"{mean(steps, 'pipeline/staleness_mean'):.2f} / "
            f"{max(r['pipeline/staleness_max'] for r in steps)} | "
            f"{mean(steps, 'pipeline/staleness_in_flight_mean'):.2f} / "
            f"{mean(steps, 'pipeline/staleness_in_queue_mean'):.2f} | "
            f"{mean(steps, 'train/logp_gap_abs'):.2e} | {mean(steps, 'train/prob_pearson'):.4f} | "
            f"{mean(steps, 'pipeline/slot_utilization'):.2f} | "
            f"{mean(steps, 'time/trainer_idle_frac'):.2f} |"
        )
        ax.plot(xs, ys, marker=".", label=name)
    ax.set_xlabel("training wall seconds (evaluations excluded)")
    ax.set_ylabel("held-out pass@1")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "wall.png"), dpi=120)


if __name__ == "__main__":
    main()
