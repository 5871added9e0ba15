"""Preference runs (`rl.dpo`, `rl.pairs`): pairs formed from the verifier's labels, rows laid
out as the preference losses read them, the reference refreshed at each round, compute
counted as the online loop counts it, exact resume mid-round, offline pairs from a file, and
bad input named at start-up.

The runs are `configs/iterative_dpo.py:smoke` and `configs/dpo.py:smoke` on one device from
the tests' shared warm start, with `reward_fixtures.even_length` (about half the samples
pass) scored in-process, so every round forms pairs.
"""

import json
import logging
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, metric_lines

from rlscale import checkpoint, config_lib, objectives, rl
from rlscale.data import tasks
from rlscale.data.preferences import Pair
from rlscale.rl import learner, pairs
from rlscale.sampling import SamplingConfig
from rlscale.sampling.scoring import Samples
from rlscale.scaling import compute

EOS = 2


class _Tokenizer:
    """Characters as their code points; BOS 1, EOS 2."""

    bos_id, eos_id = 1, EOS

    def encode(self, text, *, add_bos=False, add_eos=False):
        return [1] * add_bos + [ord(c) for c in text] + [EOS] * add_eos


def _scfg(M=6):
    return SamplingConfig(max_new_tokens=M, buckets=(4, 8), stop_tokens=(EOS,), pad_id=0)


# ------------------------------------------------------------------------------------------
# Pairs from samples, rows, losses: on the host, no model.
# ------------------------------------------------------------------------------------------


class _Source:
    """A `RolloutSource` stand-in: canned scored samples."""

    def __init__(self, problems, samples):
        self.problems, self.samples = problems, samples

    def sample(self, params, ids, rng, version):
        return self.samples


def _round(rewards_BG, lengths_BG):
    """Samples of B = 3 prompts x G = 4: row n's completion is [100 + n, 200 + n, ..., EOS]
    cut to its length, its text "t<n>"; prompt b is (1, 50 + b) left-padded to 4."""
    B, G = np.shape(rewards_BG)
    N, M = B * G, 5
    tokens = np.zeros((N, M), np.int32)
    lengths = np.asarray(lengths_BG).reshape(-1)
    for n in range(N):
        row = [100 + n, 200 + n, 300 + n, 400 + n][: lengths[n] - 1] + [EOS]
        tokens[n, : len(row)] = row
    prompt = np.zeros((B, 4), np.int32)
    prompt[:, 2:] = np.stack([np.ones(B), 50 + np.arange(B)], 1)
    return Samples(
        prompt_BP=prompt,
        prompt_mask_BP=prompt > 0,
        tokens_NM=tokens,
        mask_NM=np.arange(M) < lengths[:, None],
        logprobs_NM=np.zeros((N, M), np.float32),
        forced_NM=np.zeros((N, M), bool),
        lengths_N=lengths,
        truncated_N=np.zeros(N, bool),
        interrupted_N=np.zeros(N, bool),
        texts=[f"t{n}" for n in range(N)],
        reward_N=np.asarray(rewards_BG, float).reshape(-1),
        failures={"error": 0},
    )


REWARDS = [[0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]]
LENGTHS = [[3, 2, 4, 3], [2, 2, 2, 2], [4, 3, 2, 1]]
IDS = [7, 2, 5]  # The round's training problems.


@pytest.mark.parametrize(
    "mode,expected",
    [
        # (prompt, chosen sample, rejected sample): best (first max) against worst (first min).
        ("best_vs_worst", [(0, 1, 0), (2, 0, 3)]),
        # Every correct x incorrect, in the order (prompt, i, j).
        ("all", [(0, 1, 0), (0, 1, 2), (0, 3, 0), (0, 3, 2), (2, 0, 3), (2, 1, 3), (2, 2, 3)]),
    ],
)
def test_round_pairs_follow_the_verifier(mode, expected):
    problems = {i: tasks.Problem(f"Q{i}", "", "") for i in IDS}
    s = _round(REWARDS, LENGTHS)
    text, tokens, stats = pairs.sample_pairs(_Source(problems, s), None, IDS, None, 0, mode)
    G = 4
    want = [
        pairs.TokenPair(
            (1, 50 + b),
            tuple(s.tokens_NM[b * G + i, : s.lengths_N[b * G + i]]),
            tuple(s.tokens_NM[b * G + j, : s.lengths_N[b * G + j]]),
        )
        for b, i, j in expected
    ]
    assert tokens == want  # The sampled tokens themselves, with their EOS.
    assert [(p.prompt, p.chosen, p.rejected) for p in text] == [
        (f"Q{IDS[b]}", f"t{b * G + i}", f"t{b * G + j}") for b, i, j in expected
    ]
    assert text[0].source == f"train problem {IDS[0]}: sample 1 over 0"
    for b, i, j in expected:  # Chosen = correct.
        assert REWARDS[b][i] == 1 and REWARDS[b][j] == 0
    assert stats["prompts"] == 3 and stats["pairs"] == len(expected)
    assert stats["prompts_without_pair"] == 1  # Prompt 1: every sample scored 0.
    assert stats["prompt_tokens"] == 6 and stats["prompt_len"] == 4


def test_pair_rows_are_laid_out_as_the_preference_losses_read():
    token_pairs = [
        pairs.TokenPair((1, 5, 6), (10, 11, EOS), (12, EOS)),
        pairs.TokenPair((1, 7, 8, 9, 3), (13, EOS), (14, 15, 16, 17, 18, 19)),
    ]
    roll = pairs.pair_rollouts(token_pairs, _scfg(M=6))
    P = 8  # The bucket of the longest prompt (5 tokens).
    assert roll.prompt_len == P
    for p, pair in enumerate(token_pairs):
        for row, completion in ((2 * p, pair.chosen), (2 * p + 1, pair.rejected)):
            seq = roll.tokens_NL[row][roll.attn_mask_NL[row]]
            assert tuple(seq) == pair.prompt + completion
            assert tuple(roll.tokens_NL[row, P - len(pair.prompt) : P]) == pair.prompt
            assert roll.mask_NM[row].sum() == len(completion)  # Every completion token.
    assert roll.correct_N.tolist() == [True, False, True, False]
    assert roll.reward_N.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert not roll.sampler_logp_NM.any()

    # DPO on these rows against a NumPy re-derivation over rows (2p, 2p + 1); and no
    # preference loss reads the (zero) sampler logprobs.
    rng = np.random.default_rng(0)
    N, M = roll.mask_NM.shape
    logp, ref = (-rng.uniform(0.1, 3.0, (N, M)).astype(np.float32) for _ in range(2))
    mask = roll.mask_NM.astype(np.float32)

    def loss(chain, sampler_logp):
        obj = objectives.build(chain, group_size=2, max_len=M)
        terms = {
            "logp": jnp.asarray(logp),
            "ref_logp": jnp.asarray(ref),
            "mask": jnp.asarray(mask),
            "sampler_logp": jnp.asarray(sampler_logp),
            "correct": jnp.asarray(roll.correct_N),
            "reward": jnp.asarray(roll.reward_N),
            "row_weight": jnp.asarray(roll.row_weight_N),
        }
        out, _ = obj.loss.update(terms, obj.loss.init())
        return float(out["loss_sum"]), float(out["denominator"])

    s = ((logp - ref) * mask).sum(1)
    h = s[0::2] - s[1::2]
    want = np.sum(np.log1p(np.exp(-0.5 * h)))
    np.testing.assert_allclose(loss("dpo(beta=0.5)", roll.sampler_logp_NM), (want, 2), rtol=1e-6)
    noise = rng.normal(size=(N, M)).astype(np.float32)
    for chain in ("dpo(beta=0.5)", "ipo", "simpo", "kto"):
        assert loss(chain, noise) == loss(chain, roll.sampler_logp_NM), chain


def test_text_pairs_are_encoded_as_sampled_rows():
    text = [
        Pair("ab", "cd", "e", source="f.jsonl:1"),
        Pair("abcdefghij", "x\x02", "yyyyyyyy", source="f.jsonl:2"),  # Ends in EOS already.
    ]
    out, problems = pairs.encode_pairs(text, _Tokenizer(), _scfg(M=6))
    assert out[0] == pairs.TokenPair((1, 97, 98), (99, 100, EOS), (101, EOS))
    assert out[1].chosen == (120, EOS)  # Not a second EOS.
    assert out[1].rejected == (121,) * 6  # Cut to max_new_tokens: no room for the EOS.
    assert problems == [
        "1 prompts are longer than the largest prompt bucket (8 tokens, "
        "sampling.buckets=(4, 8)): f.jsonl:2"
    ]


# ------------------------------------------------------------------------------------------
# Start-up checks.
# ------------------------------------------------------------------------------------------


def _problems(config) -> str:
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    return str(e.value)


def test_bad_preference_configs_fail_naming_the_key(tmp_path):
    c = load_config("dpo", "smoke,file=" + str(tmp_path / "missing.jsonl"))
    c.objective.chain = config_lib.GRPO_CHAIN
    c.batch.group_size = 4
    message = _problems(c)  # Every problem at once.
    assert f"objective.chain={config_lib.GRPO_CHAIN!r} is not a preference loss" in message
    assert "must end in one of dpo, ipo, simpo, kto" in message
    assert "batch.group_size=4: with preference.file set, batches are preference pairs" in message
    assert f"preference.file='{tmp_path / 'missing.jsonl'}': no such file" in message

    c = load_config("iterative_dpo", "smoke")
    c.preference.file = "sample_at_setup"
    c.filters.zero_variance = True
    c.preference.pairs = "some"
    c.pipeline.mode = "pipeline"
    message = _problems(c)
    assert (
        "preference.file='sample_at_setup' and preference.iterations_every=2 are exclusive"
        in message
    )
    assert "filters.zero_variance act on sampled RL batches" in message
    assert "preference.pairs='some' is not one of ('best_vs_worst', 'all')" in message
    assert "pipeline.mode='pipeline': a preference run" in message

    c = load_config("iterative_dpo", "smoke")
    c.sampling.temperature = 0.0
    assert "sampling.temperature=0 (greedy)" in _problems(c)
    for chain in ("ipo", "simpo", "kto"):  # Every preference loss is one.
        c = load_config("dpo", "smoke")
        c.objective.chain = chain
        rl.resolve(c)


# ------------------------------------------------------------------------------------------
# Runs.
# ------------------------------------------------------------------------------------------


def _config(name, warm, variant="smoke", **overrides):
    c = load_config(name, variant)
    c.mesh.shape = (1, 1, 1)
    c.reward.fn, c.reward.workers = "reward_fixtures:even_length", 0
    c.sft.reuse_from = str(warm)
    c.update_from_flattened_dict(overrides)
    return c


def _host(tree):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


@pytest.fixture(scope="module")
def iterative(warm, tmp_path_factory):
    """An iterative run (rounds before steps 1, 3, 5; checkpoints at 3 and 5) with what each
    round formed and what each update was given recorded."""
    config = _config("iterative_dpo", warm, **{"steps": 5, "checkpoint.every": 3})
    workdir = tmp_path_factory.mktemp("iterative_dpo")
    rounds, updates = [], []
    sample_pairs, update = pairs.sample_pairs, learner.Learner.update

    def recording_sample_pairs(*args):
        rounds.append(sample_pairs(*args))
        return rounds[-1]

    def recording_update(self, state, ref_params, rollouts, step):
        updates.append(dict(step=step, rollouts=rollouts, params=_host(state.params)))
        updates[-1]["ref"] = _host(ref_params)
        return update(self, state, ref_params, rollouts, step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pairs, "sample_pairs", recording_sample_pairs)
        mp.setattr(learner.Learner, "update", recording_update)
        rl.run(rl.resolve(config), str(workdir))
    return config, workdir, rounds, updates


def test_iterative_rounds_train_on_their_pairs(iterative):
    config, workdir, rounds, updates = iterative
    lines = metric_lines(workdir)
    assert [u["step"] for u in updates] == [1, 2, 3, 4, 5]  # Every round formed pairs.
    assert len(rounds) == 3
    for r, (text, token_pairs, stats) in enumerate(rounds):
        assert stats["prompts"] == 2 * config.batch.prompts  # iterations_every x batch.prompts.
        # The verifier (even_length) labelled them: chosen is even, rejected odd.
        assert all(len(p.chosen) % 2 == 0 and len(p.rejected) % 2 == 1 for p in text)
        first = lines[2 * r + 1]
        assert first["pref/round"] == r and first["pref/pairs"] == len(token_pairs)
        assert first["pref/prompts_without_pair"] == stats["prompts_without_pair"]
        assert first["data/prompt_ids"] == stats["prompt_ids"]
        assert first["train/pass_rate"] == pytest.approx(float(np.mean(stats["correct"])))
    for u in updates:  # The batch is the round's pairs the line names, rows as they read.
        line, (_, token_pairs, _) = lines[u["step"]], rounds[(u["step"] - 1) // 2]
        ids = line["data/pair_ids"]
        assert len(ids) == line["pref/batch_pairs"] == config.batch.prompts
        roll = u["rollouts"]
        rows = [tuple(t[m]) for t, m in zip(roll.tokens_NL, roll.attn_mask_NL)]
        pair_rows = [(token_pairs[i].prompt + c) for i in ids for c in token_pairs[i][1:]]
        assert rows == pair_rows
        assert math.isfinite(line["train/loss"])


def test_reference_is_the_policy_at_each_rounds_start(iterative):
    _, _, _, updates = iterative
    by_step = {u["step"]: u for u in updates}
    for step, u in by_step.items():
        start = by_step[2 * ((step - 1) // 2) + 1]  # The round's first step.
        jax.tree.map(np.testing.assert_array_equal, u["ref"], start["params"])
    # The policy moved between rounds (the first update has warmup lr 0; the second not).
    moved = jax.tree.map(
        lambda a, b: not np.array_equal(a, b), by_step[3]["ref"], by_step[1]["ref"]
    )
    assert any(jax.tree.leaves(moved))


def test_compute_counts_sampling_and_training(iterative):
    """Each round's sampling and each batch's training, by the online loop's formulas
    (`report.Compute`: 2N FLOPs per forward token, x3 with the backward pass; the DPO
    reference's forward pass counted), and nothing else."""
    config, workdir, rounds, updates = iterative
    cfg, _, _ = checkpoint.load_params(str(workdir / "final"))
    M = config.sampling.max_new_tokens
    lines = metric_lines(workdir)
    sample = train = 0.0
    for u in updates:
        step = u["step"]
        if step % 2 == 1:  # A round before steps 1, 3, 5.
            stats = rounds[step // 2][2]
            tokens = stats["prompt_tokens"] + float(stats["lengths"].sum())
            sample += compute.forward_flops(cfg, tokens, stats["prompt_len"] + M / 2)
        roll = u["rollouts"]
        seq, ctx = float(roll.attn_mask_NL.sum()), roll.prompt_len + M / 2
        train += compute.forward_flops(cfg, seq, ctx) + compute.train_flops(cfg, seq, ctx)
        assert lines[step]["compute/sample_flops"] == pytest.approx(sample, rel=1e-12)
        assert lines[step]["compute/train_flops"] == pytest.approx(train, rel=1e-12)
        assert lines[step]["compute/flops"] == pytest.approx(sample + train, rel=1e-12)


def test_resume_mid_round_is_the_same_run(iterative, tmp_path):
    """From the checkpoint of step 3 (round 1's first step): step 4 trains on the restored
    round's pairs against its restored reference, step 5 samples the next round."""
    config, workdir, _, _ = iterative
    resumed = tmp_path / "run"
    shutil.copytree(workdir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "5")
    rl.run(rl.resolve(config), str(resumed))
    assert metric_lines(resumed) == metric_lines(workdir)
    host = json.load(open(resumed / "checkpoints" / "5" / "host" / "metadata"))
    assert host["pairs"]["round"] == 2 and host["pairs"]["saved"]


def test_offline_run_trains_on_the_file_pairs(warm, tmp_path, caplog):
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": "Q: 1+2=", "chosen": "1+2=3 Answer: 3", "rejected": "1+2=4"},
        {"prompt": "Q: 3+3=", "chosen": "3+3=6 Answer: 6", "rejected": "3+3=6 Answer: 6"},  # Tie.
        {"prompt": "Q: 2*3=", "chosen": "2*3=6 Answer: 6", "rejected": "2*3=5 Answer: 5"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config("dpo", warm, f"smoke,file={path}", steps=2)
    with caplog.at_level(logging.WARNING):
        summary = rl.run(rl.resolve(config), str(tmp_path / "run"))
    ties = [r for r in caplog.records if "chosen equals rejected" in r.getMessage()]
    assert len(ties) == 1 and "dropped 1 of 3 pairs" in ties[0].getMessage()
    lines = metric_lines(tmp_path / "run")
    assert [x["pref/pairs"] for x in lines[1:]] == [2, 2]
    assert sorted(set(lines[1]["data/pair_ids"])) == [0, 1]  # 8 per batch: repeats.
    # The reference is the warm start, so the first update starts at log 2.
    assert lines[1]["train/loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert summary["compute/sample_flops"] == 0.0 and summary["compute/train_flops"] > 0


def test_bad_pair_file_fails_naming_file_and_line(warm, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "Q: 1+2=", "chosen": "3", "rejected": "4"}\n'
                    '{"prompt": "Q: 1+3=", "chosen": "4"}\n')  # fmt: skip
    config = _config("dpo", warm, f"smoke,file={path}")
    with pytest.raises(ValueError) as e:
        rl.run(rl.resolve(config), str(tmp_path / "run"))
    assert (
        f"preference.file={str(path)!r}: {path}: 1 malformed row: {path}, line 2: has no 'rejected'"
        in str(e.value)
    )
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # Before any work.
