"""Evaluation metrics against hand-computed values, sampling/scoring plumbing, and the CLI."""

import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import jax
import numpy as np
import pytest
from test_main import one_error_line

from rlscale import chat, checkpoint, config_lib, eval_metrics, evaluate, model, sharding
from rlscale.data import math_data, tasks
from rlscale.sampling import Sampler, SamplingConfig, scoring
from rlscale.tokenizer import train_sentencepiece

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------------
# Metrics.
# ------------------------------------------------------------------------------------------


def test_pass_at_k_hand_computed():
    # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10; pass@4: any 4 of 5 hold a correct one.
    got = [eval_metrics.pass_at_k(5, 2, k)[()] for k in (1, 2, 3, 4, 5)]
    np.testing.assert_allclose(got, [0.4, 0.7, 0.9, 1.0, 1.0], rtol=1e-15)
    np.testing.assert_allclose(
        eval_metrics.pass_at_k([4, 4, 4, 10], [0, 4, 1, 3], 2), [0.0, 1.0, 0.5, 1 - 21 / 45]
    )


def test_pass_at_k_is_stable_for_large_n():
    # C(2000, 500) overflows a float; the product form does not.
    n, c, k = 2000, 7, 500
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert eval_metrics.pass_at_k(n, c, k)[()] == pytest.approx(float(exact), rel=1e-12)
    with pytest.raises(OverflowError):
        float(math.comb(n, k))


@pytest.mark.parametrize(
    "n, c, k, message",
    [(4, 1, 5, "larger than the samples"), (4, 5, 2, "num_correct"), (4, 1, 0, "k=0")],
)
def test_pass_at_k_bad_arguments(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        eval_metrics.pass_at_k(n, c, k)


def test_avg_at_k():
    np.testing.assert_array_equal(
        eval_metrics.avg_at_k([[1, 0, 0, 1], [0.5, 0.5, 0, 0]]), [0.5, 0.25]
    )
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        eval_metrics.avg_at_k([1, 0])


def test_maj_at_k_hand_computed():
    answers = [
        ["2", "3", "2", None],  # "2" wins 2-1.
        ["5", "7", "7", "5"],  # Tie 2-2: "5" appears first.
        [None, None, None, None],  # Nobody answers: 0.
        [None, None, "4", None],  # None does not vote: "4" wins alone.
        ["1", "2", "3", "4"],  # All tied: the first.
    ]
    rewards = [[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 1], [0, 1, 1, 1]]
    np.testing.assert_array_equal(eval_metrics.maj_at_k(answers, rewards), [1, 0, 0, 0, 0])
    assert eval_metrics.majority_vote(["b", "a", "a", "b", "c"]) == 0
    assert eval_metrics.majority_vote([None, "x"]) == 1
    with pytest.raises(ValueError, match="row 0 has 3 answers, expected 4"):
        eval_metrics.maj_at_k([["1", "2", "3"]], [[0, 0, 0, 0]])


def test_best_of_n_hand_computed_and_equals_pass_at_n_with_the_verifier_as_scorer():
    scores = [[0.1, 0.9, 0.5], [np.nan, 0.2, 0.2], [-1.0, -3.0, -2.0]]
    rewards = [[0, 1, 0], [1, 0, 1], [0.5, 1, 1]]
    np.testing.assert_array_equal(eval_metrics.best_of_n(scores, rewards), [1, 0, 0.5])
    rng = np.random.default_rng(0)
    r = (rng.random((50, 6)) < 0.2).astype(float)
    np.testing.assert_array_equal(
        eval_metrics.best_of_n(r, r), eval_metrics.pass_at_k(6, r.sum(1).astype(int), 6)
    )
    with pytest.raises(ValueError, match="must be"):
        eval_metrics.best_of_n([[1, 2]], [[1, 2, 3]])


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
    m = evaluate.metrics(s, 3, answer_fn=lambda t: t)
    assert m["pass@1"] == pytest.approx(rewards.mean())
    assert m["maj@3"] == pytest.approx(rewards[:, 0].mean())
    assert m["answered"] == 1.0 and m["accuracy_answered"] == pytest.approx(rewards.mean())
    odd = evaluate.metrics(s, 3, answer_fn=lambda t: t if len(t) % 2 else None)
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


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tok):
    """What an RL run leaves in its workdir: the tokenizer and the final params (0 steps)."""
    workdir = tmp_path_factory.mktemp("run")
    (workdir / "tokenizer.model").write_bytes(tok.serialized)
    cfg = model.from_dict({**_quickstart_smoke().model, "vocab_size": tok.vocab_size})
    checkpoint.save_params(str(workdir / "final"), cfg, _init(cfg))
    return workdir


@pytest.mark.parametrize(
    "checkpoint, expected",
    [
        ("nosuch", "--checkpoint={d}/nosuch: no such directory"),
        ("empty", "{d}/empty/model_config.json does not exist: not an rlscale params checkpoint"),
    ],
)
def test_cli_a_bad_checkpoint_is_one_error_line(tmp_path, checkpoint, expected):
    (tmp_path / "empty").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "rlscale.evaluate", "--config", "configs/quickstart.py:smoke"]
        + ["--checkpoint", str(tmp_path / checkpoint)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error_line(r, expected.format(d=tmp_path))


def test_cli_end_to_end_on_an_untrained_checkpoint(run_dir):
    k, n = 4, 6
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlscale.evaluate",
            "--config",
            "configs/quickstart.py:smoke",
            "--checkpoint",
            str(run_dir / "final"),
            f"--k={k}",
            f"--n={n}",
            "--config.sampling.max_new_tokens=8",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rlscale evaluation" in r.stdout and "pass@4" in r.stdout
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


def test_cli_rejects_a_tokenizer_larger_than_the_model(run_dir, tmp_path, tok):
    words = "the quick brown fox jumps over a lazy dog while wizards hex every judge".split()
    corpus = CORPUS + [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    bigger = train_sentencepiece(corpus, tok.vocab_size + 8)
    assert bigger.vocab_size > tok.vocab_size
    path = tmp_path / "bigger.model"
    path.write_bytes(bigger.serialized)
    with pytest.raises(ValueError, match="not the tokenizer this checkpoint was trained with"):
        evaluate.run(_quickstart_smoke(), str(run_dir / "final"), k=2, n=2, tokenizer_path=path)


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
    task, splits = evaluate.load_task(config, str(tmp_path))
    assert isinstance(task, math_data.MathTask) and sorted(splits) == ["test", "train"]
    assert splits["test"][3].prompt == chat.qwen2_5([{"role": "user", "content": "3+3?\nBox it."}])
    assert splits["test"][3].answer == "6"
    tok = train_sentencepiece(
        CORPUS, 300, user_defined_symbols=["<|im_end|>"], hard_vocab_limit=False
    )
    scfg = evaluate.sampling_config(config, tok, k=5)
    assert scfg.num_samples == 5
    assert scfg.stop_tokens == (tok.token_id("<|im_end|>"), tok.eos_id)
    assert scfg.max_new_tokens == config.sampling.max_new_tokens
