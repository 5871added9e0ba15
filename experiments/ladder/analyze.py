"""The tables of experiments/ladder (after run.sh).

    python experiments/ladder/analyze.py ROOT [--out experiments/ladder]

Reads every run ROOT/SIZE_sSEED (its metrics.jsonl, scaling/fit.json and the
`rlscale.main.evaluate` reports eval_sft.json / eval_final.json) and prints, in Markdown:

1. Per size: parameters, the warm start's held-out pass@1, `answered` and
   `accuracy_answered`; the final policies' (mean and range over seeds).
2. Per run: pass@1 at step 0, the end and best; the run's sigmoid fit on all evaluations
   (A [95% interval], B, every parameter on a bound of the fit on all evaluations or on the
   first half: `SigmoidFit.at_bounds`); the intra-model predictions: the sigmoid fitted on
   the first half of compute (`scaling/fit.json`'s `prediction`) and Tan et al.'s line
   `log10 L = -k log10 X + E0` fitted on the same half, each with its reward MAE on the later
   evaluations, beside the flat and log-linear baselines' (`rlscale.scaling.baselines`);
   the runs meeting the MAE target with no parameter on a bound, and those whose prediction
   beats both baselines by more than one evaluation's noise.
3. Inter-model: Tan et al.'s law over every size but the largest, scored on the largest
   (`tools/fit_scaling.py --law tan --holdout-size`, which run.sh writes to ROOT/tan), and
   the share of runs meeting the issue's targets (first-half MAE <= 0.02, A off its bounds).
Copies ROOT/tan/tan.png to OUT.
"""

import argparse
import glob
import json
import os
import re
import shutil

import numpy as np

from rlscale.scaling import baselines, runs, tan, tan_runs
from rlscale.scaling import fit as fit_lib

SIZES = ("xs", "s", "m", "l", "xl")
TAN_FRAC = 0.5  # Tan et al. use 25-40%; a half keeps 5 of the 10 evaluations to fit on.
TARGET_MAE = 0.02
PREDICTION = "prediction_xl.json"
EVAL_SAMPLES = 2000  # 500 problems x 4 samples: the noise `beats_baselines` must clear.


def load(path):
    with open(path) as f:
        return json.load(f)


def evals(workdir):
    """Held-out pass@1 at each of the run's evaluations, step 0 first."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return np.array([r["eval/pass@1"] for r in records if "eval/pass@1" in r])


def bounds_of(record, curve, fit_until=None):
    """Every sigmoid parameter on a bound (`SigmoidFit.at_bounds`) of a fit record of
    `curve` (on compute <= `fit_until` when given); a record written before fits named them
    is refitted with the same R0."""
    if "at_bounds" in record:
        return list(record["at_bounds"])
    keep = curve.compute <= (np.inf if fit_until is None else fit_until)
    refit = fit_lib.fit_sigmoid(curve.compute[keep], curve.reward[keep], r0=record["R0"])
    return list(refit.at_bounds)


def fmt(x, digits=3):
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.{digits}f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    a = p.parse_args()
    found = {}
    for d in sorted(glob.glob(os.path.join(a.root, "*_s*"))):
        m = re.fullmatch(r"(\w+?)_s(\d+)", os.path.basename(d))
        if m and m[1] in SIZES and os.path.exists(os.path.join(d, "summary.json")):
            found.setdefault(m[1], []).append((int(m[2]), d))
    sizes = [s for s in SIZES if s in found]

    print(
        "| size | params | warm start pass@1 | answered | accuracy when answered | "
        "final pass@1 (seeds) | answered | accuracy when answered |"
    )
    print("|" + " --- |" * 8)
    for s in sizes:
        seeds = sorted(found[s])
        warm_path = os.path.join(seeds[0][1], "eval_sft.json")
        warm = load(warm_path)["metrics"] if os.path.exists(warm_path) else {}
        finals = [
            load(os.path.join(d, "eval_final.json"))["metrics"]
            for _, d in seeds
            if os.path.exists(os.path.join(d, "eval_final.json"))
        ]

        def spread(key, finals=finals):
            v = np.array([f[key] for f in finals])
            if not v.size:
                return "-"
            return f"{v.mean():.3f}" + (f" [{v.min():.3f}, {v.max():.3f}]" if v.size > 1 else "")

        print(
            f"| {s} | {tan_runs.model_size(seeds[0][1]) / 1e6:.2f}M | {fmt(warm.get('pass@1'))} | "
            f"{fmt(warm.get('answered'))} | {fmt(warm.get('accuracy_answered'))} | "
            f"{spread('pass@1')} ({len(finals)}) | {spread('answered')} | "
            f"{spread('accuracy_answered')} |"
        )

    print()
    print(
        "| run | step 0 | end | best | A [95%] (all evals) | B | on a bound (all; half) | "
        "sigmoid, first half: A, 2nd-half MAE | Tan line, first half: 2nd-half MAE | "
        "flat, log-linear: 2nd-half MAE |"
    )
    print("|" + " --- |" * 10)
    n_ok = n_runs = n_beat = 0
    for s in sizes:
        for seed, d in sorted(found[s]):
            fit = load(os.path.join(d, "scaling", "fit.json"))
            ys = evals(d)
            curve = runs.read_curve(d)
            intra = tan.predict_within_run(curve.compute, curve.reward, fit_until_frac=TAN_FRAC)
            pred = fit["prediction"]
            mae = pred["extrapolation"]["mae"]
            half = curve.compute <= pred["fit_until"]
            on_all = bounds_of(fit, curve)
            on_half = bounds_of({"R0": fit["R0"], **pred}, curve, pred["fit_until"])
            base = baselines.baseline_errors(
                curve.compute[half], curve.reward[half], curve.compute[~half], curve.reward[~half]
            )
            noise = baselines.binomial_se(float(curve.reward[~half].mean()), EVAL_SAMPLES)
            n_runs += 1
            n_ok += mae <= TARGET_MAE and not (on_all or on_half)
            n_beat += baselines.beats_baselines(mae, base, noise)
            lo, hi = fit["A_interval"]
            print(
                f"| {s} s{seed} | {ys[0]:.3f} | {ys[-1]:.3f} | {ys.max():.3f} | "
                f"{fit['A']:.3f} [{lo:.3f}, {hi:.3f}] | {fit['B']:.2f} | "
                f"{', '.join(on_all) or '-'}; {', '.join(on_half) or '-'} | "
                f"{pred['A']:.3f}, {mae:.3f} | {intra.mae:.3f} | "
                f"{base.flat_mae:.3f}, {base.line_mae:.3f} |"
            )
    print(
        f"\nruns with first-half MAE <= {TARGET_MAE} and no parameter on a bound: {n_ok} / "
        f"{n_runs}; sigmoid predictions beating both baselines by more than the noise: "
        f"{n_beat} / {n_runs}"
    )

    tan_path = os.path.join(a.root, "tan", "fits.json")
    if os.path.exists(tan_path):
        rec = load(tan_path)
        ext = rec["extrapolation"]
        print(
            f"\nTan law on the other sizes: k_max={rec['k_max']:.4g} N0={rec['N0']:.4g} "
            f"E0_max={rec['E0_max']:.4g} N1={rec['N1']:.4g} R2={rec['r2']:.3f} "
            f"({rec['n_points']} points)"
        )
        if ext:
            print(
                f"held-out size {ext['holdout_size']:.0f}: reward MAE {ext['mae']:.4f}, "
                f"max {ext['max_abs_err']:.4f} ({ext['n_points']} points)"
            )
        shutil.copy(os.path.join(a.root, "tan", "tan.png"), os.path.join(a.out, "tan.png"))

    # The prediction written before the largest size's later seeds ran (PREDICTION), checked.
    pred_path = os.path.join(a.out, PREDICTION)
    if os.path.exists(pred_path) and sizes[-1] == "xl":
        pred = load(pred_path)
        X, R = np.array(pred["predicted"]).T
        print(f"\n{PREDICTION} (made {pred['made']}): {pred['protocol']}")
        for seed, d in sorted(found["xl"]):
            curve = runs.read_curve(d)
            at = np.interp(np.log(curve.compute), np.log(X), R)
            err = np.abs(at - curve.reward)
            print(
                f"xl s{seed}: reward MAE {err.mean():.4f}, max {err.max():.4f} ({err.size} "
                f"points); predicted end {at[-1]:.3f}, measured {curve.reward[-1]:.3f}"
            )


if __name__ == "__main__":
    main()
