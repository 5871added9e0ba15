"""End-to-end tests of the entry point and the config plumbing."""

import json
import os
import subprocess
import sys

import pytest

from rlscale import config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, workdir):
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    return subprocess.run(
        [sys.executable, "-m", "rlscale.main", "--workdir", str(workdir), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_run_with_override(tmp_path):
    r = _run(
        "--config",
        "configs/quickstart.py:demo,smoke",
        "--config.sampling.max_new_tokens=5",
        workdir=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["sampling"]["max_new_tokens"] == 5
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == config["num_prompts"] * config["sampling"]["num_samples"]
    assert all(1 <= len(row["completion"]) <= 5 for row in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["max_logprob_error_vs_forward"] < 1e-4


def test_mistyped_key_fails_naming_it(tmp_path):
    r = _run(
        "--config",
        "configs/quickstart.py:demo,smoke",
        "--config.sampling.temprature=0.5",
        workdir=tmp_path,
    )
    assert r.returncode != 0
    assert "no such config key 'temprature'" in r.stderr
    assert 'did you mean "temperature"' in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "config.json").exists()


def test_unknown_variant_fails_naming_it(tmp_path):
    r = _run("--config", "configs/quickstart.py:smok", workdir=tmp_path)
    assert r.returncode != 0
    assert "unknown config variant 'smok'" in r.stderr


def test_parse_arg_types_and_errors():
    c = config_lib.parse_arg(
        "model=small,smoke,steps=7,lr=0.5", smoke=False, model="tiny", steps=1, lr=1.0
    )
    assert (c.model, c.smoke, c.steps, c.lr) == ("small", True, 7, 0.5)
    assert config_lib.parse_arg(None, smoke=False).smoke is False
    assert config_lib.parse_arg("smoke=false", smoke=True).smoke is False
    with pytest.raises(ValueError, match="unknown config variant 'modle'"):
        config_lib.parse_arg("modle=x", model="tiny")
    with pytest.raises(ValueError, match="steps='x': expected int"):
        config_lib.parse_arg("steps=x", steps=1)
    with pytest.raises(ValueError, match="'steps' needs a value"):
        config_lib.parse_arg("steps", steps=1)


def test_rl_smoke_run_writes_metrics_and_summary(tmp_path, warm):
    reuse = f"--config.sft.reuse_from={warm}"
    r = _run("--config", "configs/quickstart.py:smoke", reuse, workdir=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    for x in lines:
        assert x["compute/flops"] >= 0 and x["compute/device_seconds"] >= 0
    train = [x for x in lines if "train/reward_mean" in x]
    assert {
        "train/loss",
        "train/response_length",
        "train/filtered_prompts",
        "train/clip_frac",
    } <= set(train[0])
    assert "eval/pass@1" in lines[0] and "eval/reward_mean" in lines[-1]
    flops = [x["compute/flops"] for x in lines]
    assert flops == sorted(flops) and flops[-1] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["end/eval_pass@1"] == lines[-1]["eval/pass@1"]
    assert (tmp_path / "sft" / "sft.json").exists()  # Copied; a rerun reuses it (reliability).
