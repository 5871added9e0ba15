"""Evaluation metrics, pure NumPy over per-prompt arrays (B prompts, G samples each);
each gives one value per prompt: average over prompts for a benchmark number.

  pass_at_k   unbiased pass@k from n samples with c correct (Chen et al. 2021)
  avg_at_k    mean reward over the k samples
  best_of_n   the reward of the sample a scorer ranks highest among N (a reward model, a
              verifier, the policy's own likelihood), averaged over the N-subsets of G
  maj_at_n    the reward of the (weighted) majority-vote answer among N (self-consistency,
              Wang et al. 2023), averaged over the N-subsets of G

Dimension letters: B problems, G samples per problem, N of them per subset, Z subsets, a distinct
answers, W summed columns (`_subset_sums`).

The N-sample metrics are unbiased estimates of the metric with N samples per problem from the
G > N drawn: the mean over the C(G, N) ways of choosing N of them (a closed form for pass@N
and best-of-N; counted subsets for voting).
"""

import functools
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Voting averages over every N-subset of the G samples up to this many subsets (C(16, 8) =
# 12870: exact for any N with G = 16), and over this many random ones beyond.
MAX_SUBSETS = 20_000


def pass_at_k(num_samples, num_correct, k: int) -> np.ndarray:
    """Unbiased pass@k per problem: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"), the probability that k of the n samples, drawn
    without replacement, include a correct one.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the binomials, so it is
    stable for any n.

    Args:
      num_samples: [B] samples drawn per problem (n), or one int for all.
      num_correct: [B] correct samples per problem (c).
      k: Samples per attempt, 1 <= k <= n.

    Returns:
      [B] float64 estimates.

    Raises:
      ValueError: If k < 1, k > n, or c is outside [0, n].
    """
    n_B, c_B = np.broadcast_arrays(np.asarray(num_samples), np.asarray(num_correct))
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    if np.any(n_B < k):
        raise ValueError(f"k={k} is larger than the samples drawn (n={int(n_B.min())})")
    if np.any((c_B < 0) | (c_B > n_B)):
        raise ValueError("num_correct must lie in [0, num_samples]")
    out = np.ones(n_B.shape, np.float64)
    for idx in np.ndindex(n_B.shape):
        n, c = int(n_B[idx]), int(c_B[idx])
        if n - c >= k:  # Otherwise every draw of k holds a correct sample.
            out[idx] = 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))
    return out


def avg_at_k(rewards_BG) -> np.ndarray:
    """Mean reward over each problem's k samples: [B, G] -> [B]."""
    rewards_BG = np.asarray(rewards_BG, np.float64)
    if rewards_BG.ndim != 2 or rewards_BG.shape[1] == 0:
        raise ValueError(f"rewards must be [B, G] with K >= 1, got shape {rewards_BG.shape}")
    return rewards_BG.mean(axis=1)


def _check_n(n, G: int, what: str) -> int:
    n = G if n is None else n
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 1 <= n <= G:
        raise ValueError(f"{what}: n={n!r} must be an integer in [1, G={G}]")
    return int(n)


def best_of_n(scores_BG, rewards_BG, n: int | None = None) -> np.ndarray:
    """Best-of-N per problem: the expected reward of the sample the scorer ranks highest among
    N of the G samples drawn without replacement (every N-subset equally likely); N = G
    (default) selects among all of them.

    Unbiased from the G samples, in closed form: with the samples sorted by decreasing score,
    the one ranked i-th (0-based) is the best of a random N-subset when the subset holds it and
    its other N - 1 samples come from the G - 1 - i ranked below it:

        P_i = C(G - 1 - i, N - 1) / C(G, N),    best_of_n = sum_i P_i r_(i).

    Equal scores are a tie broken uniformly at random: given that a group of tied samples
    holds the subset's best, each of them is equally likely to be the one in the subset that
    is picked, so the group scores its mean reward, i.e. each tied sample gets the mean of P_i
    over the group's ranks. NaN scores rank last (tied with each other and with -inf). With
    the verifier's rewards as scores this is pass@N.

    Args:
      scores_BG: [B, G] scorer outputs (higher is better).
      rewards_BG: [B, G] rewards of the same samples.
      n: samples per selection, 1 <= n <= G; default G.

    Returns:
      [B] float64.
    """
    scores_BG = np.asarray(scores_BG, np.float64)
    rewards_BG = np.asarray(rewards_BG, np.float64)
    if scores_BG.shape != rewards_BG.shape or scores_BG.ndim != 2 or scores_BG.shape[1] == 0:
        raise ValueError(f"scores {scores_BG.shape} and rewards {rewards_BG.shape} must be [B, G]")
    B, G = scores_BG.shape
    n = _check_n(n, G, "best_of_n")
    # Python's int / int is correctly rounded, whatever the size of the binomials.
    total = math.comb(G, n)
    p_G = np.array([math.comb(G - 1 - i, n - 1) / total for i in range(G)])
    s_BG = np.where(np.isnan(scores_BG), -np.inf, scores_BG)
    order_BG = np.argsort(-s_BG, axis=1, kind="stable")
    s_BG = np.take_along_axis(s_BG, order_BG, 1)
    r_BG = np.take_along_axis(rewards_BG, order_BG, 1)
    # Tie groups of the sorted scores, numbered across rows; each rank gets its group's mean P.
    starts_BG = np.ones((B, G), bool)
    starts_BG[:, 1:] = s_BG[:, 1:] != s_BG[:, :-1]
    group_BG = np.cumsum(starts_BG, axis=1) - 1 + G * np.arange(B)[:, None]
    mass = np.bincount(group_BG.ravel(), np.tile(p_G, B), minlength=B * G)
    size = np.bincount(group_BG.ravel(), minlength=B * G)
    return ((mass / np.maximum(size, 1))[group_BG] * r_BG).sum(1)


class Vote(NamedTuple):
    """`maj_at_n`'s estimate: per problem, the mean over subsets and its Monte-Carlo standard
    error (0 when every subset was counted); `subsets` counted per problem and whether that
    was all of them (`exact`)."""

    value_B: np.ndarray
    stderr_B: np.ndarray
    subsets: int
    exact: bool


@functools.lru_cache(maxsize=64)
def _all_subsets(G: int, n: int) -> np.ndarray:
    """[C(G, n), n] the sample indices of every n-subset of G samples."""
    idx_ZN = np.array(list(itertools.combinations(range(G), n)), np.int64).reshape(-1, n)
    idx_ZN.flags.writeable = False
    return idx_ZN


def _subset_sums(table_GW: np.ndarray, idx_ZN: np.ndarray) -> np.ndarray:
    """[Z, W] the sums of `table_GW`'s rows over each subset: one gathered add per member
    (a BLAS product with an indicator matrix is as much work, and far slower when its threads
    share busy cores)."""
    acc_ZW = table_GW[idx_ZN[:, 0]]
    for j in range(1, idx_ZN.shape[1]):
        acc_ZW += table_GW[idx_ZN[:, j]]
    return acc_ZW


def _subset_votes(id_G, a: int, weights_G, rewards_G, idx_ZN) -> np.ndarray:
    """One problem's vote in each subset `idx_ZN`: the mean reward of its most-voted answers.

    `id_G` is each sample's answer in [0, a) (-1: none); W = 3a summed columns, each answer's
    count, votes and reward."""
    onehot_Ga = (id_G[:, None] == np.arange(a)).astype(np.float64)
    table_GW = np.concatenate(
        [onehot_Ga, onehot_Ga * weights_G[:, None], onehot_Ga * rewards_G[:, None]],
        axis=1,
    )
    count_Za, votes_Za, reward_Za = np.split(_subset_sums(table_GW, idx_ZN), 3, axis=1)
    reward_Za = reward_Za / np.maximum(count_Za, 1)
    votes_Za = np.where(count_Za > 0, votes_Za, -np.inf)
    top_Za = (count_Za > 0) & (votes_Za == votes_Za.max(1, keepdims=True))
    return (top_Za * reward_Za).sum(1) / np.maximum(top_Za.sum(1), 1)


def maj_at_n(
    answers_BG: Sequence[Sequence[str | None]],
    rewards_BG,
    n: int | None = None,
    weights_BG=None,
    *,
    max_subsets: int = MAX_SUBSETS,
    seed: int = 0,
) -> Vote:
    """(Weighted) majority voting per problem among N of the G samples, averaged over the
    N-subsets; N = G (default) votes with all of them (self-consistency, Wang et al. 2023,
    "Self-Consistency Improves Chain of Thought Reasoning in Language Models").

    In a subset, an answer's votes are the sum of its samples' weights: 1 each (plain majority
    voting) or a scorer's (weighted majority voting; the paper's "weighted sum" with
    exp(mean logprob) is one). The answer with the most votes is submitted and scores the mean
    reward of its samples in the subset (equal answers are assumed to score alike, so that is
    any one's). A tie in votes (exact equality of the sums) is broken uniformly at random, so
    it scores the mean over the tied answers; None answers (nothing extracted) do not vote,
    and a subset where no sample states an answer scores 0.

    With at most `max_subsets` subsets (C(G, N)) the mean is over all of them, exactly;
    beyond, over `max_subsets` uniformly random N-subsets (independent draws, seeded by
    `seed`), with the Monte-Carlo standard error of that mean. The error is the estimate's
    distance from the all-subsets mean, not the benchmark's sampling error.

    Args:
      answers_BG: [B][G] extracted answers (None: nothing extracted), compared as strings:
        pass normalized ones (the verifier's extraction).
      rewards_BG: [B, G] rewards of the same samples.
      n: voters per subset, 1 <= n <= G; default G.
      weights_BG: [B, G] finite vote weights >= 0; default 1 each.
      max_subsets: the most subsets counted per problem.
      seed: the random subsets' seed.

    Returns:
      A `Vote`.
    """
    rewards_BG = np.asarray(rewards_BG, np.float64)
    if rewards_BG.ndim != 2 or len(answers_BG) != rewards_BG.shape[0]:
        raise ValueError(
            f"answers ({len(answers_BG)} rows) and rewards {rewards_BG.shape} do not match"
        )
    B, G = rewards_BG.shape
    for p, answers in enumerate(answers_BG):
        if len(answers) != G:
            raise ValueError(f"row {p} has {len(answers)} answers, expected {G}")
    n = _check_n(n, G, "maj_at_n")
    if weights_BG is None:
        weights_BG = np.ones((B, G))
    weights_BG = np.asarray(weights_BG, np.float64)
    if weights_BG.shape != (B, G):
        raise ValueError(f"weights {weights_BG.shape} and rewards {(B, G)} must match")
    if not np.all(np.isfinite(weights_BG) & (weights_BG >= 0)):
        raise ValueError("maj_at_n: vote weights must be finite and >= 0")
    if max_subsets < 1:
        raise ValueError(f"max_subsets={max_subsets} must be >= 1")
    exact = math.comb(G, n) <= max_subsets
    rng = np.random.default_rng(seed)
    value_B, stderr_B = np.zeros(B), np.zeros(B)
    for p, answers in enumerate(answers_BG):
        index: dict[str, int] = {}
        id_G = np.array([-1 if a is None else index.setdefault(a, len(index)) for a in answers])
        if not index:  # Nobody answers: every subset scores 0.
            continue
        if exact:
            idx_ZN = _all_subsets(G, n)
        else:  # The first n of a random permutation: a uniform n-subset.
            idx_ZN = np.argsort(rng.random((max_subsets, G)), axis=1)[:, :n]
        value_Z = _subset_votes(id_G, len(index), weights_BG[p], rewards_BG[p], idx_ZN)
        value_B[p] = value_Z.mean()
        if not exact:
            stderr_B[p] = value_Z.std(ddof=1) / np.sqrt(len(value_Z)) if len(value_Z) > 1 else 0
    return Vote(value_B, stderr_B, math.comb(G, n) if exact else max_subsets, exact)
