"""Stored evidence: each study keeps its runs' evaluation lines, regenerates its README's numbers
from them, and commits its protocol before its results.

A study folder `experiments/STUDY/` stores one compact file per run, `runs/NAME.jsonl`: a
header line `{"run", "seed", "config_hash", ...}` (`config_hash`: sha256 of the run's
canonical `config.json`, null when it was not kept, with `config` saying what ran), then one
line per kept step: `step, flops, samples` and, at an evaluation, `pass@1` and `reward`
(`FIELDS`), plus any keys the study keeps (`keep`). Its `analyze.py` reads them and writes
`results.json`: `{"runs": {NAME: sha256 of the file}, "numbers": {key: value}, "tables":
{name: Markdown}}`. The README quotes them checkably: a number as `0.971<!--=key-->` (the
comment is invisible when rendered; the value is compared at the quoted decimals), a table
between `<!-- begin results: NAME -->` and `<!-- end results: NAME -->` (compared exactly).
`check_study` lists every mismatch; `check_preregistered` checks that a protocol was
committed before the first of its results.
"""

import argparse
import dataclasses
import datetime
import glob
import hashlib
import json
import math
import os
import re
import subprocess

FIELDS = ("step", "flops", "samples", "pass@1", "reward")
EVAL_KEYS = {"pass@1": "eval/pass@1", "reward": "eval/reward_mean"}
META = ("run", "seed", "config_hash")
NUMBER_TAG = re.compile(r"(-?\d+(?:\.(\d+))?)<!--=([\w.@/+-]+)-->")
BLOCK = re.compile(
    r"<!-- begin results: ([\w.-]+) -->\n(.*?)\n?<!-- end results: \1 -->", re.DOTALL
)


@dataclasses.dataclass(frozen=True)
class StoredRun:
    """One run's stored evidence.

    Attributes:
      meta: the header (`run`, `seed`, `config_hash`, and whatever else was recorded).
      lines: the kept steps, in step order.
    """

    meta: dict
    lines: tuple[dict, ...]

    def evals(self, key: str = "pass@1") -> tuple[list, list, list, list]:
        """(step, flops, samples, `key`) of the evaluation lines (those holding `pass@1`)."""
        ev = [x for x in self.lines if "pass@1" in x]
        return tuple([x.get(k) for x in ev] for k in ("step", "flops", "samples", key))

    def series(self, key: str) -> tuple[list, list]:
        """(step, value) of every line holding `key`."""
        kept = [x for x in self.lines if key in x]
        return [x["step"] for x in kept], [x[key] for x in kept]


def config_hash(config: dict) -> str:
    """sha256 of a run's config as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def compact_metrics(metrics_path: str, *, group_size: int, keep=()) -> list[dict]:
    """The kept lines of a `metrics.jsonl`: every step with an evaluation or a `keep` key.

    `samples` counts the completions drawn up to and including the step: each step's
    `data/prompt_ids` (all dynamic-sampling rounds) times `group_size`. A replayed step (a
    resumed run logs the steps after its checkpoint again) counts once, its last lines.

    Raises:
      ValueError: a line that is not JSON or lacks `step` (naming it), or no line kept.
    """
    steps = {}
    with open(metrics_path) as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
                step = int(record["step"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{metrics_path}:{lineno}: not a metrics line ({e!r})") from None
            steps.setdefault(step, {}).update(record)
    out, drawn = [], 0
    for step in sorted(steps):
        record = steps[step]
        drawn += len(record.get("data/prompt_ids", ())) * group_size
        if EVAL_KEYS["pass@1"] not in record and not any(k in record for k in keep):
            continue
        line = {"step": step, "flops": record.get("compute/flops"), "samples": drawn}
        if EVAL_KEYS["pass@1"] in record:
            line.update({k: record.get(v) for k, v in EVAL_KEYS.items()})
        line.update({k: record[k] for k in keep if k in record})
        out.append(line)
    if not out:
        raise ValueError(f"{metrics_path}: no evaluation line (no {EVAL_KEYS['pass@1']!r})")
    return out


def compact_run(workdir: str, keep=()) -> tuple[dict, list[dict]]:
    """(header, lines) of a run workdir: `seed`, `batch.group_size` and the hash from its
    `config.json`, the lines from its `metrics.jsonl` (`compact_metrics`).

    Raises:
      ValueError / OSError: a missing or unreadable file, named.
    """
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        config = json.load(f)
    try:
        group, seed = config["batch"]["group_size"], config["seed"]
    except (KeyError, TypeError):
        raise ValueError(f"{path} has no seed or batch.group_size: not a run's config") from None
    lines = compact_metrics(os.path.join(workdir, "metrics.jsonl"), group_size=group, keep=keep)
    name = os.path.basename(os.path.normpath(workdir))
    return {"run": name, "seed": seed, "config_hash": config_hash(config)}, lines


def write_run(path: str, meta: dict, lines: list[dict]) -> None:
    """Writes `runs/NAME.jsonl`: the header, then one compact JSON object per line."""
    missing = [k for k in META if k not in meta]
    if missing:
        raise ValueError(f"{path}: the header lacks {', '.join(missing)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for obj in [meta, *lines]:
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")


def store_run(workdir: str, runs_dir: str, keep_pattern: str) -> str:
    """Stores a finished run as evidence: RUNS_DIR/NAME.jsonl (`compact_run`, `write_run`),
    keeping beside the evaluations every per-step key of its metrics that the regular
    expression `keep_pattern` matches in full; returns the file's path."""
    pattern, keys = re.compile(keep_pattern), set()
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                keys.update(k for k in json.loads(line) if pattern.fullmatch(k))
    meta, lines = compact_run(workdir, keep=tuple(sorted(keys)))
    path = os.path.join(runs_dir, f"{meta['run']}.jsonl")
    write_run(path, meta, lines)
    return path


def store_main(study_dir: str, keep_pattern: str, argv=None) -> None:
    """A study's `store.py`: `python experiments/STUDY/store.py WORKDIR [--runs DIR]` stores
    WORKDIR's run (`store_run`) into STUDY/runs (or DIR) and prints the file's path."""
    parser = argparse.ArgumentParser(description=f"Stores a finished run into {study_dir}/runs.")
    parser.add_argument("workdir")
    parser.add_argument("--runs", default=os.path.join(study_dir, "runs"))
    args = parser.parse_args(argv)
    print(f"stored {store_run(args.workdir, args.runs, keep_pattern)}")


def read_run(path: str) -> StoredRun:
    """Reads `runs/NAME.jsonl` (see the module docstring).

    Raises:
      ValueError: an empty file, a header without `META`, a line without `step`, or an
        evaluation line without every field of `FIELDS` (naming the file and line).
    """
    with open(path) as f:
        objs = [(n, json.loads(t)) for n, t in enumerate(f, 1) if t.strip()]
    if not objs or any(k not in objs[0][1] for k in META):
        raise ValueError(f"{path}: the first line must be a header with {', '.join(META)}")
    for n, x in objs[1:]:
        need = FIELDS if "pass@1" in x else ("step",)
        missing = [k for k in need if k not in x]
        if missing:
            raise ValueError(f"{path}:{n}: lacks {', '.join(missing)}")
    return StoredRun(objs[0][1], tuple(x for _, x in objs[1:]))


def read_study(study_dir: str) -> dict[str, StoredRun]:
    """{NAME: `StoredRun`} of `STUDY/runs/*.jsonl`, by name ({} when none is stored)."""
    paths = sorted(glob.glob(os.path.join(study_dir, "runs", "*.jsonl")))
    return {os.path.basename(p)[: -len(".jsonl")]: read_run(p) for p in paths}


def arms(runs: dict[str, StoredRun], *, last: int = 1, key: str = "pass@1") -> dict:
    """{arm: [final value per seed]} of stored runs named `ARM_sSEED`: each run's mean `key`
    over its last `last` evaluations, seeds in name order.

    Raises:
      ValueError: a run name without the `_sSEED` suffix, a run without `last` evaluations
        or `last` < 1 (naming the run).
    """
    if last < 1:
        raise ValueError(f"last={last} must be >= 1 (evaluations averaged per run)")
    out = {}
    for name, run in sorted(runs.items()):
        m = re.fullmatch(r"(.+)_s(\d+)", name)
        if not m:
            raise ValueError(f"run {name!r} is not named ARM_sSEED: its arm is unknown")
        values = [v for v in run.evals(key)[3] if v is not None]
        if len(values) < last:
            raise ValueError(f"run {name!r} has {len(values)} evaluations of {key}, < last={last}")
        out.setdefault(m.group(1), []).append(sum(values[-last:]) / last)
    return out


def manifest(study_dir: str) -> dict[str, str]:
    """{NAME: sha256 of `runs/NAME.jsonl`}: which evidence a result was computed from."""
    out = {}
    for p in sorted(glob.glob(os.path.join(study_dir, "runs", "*.jsonl"))):
        with open(p, "rb") as f:
            out[os.path.basename(p)[: -len(".jsonl")]] = hashlib.sha256(f.read()).hexdigest()
    return out


def study_parser(study_dir: str) -> argparse.ArgumentParser:
    """A study's `analyze.py` flags: `--study DIR` (the folder whose runs/ it reads; default
    `study_dir`), `--results PATH` (default STUDY/results.json) and `--plot PATH`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", default="")
    parser.add_argument("--study", default=study_dir, help="the study folder (runs/ inside)")
    parser.add_argument("--results", default="", help="default: STUDY/results.json")
    return parser


def report(args: argparse.Namespace, numbers: dict, tables: dict) -> dict:
    """Prints the tables, writes results.json where `study_parser`'s flags say (`write_results`)
    and returns it."""
    for table in tables.values():
        print(table + "\n")
    path = args.results or os.path.join(args.study, "results.json")
    results = write_results(path, args.study, numbers, tables)
    print(f"wrote {path}")
    return results


def write_results(path: str, study_dir: str, numbers: dict, tables: dict) -> dict:
    """Writes `results.json` (`runs`: the manifest, `numbers`, `tables`) and returns it."""
    results = {"runs": manifest(study_dir), "numbers": numbers, "tables": tables}
    with open(path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    return results


# ==========================================================================================
# Checks: the README against the results, the results against the evidence.
# ==========================================================================================


def check_readme(text: str, results: dict, *, name: str = "README.md") -> list[str]:
    """Every quoted number and results block of `text` that disagrees with `results`.

    A number tagged `0.971<!--=key-->` must equal `results["numbers"][key]` rounded to the
    quoted decimals; a block `<!-- begin results: NAME -->` ... `<!-- end results: NAME -->`
    must equal `results["tables"][NAME]`. A README that quotes nothing checkable is itself
    a problem.

    Returns:
      One line per problem (empty when all agree), each naming `name` and the key.
    """
    problems, numbers, tables = [], results.get("numbers", {}), results.get("tables", {})
    tags, blocks = NUMBER_TAG.findall(text), BLOCK.findall(text)
    if not tags and not blocks:
        return [f"{name}: quotes no number as NUMBER<!--=key--> and no results block"]
    for quoted, decimals, key in tags:
        if key not in numbers:
            problems.append(f"{name}: {quoted}<!--={key}--> but results have no {key!r}")
            continue
        value = numbers[key]
        shown = "nan" if value is None else f"{value:.{len(decimals)}f}"
        if shown != quoted:
            problems.append(f"{name}: quotes {key} = {quoted}, the evidence gives {shown}")
    for block, body in blocks:
        if block not in tables:
            problems.append(f"{name}: results block {block!r} is not among the results' tables")
        elif body.strip() != tables[block].strip():
            problems.append(f"{name}: results block {block!r} differs from what analyze.py makes")
    return problems


def check_study(study_dir: str, regenerated: dict, *, rel_tol: float) -> list[str]:
    """Every disagreement between a study's committed `results.json`, its README and the
    results regenerated from its stored runs (`regenerated`, as `write_results` returns).

    Args:
      study_dir: the study folder (`README.md`, `results.json`, `runs/`).
      regenerated: the results analyze.py computes now from the stored runs.
      rel_tol: relative tolerance on each committed number (the fits' optimizer tolerance:
        the last digits of a least-squares solution differ between machines).

    Returns:
      One line per problem: a run stored but not in the committed manifest or the other
      way round (a deleted or added run), a file whose hash changed, a number that moved,
      and every README mismatch (`check_readme` against `regenerated`).
    """
    problems = []
    path = os.path.join(study_dir, "results.json")
    try:
        with open(path) as f:
            committed = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return [f"{path}: cannot be read ({e})"]
    stored, recorded = regenerated["runs"], committed.get("runs", {})
    for run in sorted(set(recorded) - set(stored)):
        problems.append(f"run {run!r} is in results.json but not stored in runs/")
    for run in sorted(set(stored) - set(recorded)):
        problems.append(f"run {run!r} is stored in runs/ but not in results.json")
    for run in sorted(set(stored) & set(recorded)):
        if stored[run] != recorded[run]:
            problems.append(f"runs/{run}.jsonl changed since results.json was written")
    new, old = regenerated["numbers"], committed.get("numbers", {})
    for key in sorted(set(new) | set(old)):
        a, b = old.get(key), new.get(key)
        same = a is None and b is None
        if not same and a is not None and b is not None:
            same = math.isclose(a, b, rel_tol=rel_tol) or (math.isnan(a) and math.isnan(b))
        if not same:
            problems.append(f"number {key}: results.json has {a}, the evidence gives {b}")
    with open(os.path.join(study_dir, "README.md"), encoding="utf-8") as f:
        problems += check_readme(f.read(), regenerated)
    return problems


# ==========================================================================================
# Pre-registration: the protocol before the results.
# ==========================================================================================


def _first_commit(path: str) -> tuple[str, int] | None:
    """(hash, committer time) of the commit that first added `path`, or None if none did."""
    path = os.path.abspath(path)
    out = subprocess.run(
        ["git", "log", "--follow", "--diff-filter=A", "--format=%H %ct", "--", path],
        cwd=os.path.dirname(path),
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise ValueError(f"{path}: git log failed (not in a git checkout?): {out.stderr.strip()}")
    rows = out.stdout.split()
    return (rows[-2], int(rows[-1])) if rows else None


def _is_ancestor(a: str, b: str, cwd: str) -> bool:
    run = subprocess.run(["git", "merge-base", "--is-ancestor", a, b], cwd=cwd, check=False)
    return run.returncode == 0


def check_preregistered(protocol: str, results: list[str]) -> dict:
    """Checks that `protocol` was committed before every one of `results`.

    The protocol's first commit must be a strict ancestor of each result's first commit (a
    result not committed yet comes after it). Commit order, not file times, is what a
    reader can verify from a clone.

    Returns:
      `{"protocol", "protocol_commit", "protocol_time", "first_result",
      "first_result_time"}` (times as Unix seconds; the result fields None when no result
      is committed yet).

    Raises:
      ValueError: a protocol not committed, or one committed with or after a result: the
        message names both files and their commit times (UTC).
    """
    first = _first_commit(protocol)
    if first is None:
        raise ValueError(f"protocol {protocol} is not committed: commit it before its runs")
    committed = [(p, c) for p in results if (c := _first_commit(p)) is not None]
    committed.sort(key=lambda pc: pc[1][1])
    cwd = os.path.dirname(os.path.abspath(protocol)) or "."
    for path, (commit, when) in committed:
        if commit == first[0] or not _is_ancestor(first[0], commit, cwd):
            raise ValueError(
                f"protocol {protocol} (committed {_utc(first[1])}, {first[0][:10]}) is not "
                f"earlier than result {path} (committed {_utc(when)}, {commit[:10]}): a "
                "protocol must be committed before the first of its results"
            )
    head = committed[0] if committed else (None, (None, None))
    return {
        "protocol": protocol,
        "protocol_commit": first[0],
        "protocol_time": first[1],
        "first_result": head[0],
        "first_result_time": head[1][1],
    }


def _utc(seconds: int) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
