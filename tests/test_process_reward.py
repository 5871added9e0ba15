"""Process rewards (`rlscale.reward_models.prm`, `.step_labels`,
`objectives.process_advantages`).

A scripted environment with known values: the prompt `bad D, S steps:` asks for S steps
`d=d=...=d` (one digit each), and a completion is correct when it has S steps and none is the
digit D. A scripted policy continues a prefix of j steps with S - j steps, each D with
probability q, so a prefix's value is (1 - q)^(S - j) while it holds no D, and 0 once it
does: the Monte-Carlo labels must equal these (exactly when the policy enumerates its
outcomes evenly, within binomial bounds when it samples them). A 2-layer PRM trained from
scratch on noisy soft labels of such completions (prompt `bad D:`, the label of step j: no D
so far) must label held-out steps right (> 0.9), also where only the prompt's digit decides.
Then split_steps, the loss, the aggregations and DeepSeekMath's process advantages by hand.
Last, the command line on the suite's warm start: `label`, `train`, then `rlscale.main.evaluate
--scorer prm` on the PRM it wrote, and a user's mistakes as one `error:` line.
"""

import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import pickle
import random
import re
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, random_decoder_params, random_policy

from rlscale import cli, saved_policy
from rlscale import objectives as obj
from rlscale import tokenizers as tokenizer_lib
from rlscale.data import load as data_load
from rlscale.eval import harness
from rlscale.main import label_steps, train_prm
from rlscale.model import config as model_config
from rlscale.model import decoder
from rlscale.objectives import registry
from rlscale.reward_models import bradley_terry, scalar_head, step_labels
from rlscale.reward_models import prm as prm_lib
from rlscale.sampling import Sampler, SamplingConfig
from rlscale.sampling.sampler import SampleOutput
from rlscale.sampling.scoring import completions_text
from rlscale.tokenizers import chat, train_sentencepiece

SHAPE = dict(d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=48)
CFG = prm_lib.PRMConfig(
    delimiter="=", seq_len=20, batch_rows=32, max_steps=6, eval_every=60, lr=3e-3
)
STEPS = 120
MARKERS = "37"
PROMPT_RE = re.compile(r"bad (\d), (\d) steps:(.*)$", re.S)


# ---- the scripted environment -------------------------------------------------------------


class EnvProblem(NamedTuple):
    prompt: str
    bad: str
    steps: int


def env_problem(bad: str, steps: int) -> EnvProblem:
    return EnvProblem(f"bad {bad}, {steps} steps:", bad, steps)


def env_verify(text: str, problem: EnvProblem) -> float:
    digits = text.split("=")
    ok = len(digits) == problem.steps and all(len(d) == 1 and d.isdigit() for d in digits)
    return float(ok and problem.bad not in digits)


def env_value(completion: str, problem: EnvProblem, q: float) -> list[float]:
    """The value of each step's prefix: (1 - q)^(S - j) while no step is the bad digit, 0
    after; the last step's is the completion's verdict."""
    digits = completion.split("=")
    values = [
        0.0 if problem.bad in digits[:j] else (1 - q) ** (problem.steps - j)
        for j in range(1, len(digits))
    ]
    return values + [env_verify(completion, problem)]


class ScriptedPolicy:
    """A stand-in for `Sampler` (the interface `sample_and_score` uses): decodes each prompt,
    and writes the S - j steps still missing after its j, each the bad digit with probability
    q and "5" otherwise. enumerate=True writes sample k's pattern from the bits of k (q = 1/2
    exactly when K is a multiple of 2^(S - j)); otherwise draws them from the call's key."""

    layout = None

    def __init__(self, tok, q: float, enumerate_outcomes: bool):
        self.tok, self.q, self.enumerate = tok, q, enumerate_outcomes
        self.prompts = []  # The decoded prompts of every call, in order.

    def __call__(self, params, prompts, rng, cfg):
        del params
        K, eos = cfg.num_samples, self.tok.eos_id
        key = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
        draw = np.random.default_rng(np.asarray(key).ravel().tolist())
        texts = []
        for ids in prompts:
            text = self.tok.decode(ids)
            self.prompts.append(text)
            bad, steps, prefix = PROMPT_RE.match(text).groups()
            missing = int(steps) - prefix.count("=")
            for k in range(K):
                if self.enumerate:
                    is_bad = [(k >> i) & 1 for i in range(missing)]
                else:
                    is_bad = list(draw.random(missing) < self.q)
                texts.append("=".join(bad if b else "5" for b in is_bad))
        rows = [ids + [eos] for ids in self.tok.encode_batch(texts)]
        N, M = len(rows), max(map(len, rows))
        tokens = np.full((N, M), cfg.pad_id, np.int32)
        mask = np.zeros((N, M), bool)
        for i, r in enumerate(rows):
            tokens[i, : len(r)], mask[i, : len(r)] = r, True
        zeros = np.zeros((N, M), np.float32)
        flags = np.zeros(N, bool)
        return SampleOutput(
            tokens,
            mask,
            zeros,
            mask.sum(1).astype(np.int32),
            flags,
            np.zeros((N, M), bool),
            flags,
            np.repeat(np.arange(len(prompts)), K),
            np.zeros((len(prompts), 1), np.int32),
            np.ones((len(prompts), 1), bool),
        )


# ---- the PRM's synthetic set: the label of step j is "no bad digit so far" -----------------


def _examples(seed: int, n: int, exclude=frozenset()):
    """(examples with noisy soft labels, true labels): steps are the prompt's digit with
    probability 0.3, else another digit (the other marker digit among them, so the prompt
    decides); the soft label of a clean prefix is Binomial(8, 0.9) / 8, of a spoiled one
    Binomial(8, 0.05) / 8, like Monte-Carlo estimates under a policy that rarely recovers."""
    rng, out, truth, seen = random.Random(seed), [], [], set(exclude)
    while len(out) < n:
        bad = rng.choice(MARKERS)
        others = [d for d in "0123456789" if d != bad]
        digits = [
            bad if rng.random() < 0.3 else rng.choice(others) for _ in range(rng.randint(2, 5))
        ]
        completion = "=".join(digits)
        if (bad, completion) in seen:
            continue
        seen.add((bad, completion))
        clean = [bad not in digits[: j + 1] for j in range(len(digits))]
        soft = [sum(rng.random() < (0.9 if c else 0.05) for _ in range(8)) / 8 for c in clean]
        out.append(step_labels.StepExample(f"bad {bad}:", completion, soft))
        truth.append(clean)
    return out, truth


TRAIN, _ = _examples(0, 512)
HELDOUT, HELDOUT_TRUTH = _examples(
    1, 200, exclude=frozenset((e.prompt[4], e.completion) for e in TRAIN)
)


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    corpus = [e.prompt + e.completion for e in TRAIN[:100]]
    corpus += [env_problem(rng.choice(MARKERS), s).prompt + "5=3=5" for s in range(1, 6)]
    corpus += ["Q: 7+5*3-2=7+15-2=22-2=20 Answer: 20", "first line\nsecond line\n"]
    return train_sentencepiece(corpus, 300, hard_vocab_limit=False)


@pytest.fixture(scope="module")
def model_cfg(tok):
    return model_config.get("tiny", vocab_size=tok.vocab_size, **SHAPE)


@pytest.fixture(scope="module")
def policy(tok, model_cfg, tmp_path_factory):
    """A random policy checkpoint that carries its tokenizer."""
    return random_policy(tmp_path_factory.mktemp("policy"), model_cfg, tok)


@pytest.fixture(scope="module")
def trained(tok, policy):
    return prm_lib.train(TRAIN, tok, CFG, STEPS, model=str(policy), heldout=HELDOUT)


@pytest.fixture(scope="module")
def prm(tok, trained):
    return prm_lib.ProcessRewardModel(trained.model_cfg, trained.graphdef, trained.params, tok, CFG)


# ---- steps ----------------------------------------------------------------------------------


def test_split_steps_by_hand():
    s = step_labels.split_steps("7+15-2=22-2=20 Answer: 20", step_labels.ARITHMETIC_DELIMITER)
    assert (s.starts, s.ends, s.last_tokens) == ((0, 7, 12), (7, 12, 25), None)
    # Blank lines and a trailing delimiter join the step before; a leading one the next.
    assert step_labels.split_steps("a\n\nb\n", "\n")[:2] == ((0, 3), (3, 5))
    assert step_labels.split_steps("\n first\nsecond", "\n")[:2] == ((0, 8), (8, 14))
    assert step_labels.split_steps("one step", "\n")[:2] == ((0,), (8,))
    assert (
        step_labels.split_steps("", "\n").num_steps
        == step_labels.split_steps(" \n \n", "\n").num_steps
        == 0
    )
    # A delimiter of several characters, occurrences not overlapping.
    assert step_labels.split_steps("a\n\n\nb", "\n\n")[:2] == ((0, 3), (3, 5))
    # Tokens "1", "2", "=", "3", "=", "4", "5": each step's last token is its "=" (or last).
    ends = [1, 2, 3, 4, 5, 6, 7]
    assert step_labels.split_steps("12=3=45", "=", ends).last_tokens == (2, 4, 6)
    # Tokens "12", "=3", "=45": a token holding a step's last character and the next step's
    # first is that step's last token; two steps may end in one token.
    assert step_labels.split_steps("12=3=45", "=", [2, 4, 7]).last_tokens == (1, 2, 2)
    with pytest.raises(ValueError, match="the 2 tokens cover 4 characters but the text has 7"):
        step_labels.split_steps("12=3=45", "=", [2, 4])
    with pytest.raises(ValueError, match="step delimiter '' must be a non-empty string"):
        step_labels.split_steps("12=3", "")


def test_token_char_ends_are_the_decoded_prefixes(tok):
    """Against the definition (the common prefix of decode(ids[:t+1]) and the text), with
    characters split over byte tokens, the EOS, and more tokens than the window."""
    for text in ["Café naïve ü\n1=2", "bad 3:1=7=3", "x" * 3 + "é" * 12 + "=\n=y"]:
        ids = tok.encode(text) + [tok.eos_id]
        got = step_labels.token_char_ends(tok, ids)
        want = [
            len(os.path.commonprefix([tok.decode(ids[: t + 1]), text])) for t in range(len(ids))
        ]
        np.testing.assert_array_equal(got, want)
    # A byte no later token completes stays in the text as U+FFFD: the exact prefixes.
    ids = tok.encode("ab") + tok.encode("é")[:1]
    assert tok.decode(ids) == "ab\ufffd"
    np.testing.assert_array_equal(step_labels.token_char_ends(tok, ids), [1, 2, 3])
    ids = tok.encode("Café=1")
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[3:5] == ["\ufffd", "\ufffd"]  # "é" is two byte tokens: the second ends it.
    steps = step_labels.completion_steps(tok, ids + [tok.eos_id], "=")
    assert steps.ends == (5, 6) and steps.last_tokens == (5, 6)


def test_a_delimiter_no_completion_has_is_an_error(caplog):
    with pytest.raises(ValueError) as e:
        step_labels.check_delimiter(["7+15-2=22-2=20 Answer: 20", "3*5+7 Answer: 22"], "\n")
    assert str(e.value).startswith(
        "step delimiter '\\n' occurs in none of the 2 completions, e.g. '7+15-2=22-2=20 "
        "Answer: 20'; every completion would be one step"
    )
    with caplog.at_level(logging.WARNING, logger="absl"):
        assert step_labels.check_delimiter(["1=2", "3", "4=5", "6"], "=") == 2
    assert [r.getMessage() for r in caplog.records] == [
        "2 of 4 completions have no step delimiter '=' (each is one step), e.g. 1, 3"
    ]
    with pytest.raises(ValueError, match="step delimiter '' must be a non-empty string"):
        step_labels.check_delimiter(["1=2"], "")


# ---- Monte-Carlo labels -------------------------------------------------------------------

COMPLETIONS = [  # (bad digit, steps, completion)
    ("3", 4, "5=5=5=5"),  # Correct: values 1/8, 1/4, 1/2, then 1.
    ("3", 4, "5=3=5=5"),  # Spoiled at step 2: 1/8, then 0.
    ("7", 3, "5=5=7"),  # Spoiled at the last step: 1/4, 1/2, then 0.
    ("7", 2, "5=5"),
    ("3", 1, "5"),  # One step, no delimiter: only its verdict.
]


def _mc(tok, policy, K, seed=0):
    problems = [env_problem(b, s) for b, s, _ in COMPLETIONS]
    completions = [c for *_, c in COMPLETIONS]
    cfg = SamplingConfig(max_new_tokens=16, stop_tokens=(tok.eos_id,))
    return problems, step_labels.mc_step_labels(
        policy,
        None,
        tok,
        problems,
        completions,
        env_verify,
        num_rollouts=K,
        cfg=cfg,
        rng=jax.random.key(seed),
        delimiter="=",
    )


def test_mc_labels_equal_the_enumerated_values(tok):
    """A policy whose K = 8 continuations enumerate its outcomes evenly (q = 1/2): the soft
    labels are exactly the prefixes' values, the hard labels whether any is positive, and
    the prefixes were sampled once each, in one call, from prompt + prefix."""
    policy = ScriptedPolicy(tok, 0.5, enumerate_outcomes=True)
    problems, labels = _mc(tok, policy, K=8)
    for (_, _, completion), problem, lab in zip(COMPLETIONS, problems, labels):
        want = env_value(completion, problem, 0.5)
        np.testing.assert_array_equal(lab.soft, want)
        np.testing.assert_array_equal(lab.hard, np.asarray(want) > 0)
        assert lab.steps == step_labels.split_steps(completion, "=")
    assert labels[0].soft.tolist() == [1 / 8, 1 / 4, 1 / 2, 1.0]
    assert policy.prompts == [
        "bad 3, 4 steps:5=",
        "bad 3, 4 steps:5=5=",
        "bad 3, 4 steps:5=5=5=",
        "bad 3, 4 steps:5=",
        "bad 3, 4 steps:5=3=",
        "bad 3, 4 steps:5=3=5=",
        "bad 7, 3 steps:5=",
        "bad 7, 3 steps:5=5=",
        "bad 7, 2 steps:5=",
    ]
    # The prefix verifier goes to a verifier pool as it is.
    verify = pickle.loads(pickle.dumps(step_labels.PrefixVerifier(env_verify)))
    assert verify("5=5", step_labels.StepPrefix("", problems[0], "5=5=")) == 1.0


def test_mc_labels_sampled_are_within_binomial_bounds(tok):
    """The policy draws its outcomes (q = 0.3) from the key: every soft label is within 4
    binomial standard deviations of the value (K = 256), the same key gives the same labels
    and another key others."""
    q, K = 0.3, 256
    problems, labels = _mc(tok, ScriptedPolicy(tok, q, enumerate_outcomes=False), K)
    for (_, _, completion), problem, lab in zip(COMPLETIONS, problems, labels):
        want = np.asarray(env_value(completion, problem, q))
        assert np.all(np.abs(lab.soft - want) <= 4 * np.sqrt(want * (1 - want) / K))
    _, again = _mc(tok, ScriptedPolicy(tok, q, enumerate_outcomes=False), K)
    assert all(np.array_equal(a.soft, b.soft) for a, b in zip(labels, again))
    _, other = _mc(tok, ScriptedPolicy(tok, q, enumerate_outcomes=False), K, seed=1)
    assert not all(np.array_equal(a.soft, b.soft) for a, b in zip(labels, other))


def _even_length(text: str, problem) -> float:
    """A verifier a random policy passes about half the time."""
    del problem
    return float(len(text) % 2 == 0)


def test_mc_labels_with_the_sampler_match_sampling_directly(tok, model_cfg):
    """With the real `Sampler` and a random tiny policy, the labels equal what sampling the
    prefixes directly (the same key, prompt + prefix encoded as a prompt) and verifying
    prefix + continuation gives."""
    graphdef, _ = decoder.abstract_model(model_cfg)
    params = random_decoder_params(model_cfg, 0)
    sampler = Sampler(graphdef, model_cfg)
    cfg = SamplingConfig(max_new_tokens=6, stop_tokens=(tok.eos_id,), buckets=(24,))
    problems = [env_problem("3", 3), env_problem("7", 2)]
    completions = ["5=5=5", "1=7"]
    rng, K = jax.random.key(3), 4
    labels = step_labels.mc_step_labels(
        sampler, params, tok, problems, completions, _even_length,
        num_rollouts=K, cfg=cfg, rng=rng, delimiter="=",
    )  # fmt: skip
    prefixes = [(problems[0], "5="), (problems[0], "5=5="), (problems[1], "1=")]
    out = sampler(
        params,
        [chat.encode_prompt(tok, p.prompt + x) for p, x in prefixes],
        rng,
        dataclasses.replace(cfg, num_samples=K),
    )
    texts = completions_text(tok, np.asarray(out.tokens), np.asarray(out.lengths))
    direct = [
        np.mean([_even_length(x + texts[i * K + k], p) for k in range(K)])
        for i, (p, x) in enumerate(prefixes)
    ]
    assert 0 < np.mean(direct) < 1  # Not a verifier every continuation fails (or passes).
    np.testing.assert_array_equal(labels[0].soft, [*direct[:2], _even_length("5=5=5", None)])
    np.testing.assert_array_equal(labels[1].soft, [direct[2], _even_length("1=7", None)])


# ---- the PRM ------------------------------------------------------------------------------


@pytest.mark.slow
def test_prm_learns_known_step_labels(prm, trained, tok):
    """Trained on noisy soft labels, the PRM labels held-out steps as the truth (no bad digit
    so far) has them: > 0.9; and > 0.9 in each class on the steps that only the prompt's
    digit decides (the prefix holds one of the two marker digits: spoiled if it is the
    prompt's, clean if it is the other), which a model blind to the prompt gets right half
    the time. Ranked by any aggregation of its step probabilities, a completion without a bad
    step comes before a spoiled one (AUC > 0.95)."""
    assert [r.step for r in trained.history] == [60, 120]
    assert trained.history[-1].loss < trained.history[0].loss
    assert trained.history[-1].heldout_accuracy > 0.9
    prompt_ids = [chat.encode_prompt(tok, e.prompt) for e in HELDOUT]
    completion_ids = tok.encode_batch([e.completion for e in HELDOUT])
    s_NS, mask_NS, _ = prm.score_steps(prompt_ids, completion_ids)
    truth, by_prompt = np.zeros_like(mask_NS), np.zeros_like(mask_NS)
    for i, (e, t) in enumerate(zip(HELDOUT, HELDOUT_TRUTH)):
        digits = e.completion.split("=")
        truth[i, : len(t)] = t
        by_prompt[i, : len(t)] = [
            len(set(digits[: j + 1]) & set(MARKERS)) == 1 for j in range(len(t))
        ]
    right = (s_NS > 0) == truth
    assert right[mask_NS].mean() > 0.9
    for label in (True, False):
        decided = by_prompt & (truth == label)
        assert decided.sum() > 30 and right[decided].mean() > 0.9
    # Best-of-N: every aggregation ranks the completions without a bad step above the others
    # (the area under the ROC curve, ties counting half).
    clean = np.array([all(t) for t in HELDOUT_TRUTH])
    assert 30 < clean.sum() < len(clean) - 30
    for aggregation in prm_lib.AGGREGATIONS:
        score = prm_lib.prm_scores(prm, prompt_ids, completion_ids, aggregation)
        above = score[clean][:, None] - score[~clean][None, :]
        assert np.mean((above > 0) + 0.5 * (above == 0)) > 0.95


def test_step_loss_and_gradient_by_hand():
    s = jnp.array([[2.0, -1.0, 0.0], [0.5, 3.0, 9.0]])
    y = jnp.array([[1.0, 0.25, 0.5], [0.0, 1.0, 0.7]])
    m = jnp.array([[True, True, True], [True, False, False]])
    total, n = prm_lib.step_loss(s, y, m)
    # -[y log sig(s) + (1 - y) log sig(-s)] = log(1 + e^-s) + (1 - y) s.
    want = [np.log1p(np.exp(-2.0)), np.log1p(np.exp(1.0)) - 0.75, np.log(2.0)]
    want += [np.log1p(np.exp(-0.5)) + 0.5]
    assert float(n) == 4
    np.testing.assert_allclose(total, sum(want), rtol=1e-6)
    g = jax.grad(lambda x: prm_lib.step_loss(x, y, m)[0])(s)
    sig = 1 / (1 + np.exp(-np.asarray(s)))
    np.testing.assert_allclose(g, (sig - np.asarray(y)) * np.asarray(m), rtol=1e-6, atol=1e-7)


@functools.partial(jax.jit, static_argnums=0)
def _unpadded_hidden(graphdef, decoder_params, ids_NT):
    """The decoder's final hidden states of unpadded rows."""
    mask = jnp.ones_like(ids_NT, bool)
    return decoder.hidden(
        graphdef, decoder_params, ids_NT, decoder.positions_from_mask(mask), mask
    )[0]


def test_scores_are_the_head_at_each_steps_last_token(prm, tok):
    """score_steps == w . h[t_j] + b with h from the unpadded row, for each step's last token
    t_j; an EOS after the completion changes nothing; step_rewards places sigmoid(s_j) there,
    the final step's at the completion's last token (the EOS when there is one)."""
    prompt_ids = [chat.encode_prompt(tok, "bad 3:"), chat.encode_prompt(tok, "bad 7:")]
    completion_ids = [tok.encode("1=3=5"), tok.encode("86=2") + [tok.eos_id]]
    s_NS, mask_NS, steps = prm.score_steps(prompt_ids, completion_ids)
    assert mask_NS.tolist() == [[True, True, True], [True, True, False]]
    assert [s.last_tokens for s in steps] == [(1, 3, 4), (2, 3)]
    rows = np.asarray([p + c for p, c in zip(prompt_ids, completion_ids)], np.int32)
    h_NTD = np.asarray(_unpadded_hidden(prm.graphdef, prm.params["decoder"], rows), np.float64)
    w, b = np.asarray(prm.params["head"]["w"], np.float64), float(prm.params["head"]["b"])
    for i, p in enumerate(prompt_ids):
        want = [h_NTD[i, len(p) + t] @ w + b for t in steps[i].last_tokens]
        np.testing.assert_allclose(s_NS[i, : len(want)], want, rtol=1e-5, atol=1e-5)
    no_eos, _, _ = prm.score_steps(prompt_ids, [completion_ids[0], completion_ids[1][:-1]])
    np.testing.assert_allclose(no_eos, s_NS, rtol=1e-6, atol=1e-6)
    reward, mask = prm.step_rewards(prompt_ids, completion_ids, max_len=6)
    assert mask.astype(int).tolist() == [[0, 1, 0, 1, 1, 0], [0, 0, 1, 0, 1, 0]]
    np.testing.assert_allclose(reward[mask], prm_lib.sigmoid(s_NS[mask_NS]), rtol=1e-6)
    assert not reward[~mask].any()
    with pytest.raises(ValueError, match="completion 0 has 5 tokens, more than max_len=4"):
        prm.step_rewards(prompt_ids, completion_ids, max_len=4)


def test_save_load_round_trip(prm, trained, tok, tmp_path):
    path = str(tmp_path / "prm")
    prm_lib.save(path, trained.model_cfg, trained.params, tok, CFG, trained.history)
    loaded = prm_lib.load(path)
    assert loaded.config == CFG and loaded.model_cfg == trained.model_cfg
    scalar_head.check_tokenizer(path, tok)
    prompt_ids = [chat.encode_prompt(tok, e.prompt) for e in HELDOUT[:8]]
    completion_ids = tok.encode_batch([e.completion for e in HELDOUT[:8]])
    for aggregation in prm_lib.AGGREGATIONS:
        np.testing.assert_array_equal(
            prm_lib.prm_scores(loaded, prompt_ids, completion_ids, aggregation),
            prm_lib.prm_scores(prm, prompt_ids, completion_ids, aggregation),
        )
    bradley_terry.save(
        str(tmp_path / "rm"), trained.model_cfg, trained.params, tok, CFG.rm_config()
    )
    with pytest.raises(FileNotFoundError, match="not a process reward model directory"):
        prm_lib.load(str(tmp_path / "rm"))


# ---- best-of-N ----------------------------------------------------------------------------


def test_aggregations_by_hand(prm, tok):
    p = np.array([[0.9, 0.5, 0.8], [0.2, 0.9, 0.4], [0.6, 0.6, 0.6]])
    m = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
    np.testing.assert_allclose(prm_lib.prm_min(p, m), [0.5, 0.2, 0.0])
    np.testing.assert_allclose(prm_lib.prm_last(p, m), [0.8, 0.9, 0.0])
    np.testing.assert_allclose(prm_lib.prm_product(p, m), [0.36, 0.18, 0.0])
    with pytest.raises(ValueError, match=r"step probabilities \(3, 3\) and mask \(3, 2\)"):
        prm_lib.prm_min(p, m[:, :2])
    # prm_scores: the aggregation of the model's step probabilities.
    prompt_ids = [chat.encode_prompt(tok, "bad 3:")] * 2
    completion_ids = [tok.encode("1=3=5"), tok.encode("8=2")]
    s_NS, mask_NS, _ = prm.score_steps(prompt_ids, completion_ids)
    for name, fn in prm_lib.AGGREGATIONS.items():
        np.testing.assert_allclose(
            prm_lib.prm_scores(prm, prompt_ids, completion_ids, name),
            fn(prm_lib.sigmoid(s_NS), mask_NS),
        )
    with pytest.raises(ValueError, match=r"aggregation='mean' is not one of \('min'"):
        prm_lib.prm_scores(prm, prompt_ids, completion_ids, "mean")


def test_config_lists_every_problem():
    with pytest.raises(ValueError) as e:
        prm_lib.PRMConfig(delimiter="", max_steps=0)
    assert str(e.value) == (
        "Invalid process reward model config: delimiter='' must be a non-empty string; "
        "max_steps=0 must be >= 1"
    )
    with pytest.raises(ValueError) as e:
        prm_lib.PRMConfig(seq_len=0, lr=-1.0)
    assert str(e.value) == (
        "Invalid process reward model config: seq_len=0 must be >= 1; lr=-1.0 must be > 0"
    )


def test_encoding_drops_what_does_not_fit_and_refuses_mismatched_labels(tok, caplog):
    examples = [
        step_labels.StepExample("bad 3:", "1=2=4", [1.0, 1.0, 0.5]),
        step_labels.StepExample("bad 3:", "=".join("1" * 7), [1.0] * 7),  # 7 steps > max_steps = 6.
        step_labels.StepExample("bad 3:", "12345=" * 3, [1.0] * 3),  # 5 + 18 tokens > seq_len = 20.
        step_labels.StepExample("bad 3:", " ", []),  # No steps.
    ]
    with caplog.at_level(logging.WARNING, logger="absl"):
        enc = prm_lib.encode_examples(examples, tok, CFG)
    assert enc.sources == [0] and enc.batch.tokens_NT.shape == (1, CFG.seq_len)
    np.testing.assert_array_equal(enc.batch.labels_NJ[0], [1.0, 1.0, 0.5, 0, 0, 0])
    np.testing.assert_array_equal(enc.batch.positions_NJ[0, :3], np.array([1, 3, 4]) + 5)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "1 of 4 completions have no step delimiter '=' (each is one step), e.g. 3",
        "dropped 1 of 4 labelled completions without steps (seq_len=20, max_steps=6): rows 3",
        "dropped 1 of 4 labelled completions longer than seq_len (seq_len=20, max_steps=6): rows 2",
        "dropped 1 of 4 labelled completions with more than max_steps steps (seq_len=20, "
        "max_steps=6): rows 1",
    ]
    bad = [
        step_labels.StepExample("bad 3:", "1=2=4", [1.0, 1.0]),
        step_labels.StepExample("bad 3:", "1", [1.0]),
    ]
    with pytest.raises(ValueError, match=r"1 rows' labels do not match the steps .* row 0 \(2 "):
        prm_lib.encode_examples(bad, tok, CFG)


# ---- process advantages -------------------------------------------------------------------

# Two prompts x two samples, M = 5, ragged; steps end where STEP_MASK is 1. Row 1's one step
# has reward 0.0 and ends on a masked token (written by forced interruption): it counts in
# its group's statistics all the same.
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], bool)
STEP_MASK = np.array([[0, 1, 0, 0, 1], [0, 0, 1, 0, 0], [1, 0, 0, 1, 0], [0, 1, 0, 0, 0]], bool)
STEP_REWARD = np.array(
    [[0, 0.9, 0, 0, 0.6], [0, 0, 0.0, 0, 0], [0.2, 0, 0, 0.5, 0], [0, 0.8, 0, 0, 0]],
    np.float32,
)


def _process_terms(**extra):
    return {
        "mask": jnp.asarray(MASK),
        "step_mask": jnp.asarray(STEP_MASK),
        "step_reward": jnp.asarray(STEP_REWARD),
        "reward": jnp.asarray([1.0, 0.0, 1.0, 1.0]),
        **extra,
    }


def _run(transform, terms):
    return transform.update(terms, transform.init())[0]


def test_process_advantages_by_hand():
    """DeepSeekMath 4.1.3: normalize over each group's step rewards (the 0.0 step counts),
    then a token's advantage is the sum of the normalized rewards of its step and later."""
    out = _run(obj.process_advantages(group_size=2, eps=0.0), _process_terms())
    # Group 1: R = {0.9, 0.6, 0.0}, mean 0.5, unbiased var (0.16 + 0.01 + 0.25) / 2 = 0.21.
    a, b, c = (np.array([0.9, 0.6, 0.0]) - 0.5) / np.sqrt(0.21)
    # Group 2: R = {0.2, 0.5, 0.8}, mean 0.5, unbiased var 0.09: r~ = -1, 0, 1.
    want = [
        [a + b, a + b, b, b, b],
        [c, c, 0.0, 0.0, 0.0],  # Masked tokens get 0, and so do tokens after the last step.
        [-1.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 0.0, 0.0, 0.0],
    ]
    np.testing.assert_allclose(out["advantage"], want, rtol=1e-5, atol=1e-6)
    m = out["metrics"]
    np.testing.assert_allclose(m["step_reward_mean"], 3.0 / 6, rtol=1e-6)
    np.testing.assert_allclose(m["steps_per_row"], 6 / 4)


def test_process_advantages_mix_and_raw():
    """mix=add adds coef x the process term to the outcome advantage; normalize=none sums the
    raw step rewards."""
    outcome = obj.group_advantages(2, scale="none")
    base = _run(outcome, _process_terms())["advantage"]
    out = _run(
        obj.chain(
            outcome, obj.process_advantages(group_size=2, coef=0.5, mix="add", normalize="none")
        ),
        _process_terms(),
    )
    raw = np.cumsum(STEP_REWARD[:, ::-1], axis=1)[:, ::-1] * MASK
    np.testing.assert_allclose(out["advantage"], np.asarray(base) + 0.5 * raw, rtol=1e-6)
    np.testing.assert_allclose(raw[0], [1.5, 1.5, 0.6, 0.6, 0.6], rtol=1e-6)


def test_process_policy_gradient_identity():
    """d loss / d logp of process_advantages | policy_gradient | aggregate(seq_sum) equals
    that of -sum_i sum_j r~_ij log pi(o_i,<=index(j)) / (N M): each normalized step reward
    weights the log-probability of the prefix through its step (trained tokens only)."""
    spec = "process_advantages | policy_gradient | aggregate(mode=seq_sum)"
    objective = registry.build(spec, group_size=2, max_len=5)
    adv = _run(objective.batch, _process_terms())

    def loss(logp):
        terms = _run(objective.loss, {**adv, "logp": logp})
        return terms["loss_sum"] / terms["denominator"]

    logp = jnp.asarray(-np.random.default_rng(0).uniform(0.1, 2.0, MASK.shape), jnp.float32)
    r = np.zeros_like(STEP_REWARD, np.float64)  # r~ by hand, as in the test above.
    r[0, [1, 4]] = (np.array([0.9, 0.6]) - 0.5) / np.sqrt(0.21)
    r[1, 2] = (0.0 - 0.5) / np.sqrt(0.21)
    r[2, [0, 3]], r[3, 1] = [-1.0, 0.0], 1.0

    def prefixes(logp):
        total = 0.0
        for i, j in zip(*np.nonzero(STEP_MASK)):
            total += r[i, j] * jnp.sum((logp[i] * MASK[i])[: j + 1])
        return -total / (4 * 5)

    np.testing.assert_allclose(
        jax.jit(jax.grad(loss))(logp), jax.jit(jax.grad(prefixes))(logp), atol=1e-6
    )


def test_process_chains_check():
    run = dict(group_size=2, max_len=5)
    for spec in (
        "process_advantages | token_ratio | cispo | aggregate(mode=token_mean)",
        "group_advantages | process_advantages(mix=add, coef=0.3) | policy_gradient"
        " | aggregate(mode=seq_sum)",
    ):
        assert registry.check(spec, **run) == []
    assert registry.build(
        "process_advantages | token_ratio | cispo | aggregate(mode=token_mean)", **run
    ).model_terms == {"logp"}
    assert registry.check(
        "process_advantages(mix=add) | policy_gradient | aggregate(mode=seq_sum)", **run
    ) == [
        "objective.chain: process_advantages needs term 'advantage', which nothing before it "
        "provides (add one of: group_advantages, reinforce_pp_baseline, gae, process_advantages)"
    ]
    assert registry.check(
        "process_advantages(mix=sum, normalize=batch) | policy_gradient | aggregate(mode=seq_sum)",
        **run,
    ) == [
        "objective.chain: process_advantages: mix='sum' is not one of ('replace', 'add'): "
        "'replace' makes the process advantage the whole advantage (DeepSeekMath's process "
        "supervision), 'add' adds it to the advantage already computed (the outcome one)"
    ]
    with pytest.raises(ValueError, match="normalize='batch' is not one of"):
        obj.process_advantages(group_size=2, normalize="batch")
    with pytest.raises(ValueError, match="5 rows are not whole groups of 2"):
        _run(
            obj.process_advantages(group_size=2),
            {k: v[:1].repeat(5, 0) for k, v in _process_terms().items() if k != "reward"},
        )


# ---- the command line, on the suite's warm start --------------------------------------------

QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
N, K, ROLLOUTS = 3, 2, 4


def _command(args):
    """`python -m rlscale.main.label_steps` (args "label", ...) or `train_prm` ("train", ...),
    in-process."""
    command = {"label": label_steps, "train": train_prm}[args[0]]
    return cli.call(command.define_flags, command.main, args[1:])


def _label_args(warm, *more):
    """`label` on the warm start (the quickstart smoke run's final params), one device and the
    verifier in-process, as the warm run itself."""
    return [
        "label",
        "--config",
        f"{QUICKSTART}:smoke",
        "--config.mesh.shape=(1,1,1)",
        "--config.reward.workers=0",
        "--checkpoint",
        str(warm / "final"),
        *("--n", str(N), "--k", str(K), "--rollouts", str(ROLLOUTS)),
        *more,
    ]


class EvenLengthTask:
    """The arithmetic problems graded by `_even_length`, which the warm start's completions and
    continuations pass about half the time (the task's own verifier it rarely passes: all-zero
    labels would test nothing)."""

    def verify(self, text, problem):
        return _even_length(text, problem)


def _problems(warm):
    """The first N problems of the train split, as `label` reads them."""
    _, splits = data_load.load_task(cli.load_config(f"{QUICKSTART}:smoke").task, str(warm))
    return splits["train"][:N]


@pytest.fixture(scope="module")
def labelled(warm, tmp_path_factory):
    """(summary, rows, the labels file, what `label` printed)."""
    out = tmp_path_factory.mktemp("labels") / "labels.jsonl"
    load_task = data_load.load_task
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(data_load, "load_task", lambda c, w: (EvenLengthTask(), load_task(c, w)[1]))
        summary = _command(_label_args(warm, "--out", str(out)))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return summary, rows, out, printed.getvalue()


def test_cli_label_writes_each_completions_step_labels(labelled, warm):
    """One row per completion, problem-major: its problem's prompt, the outcome the verifier
    gives its text, the steps `split_steps` finds at the arithmetic task's "=" (the default),
    soft labels that are fractions of the K rollouts, hard labels that say whether any rollout
    passed, and a last label that is the outcome; the summary counts them."""
    summary, rows, out, printed = labelled
    problems = _problems(warm)
    assert [(r["problem"], r["sample"]) for r in rows] == [
        (i, j) for i in range(N) for j in range(K)
    ]
    for r in rows:
        problem = problems[r["problem"]]
        assert r["prompt"] == problem.prompt and r["delimiter"] == step_labels.ARITHMETIC_DELIMITER
        assert r["outcome"] == _even_length(r["completion"], problem)
        assert r["step_ends"] == list(step_labels.split_steps(r["completion"], "=").ends)
        assert len(r["soft"]) == len(r["hard"]) == len(r["step_ends"]) > 0
        soft = np.array(r["soft"])
        assert np.all((soft >= 0) & (soft <= 1))
        np.testing.assert_array_equal(soft * ROLLOUTS, np.round(soft * ROLLOUTS))
        assert r["hard"] == [float(x > 0) for x in r["soft"]]
        assert r["soft"][-1] == r["hard"][-1] == float(r["outcome"] > 0)
    # The checks above have teeth: outcomes of both kinds, several steps, labels strictly
    # between 0 and 1.
    assert 0 < np.mean([r["outcome"] for r in rows]) < 1
    assert any(len(r["soft"]) > 1 for r in rows)
    assert any(0 < x < 1 for r in rows for x in r["soft"])
    soft = [x for r in rows for x in r["soft"]]
    with_delimiter = [("=" in r["completion"]) for r in rows]
    assert summary == {
        "completions": N * K,
        "problems": N,
        "steps": len(soft),
        "mean_soft_label": pytest.approx(np.mean(soft)),
        "correct_frac": pytest.approx(np.mean([r["outcome"] > 0 for r in rows])),
        "delimiter": "=",
        "delimiter_coverage": pytest.approx(np.mean(with_delimiter)),
        "out": str(out),
    }
    assert f"  steps                {len(soft)}\n" in printed
    assert "  delimiter            '='\n" in printed


def test_cli_train_writes_a_prm_that_evaluate_scores_with(
    labelled, warm, tmp_path, capsys, monkeypatch
):
    """`train` from the warm start's params, its tokenizer found next to them (the run's
    WORKDIR/tokenizer.model): the PRM it writes loads, holds out one prompt's completions
    (--heldout_frac 0.1 of 3 prompts), prints the held-out step accuracy of the params it
    saved, scores completions, and ranks samples in `rlscale.main.evaluate --scorer prm`."""
    _, rows, labels, _ = labelled
    out = tmp_path / "prm"
    args = ["train", "--labels", str(labels), "--init", str(warm / "final"), "--steps", "2"]
    summary = _command([*args, "--batch_rows", "4", "--lr", "1e-3", "--out", str(out)])
    printed = capsys.readouterr().out
    prm = prm_lib.load(str(out))
    assert scalar_head.same_tokenizer(
        prm.tokenizer, tokenizer_lib.load(str(warm / "tokenizer.model"))
    )
    assert (prm.config.delimiter, prm.config.batch_rows, prm.config.lr) == ("=", 4, 1e-3)
    # The default bucket: the longest row, rounded up to a multiple of 16.
    tok = prm.tokenizer
    prompt_ids = [chat.encode_prompt(tok, r["prompt"]) for r in rows]
    completion_ids = tok.encode_batch([r["completion"] for r in rows])
    longest = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    assert prm.config.seq_len % 16 == 0 and longest <= prm.config.seq_len < longest + 16
    # The held-out rows: every completion of one of the three prompts.
    examples, _ = step_labels.read_labels(str(labels))
    train_rows, heldout = step_labels.split_heldout(examples, 0.1, seed=0)
    assert len({e.prompt for e in heldout}) == 1 and len(heldout) == K
    assert not {e.prompt for e in heldout} & {e.prompt for e in train_rows}
    encoded = prm_lib.encode_examples(heldout, tok, prm.config)
    _, accuracy = prm_lib.heldout_metrics(prm.forward, prm.params, encoded)
    assert summary["heldout_step_accuracy"] == pytest.approx(accuracy)
    assert (summary["train_completions"], summary["heldout_completions"]) == (N * K - K, K)
    assert printed.splitlines() == [
        f"held-out step accuracy {accuracy:.4f} ({K} completions)",
        f"process reward model written to {out}",
    ]
    # The third command: evaluate ranks its samples with the PRM. Its calls are recorded to
    # score the same samples here.
    scored, prm_scores = [], prm_lib.prm_scores

    def recording_prm_scores(model, prompt_ids, completion_ids, aggregation):
        scored.append((prompt_ids, completion_ids))
        return prm_scores(model, prompt_ids, completion_ids, aggregation)

    monkeypatch.setattr(prm_lib, "prm_scores", recording_prm_scores)
    config = cli.load_config(f"{QUICKSTART}:smoke", ["--config.mesh.shape=(1,1,1)"])
    config.reward.workers = 0
    report = harness.run(
        saved_policy.resolve(config),
        str(warm / "final"),
        k=2,
        n=2,
        best_of=[1, 2],
        scorers=["prm"],
        prm_dir=str(out),
        output=str(tmp_path / "eval.json"),
        plot=str(tmp_path / "curves.png"),
    )
    s = np.array(report["per_prompt"]["scores"]["prm_min"])
    r = np.array(report["per_prompt"]["rewards"])
    assert s.shape == r.shape == (2, 2)
    # Each sample's score is the written PRM's least step probability (0 without a step).
    ((prompt_ids, completion_ids),) = scored
    longest = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    s_NS, mask_NS, _ = prm.with_bucket(longest).score_steps(prompt_ids, completion_ids)
    p_NS = 1 / (1 + np.exp(-s_NS.astype(np.float64)))
    least = [min(row[m], default=0.0) for row, m in zip(p_NS, mask_NS)]
    np.testing.assert_allclose(s.reshape(-1), least, rtol=1e-6)
    # Best of 1 is any sample; best of both is the one the PRM scores higher (a tie: either).
    best = np.where(s[:, 0] == s[:, 1], r.mean(1), r[np.arange(2), s.argmax(1)])
    assert list(report["test_time"]["N"]) == [1, 2]
    assert report["test_time"]["best_of/prm_min"] == pytest.approx([r.mean(), best.mean()])


def test_cli_a_users_mistake_is_one_error_line(labelled, warm, tmp_path, capsys):
    """A delimiter no completion has, malformed labels rows (each named by file, line and
    field, all at once), a mistyped config key, a missing tokenizer."""

    def error(args):
        with pytest.raises(SystemExit) as e:
            cli.guard(_command)(args)
        assert e.value.code == 1
        return capsys.readouterr().err

    never = tmp_path / "never.jsonl"
    err = error(_label_args(warm, "--delimiter", "\n", "--out", str(never)))
    assert err.startswith(
        f"error: step delimiter '\\n' occurs in none of the {N * K} completions, e.g. "
    )
    assert err.count("\n") == 1 and not never.exists()

    _, rows, _, _ = labelled
    bad = [
        rows[0],
        {k: v for k, v in rows[1].items() if k != "soft"},
        {**rows[2], "soft": rows[2]["soft"] + [0.5]},
        {**rows[3], "prompt": 3},
        {**rows[4], "step_ends": [1]},
        {**rows[5], "hard": [2.0] * len(rows[5]["hard"])},  # Fine while the soft are read.
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad) + "not json\n")
    steps = len(rows[2]["soft"])
    args = ["train", "--labels", str(path), "--init", str(warm / "final")]
    assert error([*args, "--out", str(tmp_path / "prm")]) == (
        f"error: {path}: 5 malformed rows: "
        f"{path}, line 2: has no 'soft'; "
        f"{path}, line 3: 'soft' has {steps + 1} labels but the completion has {steps} steps "
        "at '='; "
        f"{path}, line 4: 'prompt' must be a string, got int; "
        f"{path}, line 5: 'step_ends' [1] are not the completion's steps at '=', which end at "
        f"{rows[4]['step_ends']}; "
        f"{path}, line 7: bad JSON: Expecting value: line 1 column 1 (char 0)\n"
    )
    err = error([*args, "--label", "hard", "--out", str(tmp_path / "prm")])
    assert err.startswith(f"error: {path}: 4 malformed rows: {path}, line 4: ")
    assert f"{path}, line 6: 'hard' has labels outside [0, 1]: [2.0, " in err
    assert not (tmp_path / "prm").exists()

    err = error(
        ["label", "--config", f"{QUICKSTART}:smoke", "--config.sampling.max_new_token=5"]
        + ["--checkpoint", str(warm / "final"), "--out", str(never)]
    )
    assert err == (
        "error: --config.sampling.max_new_token=5: no such config key 'max_new_token'; did you "
        "mean 'max_new_tokens'?\n"
    )
    err = error(["train", "--labels", str(labelled[2]), "--out", str(tmp_path / "prm")])
    assert err == "error: --tokenizer: required unless --init names a policy checkpoint\n"


def test_cli_label_scores_in_the_verifier_pool(warm, tmp_path):
    """`python -m rlscale.main.label_steps` with the verifier in a worker process: the worker
    unpickles each continuation's `PrefixVerifier` by its module path (a class defined in
    `__main__` could not be found there: every continuation would crash and count as
    wrong)."""
    out = tmp_path / "labels.jsonl"
    args = _label_args(warm, "--out", str(out), "--n", "2", "--k", "2", "--rollouts", "2")
    args[args.index("--config.reward.workers=0")] = "--config.reward.workers=1"
    done = subprocess.run(
        [sys.executable, "-m", "rlscale.main.label_steps", *args[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reward function failed" not in done.stderr and "Traceback" not in done.stderr
    assert len(out.read_text().splitlines()) == 4
