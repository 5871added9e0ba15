"""How far the trainer's logprobs are from the generator's on the trained tokens, over any
number of chunks: per-chunk statistics on the device (`logp_match_stats`), merged exactly on
the host (`logp_match`), with the per-token log-ratio's histogram (TensorBoard).
"""

import jax.numpy as jnp
import numpy as np

from rlscale import metrics

# The log-ratio histogram's bucket limits: a decade each side of 0, from 1e-8 (float32's unit
# roundoff is 6e-8, bfloat16's 4e-3) to 10, and 0 itself.
# Bucket i holds (LIMITS[i - 1], LIMITS[i]], the first from -inf; the last is (10, inf].
_DECADES = 10.0 ** np.arange(1, -9, -1)
LIMITS = np.concatenate([-_DECADES, [0.0], _DECADES[::-1], [np.inf]]).astype(np.float32)


def logp_match_stats(logp, sampler_logp, mask) -> dict:
    """One chunk's (a micro-batch's) statistics of its masked tokens, from which `logp_match`
    computes how far the trainer's logprobs are from the generator's over any number of
    chunks: the count n, the means of x = exp(logp) and y = exp(sampler_logp), the centred
    sums M2x = sum (x - mean x)^2, M2y = sum (y - mean y)^2, Cxy = sum (x - mean x)(y - mean y),
    and sum |logp - sampler_logp|. Centred within the chunk, not raw sums of x^2: probabilities
    near 1 would lose the variance to float32 cancellation (a Pearson r of 1.000002). And the
    log-ratio d = logp - sampler_logp's histogram over `LIMITS` (`hist`), min, max, sum and
    sum of squares."""
    m = mask > 0
    n = jnp.sum(m.astype(jnp.int32))
    x, y = jnp.exp(logp), jnp.exp(sampler_logp)
    mean_x = jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(n, 1)
    mean_y = jnp.sum(jnp.where(m, y, 0.0)) / jnp.maximum(n, 1)
    dx, dy = jnp.where(m, x - mean_x, 0.0), jnp.where(m, y - mean_y, 0.0)
    return {
        "n": n,
        "mean_x": mean_x,
        "mean_y": mean_y,
        "m2_x": jnp.sum(dx * dx),
        "m2_y": jnp.sum(dy * dy),
        "c_xy": jnp.sum(dx * dy),
        "abs_gap": jnp.sum(jnp.where(m, jnp.abs(logp - sampler_logp), 0.0)),
        **_log_ratio_stats(logp - sampler_logp, m),
    }


def _log_ratio_stats(d, m) -> dict:
    bucket = jnp.searchsorted(jnp.asarray(LIMITS), d, side="left")  # (LIMITS[i-1], LIMITS[i]]
    ones = m.astype(jnp.int32)  # A NaN's bucket is past the end: dropped.
    return {
        "hist": jnp.zeros(len(LIMITS), jnp.int32).at[bucket].add(ones, mode="drop"),
        "d_min": jnp.min(jnp.where(m, d, jnp.inf)),
        "d_max": jnp.max(jnp.where(m, d, -jnp.inf)),
        "d_sum": jnp.sum(jnp.where(m, d, 0.0)),
        "d_sum_sq": jnp.sum(jnp.where(m, d * d, 0.0)),
    }


def log_ratio_histogram(chunks: list[dict]) -> metrics.Histogram | None:
    """The histogram of the per-token log-ratio logp_t - sampler_logp_t over the tokens of
    all `chunks` (`logp_match_stats` of each); None without tokens."""
    counts = np.sum([np.asarray(c["hist"], np.int64) for c in chunks], axis=0)
    if not counts.sum():
        return None
    return metrics.Histogram(
        limits=LIMITS.astype(np.float64),
        counts=counts,
        min=min(float(c["d_min"]) for c in chunks),
        max=max(float(c["d_max"]) for c in chunks),
        sum=sum(float(c["d_sum"]) for c in chunks),
        sum_squares=sum(float(c["d_sum_sq"]) for c in chunks),
    )


def logp_match(chunks: list[dict]) -> dict[str, float]:
    """The trainer-vs-generator metrics over the tokens of all `chunks` (`logp_match_stats`
    of each), merged on the host in float64 with the exact pairwise update of Chan, Golub and
    LeVeque (1979): for chunks a, b with d = mean_b - mean_a, M2 = M2_a + M2_b + d^2 n_a n_b / n
    and C = C_a + C_b + d_x d_y n_a n_b / n. Any split gives the value of the whole, up to
    float32 rounding within each chunk.

      train/logp_gap_abs   mean_t |logp_t - sampler_logp_t|
      train/prob_pearson   Pearson r between exp(logp_t) and exp(sampler_logp_t):
                           Cxy / sqrt(M2x M2y)
      train/routing_mismatch  (a mixture of experts with recorded routing: the chunks'
                           `routing_diff`, each token's share of mismatched (layer, choice)
                           slots, `forward.routing_mismatch`, summed) the share of the
                           tokens' slots whose recorded expert is not among the trainer's
                           own top-k

    NaN (null in metrics.jsonl) where undefined: no tokens, or r of a constant.
    """
    n = mean_x = mean_y = m2_x = m2_y = c_xy = abs_gap = 0.0
    for c in chunks:
        c = {k: float(c[k]) for k in ("n", "mean_x", "mean_y", "m2_x", "m2_y", "c_xy", "abs_gap")}
        total = n + c["n"]
        if c["n"] > 0:
            d_x, d_y, w = c["mean_x"] - mean_x, c["mean_y"] - mean_y, n * c["n"] / total
            m2_x += c["m2_x"] + d_x * d_x * w
            m2_y += c["m2_y"] + d_y * d_y * w
            c_xy += c["c_xy"] + d_x * d_y * w
            mean_x += d_x * c["n"] / total
            mean_y += d_y * c["n"] / total
        n, abs_gap = total, abs_gap + c["abs_gap"]
    routed = {}
    if chunks and "routing_diff" in chunks[0]:
        diff = sum(float(c["routing_diff"]) for c in chunks)
        routed["train/routing_mismatch"] = diff / n if n > 0 else float("nan")
    return {
        **routed,
        "train/logp_gap_abs": abs_gap / n if n > 0 else float("nan"),
        "train/prob_pearson": c_xy / np.sqrt(m2_x * m2_y)
        if m2_x > 0 and m2_y > 0
        else float("nan"),
    }
