"""Fits the ScaleRL sigmoid to runs' compute-reward curves and compares them.

    python tools/fit_scaling.py RUN_DIR [RUN_DIR|FILE.csv ...] --out DIR \\
        [--x compute/flops] [--y eval/reward_mean] [--r0 R] [--min-compute C] \\
        [--fit-until C | --fit-until-frac F] [--method grid|lsq]

Each input is a run's workdir (its `metrics.jsonl`; eval lines are those with the `--y` key,
and the step-0 evaluation at zero compute gives R0), a metrics `.jsonl` file, or a CSV with
the header row `compute,reward`. Fits `R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)` (Khatri et
al. 2025, arXiv 2510.13786) to each, prints a table sorted by the asymptote A, and writes
`DIR/fits.json` (one record per input), `DIR/curves.png` (all fitted runs) and
`DIR/curve_NAME.png` (each alone). With a cut (`--fit-until` in compute units, or
`--fit-until-frac` of each run's largest compute), the fit uses the points up to the cut and
the extrapolation error on the later points is reported. Inputs that cannot be fitted are
reported with the reason and skipped; the exit status is 1 when none fits.
"""

import argparse
import sys

from rlscale import cli
from rlscale.scaling import runs


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
    p.add_argument("--method", choices=("grid", "lsq"), default="grid")
    p.add_argument("--a-max", type=float, default=1.0, help="upper bound on A (1 for rates)")
    p.add_argument("--n-boot", type=int, default=200, help="bootstrap resamples for A's interval")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    args = p.parse_args(argv)
    if args.fit_until_frac is not None and not 0 < args.fit_until_frac < 1:
        p.error(f"--fit-until-frac={args.fit_until_frac} must be in (0, 1)")
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


def main(argv=None) -> int:
    args = parse_args(argv)
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
