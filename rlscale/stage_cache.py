"""The one cache for what a run makes before RL: each stage a directory of its workdir.

Stages (`STAGES`): the SFT warm start (WORKDIR/sft, a params checkpoint: `warm_start`),
preference pairs sampled from it (WORKDIR/preference_pairs: `rl.pairs`), and a reward model
trained on such pairs (WORKDIR/reward_model, a reward-model directory: `rl.learned_rewards`).
A stage's maker writes its files (`begin` first), then `complete` writes `MARKER`, last: the
settings the stage was made with and its record (what making it cost, what it measured). A
directory without the marker (a crash mid-write) is incomplete, and made again; a complete
one made with other settings is refused, the error listing the differing settings
(`check_settings`), never silently reused or overwritten.
"""

import json
import os
import shutil

import jax

from rlscale import checkpoint

MARKER = "stage.json"  # Written last: its presence says the stage is whole.
WARM_START = "sft"
PREFERENCE_PAIRS = "preference_pairs"
REWARD_MODEL = "reward_model"
STAGES = {
    WARM_START: "warm start",
    PREFERENCE_PAIRS: "preference pairs",
    REWARD_MODEL: "reward model",
}


def path(workdir: str, stage: str) -> str:
    """WORKDIR/`stage`, the stage's directory."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: not one of {tuple(STAGES)}")
    return os.path.join(workdir, stage)


def _read_marker(workdir: str, stage: str) -> dict | None:
    marker = os.path.join(path(workdir, stage), MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        return json.load(f)


def record(workdir: str, stage: str) -> dict | None:
    """The record of the complete `stage` in `workdir` (None when it is absent or
    incomplete)."""
    marker = _read_marker(workdir, stage)
    return None if marker is None else marker["record"]


def check_settings(made: dict, settings: dict, where: str) -> None:
    """Raises ValueError, `where` followed by one line per differing setting
    (`checkpoint.config_diff`), unless the settings a stage was `made` with are `settings`."""
    diff = checkpoint.config_diff(made, settings)
    if diff:
        raise ValueError(f"{where}:\n  " + "\n  ".join(diff))


def lookup(workdir: str, stage: str, settings: dict) -> dict | None:
    """The record of `stage` in `workdir` when it is complete (None when absent or
    incomplete: to be made).

    Raises:
      ValueError: If it is complete but was made with settings other than `settings`,
        listing the differences.
    """
    marker = _read_marker(workdir, stage)
    if marker is None:
        return None
    where = (
        f"{path(workdir, stage)} holds a {STAGES[stage]} made with different settings; "
        "delete it or use another workdir"
    )
    check_settings(marker["settings"], settings, where)
    return marker["record"]


def begin(workdir: str, stage: str) -> str:
    """Readies `stage`'s directory to be (re)made and returns it: any marker removed first,
    so the stage reads incomplete until `complete`. Process 0 removes; every process may then
    write its share."""
    d = path(workdir, stage)
    marker = os.path.join(d, MARKER)
    if jax.process_index() == 0 and os.path.exists(marker):
        os.remove(marker)
    os.makedirs(d, exist_ok=True)
    return d


def complete(workdir: str, stage: str, settings: dict, stage_record: dict) -> None:
    """Marks `stage` whole (process 0 writes): `MARKER` with `settings` and `stage_record`,
    written to a temporary file and renamed, so a marker is never half written."""
    if jax.process_index() != 0:
        return
    marker = os.path.join(path(workdir, stage), MARKER)
    with open(marker + ".tmp", "w") as f:
        json.dump({"settings": settings, "record": stage_record}, f, indent=2)
    os.replace(marker + ".tmp", marker)


def copy(source: str, workdir: str, stage: str, settings: dict, key: str, with_files=()) -> None:
    """Copies the complete `stage` of another workdir `source` into `workdir`, after the
    workdir-level files and directories `with_files` it was made from (the warm start's data
    and tokenizer); the marker last, so an interrupted copy is an incomplete stage.

    Raises:
      ValueError: Naming `key` (the config key that names `source`), if `source` holds no
        complete `stage`, or one made with other settings (listing the differences); nothing
        is copied then.
    """
    marker = _read_marker(source, stage)
    if marker is None:
        raise ValueError(
            f"{key}={source!r}: {path(source, stage)} holds no complete {STAGES[stage]}"
        )
    check_settings(
        marker["settings"], settings, f"{key}={source!r} was made with different settings"
    )
    os.makedirs(workdir, exist_ok=True)
    for name in with_files:
        src, dst = os.path.join(source, name), os.path.join(workdir, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)
        elif os.path.exists(src):
            shutil.copy2(src, dst)
    ignore = shutil.ignore_patterns(MARKER)
    shutil.copytree(path(source, stage), path(workdir, stage), ignore=ignore, dirs_exist_ok=True)
    complete(workdir, stage, marker["settings"], marker["record"])
