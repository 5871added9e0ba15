"""Evaluation metrics, pure NumPy over per-prompt arrays (B prompts, G samples each);
each returns one value per prompt: average over prompts for a benchmark number.

  pass_at_k   unbiased pass@k from n samples with c correct (Chen et al. 2021)
  avg_at_k    mean reward over the k samples
  maj_at_k    the reward of the majority-vote answer (self-consistency, Wang et al. 2023)
  best_of_n   the reward of the sample a scorer ranks highest (a reward model, a verifier,
              the policy's own likelihood)
"""

from collections.abc import Sequence

import numpy as np


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


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index of the sample holding the most frequent answer, or None if none has an answer.

    None answers (nothing extracted) do not vote. Ties go to the answer that appears first,
    and the index is that answer's first sample, so the result is deterministic.
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return None
    # max() keeps the first of equal counts, and dicts keep first-appearance order.
    return first[max(counts, key=counts.get)]


def maj_at_k(answers_BG: Sequence[Sequence[str | None]], rewards_BG) -> np.ndarray:
    """Majority-vote accuracy per problem: the reward of a sample with the most common answer.

    Answers are compared as strings, so pass normalized ones (the verifier's extraction);
    equal strings are assumed to score alike. A problem where no sample has an answer scores 0.

    Args:
      answers_BG: [B][G] extracted answers (None: nothing extracted).
      rewards_BG: [B, G] rewards of the same samples.

    Returns:
      [B] float64.
    """
    rewards_BG = np.asarray(rewards_BG, np.float64)
    if rewards_BG.ndim != 2 or len(answers_BG) != rewards_BG.shape[0]:
        raise ValueError(
            f"answers ({len(answers_BG)} rows) and rewards {rewards_BG.shape} do not match"
        )
    out = np.zeros(rewards_BG.shape[0], np.float64)
    for p, answers in enumerate(answers_BG):
        if len(answers) != rewards_BG.shape[1]:
            raise ValueError(f"row {p} has {len(answers)} answers, expected {rewards_BG.shape[1]}")
        i = majority_vote(answers)
        if i is not None:
            out[p] = rewards_BG[p, i]
    return out


def best_of_n(scores_BG, rewards_BG) -> np.ndarray:
    """Best-of-N per problem: the reward of the sample the scorer ranks highest.

    The scores come from any scorer (a reward model, a verifier, the policy's mean token
    logprob); with the verifier's own rewards as scores this is pass@N. Ties go to the first
    sample; NaN scores rank last.

    Args:
      scores_BG: [B, G] scorer outputs.
      rewards_BG: [B, G] rewards of the same samples.

    Returns:
      [B] float64.
    """
    scores_BG = np.asarray(scores_BG, np.float64)
    rewards_BG = np.asarray(rewards_BG, np.float64)
    if scores_BG.shape != rewards_BG.shape or scores_BG.ndim != 2:
        raise ValueError(f"scores {scores_BG.shape} and rewards {rewards_BG.shape} must be [B, G]")
    best_B = np.argmax(np.where(np.isnan(scores_BG), -np.inf, scores_BG), axis=1)
    return rewards_BG[np.arange(len(best_B)), best_B]
