"""Compares arms of seeds: Welch's t-test against a baseline arm, Holm-corrected across the
table, and the seeds per arm a given effect needs.

    python tools/compare_runs.py experiments/STUDY [RUN.jsonl ...] --baseline ARM \\
        [--last 2] [--key pass@1] [--effect 0.02] [--alpha 0.05] [--power 0.8] \\
        [--protocol experiments/STUDY/protocol.md]
    python tools/compare_runs.py VALUES.csv --baseline ARM [--effect ...]

Inputs are stored-evidence files `runs/ARM_sSEED.jsonl` (`rlscale.scaling.evidence`), study
folders (their `runs/*.jsonl`), or CSVs with the header `arm,seed,value`. A run's value is
its mean `--key` over its last `--last` evaluations. It prints one Markdown row per arm
(seeds, mean +- standard error, the difference from the baseline, t, Welch's df, p, Holm's
adjusted p) and the pooled run-to-run sd; with `--effect`, the seeds per arm that detect it
with power `--power` at `--alpha` and at Holm's strictest level. With `--protocol`, the
protocol must have been committed before every input (`evidence.check_preregistered`). An
arm with one seed, an unknown baseline or a protocol committed after its results is
refused with a message naming it (exit status 1).
"""

import csv
import glob
import os

from absl import flags

from rlscale import cli
from rlscale.scaling import evidence, stats


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_string("baseline", None, "the arm the others are compared with", flag_values=fv)
    flags.mark_flag_as_required("baseline", flag_values=fv)
    flags.DEFINE_integer("last", 1, "evaluations averaged per run", flag_values=fv)
    flags.DEFINE_string("key", "pass@1", "evaluation field compared", flag_values=fv)
    flags.DEFINE_float("effect", None, "effect to power for (key units)", flag_values=fv)
    flags.DEFINE_float("alpha", 0.05, "two-sided significance level", flag_values=fv)
    flags.DEFINE_float("power", 0.8, "target power", flag_values=fv)
    flags.DEFINE_string("protocol", None, "protocol committed before the runs", flag_values=fv)


def read_arms(inputs, *, last, key):
    """({arm: [values]}, the files read) of the inputs (see the module docstring).

    Raises:
      ValueError: no input, an input that is none of the kinds, or a bad row (named).
    """
    if not inputs:
        raise ValueError("give study folders, runs/ARM_sSEED.jsonl files or arm,seed,value CSVs")
    runs, arms, files = {}, {}, []
    for path in inputs:
        if path.endswith(".csv"):
            files.append(path)
            with open(path, newline="") as f:
                for i, row in enumerate(csv.DictReader(f), 2):
                    try:
                        arms.setdefault(row["arm"], []).append(float(row["value"]))
                    except (KeyError, TypeError, ValueError):
                        raise ValueError(f"{path}:{i}: expected arm,seed,value") from None
            continue
        paths = sorted(glob.glob(os.path.join(path, "runs", "*.jsonl")))
        if not paths and path.endswith(".jsonl"):
            paths = [path]
        if not paths:
            raise ValueError(f"{path}: not a study folder with runs/, a .jsonl or a .csv")
        for p in paths:
            runs[os.path.basename(p)[: -len(".jsonl")]] = evidence.read_run(p)
        files += paths
    for arm, values in evidence.arms(runs, last=last, key=key).items():
        arms.setdefault(arm, []).extend(values)
    return arms, files


def main(fv: flags.FlagValues, inputs) -> None:
    """Prints the comparison table of `inputs` (positional)."""
    arms, files = read_arms(inputs, last=fv.last, key=fv.key)
    if fv.protocol:
        pre = evidence.check_preregistered(fv.protocol, files)
        print(f"pre-registered: {fv.protocol} committed at {pre['protocol_commit'][:10]}")
    print(
        stats.format_comparison(
            arms, fv.baseline, effect=fv.effect, alpha=fv.alpha, target=fv.power
        )
    )


if __name__ == "__main__":
    cli.run_command(define_flags, main)
