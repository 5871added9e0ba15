"""Experiment tracking (`rlscale.tracking`): a Weights & Biases run written offline and read
back (`wandb_files`): the metrics writer's records under their names and steps, the config
and commit, a resumed process continuing the same run without logging a step twice; W&B
asked for without wandb installed."""

import importlib.util

import pytest
from conftest import load_config
from wandb_files import offline_runs

from rlscale import metrics, rl, tracking

COMPUTE = {"compute/flops": 1.0, "compute/device_seconds": 0.5}


def _write(workdir, steps, offset=None):
    cfg = tracking.TrackingConfig(wandb_project="rlscale-test")
    sink = tracking.sink(cfg, str(workdir), {"seed": 3, "optim": {"lr": 1e-4}}, enabled=True)
    writer = metrics.MetricWriter(str(workdir), 6, resume_offset=offset, sink=sink)
    for step in steps:
        writer.write(step, {**COMPUTE, "train/loss": step / 4, "eval/pass@1": 0.5}, False)
    offset = writer.offset()
    writer.close()
    return offset


def test_an_offline_run_continues_after_a_resume(tmp_path, monkeypatch):
    """Steps 0-3 written, then a resumed writer (as a process resumed from the step-1
    checkpoint writes) steps 2-5: one W&B run id in both processes' files, each step
    logged once, with metrics.jsonl's names and values."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    _write(tmp_path, range(4))
    _write(tmp_path, range(2, 6), offset=0)
    first, second = offline_runs(tmp_path)
    assert first["id"] == second["id"] and first["project"] == "rlscale-test"
    assert [row["_step"] for row in first["history"] + second["history"]] == list(range(6))
    for row in first["history"] + second["history"]:
        assert row["train/loss"] == row["_step"] / 4 and row["eval/pass@1"] == 0.5
        assert row["compute/flops"] == 1.0
    assert first["config"]["optim"] == {"lr": 1e-4} and first["config"]["seed"] == 3
    assert first["config"]["git_commit"] == tracking.git_commit()


def test_wandb_asked_for_without_wandb_names_the_key(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    config = load_config("quickstart")
    config.tracking.wandb_project = "mine"
    with pytest.raises(ValueError, match=r"tracking.wandb_project='mine' needs the wandb package"):
        rl.resolve(config)
