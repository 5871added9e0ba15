"""`tools/rl_sanity.py` end to end: two steps of the quickstart's `:smoke` config with the
tool's reward, scored in the reward worker pool."""

import json
import os
import subprocess
import sys

from conftest import ROOT, subprocess_env


def test_rl_sanity_smoke(tmp_path, warm):
    env = subprocess_env()
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "rl_sanity.py"),
            "--workdir",
            str(tmp_path),
            "--config",
            os.path.join(ROOT, "configs", "quickstart.py:smoke"),
            "--config.steps=2",
            f"--warm_from={warm}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(result) == ["end", "start"]

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["reward"]["fn"] == "rl_sanity:starts_with_one"
    assert config["reward"]["workers"] > 0  # Scored in worker processes, not in-process.
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "train/reward_mean" in line]
    # The printed rates are the run's first and last evaluations.
    evals = [line["eval/pass@1"] for line in lines if "eval/pass@1" in line]
    assert [result["start"], result["end"]] == [evals[0], evals[-1]]
    assert [line["step"] for line in train] == [1, 2]
    # The workers imported the tool's reward: no sample failed (the old tool's lambda could not
    # be pickled for them, so every sample did).
    failures = {k: v for line in train for k, v in line.items() if k.startswith("reward/failures")}
    assert failures and not any(failures.values()), failures
