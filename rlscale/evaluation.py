"""Evaluation: the RL loop's held-out pass@1 and mean reward, and the metric functions.

Metrics are pure NumPy over per-prompt arrays (P prompts, K or N samples each) and return one
value per prompt; average them over prompts for a benchmark number:

  pass_at_k   unbiased pass@k from n samples with c correct (Chen et al. 2021)
  avg_at_k    mean reward over the k samples
  maj_at_k    the reward of the majority-vote answer (self-consistency, Wang et al. 2023)
  best_of_n   the reward of the sample a scorer ranks highest (a reward model, a verifier,
              the policy's own likelihood)
"""

from collections.abc import Sequence

import numpy as np

from rlscale import chat
from rlscale.rewards import isolation
from rlscale.sampling import Sampler, SamplingConfig


def encode_prompts(tokenizer, problems):
    """Prompt ids, with the BOS when the tokenizer has one (Qwen tokenizers have none)."""
    return [chat.encode_prompt(tokenizer, p.prompt) for p in problems]


def completions_text(tokenizer, out) -> list[str]:
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    eos = tokenizer.eos_id
    return [
        tokenizer.decode([t for t in tokens[i, : lengths[i]] if t != eos])
        for i in range(tokens.shape[0])
    ]


def evaluate(
    sampler: Sampler, params, tokenizer, task, problems, rng, cfg: SamplingConfig, batch: int = 64
) -> dict:
    """Samples `cfg.num_samples` completions per problem: mean reward, pass@1 (the mean
    correctness) and, with n > 1 samples, pass@n."""
    rewards = []
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        out = sampler(params, encode_prompts(tokenizer, chunk), rng, cfg)
        texts = completions_text(tokenizer, out)
        probs = [chunk[i] for i in out.prompt_index]
        r, _ = isolation.score_all(task.verify, texts, probs)
        rewards.append(r)
    r = np.concatenate(rewards)
    out = {"eval/reward_mean": float(r.mean()), "eval/pass@1": float((r > 0).mean())}
    n = cfg.num_samples
    if n > 1:  # Rows are prompt-major: each prompt's n samples give an unbiased pass@n.
        correct_P = (r > 0).reshape(-1, n).sum(axis=1)
        out[f"eval/pass@{n}"] = float(pass_at_k(n, correct_P, n).mean())
    return out


# ==========================================================================================
# Metrics (pure NumPy).
# ==========================================================================================


def pass_at_k(num_samples, num_correct, k: int) -> np.ndarray:
    """Unbiased pass@k per problem: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"), the probability that k of the n samples, drawn
    without replacement, include a correct one.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the binomials, so it is
    stable for any n.

    Args:
      num_samples: [P] samples drawn per problem (n), or one int for all.
      num_correct: [P] correct samples per problem (c).
      k: Samples per attempt, 1 <= k <= n.

    Returns:
      [P] float64 estimates.

    Raises:
      ValueError: If k < 1, k > n, or c is outside [0, n].
    """
    n_P, c_P = np.broadcast_arrays(np.asarray(num_samples), np.asarray(num_correct))
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    if np.any(n_P < k):
        raise ValueError(f"k={k} is larger than the samples drawn (n={int(n_P.min())})")
    if np.any((c_P < 0) | (c_P > n_P)):
        raise ValueError("num_correct must lie in [0, num_samples]")
    out = np.ones(n_P.shape, np.float64)
    for idx in np.ndindex(n_P.shape):
        n, c = int(n_P[idx]), int(c_P[idx])
        if n - c >= k:  # Otherwise every draw of k holds a correct sample.
            out[idx] = 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))
    return out


def avg_at_k(rewards_PK) -> np.ndarray:
    """Mean reward over each problem's k samples: [P, K] -> [P]."""
    rewards_PK = np.asarray(rewards_PK, np.float64)
    if rewards_PK.ndim != 2 or rewards_PK.shape[1] == 0:
        raise ValueError(f"rewards must be [P, K] with K >= 1, got shape {rewards_PK.shape}")
    return rewards_PK.mean(axis=1)


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


def maj_at_k(answers_PK: Sequence[Sequence[str | None]], rewards_PK) -> np.ndarray:
    """Majority-vote accuracy per problem: the reward of a sample with the most common answer.

    Answers are compared as strings, so pass normalized ones (the verifier's extraction);
    equal strings are assumed to score alike. A problem where no sample has an answer scores 0.

    Args:
      answers_PK: [P][K] extracted answers (None: nothing extracted).
      rewards_PK: [P, K] rewards of the same samples.

    Returns:
      [P] float64.
    """
    rewards_PK = np.asarray(rewards_PK, np.float64)
    if rewards_PK.ndim != 2 or len(answers_PK) != rewards_PK.shape[0]:
        raise ValueError(
            f"answers ({len(answers_PK)} rows) and rewards {rewards_PK.shape} do not match"
        )
    out = np.zeros(rewards_PK.shape[0], np.float64)
    for p, answers in enumerate(answers_PK):
        if len(answers) != rewards_PK.shape[1]:
            raise ValueError(f"row {p} has {len(answers)} answers, expected {rewards_PK.shape[1]}")
        i = majority_vote(answers)
        if i is not None:
            out[p] = rewards_PK[p, i]
    return out


def best_of_n(scores_PN, rewards_PN) -> np.ndarray:
    """Best-of-N per problem: the reward of the sample the scorer ranks highest.

    The scores come from any scorer (a reward model, a verifier, the policy's mean token
    logprob); with the verifier's own rewards as scores this is pass@N. Ties go to the first
    sample; NaN scores rank last.

    Args:
      scores_PN: [P, N] scorer outputs.
      rewards_PN: [P, N] rewards of the same samples.

    Returns:
      [P] float64.
    """
    scores_PN = np.asarray(scores_PN, np.float64)
    rewards_PN = np.asarray(rewards_PN, np.float64)
    if scores_PN.shape != rewards_PN.shape or scores_PN.ndim != 2:
        raise ValueError(f"scores {scores_PN.shape} and rewards {rewards_PN.shape} must be [P, N]")
    best_P = np.argmax(np.where(np.isnan(scores_PN), -np.inf, scores_PN), axis=1)
    return rewards_PN[np.arange(len(best_P)), best_P]
