"""Fits the ScaleRL sigmoid (or Tan et al.'s law over model sizes) to runs' curves.

    python tools/fit_scaling.py RUN_DIR [RUN_DIR|FILE.csv ...] --out DIR \\
        [--x compute/flops] [--y eval/reward_mean] [--r0 R] [--min-compute C] \\
        [--fit-until C | --fit-until-frac F] [--method grid|lsq]
    python tools/fit_scaling.py RUN_DIR ... | SIZES.csv --law tan --out DIR \\
        [--holdout-size N] [--x compute/flops] [--y eval/pass@1] [--min-compute C]

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
k_max, N0, E0_max, N1, r2, n_points, extrapolation`) and `DIR/tan.png` (1 - reward against
X, log-log); the exit status is 1 when the points cannot be fitted (the reason is printed).
"""

import argparse
import sys

from rlscale import cli
from rlscale.scaling import runs, tan


def parse_args(argv=None):
    p = cli.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="run workdir, .jsonl or .csv")
    p.add_argument("--out", required=True, help="directory for fits.json and the plots")
    p.add_argument("--x", default=runs.DEFAULT_X, help="compute key (e.g. compute/device_seconds)")
    p.add_argument("--y", default=runs.DEFAULT_Y, help="reward key (e.g. eval/pass@1)")
    p.add_argument("--r0", type=float, default=None, help="fixed R0 (default: step-0 eval)")
    p.add_argument("--min-compute", type=float, default=0.0, help="skip points below this")
    cut = p.add_mutually_exclusive_group()
    cut.add_argument("--fit-until", type=float, default=None, help="fit on compute <= this")
    cut.add_argument(
        "--fit-until-frac", type=float, default=None, help="fit on this fraction of max compute"
    )
    p.add_argument(
        "--law", choices=("sigmoid", "tan"), default="sigmoid", help="the law to fit (see above)"
    )
    p.add_argument(
        "--holdout-size", type=float, default=None, help="tan: fit the other sizes, predict this"
    )
    p.add_argument("--method", choices=("grid", "lsq"), default="grid")
    p.add_argument("--a-max", type=float, default=1.0, help="upper bound on A (1 for rates)")
    p.add_argument("--n-boot", type=int, default=200, help="bootstrap resamples for A's interval")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    args = p.parse_args(argv)
    if args.fit_until_frac is not None and not 0 < args.fit_until_frac < 1:
        p.error(f"--fit-until-frac={args.fit_until_frac} must be in (0, 1)")
    if args.law == "tan":
        cut = {"--fit-until": args.fit_until, "--fit-until-frac": args.fit_until_frac}
        given = [k for k, v in {**cut, "--r0": args.r0}.items() if v is not None]
        if given:
            p.error(f"{', '.join(given)}: sigmoid only; --law tan predicts with --holdout-size")
    elif args.holdout_size is not None:
        p.error("--holdout-size needs --law tan")
    return args


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
    n, x, r = runs.read_sized_points(inputs, x_key, y_key)
    keep = ~(x < min_compute)  # NaN stays, for the fit's check to name.
    n, x, r = n[keep], x[keep], r[keep]
    ext = None
    if holdout_size is None:
        fit = tan.fit_tan(n, x, r)
    else:
        ext = tan.extrapolate_to_size(n, x, r, holdout_size=holdout_size)
        fit = ext.fit
    print(runs.format_tan_table(fit, n, x, r, holdout_size))
    if ext:
        print(
            f"held-out size {ext.holdout_size:.12g}: reward MAE {ext.mae:.4f}, max "
            f"{ext.max_abs_err:.4f} over {ext.n_points} points"
        )
    csv_only = all(p.endswith(".csv") for p in inputs)  # The axes are the CSV's columns.
    labels = dict(x_key="compute", y_key="reward") if csv_only else dict(x_key=x_key, y_key=y_key)
    paths = runs.write_tan_report(fit, n, x, r, out, extrapolation=ext, **labels)
    print(f"wrote {paths['fits']} and {paths['plot']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.law == "tan":
        fit_tan_and_report(
            args.inputs,
            args.out,
            x_key=args.x,
            y_key=args.y,
            min_compute=args.min_compute,
            holdout_size=args.holdout_size,
        )
        return 0
    results = fit_and_report(
        args.inputs,
        args.out,
        x_key=args.x,
        y_key=args.y,
        r0=args.r0,
        min_compute=args.min_compute,
        method=args.method,
        fit_until=args.fit_until,
        fit_until_frac=args.fit_until_frac,
        a_max=args.a_max,
        n_boot=args.n_boot,
        seed=args.seed,
    )
    if not any(r.fit for r in results):
        print("error: no input could be fitted", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.guard(main)())
