"""Fits the ScaleRL sigmoid (or Tan et al.'s law over model sizes) to runs' curves.

    python tools/fit_scaling.py RUN_DIR [RUN_DIR|FILE.csv ...] --out DIR \\
        [--x compute/flops] [--y eval/reward_mean] [--r0 R] [--min-compute C] \\
        [--fit-until C | --fit-until-frac F] [--method grid|lsq]
    python tools/fit_scaling.py RUN_DIR ... | SIZES.csv --law tan --out DIR \\
        [--holdout-size N] [--x compute/flops] [--y eval/pass@1] [--min-compute C]
    python tools/fit_scaling.py SEED_RUN SEED_RUN [...] --seeds --out DIR [--min-compute C]

Each input is a run's workdir (its `metrics.jsonl`; eval lines are those with the `--y` key,
and the step-0 evaluation at zero compute gives R0), a metrics `.jsonl` file, or a CSV with
the header row `compute,reward`. Fits `R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)` (Khatri et
al. 2025, arXiv 2510.13786) to each, prints a table sorted by the asymptote A, and writes
`DIR/fits.json` (one record per input), `DIR/curves.png` (all fitted runs) and
`DIR/curve_NAME.png` (each alone). With a cut (`--fit-until` in compute units, or
`--fit-until-frac` of each run's largest compute), the fit uses the points up to the cut and
the extrapolation error on the later points is reported. Inputs that cannot be fitted are
reported with the reason and skipped; the exit status is 1 when none fits.

`--law tan` fits `log10(1 - R) = -k(N) log10 X + E0(N)`, `k(N) = k_max N / (N + N0)`,
`E0(N) = E0_max N / (N + N1)` (Tan et al. 2025, arXiv 2509.25300) jointly over model sizes N:
the inputs are runs of several sizes (each sized by its policy's parameter count, from its
workdir's files) or CSVs with the header `model_size,compute,reward`. `--holdout-size N`
leaves size N (as the table prints it) out of the fit and reports the fit's reward error on
it. X is `--x` (metrics.jsonl counts no samples: for data, give a CSV whose `compute` column
holds samples). It prints one row per size and writes `DIR/fits.json` (one object: `law,
k_max, N0, E0_max, N1, r2, n_points, at_bounds, extrapolation`) and `DIR/tan.png` (1 -
reward against X, log-log); the exit status is 1 when the points cannot be fitted (the reason
is printed). The fit is bounded as the law's authors bound it (k_max in [0, 2], |E0_max| <=
10, N0 and N1 within the fitted sizes); a parameter left on a bound is named.

`--seeds` takes the inputs as seeds of one recipe (`rlscale.scaling.seeds`): each fitted
alone and all together, A, B and log10 C_mid with their mean +- sd over seeds and a
bootstrap over seeds (`--n-boot` resamples of whole seeds), every parameter on a bound
flagged; R0 is `--r0` or the median of the seeds' step-0 evaluations. It prints the tables and
writes `DIR/seeds.json`.
"""

import os
import sys

import numpy as np
from absl import flags

from rlscale import cli
from rlscale.scaling import runs, seeds, tan, tan_runs


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_string("out", None, "directory for fits.json and the plots", flag_values=fv)
    flags.mark_flag_as_required("out", flag_values=fv)
    flags.DEFINE_string(
        "x", runs.DEFAULT_X, "compute key (e.g. compute/device_seconds)", flag_values=fv
    )
    flags.DEFINE_string("y", runs.DEFAULT_Y, "reward key (e.g. eval/pass@1)", flag_values=fv)
    flags.DEFINE_float("r0", None, "fixed R0 (default: step-0 eval)", flag_values=fv)
    flags.DEFINE_float("min-compute", 0.0, "skip points below this", flag_values=fv)
    flags.DEFINE_float(
        "fit-until", None, "fit on compute <= this (not with --fit-until-frac)", flag_values=fv
    )
    flags.DEFINE_float(
        "fit-until-frac", None, "fit on this fraction of max compute", flag_values=fv
    )
    flags.DEFINE_enum(
        "law", "sigmoid", ["sigmoid", "tan"], "the law to fit (see above)", flag_values=fv
    )
    flags.DEFINE_float(
        "holdout-size", None, "tan: fit the other sizes, predict this", flag_values=fv
    )
    flags.DEFINE_bool("seeds", False, "inputs are seeds of one recipe", flag_values=fv)
    flags.DEFINE_enum("method", "grid", ["grid", "lsq"], "the sigmoid's fit", flag_values=fv)
    flags.DEFINE_float("a-max", 1.0, "upper bound on A (1 for rates)", flag_values=fv)
    flags.DEFINE_integer("n-boot", 200, "bootstrap resamples for A's interval", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "bootstrap seed", flag_values=fv)


def check_flags(fv: flags.FlagValues, inputs) -> None:
    """Raises ValueError naming the flags that do not go together."""
    if not inputs:
        raise ValueError("give at least one INPUT: a run workdir, .jsonl or .csv")
    until, frac = fv["fit-until"].value, fv["fit-until-frac"].value
    if until is not None and frac is not None:
        raise ValueError("--fit-until and --fit-until-frac: give one cut, not both")
    if frac is not None and not 0 < frac < 1:
        raise ValueError(f"--fit-until-frac={frac} must be in (0, 1)")
    if fv.law == "tan":
        cut = {"--fit-until": until, "--fit-until-frac": frac}
        given = [k for k, v in {**cut, "--r0": fv.r0}.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: sigmoid only; --law tan predicts with --holdout-size"
            )
    elif fv["holdout-size"].value is not None:
        raise ValueError("--holdout-size needs --law tan")
    if fv.seeds and (fv.law == "tan" or until is not None or frac is not None):
        raise ValueError("--seeds fits the sigmoid on all points: not with --law tan or a cut")


def fit_and_report(inputs, out, **kwargs) -> list:
    """Fits every input, prints the table and the skipped inputs, writes fits.json + PNGs."""
    results = runs.fit_inputs(inputs, **kwargs)
    print(runs.format_table(results))
    for r in results:
        if r.error:
            print(f"skipped {r.name}: {r.error}", file=sys.stderr)
    paths = runs.write_report(results, out)
    print(f"wrote {paths['fits']}" + (f" and {paths['curves']}" if paths["curves"] else ""))
    return results


def fit_tan_and_report(inputs, out, *, x_key, y_key, min_compute, holdout_size) -> None:
    """Fits Tan et al.'s law over the inputs' sizes (holding `holdout_size` out), prints the
    table and writes fits.json + tan.png."""
    n, x, r = tan_runs.read_sized_points(inputs, x_key, y_key)
    keep = ~(x < min_compute)  # NaN stays, for the fit's check to name.
    n, x, r = n[keep], x[keep], r[keep]
    ext = None
    if holdout_size is None:
        fit = tan.fit_tan(n, x, r)
    else:
        ext = tan.extrapolate_to_size(n, x, r, holdout_size=holdout_size)
        fit = ext.fit
    print(tan_runs.format_tan_table(fit, n, x, r, holdout_size))
    if ext:
        print(
            f"held-out size {ext.holdout_size:.12g}: reward MAE {ext.mae:.4f}, max "
            f"{ext.max_abs_err:.4f} over {ext.n_points} points"
        )
    csv_only = all(p.endswith(".csv") for p in inputs)  # The axes are the CSV's columns.
    labels = dict(x_key="compute", y_key="reward") if csv_only else dict(x_key=x_key, y_key=y_key)
    paths = tan_runs.write_tan_report(fit, n, x, r, out, extrapolation=ext, **labels)
    print(f"wrote {paths['fits']} and {paths['plot']}")


def fit_seeds_and_report(inputs, out, *, x_key, y_key, r0, **kwargs) -> None:
    """Fits the inputs as seeds of one recipe; prints the tables, writes OUT/seeds.json."""
    curves = {}
    for path in inputs:
        curve = runs.read_curve(path, x_key, y_key)
        curves[curve.name] = curve
    if r0 is None:
        r0s = [c.r0 if c.r0 is not None else float(c.reward[0]) for c in curves.values()]
        r0 = float(np.median(r0s))
    fits = seeds.fit_seeds({k: (c.compute, c.reward) for k, c in curves.items()}, r0=r0, **kwargs)
    print(seeds.format_seed_table(fits))
    print("on a bound: " + ("; ".join(fits.flagged()) or "none"))
    os.makedirs(out, exist_ok=True)
    runs.write_json(os.path.join(out, "seeds.json"), fits.as_dict())
    print(f"wrote {os.path.join(out, 'seeds.json')}")


def main(fv: flags.FlagValues, inputs) -> None:
    """Fits `inputs` (positional: run workdirs, .jsonl or .csv files) by the flags' law.

    Raises:
      ValueError: flags that do not go together (named), or no input could be fitted.
    """
    check_flags(fv, inputs)
    if fv.seeds:
        fit_seeds_and_report(
            inputs,
            fv.out,
            x_key=fv.x,
            y_key=fv.y,
            r0=fv.r0,
            min_compute=fv["min-compute"].value,
            method=fv.method,
            n_boot=fv["n-boot"].value,
            seed=fv.seed,
            a_max=fv["a-max"].value,
        )
        return
    if fv.law == "tan":
        fit_tan_and_report(
            inputs,
            fv.out,
            x_key=fv.x,
            y_key=fv.y,
            min_compute=fv["min-compute"].value,
            holdout_size=fv["holdout-size"].value,
        )
        return
    results = fit_and_report(
        inputs,
        fv.out,
        x_key=fv.x,
        y_key=fv.y,
        r0=fv.r0,
        min_compute=fv["min-compute"].value,
        method=fv.method,
        fit_until=fv["fit-until"].value,
        fit_until_frac=fv["fit-until-frac"].value,
        a_max=fv["a-max"].value,
        n_boot=fv["n-boot"].value,
        seed=fv.seed,
    )
    if not any(r.fit for r in results):
        raise ValueError("no input could be fitted")


if __name__ == "__main__":
    cli.run_command(define_flags, main)
