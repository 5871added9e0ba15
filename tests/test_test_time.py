"""Test-time scaling curves (`rlscale.eval.best_of_n`): the curves against their definitions, the
scorers on hand-made samples, the table and the plot. The command's end
to end run is in test_evaluate.py."""

import math

import numpy as np
import pytest

from rlscale.eval import best_of_n, estimators
from rlscale.sampling import scoring


def _samples(logprobs_NM, mask_NM, prompts, tokens_NM, lengths_N):
    """Hand-made `Samples` (only the fields the scorers read are meaningful)."""
    N, M = np.shape(tokens_NM)
    prompt_BP = np.array([[0] * (3 - len(p)) + p for p in prompts])
    return scoring.Samples(
        prompt_BP=prompt_BP,
        prompt_mask_BP=np.array([[False] * (3 - len(p)) + [True] * len(p) for p in prompts]),
        tokens_NM=np.array(tokens_NM),
        mask_NM=np.array(mask_NM, bool),
        logprobs_NM=np.array(logprobs_NM, np.float32),
        forced_NM=np.zeros((N, M), bool),
        lengths_N=np.array(lengths_N),
        truncated_N=np.zeros(N, bool),
        interrupted_N=np.zeros(N, bool),
        texts=[""] * N,
        reward_N=np.zeros(N),
        failures={},
    )


def test_curves_against_their_definitions():
    rewards = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], float)
    scores = {"a": np.array([[0.1, 0.9, 0.3, 0.2], [1, 2, 3, 4], [4, 3, 2, 1]], float)}
    answers = [["7", "8", "8", "7"], [None, "1", None, "2"], ["5", "5", "5", "6"]]
    weights = {"a": np.array([[3, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 9]], float)}
    c = best_of_n.curves(rewards, [1, 2, 4], scores, answers, weights)
    assert c["N"] == [1, 2, 4]
    # pass@N = mean of 1 - C(k - c, N) / C(k, N), c = 2, 0, 3.
    for j, n in enumerate((1, 2, 4)):
        want = np.mean([1 - math.comb(4 - ci, n) / math.comb(4, n) for ci in (2, 0, 3)])
        assert c["pass@N"][j] == pytest.approx(want)
    # N = 1: every curve is the mean reward of a random sample (voting: of an answered one).
    assert c["best_of/a"][0] == pytest.approx(rewards.mean())
    assert c["maj@N"][0] == c["wmaj@N/a"][0] == pytest.approx(rewards.mean())
    # N = 4, best-of: the top scores are 0.9 (0), 4 (0), 4 (1); votes: "7"/"8" tie (1/2),
    # "1"/"2" tie (0), "5" (1); weighted: "7" 4 to 2 (1), a tie (0), "6" 9 to 3 (0).
    assert c["best_of/a"][2] == pytest.approx(1 / 3)
    assert c["maj@N"][2] == pytest.approx(1.5 / 3)
    assert c["wmaj@N/a"][2] == pytest.approx(1 / 3)
    assert c["maj@N"][1] == pytest.approx(estimators.maj_at_n(answers, rewards, 2).value_B.mean())
    assert c["stderr"] == {"maj@N": [0.0] * 3, "wmaj@N/a": [0.0] * 3}
    assert c["vote_subsets"] == [4, 6, 1]
    # Without answers: no voting curves.
    assert set(best_of_n.curves(rewards, [2], scores)) == {"N", "pass@N", "best_of/a"}


def test_curves_report_the_monte_carlo_error_where_they_sample_subsets():
    rng = np.random.default_rng(0)
    rewards = (rng.random((8, 10)) < 0.5).astype(float)
    answers = [[str(a) for a in row] for row in rng.integers(0, 3, (8, 10))]
    c = best_of_n.curves(rewards, [1, 5], None, answers, seed=3, max_subsets=100)
    assert c["vote_subsets"] == [10, 100]  # C(10, 1) = 10 counted; C(10, 5) = 252 sampled.
    exact = estimators.maj_at_n(answers, rewards, 5).value_B.mean()
    err = c["stderr"]["maj@N"]
    assert err[0] == 0 and 0 < err[1] < 0.05
    assert abs(c["maj@N"][1] - exact) < 4 * err[1]
    text = best_of_n.table(c)
    assert text.splitlines()[2].endswith("~") and "100 random subsets" in text


def test_logprob_and_reward_model_scorers_read_the_samples():
    # 2 prompts x 2 samples; prompt 0 is left-padded; the mask marks the sampled tokens.
    s = _samples(
        logprobs_NM=[[-1, -3, 0], [-2, 0, 0], [0, 0, 0], [-0.5, -0.5, -2]],
        mask_NM=[[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]],
        prompts=[[5, 6], [7, 8, 9]],
        tokens_NM=[[11, 12, 0], [13, 0, 0], [0, 0, 0], [14, 15, 2]],
        lengths_N=[2, 1, 0, 3],
    )
    r = best_of_n.logprob_ranker()
    scores = r.score(s, None)
    np.testing.assert_allclose(scores, [-2, -2, 0, -1])
    np.testing.assert_allclose(r.vote_weight(scores), np.exp([-2, -2, 0, -1]))
    prompts, completions = best_of_n.sample_ids(s)
    assert prompts == [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
    assert completions == [[11, 12], [13], [], [14, 15, 2]]

    class FakeRM:  # What reward_model_ranker uses of a RewardModel.
        def with_bucket(self, tokens):
            assert tokens == 7  # The longest row (3 + 3 ids), with the EOS it may append.
            return self

        def score_completions(self, prompt_ids, completion_ids):
            return np.array([sum(p) - len(c) for p, c in zip(prompt_ids, completion_ids)])

    rm = best_of_n.reward_model_ranker(FakeRM())
    np.testing.assert_array_equal(rm.score(s, None), [9, 10, 24, 21])
    np.testing.assert_allclose(
        rm.vote_weight(np.array([0.0, 2.0, -30.0, np.nan])),
        [0.5, 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(30)), 0.0],
        rtol=1e-12,
    )


def test_plot_writes_a_png(tmp_path):
    c = best_of_n.curves(
        [[1, 0, 0, 1], [0, 1, 1, 1]],
        [1, 2, 4],
        {"logprob": [[1, 2, 3, 4], [4, 3, 2, 1]]},
        [["1", "2", "1", None], ["3", "3", "4", "4"]],
        {"logprob": [[1, 1, 1, 1], [1, 2, 1, 2]]},
    )
    path = best_of_n.plot(c, str(tmp_path / "t.png"), title="t")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    lines = best_of_n.table(c).splitlines()
    assert [line.split()[0] for line in lines] == ["N"] + best_of_n.curve_keys(c)
    assert "~" not in best_of_n.table(c)  # Every subset counted.
