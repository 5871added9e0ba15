"""The RL loop: every recipe runs a few steps; bad configs fail at start-up naming the key."""

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from rlscale import rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ["grpo", "dapo", "drgrpo", "gspo", "cispo", "scalerl", "ppo", "quickstart"]


def _config(name, arg="smoke"):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One smoke run's workdir: its data, tokenizer and SFT warm start are reused."""
    workdir = tmp_path_factory.mktemp("warm")
    rl.run(_config("grpo"), str(workdir))
    return workdir


def _workdir_from(warm, tmp_path):
    for name in ("data", "sft", "tokenizer.model"):
        src = warm / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs(name, warm, tmp_path):
    config = _config(name)
    summary = rl.run(config, str(_workdir_from(warm, tmp_path)))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(config.steps + 1))
    train = lines[1:]
    assert all(np.isfinite(x["train/loss"]) for x in train if x["train/loss"] is not None)
    assert all(x["train/sampler_logp_gap"] < 1e-4 for x in train)  # Sampler == learner.
    assert summary["compute/flops"] > 0
    if name == "ppo":
        assert "train/value_loss" in train[0]
    if name == "dapo":
        assert all(x["train/sampling_rounds"] >= 1 for x in train)
    if name == "scalerl":
        assert config.sampling.think_budget > 0
        assert all(0 <= x["train/interrupted_frac"] <= 1 for x in train)


def test_forced_tokens_are_context_not_actions():
    """Rows for the learner keep interruption tokens in attention but out of the loss."""
    from rlscale.sampling import SampleOutput

    class FakeSampler:
        def prepare(self, encoded, scfg):
            return np.array([[0, 5, 6]]), np.array([[False, True, True]])

    mask = np.array([[True, True, True, True, False]] * 2)
    forced = np.array([[False, True, True, False, False], [False] * 5])
    out = SampleOutput(
        tokens=np.array([[7, 8, 9, 3, 0]] * 2),
        mask=mask,
        logprobs=np.where(mask & ~forced, -1.0, 0.0),
        lengths=np.array([4, 4]),
        truncated=np.array([False, False]),
        forced=forced,
        interrupted=np.array([True, False]),
        prompt_index=np.array([0, 0]),
    )
    roll = rl._rollouts(FakeSampler(), None, out, None, np.ones(2), np.ones(2, bool))
    assert roll.mask_NM.tolist() == (mask & ~forced).tolist()
    assert roll.attn_mask_NL[:, 3:].tolist() == mask.tolist()


def test_bad_config_lists_every_problem():
    config = _config("ppo")
    config.objective.value.coef = 0.0
    config.objective.policy.name = "trpo"
    config.batch.prompts = 6
    config.learner.minibatches = 4
    with pytest.raises(ValueError) as e:
        rl.validate(config)
    text = str(e.value)
    assert "needs a value head" in text
    assert "objective.policy.name='trpo'" in text
    assert "batch.prompts=6 is not divisible by learner.minibatches=4" in text
    config = _config("grpo")
    config.batch.group_size = 1
    with pytest.raises(ValueError, match="group advantages need group_size >= 2"):
        rl.validate(config)


def test_failing_reward_costs_one_sample(monkeypatch):
    from rlscale.rewards import isolation

    def verify(text, problem):
        if problem == 1:
            raise RuntimeError("verifier crashed")
        return float("nan") if problem == 2 else 1.0

    rewards, failures = isolation.score_all(verify, ["a", "b", "c", "d"], [0, 1, 2, 3])
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and failures == 2
