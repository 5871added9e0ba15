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
and runs nothing. `--set key=value` (repeatable) adds the same override to every run without
naming it (a shared warm start: `--set sft.reuse_from=DIR`). Run from the repository root (or
with rlscale installed). The exit status is 1 when a run failed.

Iso-compute mode (the IsoCompute playbook, arXiv 2603.12151; `rlscale.scaling.allocation`):

    python tools/sweep.py --config configs/X.py[:variant] --workdir ROOT \\
        --budgets 8192,32768 --rollouts 2,4,8,16,32 --prompts 16 [--reuse 1,4,16] \\
        [--evals 4] [--min_steps 1] [--bin_width 0.01] [--seeds 3] [--grid 'k=a,b'] [--shard i/n]

splits each budget C (in rollouts) as C = n * B_p * M over every n in --rollouts and B_p in
--prompts where M = C / (n B_p) is an integer >= --min_steps, and over every reuse factor tau
in --reuse where the pool B_p M / tau is an integer >= B_p (`allocation.iso_cells`; others
are skipped). Each cell runs with `--config.batch.group_size=n --config.batch.prompts=B_p
--config.steps=M --config.eval.every=max(1, M // evals) --config.checkpoint.every=M`, plus
`--config.batch.prompt_pool=B_p*M/tau` when tau > 1, as `ROOT/C{C}__n{n}__B{B_p}__M{M}`
(`__tau{tau}` when tau > 1; `__` and the --grid combination's name when --grid is given,
every cell crossed with every combination). `--seeds K` runs each cell K times, cell i with
seeds i K to i K + K - 1 (`__seed_S`): independent cells, since a cell of one n and B_p at a
smaller budget, run with the same seed at a constant learning rate, is a prefix of the larger
one. Skipping, --shard and --dry_run work as above.
Afterwards each finished cell's final reward is its last `eval/pass@1` (at step M); repeats
of a cell (the --grid combinations) are averaged, then per budget the reward at each n is
the best over B_p and tau, and n* the vertex of a parabola in log2 n
(`allocation.optimal_rollouts`), with the power law log2 n* = a + b log2 C fitted across
budgets (`allocation.fit_optimal_rollouts`). Written: `ROOT/iso_compute.json` (the cells
with overrides, workdir and final reward, the optimum per budget, the n*(C) fit, and the
best-so-far record points of every evaluation, compute in rollouts = step * n * B_p, reward
bins of --bin_width) and `ROOT/iso_compute.png`; printed: a Markdown table per budget (and,
with several --reuse values, the final reward against tau). When every cell has at least 2
repeats (seeds, `--grid 'seed=...'`), n* per budget and the exponent b get 95% intervals from
resampling each cell's seeds (`allocation.bootstrap_optimal_rollouts`: `bootstrap` in the
JSON); `--seeds` gives them.
"""

import collections
import dataclasses
import itertools
import math
import os
import re
import shlex
import subprocess
import sys

from absl import flags

from rlscale import cli
from rlscale.scaling import allocation, runs

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


def _select(named, config, root, shard):
    """`named` = [(name, overrides)] -> ([(name, workdir, command)] of this shard, every
    workdir).

    Raises:
      ValueError: bad shard syntax, or two runs with the same name.
    """
    seen = {}
    for name, overrides in named:
        if name in seen:
            raise ValueError(
                f"combinations {seen[name]} and {overrides} both map to the run name {name!r}"
            )
        seen[name] = overrides
    i, n = parse_shard(shard)
    out = []
    for j, (name, overrides) in enumerate(named):
        if j % n == i:
            workdir = os.path.join(root, name)
            out.append((name, workdir, command(config, workdir, overrides)))
    return out, [os.path.join(root, name) for name, _ in named]


def plan(config, grid_text, root, shard="0/1"):
    """[(name, workdir, command)] for this shard's combinations, and every workdir.

    Raises:
      ValueError: bad grid or shard syntax, or two combinations with the same name.
    """
    combos = combinations(parse_grid(grid_text))
    return _select([(run_name(c), c) for c in combos], config, root, shard)


# ==========================================================================================
# Iso-compute mode.
# ==========================================================================================

# The config keys an iso-compute cell sets; a --grid may not set them too.
CELL_KEYS = (
    "batch.group_size",
    "batch.prompts",
    "steps",
    "eval.every",
    "checkpoint.every",
    "batch.prompt_pool",
)


def parse_ints(flag: str, text: str) -> list[int]:
    """`"8192,32768"` -> `[8192, 32768]`: distinct positive integers.

    Raises:
      ValueError: naming `flag` and the bad item.
    """
    out = []
    for item in text.split(","):
        item = item.strip()
        if not re.fullmatch(r"\d+", item) or int(item) < 1:
            raise ValueError(
                f"bad {flag} {text!r}: {item!r} is not a positive integer; expected e.g. 2,4,8"
            )
        if int(item) in out:
            raise ValueError(f"bad {flag} {text!r}: {item} appears twice")
        out.append(int(item))
    return out


def cell_name(cell: allocation.Cell) -> str:
    """`C8192__n4__B16__M128`, with `__tau4` when the cell reuses its prompts 4 times."""
    name = f"C{cell.budget}__n{cell.rollouts}__B{cell.prompts}__M{cell.steps}"
    return name + (f"__tau{cell.reuse}" if cell.reuse > 1 else "")


def cell_overrides(cell: allocation.Cell, evals: int) -> list[tuple[str, str]]:
    """The config overrides that run `cell` with about `evals` evaluations after step 0."""
    out = [
        ("batch.group_size", str(cell.rollouts)),
        ("batch.prompts", str(cell.prompts)),
        ("steps", str(cell.steps)),
        ("eval.every", str(max(1, cell.steps // evals))),
        ("checkpoint.every", str(cell.steps)),
    ]
    if cell.reuse > 1:
        out.append(("batch.prompt_pool", str(cell.prompt_pool)))
    return out


def iso_plan(
    config,
    root,
    *,
    budgets: str,
    rollouts: str,
    prompts: str,
    reuse: str = "1",
    evals: int = 4,
    min_steps: int = 1,
    grid_text: str | None = None,
    shard: str = "0/1",
    seeds: int = 0,
):
    """The iso-compute runs: each cell of `allocation.iso_cells`, crossed with the grid, and
    with `seeds` = K > 0 run K times, cell i with seeds i K to i K + K - 1: no two runs share
    a seed, so none is a prefix of another (cells of one n and B_p at a smaller budget would
    be, with one seed and a constant learning rate).

    Returns:
      `(todo, entries)`: this shard's [(name, workdir, command)], and every run's
      `(cell, name, workdir, overrides)`, cells in `iso_cells` order, grid fastest.

    Raises:
      ValueError: a bad flag (named), a budget with no cell, a --grid key that a cell sets,
        or bad shard syntax.
    """
    cells = allocation.iso_cells(
        parse_ints("--budgets", budgets),
        parse_ints("--rollouts", rollouts),
        parse_ints("--prompts", prompts),
        reuse=parse_ints("--reuse", reuse),
        min_steps=min_steps,
    )
    grid = parse_grid(grid_text) if grid_text is not None else []
    for key, _ in grid:
        if key in CELL_KEYS or (seeds and key == "seed"):
            raise ValueError(f"--grid key {key!r} is set by the iso-compute cells")
    combos = combinations(grid)
    named, cell_of = [], []
    for i, cell in enumerate(cells):
        own = [[("seed", str(i * seeds + r))] for r in range(seeds)] or [[]]
        for combo in (mine + c for mine in own for c in combos):
            name = "__".join(filter(None, [cell_name(cell), run_name(combo)]))
            named.append((name, cell_overrides(cell, evals) + combo))
            cell_of.append(cell)
    todo, workdirs = _select(named, config, root, shard)
    entries = [(c, n, w, o) for c, (n, o), w in zip(cell_of, named, workdirs)]
    return todo, entries


def _cell_record(cell, name, workdir, overrides) -> tuple[dict, list]:
    """A cell's JSON record and its evaluations `(rollouts spent, pass@1)`; the final reward
    is the last `eval/pass@1`, which must be at step M (else the record has an error)."""
    rec = dict(name=name, workdir=workdir, **dataclasses.asdict(cell))
    rec.update(overrides=dict(overrides), finished=finished(workdir), final_reward=None)
    rec.update(final_flops=None, error=None)
    if not rec["finished"]:
        return rec, []
    y = "eval/pass@1"
    try:
        by_step = runs.read_metrics(workdir, x_key="step", y_key=y)
        by_flops = runs.read_metrics(workdir, x_key=runs.DEFAULT_X, y_key=y)
    except (OSError, ValueError) as e:
        rec["error"] = str(e)
        return rec, []
    steps, reward = list(by_step.compute), list(by_step.reward)
    if by_step.r0 is not None:
        steps, reward = [0.0] + steps, [by_step.r0] + reward
    points = [(s * cell.rollouts * cell.prompts, r) for s, r in zip(steps, reward)]
    if not math.isfinite(reward[-1]):
        rec["error"] = f"the last {y} is {reward[-1]}"
    elif steps[-1] != cell.steps:
        rec["error"] = f"the last {y} is at step {steps[-1]:g}, not at the cell's M={cell.steps}"
    else:
        rec["final_reward"] = float(reward[-1])
        flops = by_flops.compute
        rec["final_flops"] = float(flops[-1]) if flops.size else 0.0
    return rec, [(c, r) for c, r in points if math.isfinite(r)]


def iso_report(entries, root: str, *, bin_width: float = 0.01) -> dict:
    """Analyses the finished cells; writes `ROOT/iso_compute.json` and `ROOT/iso_compute.png`.

    Returns:
      `{"json": path, "png": path or None, "text": the Markdown tables}`.
    """
    from rlscale.scaling import plot

    records, cells, rewards, points = [], [], [], []
    for entry in entries:
        rec, pts = _cell_record(*entry)
        if rec["final_reward"] is not None:
            cells.append(entry[0])
            rewards.append(rec["final_reward"])
            points += [(c, r, len(records)) for c, r in pts]
        elif rec["error"]:
            print(f"# {rec['name']}: no final reward: {rec['error']}", flush=True)
        records.append(rec)
    report = dict(compute="rollouts = step * n * B_p", cells=records, optima=[], fit=None)
    report.update(fit_error=None, records=dict(bin_width=bin_width, points=[]))
    out = {"json": os.path.join(root, "iso_compute.json"), "png": None, "text": ""}
    if cells:
        optima = allocation.optimal_rollouts(cells, rewards)
        try:
            scaling = allocation.fit_optimal_rollouts(
                [o.budget for o in optima], [o.n_star for o in optima]
            )
        except ValueError as e:  # Fewer than 2 budgets measured so far.
            scaling, report["fit_error"] = None, str(e)
        frontier = allocation.record_points(points, bin_width=bin_width)
        report["optima"] = [o.as_dict() for o in optima]
        report["fit"] = scaling.as_dict() if scaling else None
        report["records"]["points"] = [p._asdict() for p in frontier]
        text = allocation.format_allocation_table(optima, scaling)
        if scaling is None:
            text += f"\n\nn*(C): no fit ({report['fit_error']})"
        elif min(collections.Counter(cells).values()) >= 2:  # Seeds: intervals from them.
            boot = allocation.bootstrap_optimal_rollouts(cells, rewards)
            report["bootstrap"] = boot.as_dict()
            text += "\n\n" + allocation.format_bootstrap(boot)
        if len({c.reuse for c in cells}) > 1:
            text += "\n\nfinal reward against data reuse tau:\n\n"
            text += allocation.format_reuse_table(cells, rewards)
        out["text"] = text
        out["png"] = plot.plot_iso_compute(optima, scaling, os.path.join(root, "iso_compute.png"))
    os.makedirs(root, exist_ok=True)
    runs.write_json(out["json"], report)
    return out


# ==========================================================================================
# The command.
# ==========================================================================================


def run_all(todo, dry_run: bool) -> list[str]:
    """Runs each unfinished run of `todo` in turn (prints the commands only when `dry_run`).

    Returns:
      The names of the runs that failed.
    """
    failed = []
    for name, workdir, cmd in todo:
        line = shlex.join(cmd)
        if finished(workdir):
            print(f"# finished, skipped: {line}")
            continue
        print(line, flush=True)
        if dry_run:
            continue
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            print(f"# run {name} failed (exit status {rc})", flush=True)
            failed.append(name)
    return failed


_ISO_FLAGS = ("rollouts", "prompts", "reuse", "evals", "min_steps", "bin_width", "seeds")


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv  # --config is a path handed to each run, not loaded here.
    flags.DEFINE_string("config", None, "configs/X.py[:variant]", flag_values=fv)
    flags.DEFINE_string(
        "grid", None, "'key=v1,v2;other=a,b' (optional with --budgets: crossed)", flag_values=fv
    )
    flags.DEFINE_string("workdir", None, "ROOT: one subdirectory per run", flag_values=fv)
    flags.DEFINE_string("shard", "0/1", "i/n: run combinations i, i+n, ...", flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "print, run nothing", flag_values=fv)
    flags.DEFINE_alias("dry-run", "dry_run", flag_values=fv)
    flags.DEFINE_enum("method", "grid", ["grid", "lsq"], "grid-mode fit", flag_values=fv)
    flags.DEFINE_multi_string(
        "set",
        [],
        "KEY=VALUE: an override for every run, not in the run names",
        flag_values=fv,
    )
    for name in ("config", "workdir"):
        flags.mark_flag_as_required(name, flag_values=fv)
    # Iso-compute mode (--budgets).
    iso = "iso-compute mode: "
    flags.DEFINE_string(
        "budgets", None, iso + "C values in rollouts, e.g. 8192,32768", flag_values=fv
    )
    flags.DEFINE_string(
        "rollouts", None, iso + "n values (batch.group_size), e.g. 2,4,8,16,32", flag_values=fv
    )
    flags.DEFINE_string(
        "prompts", None, iso + "B_p values (batch.prompts), e.g. 16", flag_values=fv
    )
    flags.DEFINE_string("reuse", None, iso + "tau values (default 1), e.g. 1,4,16", flag_values=fv)
    flags.DEFINE_integer(
        "evals", None, iso + "evaluations per run after step 0 (default 4)", flag_values=fv
    )
    flags.DEFINE_integer(
        "min_steps", None, iso + "fewest steps M of a cell (default 1)", flag_values=fv
    )
    flags.DEFINE_float(
        "bin_width", None, iso + "record points' reward bin (default 0.01)", flag_values=fv
    )
    flags.DEFINE_integer(
        "seeds", None, iso + "runs per cell, each with a seed no other run has", flag_values=fv
    )


def check_modes(fv: flags.FlagValues) -> None:
    """The flags fit one mode: --grid alone, or --budgets with its own flags.

    Raises:
      ValueError: naming the flag that does not fit.
    """
    if fv.budgets is None:
        given = [f"--{k}" for k in _ISO_FLAGS if fv[k].value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --budgets (the iso-compute mode)")
        if fv.grid is None:
            raise ValueError(
                "give --grid, or --budgets with --rollouts and --prompts (iso-compute)"
            )
        return
    for flag in ("rollouts", "prompts"):
        if fv[flag].value is None:
            raise ValueError(f"--budgets needs --{flag}")
    for flag in ("evals", "min_steps", "seeds"):
        if fv[flag].value is not None and fv[flag].value < 1:
            raise ValueError(f"bad --{flag} {fv[flag].value}: must be >= 1")
    if fv.bin_width is not None and not fv.bin_width > 0:
        raise ValueError(f"bad --bin_width {fv.bin_width}: must be > 0")


def main(fv: flags.FlagValues) -> None:
    """Runs this shard's unfinished runs, then fits (or, with --budgets, analyses) them.

    Raises:
      ValueError: a bad flag (named), or a run that failed (after the report).
    """
    check_modes(fv)
    if fv.budgets is None:
        todo, all_workdirs = plan(fv.config, fv.grid, fv.workdir, fv.shard)
    else:
        todo, entries = iso_plan(
            fv.config,
            fv.workdir,
            budgets=fv.budgets,
            rollouts=fv.rollouts,
            prompts=fv.prompts,
            reuse=fv.reuse or "1",
            evals=fv.evals or 4,
            min_steps=fv.min_steps or 1,
            grid_text=fv.grid,
            shard=fv.shard,
            seeds=fv.seeds or 0,
        )
        all_workdirs = [w for _, _, w, _ in entries]
    fixed = parse_grid(";".join(fv.set)) if fv.set else []
    for key, values in fixed:
        if len(values) != 1:
            raise ValueError(
                f"--set {key}={','.join(values)}: one value per key (a list is a --grid)"
            )
    todo = [(n, w, cmd + [f"--config.{k}={v[0]}" for k, v in fixed]) for n, w, cmd in todo]

    print(f"# shard {fv.shard}: {len(todo)} of {len(all_workdirs)} runs")
    failed = run_all(todo, fv.dry_run)
    if fv.dry_run:
        return

    if fv.budgets is not None:
        paths = iso_report(entries, fv.workdir, bin_width=fv.bin_width or 0.01)
        if paths["text"]:
            print(paths["text"])
        else:
            print("# no finished cell with a final reward yet")
        print(f"wrote {paths['json']}" + (f" and {paths['png']}" if paths["png"] else ""))
    else:
        have = [w for w in all_workdirs if os.path.exists(os.path.join(w, "metrics.jsonl"))]
        if have:
            results = runs.fit_inputs(have, method=fv.method)
            print(runs.format_table(results))
            paths = runs.write_report(results, fv.workdir, per_run_plots=False)
            print(f"wrote {paths['fits']}" + (f" and {paths['curves']}" if paths["curves"] else ""))
    if failed:
        raise ValueError(f"{len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    cli.run_command(define_flags, main)
