"""Evaluation metrics against hand-computed values, sampling/scoring plumbing, and the CLI."""

import hashlib
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import types
from fractions import Fraction

import jax
import numpy as np
import pytest
from conftest import subprocess_env
from test_main import one_error_line

from rlscale import checkpoint, cli, config_lib, model, saved_policy, sharding
from rlscale.data import load as data_load
from rlscale.data import math_data, tasks
from rlscale.eval import estimators, harness
from rlscale.main import evaluate
from rlscale.reward_models import bradley_terry, scalar_head
from rlscale.reward_models import prm as prm_lib
from rlscale.sampling import Sampler, SamplingConfig, scoring
from rlscale.tokenizers import chat, train_sentencepiece

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------------
# Metrics.
# ------------------------------------------------------------------------------------------


def test_pass_at_k_hand_computed():
    # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10; pass@4: any 4 of 5 hold a correct one.
    got = [estimators.pass_at_k(5, 2, k)[()] for k in (1, 2, 3, 4, 5)]
    np.testing.assert_allclose(got, [0.4, 0.7, 0.9, 1.0, 1.0], rtol=1e-15)
    np.testing.assert_allclose(
        estimators.pass_at_k([4, 4, 4, 10], [0, 4, 1, 3], 2), [0.0, 1.0, 0.5, 1 - 21 / 45]
    )


def test_pass_at_k_is_stable_for_large_n():
    # C(2000, 500) overflows a float; the product form does not.
    n, c, k = 2000, 7, 500
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert estimators.pass_at_k(n, c, k)[()] == pytest.approx(float(exact), rel=1e-12)
    with pytest.raises(OverflowError):
        float(math.comb(n, k))


@pytest.mark.parametrize(
    "n, c, k, message",
    [(4, 1, 5, "larger than the samples"), (4, 5, 2, "num_correct"), (4, 1, 0, "k=0")],
)
def test_pass_at_k_bad_arguments(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        estimators.pass_at_k(n, c, k)


def test_avg_at_k():
    np.testing.assert_array_equal(
        estimators.avg_at_k([[1, 0, 0, 1], [0.5, 0.5, 0, 0]]), [0.5, 0.25]
    )
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        estimators.avg_at_k([1, 0])


def test_maj_at_n_hand_computed():
    answers = [
        ["2", "3", "2", None],  # "2" wins 2-1.
        ["5", "7", "7", "5"],  # Tie 2-2: broken at random, so the mean of "5" (0) and "7" (1).
        [None, None, None, None],  # Nobody answers: 0.
        [None, None, "4", None],  # None does not vote: "4" wins alone.
        ["1", "2", "3", "4"],  # All tied: the mean of the four.
    ]
    rewards = [[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 1], [0, 1, 1, 1]]
    vote = estimators.maj_at_n(answers, rewards)
    np.testing.assert_array_equal(vote.value_B, [1, 0.5, 0, 0, 0.75])
    assert (vote.subsets, vote.exact) == (1, True) and not vote.stderr_B.any()
    # Subsets of N of G = 6. N = 1: each sample alone, so the mean reward of answered samples;
    # N = 2 over the 15 pairs: a+a, a+None (twice), 1; a+b, a+c (6 pairs), 1/2; the rest 0:
    # (3 + 6 / 2) / 15 = 0.4.
    answers, rewards = [["a", "b", "a", None, "c", "b"]], [[1, 0, 1, 0, 0, 0]]
    got = [estimators.maj_at_n(answers, rewards, n).value_B[0] for n in (1, 2, 6)]
    np.testing.assert_allclose(got, [2 / 6, 0.4, 0.5], rtol=1e-15)
    # Weighted: "a" (weight 3) outvotes two "b"s (weight 1 each); unweighted, "b" wins.
    answers, rewards, weights = [["a", "b", "b"]], [[1, 0, 0]], [[3, 1, 1]]
    assert estimators.maj_at_n(answers, rewards).value_B[0] == 0
    assert estimators.maj_at_n(answers, rewards, 3, weights).value_B[0] == 1
    # N = 2: {a, b} twice (a wins 3-1), {b, b} once.
    assert estimators.maj_at_n(answers, rewards, 2, weights).value_B[0] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="row 0 has 3 answers, expected 4"):
        estimators.maj_at_n([["1", "2", "3"]], [[0, 0, 0, 0]])


def _brute_force_vote(answers, rewards, n, weights):
    """The mean over every n-subset of the (weighted) vote, ties split evenly: plain Python."""
    values = []
    for subset in itertools.combinations(range(len(answers)), n):
        votes, reward = {}, {}
        for i in subset:
            if answers[i] is not None:
                votes[answers[i]] = votes.get(answers[i], 0) + weights[i]
                reward.setdefault(answers[i], []).append(rewards[i])
        if not votes:
            values.append(0.0)
            continue
        top = [a for a, v in votes.items() if v == max(votes.values())]
        values.append(sum(sum(reward[a]) / len(reward[a]) for a in top) / len(top))
    return sum(values) / len(values)


def test_maj_at_n_is_the_mean_over_all_subsets_and_estimates_it_when_there_are_too_many():
    rng = np.random.default_rng(0)
    B, G = 6, 7
    answers = [[rng.choice(["x", "y", "z", None]) for _ in range(G)] for _ in range(B)]
    rewards = rng.random((B, G))
    weights = rng.integers(0, 3, (B, G)).astype(float)  # Small integers: tied votes happen.
    for n in range(1, G + 1):
        for w in (None, weights):
            got = estimators.maj_at_n(answers, rewards, n, w).value_B
            ref = np.ones((B, G)) if w is None else w
            want = [_brute_force_vote(answers[b], rewards[b], n, ref[b]) for b in range(B)]
            np.testing.assert_allclose(got, want, rtol=1e-12)
    # C(7, 3) = 35 subsets; with at most 30, a seeded Monte-Carlo estimate within its error.
    exact = estimators.maj_at_n(answers, rewards, 3, weights).value_B
    mc = estimators.maj_at_n(answers, rewards, 3, weights, max_subsets=30, seed=1)
    assert (mc.subsets, mc.exact) == (30, False) and (mc.stderr_B > 0).all()
    assert (np.abs(mc.value_B - exact) < 4 * mc.stderr_B).all()
    assert not np.array_equal(mc.value_B, exact)  # It is an estimate,
    again = estimators.maj_at_n(answers, rewards, 3, weights, max_subsets=30, seed=1)
    np.testing.assert_array_equal(again.value_B, mc.value_B)  # and a reproducible one.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, r"n=0 must be an integer in \[1, G=3\]"),
        ({"n": 4}, "n=4 must be"),
        ({"n": 2.0}, "n=2.0 must be an integer"),
        ({"weights_BG": [[1, -1, 1]]}, "finite and >= 0"),
        ({"weights_BG": [[1, np.nan, 1]]}, "finite and >= 0"),
        ({"weights_BG": [[1, 1]]}, r"weights \(1, 2\) and rewards \(1, 3\) must match"),
    ],
)
def test_maj_at_n_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimators.maj_at_n([["a", "b", "a"]], [[1, 0, 1]], **kwargs)


def test_best_of_n_hand_computed_and_equals_pass_at_n_with_the_verifier_as_scorer():
    # N = G: the top-scored sample; tied tops share (row 2: mean of 0 and 1); NaN ranks last.
    scores = [[0.1, 0.9, 0.5], [np.nan, 0.2, 0.2], [-1.0, -3.0, -2.0]]
    rewards = [[0, 1, 0], [1, 0, 1], [0.5, 1, 1]]
    np.testing.assert_array_equal(estimators.best_of_n(scores, rewards), [1, 0.5, 0.5])
    # N = 2 of 3: the pairs {0.1, 0.9} -> 1, {0.1, 0.5} -> 0, {0.9, 0.5} -> 1.
    assert estimators.best_of_n(scores[:1], rewards[:1], 2)[0] == pytest.approx(2 / 3)
    rng = np.random.default_rng(0)
    r = (rng.random((50, 6)) < 0.2).astype(float)
    for n in range(1, 7):
        np.testing.assert_allclose(
            estimators.best_of_n(r, r, n),
            estimators.pass_at_k(6, r.sum(1).astype(int), n),
            rtol=1e-14,
        )
    with pytest.raises(ValueError, match="must be"):
        estimators.best_of_n([[1, 2]], [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"best_of_n: n=3 must be an integer in \[1, G=2\]"):
        estimators.best_of_n([[1, 2]], [[1, 2]], 3)


def _brute_force_best_of(scores, rewards, n):
    """The mean over every n-subset of the reward of its top-scored sample, ties split evenly
    and NaN below everything: plain Python."""
    key = [-math.inf if math.isnan(s) else s for s in scores]
    values = []
    for subset in itertools.combinations(range(len(scores)), n):
        best = max(key[i] for i in subset)
        top = [rewards[i] for i in subset if key[i] == best]
        values.append(sum(top) / len(top))
    return sum(values) / len(values)


def test_best_of_n_closed_form_equals_enumerating_the_subsets():
    rng = np.random.default_rng(1)
    for G in (1, 2, 5, 8):
        B = 20
        scores = rng.integers(0, 4, (B, G)).astype(float)  # Few values: many ties.
        scores[rng.random((B, G)) < 0.15] = np.nan
        scores[:5] = rng.standard_normal((5, G))  # And rows without ties.
        rewards = rng.random((B, G))
        for n in range(1, G + 1):
            want = [_brute_force_best_of(scores[b], rewards[b], n) for b in range(B)]
            np.testing.assert_allclose(
                estimators.best_of_n(scores, rewards, n), want, rtol=1e-12, atol=1e-15
            )


# ------------------------------------------------------------------------------------------
# Sampling and scoring.
# ------------------------------------------------------------------------------------------


def _init(cfg):
    """Params initialized in one jitted call (eager init is slow on 8 devices)."""
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    return model.init_sharded(cfg, jax.random.key(1), mesh, sharding.SAMPLE_RULES)[1]


CORPUS = [f"Q: {a}+{b}={a + b} Answer: {a + b}" for a in range(30) for b in range(10)]


@pytest.fixture(scope="module")
def tok():
    return train_sentencepiece(CORPUS, 300, hard_vocab_limit=False)


class HashTask:
    """A verifier that depends on both the completion and the problem, arbitrarily."""

    def verify(self, completion, problem):
        h = hashlib.sha256((problem.prompt + "|" + completion).encode()).digest()
        return float(h[0] % 3 == 0)


@pytest.mark.slow
def test_sample_and_score_keeps_prompts_rewards_and_texts_together(run_dir, tok):
    # Two devices: the batch axis splits 2 ways, so the 5 prompts are topped up to 6.
    mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
    cfg, graphdef, params = checkpoint.load_params(
        str(run_dir / "final"), mesh, sharding.SAMPLE_RULES
    )
    sampler = Sampler(graphdef, cfg, mesh)
    scfg = SamplingConfig(
        max_new_tokens=6, temperature=0.0, num_samples=3, stop_tokens=(tok.eos_id,), buckets=(16,)
    )
    problems = [tasks.Problem(prompt=f"Q: {i}+{2 * i}=", answer="", demo="") for i in range(5)]
    run = lambda ps: scoring.sample_and_score(
        sampler, params, tok, ps, jax.random.key(0), scfg, scoring.Scorer(HashTask().verify), 6
    )
    s = run(problems)
    rewards = s.reward_N.reshape(5, 3)
    texts = [s.texts[i * 3 : (i + 1) * 3] for i in range(5)]
    assert s.lengths_N.shape == (15,) and len(s.texts) == 15
    expected = [[HashTask().verify(t, p) for t in row] for row, p in zip(texts, problems)]
    np.testing.assert_array_equal(rewards, expected)
    assert 0 < rewards.sum() < rewards.size  # The check above has teeth.
    # Greedy completions depend on the prompt alone: reversing the prompts reverses the rows.
    reversed_run = run(problems[::-1])
    assert [reversed_run.texts[i * 3 : (i + 1) * 3] for i in range(5)] == texts[::-1]
    np.testing.assert_array_equal(reversed_run.reward_N.reshape(5, 3), rewards[::-1])
    assert all(len(set(row)) == 1 for row in texts)  # Greedy: k identical samples,
    assert len({row[0] for row in texts}) > 1  # and the prompts' differ.
    m = harness.metrics(s, 3, answer_fn=lambda t: t)
    assert m["pass@1"] == pytest.approx(rewards.mean())
    assert m["maj@3"] == pytest.approx(rewards[:, 0].mean())
    assert m["answered"] == 1.0 and m["accuracy_answered"] == pytest.approx(rewards.mean())
    odd = harness.metrics(s, 3, answer_fn=lambda t: t if len(t) % 2 else None)
    stated = np.array([len(t) % 2 == 1 for t in s.texts])
    assert 0 < stated.sum() < stated.size  # Some samples state an answer, some do not.
    assert odd["answered"] == pytest.approx(stated.mean())
    assert odd["accuracy_answered"] == pytest.approx((s.reward_N > 0)[stated].mean())
    assert m["prompts"] == 5 and m["samples_per_prompt"] == 3


# ------------------------------------------------------------------------------------------
# The command line.
# ------------------------------------------------------------------------------------------


def _quickstart_smoke():
    path = os.path.join(ROOT, "configs", "quickstart.py")
    spec = importlib.util.spec_from_file_location("quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("smoke")


def _resolved_smoke():
    """The quickstart smoke config's sections, as the evaluate command resolves them."""
    return saved_policy.resolve(_quickstart_smoke())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tok):
    """What an RL run leaves in its workdir: the tokenizer and the final params (0 steps)."""
    workdir = tmp_path_factory.mktemp("run")
    (workdir / "tokenizer.model").write_bytes(tok.serialized)
    cfg = model.from_dict({**_quickstart_smoke().model, "vocab_size": tok.vocab_size})
    checkpoint.save_params(str(workdir / "final"), cfg, _init(cfg))
    return workdir


@pytest.fixture(scope="module")
def rm_dir(run_dir, tok, tmp_path_factory):
    """An untrained reward model on the policy's decoder and tokenizer. Its bucket, 16 tokens,
    is shorter than the rows it will score: the scorer widens it."""
    path = tmp_path_factory.mktemp("rm")
    model_cfg, _, params = scalar_head.init(str(run_dir / "final"), jax.random.key(2))
    bradley_terry.save(str(path), model_cfg, params, tok, bradley_terry.RMConfig(seq_len=16))
    return path


@pytest.fixture(scope="module")
def prm_dir(run_dir, tok, tmp_path_factory):
    """An untrained process reward model on the policy's decoder and tokenizer (the same
    narrow bucket as `rm_dir`)."""
    path = tmp_path_factory.mktemp("prm")
    model_cfg, _, params = scalar_head.init(str(run_dir / "final"), jax.random.key(3))
    cfg = prm_lib.PRMConfig(delimiter="=", seq_len=16)
    prm_lib.save(str(path), model_cfg, params, tok, cfg)
    return path


@pytest.mark.slow
def test_cli_a_bad_checkpoint_is_one_error_line(tmp_path, capsys):
    """No such directory, from the command as a user starts it (its exit status and its one
    error line); a directory that is not a checkpoint, from the same command in-process (the
    same guard writes the line and sets the status)."""
    args = ["--config", os.path.join(ROOT, "configs", "quickstart.py") + ":smoke"]
    r = subprocess.run(
        [sys.executable, "-m", "rlscale.main.evaluate", *args]
        + ["--checkpoint", str(tmp_path / "nosuch")],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error_line(r, f"--checkpoint={tmp_path}/nosuch: no such directory")
    (tmp_path / "empty").mkdir()
    command = lambda argv: cli.call(evaluate.define_flags, evaluate.main, argv)  # noqa: E731
    with pytest.raises(SystemExit) as e:
        cli.guard(command, own=evaluate.main)([*args, "--checkpoint", str(tmp_path / "empty")])
    out, err = capsys.readouterr()
    one_error_line(
        types.SimpleNamespace(returncode=e.value.code, stdout=out, stderr=err),
        f"{tmp_path}/empty/model_config.json does not exist: not an rlscale params checkpoint",
    )


@pytest.mark.slow
def test_cli_end_to_end_on_an_untrained_checkpoint(run_dir, rm_dir, prm_dir):
    k, n = 4, 6
    env = subprocess_env()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlscale.main.evaluate",
            "--config",
            "configs/quickstart.py:smoke",
            "--checkpoint",
            str(run_dir / "final"),
            f"--k={k}",
            f"--n={n}",
            "--config.sampling.max_new_tokens=8",
            "--best_of=4,1,2",
            "--scorer=logprob,reward_model,prm",
            f"--reward_model={rm_dir}",
            f"--prm={prm_dir}",
            "--prm_aggregation=min,product",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rlscale evaluation" in r.stdout and "pass@4" in r.stdout
    assert "test-time scaling" in r.stdout and "wmaj@N/reward_model" in r.stdout
    report = json.loads((run_dir / "eval_test.json").read_text())
    m = report["metrics"]
    assert set(m) >= {"pass@1", "pass@2", "pass@4", "avg@4", "maj@4", "best_of_4/mean_logprob"}
    assert (m["prompts"], m["samples_per_prompt"]) == (n, k)
    assert report["sampling"]["max_new_tokens"] == 8 and 1 <= m["response_length"] <= 8
    # The metrics are those of the per-prompt rewards it reports.
    rewards = np.array(report["per_prompt"]["rewards"])
    assert rewards.shape == (n, k)
    c = (rewards > 0).sum(1)
    for j in (1, 2, 4):
        exact = np.mean([1 - math.comb(k - ci, j) / math.comb(k, j) for ci in c])
        assert m[f"pass@{j}"] == pytest.approx(exact)
    assert m["avg@4"] == pytest.approx(rewards.mean())
    # The held-out problems are the RL loop's: materialized in WORKDIR/data.
    assert (run_dir / "data").is_dir()
    # Test-time scaling: the flags reach the curves (their values: the next test, where rewards
    # are not all 0 as an untrained policy's are here), the table and the plot.
    t = report["test_time"]
    rankers = ("logprob", "reward_model", "prm_min", "prm_product")
    assert list(t) == [
        "N",
        "pass@N",
        *(f"best_of/{name}" for name in rankers),
        "maj@N",
        *(f"wmaj@N/{name}" for name in rankers),
        "stderr",
        "vote_subsets",
    ]
    assert t["N"] == [1, 2, 4] and t["vote_subsets"] == [4, 6, 1]
    for name in rankers:
        scores = np.array(report["per_prompt"]["scores"][name])
        assert scores.shape == (n, k) and len(np.unique(scores)) > 1  # Each sample scored.
    table = r.stdout[r.stdout.index("test-time scaling") :].splitlines()[1:13]
    assert [line.split()[0] for line in table] == ["N"] + list(t)[1:11] + ["plot:"]
    assert report["test_time_plot"] == str(run_dir / "test_time_test.png")
    assert (run_dir / "test_time_test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class AnswerTask:
    """A task whose answer is the completion's length mod 3 and whose reward depends on the
    problem and the answer alone (equal answers score alike), arbitrarily."""

    def extract_answer(self, completion):
        return str(len(completion) % 3)

    def verify(self, completion, problem):
        key = f"{problem.prompt}|{self.extract_answer(completion)}"
        return float(hashlib.sha256(key.encode()).digest()[0] % 2)


@pytest.mark.slow
def test_test_time_curves_of_an_evaluation_against_enumerated_subsets(
    run_dir, rm_dir, tok, tmp_path, monkeypatch
):
    problems = [tasks.Problem(prompt=f"Q: {i}+{2 * i}=", answer="", demo="") for i in range(6)]
    monkeypatch.setattr(
        data_load, "load_task", lambda config, workdir: (AnswerTask(), {"t": problems})
    )
    seen = []  # The scored samples, as the evaluation holds them.
    sample_and_score = scoring.sample_and_score
    monkeypatch.setattr(
        scoring,
        "sample_and_score",
        lambda *a, **kw: seen.append(sample_and_score(*a, **kw)) or seen[-1],
    )
    config = _quickstart_smoke()
    config.sampling.max_new_tokens = 8
    config.mesh.shape = (1, 1, 1)  # One device: a quicker compile than the 8 of the tests.
    config.reward.workers = 0  # The verifier in-process: no worker processes to start.
    k = 4
    report = harness.run(
        saved_policy.resolve(config),
        str(run_dir / "final"),
        split="t",
        k=k,
        n=6,
        best_of=[1, 2, 4],
        scorers=["logprob", "reward_model"],
        reward_model_dir=str(rm_dir),
        output=str(tmp_path / "eval.json"),
        plot=str(tmp_path / "curves.png"),
    )
    (samples,) = seen
    rewards = samples.reward_N.reshape(-1, k)
    answers = [[str(len(x) % 3) for x in samples.texts[i : i + k]] for i in range(0, 24, k)]
    assert 0 < rewards.mean() < 1 and len({a for row in answers for a in row}) > 1
    # The scores: the mean token logprob, and the reward model on the prompt's ids (with its
    # BOS) then the completion's, ended by the EOS, scored here in a bucket of 64.
    logprob = (samples.logprobs_NM * samples.mask_NM).sum(1) / samples.mask_NM.sum(1)
    rm = bradley_terry.load(str(rm_dir))
    rows = []
    for i in range(24):
        completion = samples.tokens_NM[i, : samples.lengths_N[i]].tolist()
        eos = [] if completion[-1:] == [tok.eos_id] else [tok.eos_id]
        rows.append(chat.encode_prompt(tok, problems[i // k].prompt) + completion + eos)
    by_rm = bradley_terry.score_rows(rm.forward, rm.params, *bradley_terry.pad_rows(rows, 64, 0))
    scores = report["per_prompt"]["scores"]
    np.testing.assert_allclose(scores["logprob"], logprob.reshape(-1, k), rtol=1e-6)
    np.testing.assert_allclose(scores["reward_model"], by_rm.reshape(-1, k), rtol=1e-4, atol=1e-5)
    # Every curve against its definition: all N-subsets of the k samples, enumerated.
    t = report["test_time"]
    weights = {
        "logprob": np.exp(scores["logprob"]),
        "reward_model": 1 / (1 + np.exp(-np.array(scores["reward_model"]))),
    }
    for j, n in enumerate((1, 2, 4)):
        c = (rewards > 0).sum(1)
        assert t["pass@N"][j] == pytest.approx(
            np.mean([1 - math.comb(k - ci, n) / math.comb(k, n) for ci in c])
        )
        for name in ("logprob", "reward_model"):
            s = np.array(scores[name])
            want = np.mean([_brute_force_best_of(s[b], rewards[b], n) for b in range(6)])
            assert t[f"best_of/{name}"][j] == pytest.approx(want, rel=1e-12)
            want = np.mean(
                [_brute_force_vote(answers[b], rewards[b], n, weights[name][b]) for b in range(6)]
            )
            assert t[f"wmaj@N/{name}"][j] == pytest.approx(want, rel=1e-12)
        want = np.mean([_brute_force_vote(answers[b], rewards[b], n, [1] * k) for b in range(6)])
        assert t["maj@N"][j] == pytest.approx(want, rel=1e-12)
    assert json.loads((tmp_path / "eval.json").read_text())["test_time"] == t
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_a_tokenizer_larger_than_the_model(run_dir, tmp_path, tok):
    words = "the quick brown fox jumps over a lazy dog while wizards hex every judge".split()
    corpus = CORPUS + [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    bigger = train_sentencepiece(corpus, tok.vocab_size + 8)
    assert bigger.vocab_size > tok.vocab_size
    path = tmp_path / "bigger.model"
    path.write_bytes(bigger.serialized)
    with pytest.raises(ValueError, match="not the tokenizer this checkpoint was trained with"):
        harness.run(_resolved_smoke(), str(run_dir / "final"), k=2, n=2, tokenizer_path=path)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"best_of": ["1", "8"]}, "--best_of=1,8: N=8 is outside [1, --k=4]"),
        (
            {"best_of": ["0", "x", "2.5"]},
            "--best_of=0,x,2.5: N=0 is outside [1, --k=4]; 'x' is not an integer; "
            "'2.5' is not an integer",
        ),
        ({"best_of": ["2", "1", "2"]}, "--best_of=2,1,2: N=2 given more than once"),
        ({"best_of": []}, "--best_of=: no N given"),
        (
            {"best_of": ["2"], "scorers": ["reward_model"]},
            "--scorer=reward_model needs --reward_model DIR",
        ),
        (
            {"best_of": ["2"], "scorers": ["logprob", "prm"]},
            "--scorer=prm needs --prm DIR",
        ),
        (
            {"best_of": ["2"], "prm_dir": "/p", "prm_aggregation": ["min", "mean"]},
            "--prm=/p is unused: --scorer does not name prm; --prm_aggregation: 'mean' not one "
            "of min, last, product",
        ),
        (
            {"best_of": ["2"], "scorers": ["logprob", "logprob"]},
            "--scorer: 'logprob' given more than once",
        ),
        (
            {"best_of": ["2"], "reward_model_dir": "/rm"},
            "--reward_model=/rm is unused: --scorer does not name reward_model",
        ),
        (
            {"scorers": ["reward_model"], "reward_model_dir": "/rm"},
            "--scorer, --reward_model and --prm score the --best_of curves: pass --best_of",
        ),
        ({"plot": "t.png"}, "--plot=t.png: plots the --best_of curves: pass --best_of"),
        (  # Every problem at once.
            {"best_of": ["9"], "scorers": ["rm"]},
            "--best_of=9: N=9 is outside [1, --k=4]; --scorer: 'rm' is not one of logprob, "
            "reward_model, prm",
        ),
    ],
)
def test_bad_test_time_flags_fail_before_anything_loads(tmp_path, flags, message):
    # The checkpoint does not exist: the flags are checked first.
    with pytest.raises(ValueError) as e:
        harness.run(_resolved_smoke(), str(tmp_path / "nosuch"), k=4, n=2, **flags)
    assert str(e.value) == message


def test_a_bad_reward_model_fails_before_sampling(run_dir, rm_dir, tmp_path):
    def run(rm, config=None):
        harness.run(
            saved_policy.resolve(config or _quickstart_smoke()),
            str(run_dir / "final"),
            k=2,
            n=2,
            best_of=["2"],
            scorers=["reward_model"],
            reward_model_dir=str(rm),
            output=str(tmp_path / "never.json"),
        )

    with pytest.raises(ValueError, match=f"--reward_model={tmp_path}/nosuch: no such directory"):
        run(tmp_path / "nosuch")
    with pytest.raises(ValueError, match="reward_model.json does not exist: not a reward model"):
        run(run_dir / "final")
    # A reward model saved with another tokenizer.
    other_tok = train_sentencepiece(CORPUS[::3], 290, hard_vocab_limit=False)
    rm = bradley_terry.load(str(rm_dir))
    other = tmp_path / "other"
    bradley_terry.save(str(other), rm.model_cfg, rm.params, other_tok, rm.config)
    with pytest.raises(ValueError, match=f"--reward_model={other}: tokenizer mismatch"):
        run(other)
    # Rows the reward model's decoder cannot read (max_seq_len 128).
    config = _quickstart_smoke()
    config.sampling.max_new_tokens = 200
    with pytest.raises(ValueError, match="reads at most max_seq_len=128 tokens, but the longest"):
        run(rm_dir, config)
    assert not (tmp_path / "never.json").exists()


def test_load_task_reads_a_math_dataset_with_its_chat_template(tmp_path):
    path = tmp_path / "polaris.jsonl"
    path.write_text(
        "".join(
            json.dumps({"problem": f"{i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(20)
        )
    )
    config = _quickstart_smoke()
    config.task = config_lib.files_task(
        name="math",  # The files task's old name.
        format="polaris",
        files={"train": str(path), "test": str(path)},
        chat_template="qwen2.5",
        instruction="Box it.",
    )
    task, splits = data_load.load_task(config.task, str(tmp_path))
    assert isinstance(task, math_data.MathTask) and sorted(splits) == ["test", "train"]
    assert splits["test"][3].prompt == chat.qwen2_5([{"role": "user", "content": "3+3?\nBox it."}])
    assert splits["test"][3].answer == "6"
    tok = train_sentencepiece(
        CORPUS, 300, user_defined_symbols=["<|im_end|>"], hard_vocab_limit=False
    )
    saved = saved_policy.resolve(config)
    scfg = saved_policy.sampling_config(saved.sampling, saved.task, tok, 5)
    assert scfg.num_samples == 5
    assert scfg.stop_tokens == (tok.token_id("<|im_end|>"), tok.eos_id)
    assert scfg.max_new_tokens == config.sampling.max_new_tokens
