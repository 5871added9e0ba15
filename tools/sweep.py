"""Runs a grid of config overrides, one RL run after another, then fits their scaling curves.

    python tools/sweep.py --config configs/X.py[:variant] --grid 'key=v1,v2;other=a,b' \\
        --workdir ROOT [--shard i/n] [--dry_run]

Every combination of the grid runs as its own process,

    python -m rlscale.main --config configs/X.py[:variant] --workdir ROOT/NAME \\
        --config.key=v1 --config.other=a

with NAME derived from the overrides (`key_v1__other_a`, file-name safe). Keys are config
paths (`optim.lr`); values are passed through as written (no commas inside a value).
`--shard i/n` runs only combinations i, i + n, i + 2n, ... (0 <= i < n), so n hosts split a
sweep disjointly. A run is finished when `ROOT/NAME/summary.json` exists; finished runs are
skipped, so a sweep resumes where it stopped. Afterwards every combination's run that has a
`metrics.jsonl` (this shard's or others' in a shared ROOT) is fitted as by
`tools/fit_scaling.py`: `ROOT/fits.json`, `ROOT/curves.png`. `--dry_run` prints the commands
and runs nothing. Run from the repository root (or with rlscale installed). The exit status
is 1 when a run failed.
"""

import argparse
import itertools
import os
import re
import shlex
import subprocess
import sys

from rlscale import cli
from rlscale.scaling import runs

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_GRID_HELP = "expected 'key=v1,v2;other=a,b'"


def parse_grid(text: str) -> list[tuple[str, list[str]]]:
    """`'key=v1,v2;other=a,b'` -> `[("key", ["v1", "v2"]), ("other", ["a", "b"])]`.

    Raises:
      ValueError: naming the bad item (no `=`, a bad or repeated key, an empty value).
    """
    grid = []
    items = [item.strip() for item in text.split(";")]
    if not any(items):
        raise ValueError(f"empty --grid {text!r}; {_GRID_HELP}")
    for item in items:
        if not item:
            continue  # A trailing ';' is harmless.
        key, eq, values = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"bad --grid item {item!r}: no '='; {_GRID_HELP}")
        if not _KEY.match(key):
            raise ValueError(f"bad --grid key {key!r} in {item!r}: expected a config path")
        if key in dict(grid):
            raise ValueError(f"--grid key {key!r} appears twice")
        vals = [v.strip() for v in values.split(",")]
        if not all(vals):
            raise ValueError(f"bad --grid item {item!r}: an empty value; {_GRID_HELP}")
        grid.append((key, vals))
    return grid


def combinations(grid) -> list[list[tuple[str, str]]]:
    """Every combination, the last key varying fastest."""
    keys = [k for k, _ in grid]
    return [list(zip(keys, vals)) for vals in itertools.product(*(v for _, v in grid))]


def run_name(overrides) -> str:
    """`[("optim.lr", "3e-4"), ("seed", "1")]` -> `"optim.lr_3e-4__seed_1"`."""
    return "__".join(runs.safe_name(f"{k}_{v}") for k, v in overrides)


def parse_shard(text: str) -> tuple[int, int]:
    """`"i/n"` -> (i, n) with 0 <= i < n."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"bad --shard {text!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return int(m.group(1)), int(m.group(2))


def command(config: str, workdir: str, overrides, python: str = sys.executable) -> list[str]:
    """The `rlscale.main` command line of one run."""
    cmd = [python, "-m", "rlscale.main", "--config", config, "--workdir", workdir]
    return cmd + [f"--config.{k}={v}" for k, v in overrides]


def finished(workdir: str) -> bool:
    return os.path.exists(os.path.join(workdir, "summary.json"))


def plan(config, grid_text, root, shard="0/1"):
    """[(name, workdir, command)] for this shard's combinations.

    Raises:
      ValueError: bad grid or shard syntax, or two combinations with the same name.
    """
    combos = combinations(parse_grid(grid_text))
    names = [run_name(c) for c in combos]
    seen = {}
    for name, combo in zip(names, combos):
        if name in seen:
            raise ValueError(
                f"combinations {seen[name]} and {combo} both map to the run name {name!r}"
            )
        seen[name] = combo
    i, n = parse_shard(shard)
    out = []
    for j, (name, combo) in enumerate(zip(names, combos)):
        if j % n == i:
            workdir = os.path.join(root, name)
            out.append((name, workdir, command(config, workdir, combo)))
    return out, [os.path.join(root, name) for name in names]


def main(argv=None) -> int:
    p = cli.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    p.add_argument("--config", required=True, help="configs/X.py[:variant]")
    p.add_argument("--grid", required=True, help="'key=v1,v2;other=a,b'")
    p.add_argument("--workdir", required=True, help="ROOT: one subdirectory per run")
    p.add_argument("--shard", default="0/1", help="i/n: run combinations i, i+n, ...")
    p.add_argument("--dry_run", "--dry-run", action="store_true", help="print, run nothing")
    p.add_argument("--method", choices=("grid", "lsq"), default="grid", help="fit method")
    args = p.parse_args(argv)
    try:
        todo, all_workdirs = plan(args.config, args.grid, args.workdir, args.shard)
    except ValueError as e:
        p.error(str(e))

    print(f"# shard {args.shard}: {len(todo)} of {len(all_workdirs)} runs")
    failed = []
    for name, workdir, cmd in todo:
        line = shlex.join(cmd)
        if finished(workdir):
            print(f"# finished, skipped: {line}")
            continue
        print(line, flush=True)
        if args.dry_run:
            continue
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            print(f"# run {name} failed (exit status {rc})", flush=True)
            failed.append(name)
    if args.dry_run:
        return 0

    have = [w for w in all_workdirs if os.path.exists(os.path.join(w, "metrics.jsonl"))]
    if have:
        results = runs.fit_inputs(have, method=args.method)
        print(runs.format_table(results))
        paths = runs.write_report(results, args.workdir, per_run_plots=False)
        print(f"wrote {paths['fits']}" + (f" and {paths['curves']}" if paths["curves"] else ""))
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.guard(main)())
