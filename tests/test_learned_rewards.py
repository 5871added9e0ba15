"""Learned rewards in the RL loop (`rl.learned_rewards`): `configs/rm_rl.py:smoke` end to end
(one device) with a reward model made at set-up and a process reward model's step rewards;
the PRM's terms, scored on an 8-device mesh, placed as `ProcessRewardModel.step_rewards`
places them on the unpadded rows; the compute the reward model cost; the config and tokenizer
checks."""

import numpy as np
import pytest
from conftest import load_config, metric_lines, untrained_prm

from rlscale import rl, sharding, stage_cache
from rlscale import tokenizers as tokenizer_lib
from rlscale.reward_models import prm as prm_lib
from rlscale.rl import checks, learned_rewards
from rlscale.rl.rollouts import Rollouts
from rlscale.tokenizers import train_sentencepiece


@pytest.fixture(scope="module")
def prm_dir(warm, tmp_path_factory):
    return untrained_prm(warm, str(tmp_path_factory.mktemp("prm") / "prm"), seq_len=128)


@pytest.fixture(scope="module")
def rm_run(warm, prm_dir, tmp_path_factory):
    config = load_config("rm_rl", f"smoke,prm={prm_dir}")
    config.sft.reuse_from = str(warm)
    config.mesh.shape = (1, 1, 1)
    # Two steps of the reward model's training (the smoke config's 20 were 40% of the run's
    # CPU time): what is checked is its making's plumbing and cost, not its accuracy.
    config.reward.model_steps = 2
    workdir = tmp_path_factory.mktemp("rm_rl")
    return config, rl.run(rl.resolve(config), str(workdir)), workdir


def test_rm_rl_smoke_run(rm_run):
    config, summary, workdir = rm_run
    assert config.reward.model == learned_rewards.TRAIN_AT_SETUP
    assert "process_advantages" in config.objective.chain
    lines = metric_lines(workdir)
    assert [x["step"] for x in lines] == list(range(config.steps + 1))
    made = stage_cache.record(str(workdir), stage_cache.REWARD_MODEL)
    # The reward model's making is on the compute axis from step 0, counted once.
    for k in ("compute/sample_flops", "compute/train_flops"):
        assert made[k] > 0 and lines[0][k] == made[k]
    assert summary["reward_model/heldout_accuracy"] == made["heldout_accuracy"]
    assert made["train_pairs"] > 0 and made["heldout_pairs"] > 0
    train = lines[1:]
    for x in train:
        # The reward model's score is the reward: real-valued, not the verifier's 0/1.
        assert np.isfinite(x["train/reward_mean"])
        # The PRM's step rewards reach the objective (`process_advantages` reports them).
        assert {"train/step_reward_mean", "train/steps_per_row"} <= x.keys()
    assert any(x["train/reward_mean"] not in (0.0, 1.0) for x in train)
    # Each step samples and scores: the learned rewards' forward passes add to the sampling.
    assert all(b["compute/sample_flops"] > a["compute/sample_flops"] for a, b in zip(lines, train))


def _rows(prompts, completions, pad, M):
    """A `Rollouts` of id rows as the rollout stage assembles them: prompts left-padded to
    the longest, completions right-padded to M."""
    P = max(map(len, prompts))
    N = len(prompts)
    tokens, attn = np.full((N, P + M), pad, np.int32), np.zeros((N, P + M), bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tokens[i, P - len(p) : P], attn[i, P - len(p) : P] = p, True
        tokens[i, P : P + len(c)], attn[i, P : P + len(c)] = c, True
    zeros = np.zeros((N, M), np.float32)
    return Rollouts(
        tokens,
        attn,
        attn[:, P:],
        zeros,
        np.zeros(N),
        np.zeros(N, bool),
        np.ones(N),
        np.zeros((N, M), np.int32),
        P,
    )


def test_step_rewards_read_the_unpadded_rows(prm_dir):
    """On the loop's padded rows, with the PRM on an 8-device mesh as the trainer's: what
    `step_rewards` gives on the unpadded rows with the PRM on one device."""
    prm = prm_lib.load(prm_dir)
    tok = prm.tokenizer
    texts = [("1+1", "1+1=2 Answer: 2"), ("Hi", "a=b=c"), ("x", "no step")]
    prompts = [[tok.bos_id, *tok.encode(p)] if tok.bos_id >= 0 else tok.encode(p) for p, _ in texts]
    completions = [tok.encode(c) + [tok.eos_id] for _, c in texts]
    M = 24
    roll = _rows(prompts, completions, tok.padding_id, M)
    sharded = prm_lib.load(prm_dir, sharding.make_mesh((8, 1, 1)))
    reward_NM, mask_NM, flops = learned_rewards.StepRewards(sharded)(roll)
    want_reward, want_mask = prm.step_rewards(prompts, completions, M)
    np.testing.assert_array_equal(mask_NM, want_mask)
    np.testing.assert_allclose(reward_NM, want_reward, rtol=1e-6)
    # Each row's steps end at its delimiters and at its last token.
    assert mask_NM.sum(1).tolist() == [2, 3, 1]
    assert all(mask_NM[i, len(c) - 1] for i, c in enumerate(completions))
    assert flops > 0


def test_config_problems_name_the_keys(tmp_path):
    c = load_config("rm_rl", "smoke")
    c.reward.model, c.reward.fn, c.reward.model_steps = str(tmp_path), "m:f", 0
    c.objective.chain = c.objective.chain.replace(
        "token_ratio", "process_advantages(mix=add) | token_ratio"
    )
    with pytest.raises(ValueError) as e:
        rl.resolve(c)
    msg = str(e.value)
    assert f"reward.model={str(tmp_path)!r} is not a reward model directory" in msg
    assert "reward.model=" in msg and "reward.fn='m:f' both replace the verifier's reward" in msg
    assert "reward.model_steps=0 must be an integer >= 1" in msg
    assert "objective.chain reads step_reward (process_advantages) but reward.prm is empty" in msg

    c = load_config("rm_rl", "smoke")
    c.reward.prm = str(tmp_path)
    c.init.hf_checkpoint = str(tmp_path)
    with pytest.raises(ValueError) as e:
        rl.resolve(c)
    msg = str(e.value)
    assert "is not a process reward model directory (no process_reward.json)" in msg
    assert "reward.prm=" in msg and "objective.chain reads no step_reward" in msg
    assert "reward.model='train_at_setup' trains from the SFT warm start" in msg

    c = load_config("dpo", "smoke")
    c.reward.model = "train_at_setup"
    with pytest.raises(ValueError, match="a preference run trains on pairs labelled by the"):
        rl.resolve(c)

    c = load_config("rm_rl", "smoke")  # The value both keys once shared: named, refused.
    c.reward.model = "warm_start"
    with pytest.raises(ValueError, match="or set 'train_at_setup' \\(once 'warm_start'\\)"):
        rl.resolve(c)
    c = load_config("dpo", "smoke")
    c.preference.file = "warm_start"
    with pytest.raises(ValueError, match="or 'sample_at_setup', once 'warm_start': pairs sampled"):
        rl.resolve(c)


def test_tokenizer_mismatch_names_both(prm_dir, warm):
    c = load_config("rm_rl", f"smoke,prm={prm_dir}")
    own = tokenizer_lib.load(str(warm / "tokenizer.model"))
    assert checks.learned_reward_tokenizer_problems(c.reward, own) == []
    other = train_sentencepiece(
        ["hello world, the policy's words"] * 20, 290, hard_vocab_limit=False
    )
    (problem,) = checks.learned_reward_tokenizer_problems(c.reward, other)
    assert problem.startswith(f"reward.prm={prm_dir!r}: tokenizer mismatch: the reward model")
    assert "is not the policy's tokenizer" in problem
