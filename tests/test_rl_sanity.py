"""`tools/rl_sanity.py` end to end: two steps of the quickstart's `:smoke` config with the
tool's reward, scored in the reward worker pool. In this process (`cli.call`, the command's
flags and `main`), on one device as the command runs on a laptop: the pool's workers are
processes of their own, started with this process's `sys.path` (the tool puts its directory
there), so they import the tool's reward by name as they do under the command."""

import importlib.util
import json
import os

from conftest import ROOT

from rlscale import cli

TOOLS = os.path.join(ROOT, "tools")


def test_rl_sanity_smoke(tmp_path, warm, capsys, monkeypatch):
    monkeypatch.syspath_prepend(TOOLS)  # As `python tools/rl_sanity.py` has it; undone after.
    spec = importlib.util.spec_from_file_location("rl_sanity", os.path.join(TOOLS, "rl_sanity.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    args = [
        "--workdir",
        str(tmp_path),
        "--config",
        os.path.join(ROOT, "configs", "quickstart.py:smoke"),
        "--config.steps=2",
        "--config.mesh.shape=(1,1,1)",
        f"--warm_from={warm}",
    ]
    cli.call(tool.define_flags, tool.main, args)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
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
