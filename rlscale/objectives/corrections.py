"""Off-policy corrections beyond truncated IS: masks and penalties on the ratio of the trainer
to the generator, rho_t = pi_old(y_t) / pi_sampler(y_t), log rho_t = old_logp_t -
sampler_logp_t (`old_logp`: the trainer's recomputation at the start of the update;
`sampler_logp`: the logprob the generator sampled the token with). rho measures the
training-inference mismatch (numerics) and, with asynchronous generation, the policy lag.

A rejection removes tokens (or whole sequences) from `mask`, so the aggregation counts only
the kept tokens in its denominator, as verl's and slime's rejection sampling do. The masks
that need only `old_logp` and `sampler_logp` run in the batch stage, once on the whole batch
before any update (M2PO's statistic is the batch's); put them after the advantages and
before the ratio. Each reports the fractions it masks: `NAME_masked_tokens` (of the batch's
trained tokens) and `NAME_masked_seqs` (of its sequences with tokens, those that lose at
least one). Derivations and the table: docs/objectives.md#off-policy-corrections.

Arrays are [N, M]: N sampled rows, M completion tokens.
"""

import jax
import jax.numpy as jnp

from rlscale.objectives.core import (
    Transform,
    add_loss,
    add_metrics,
    masked_mean,
    require,
    stateless,
)
from rlscale.objectives.policy import kl_estimate
from rlscale.objectives.registry import register

sg = jax.lax.stop_gradient

LEVELS = ("token", "sequence")
_RHO = ("old_logp", "sampler_logp", "mask")


def _band(low: float, high: float):
    if not 0.0 <= low < high:
        raise ValueError(f"low={low}, high={high}: the band needs 0 <= low < high")


def _positive(name: str, value: float):
    if not value > 0.0:
        raise ValueError(f"{name}={value} must be > 0")


def _log_rho(terms, by: str):
    """(log rho [N, M], 0 off the mask; mask as float32 [N, M])."""
    require(terms, *_RHO, by=by)
    m = terms["mask"].astype(jnp.float32)
    return sg(terms["old_logp"] - terms["sampler_logp"]) * m, m


def _row_mean(x, m):
    return jnp.sum(x * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def _narrow(terms, keep_NM, name: str, **metrics):
    """`mask` narrowed to `keep_NM`, with the fractions of tokens and of sequences masked."""
    mask = terms["mask"]
    m = mask.astype(jnp.float32)
    dropped = m * (1.0 - keep_NM.astype(jnp.float32))
    rows = (jnp.sum(m, axis=1) > 0).astype(jnp.float32)
    hit = (jnp.sum(dropped, axis=1) > 0).astype(jnp.float32)
    out = {**terms, "mask": (mask * keep_NM).astype(mask.dtype)}
    return add_metrics(
        out,
        **{
            f"{name}_masked_tokens": jnp.sum(dropped) / jnp.maximum(jnp.sum(m), 1.0),
            f"{name}_masked_seqs": jnp.sum(hit) / jnp.maximum(jnp.sum(rows), 1.0),
        },
        **metrics,
    )


def _in_band(log_x, low: float, high: float):
    """low <= x <= high, compared in log space (exp(log_x) may overflow); low = 0 is -inf."""
    lo = jnp.log(low) if low > 0 else -jnp.inf
    return (log_x >= lo) & (log_x <= jnp.log(high))


@register("icepop", stage="batch", requires=_RHO, provides=("mask",))
def icepop(low: float = 0.5, high: float = 5.0) -> Transform:
    """IcePop's band mask (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement
    Learning for Trillion-Scale Thinking Model", Ring-1T, arXiv 2510.18855): a token whose
    ratio leaves the band gets no loss and no gradient, rather than a clipped one:

      mask_t <- mask_t * 1[low <= rho_t <= high],   rho_t = pi_old(y_t) / pi_sampler(y_t).

    The paper's objective weights the kept tokens by M(rho) = rho as well; with the default
    `token_ratio` (against the generator, pi_theta / pi_sampler = rho * pi_theta / pi_old)
    the ratio already carries that factor, so the mask alone reproduces it.
    """
    _band(low, high)

    def fn(terms):
        log_rho, _ = _log_rho(terms, "icepop")
        return _narrow(terms, _in_band(log_rho, low, high), "icepop")

    return stateless(fn)


@register(
    "masked_is",
    stage="loss",
    requires=("loss", *_RHO),
    provides=("loss", "mask"),
)
def masked_is(low: float = 0.5, high: float = 2.0, level: str = "token") -> Transform:
    """Masked importance sampling (MIS) against the sampler (Liu, Li et al. 2025, "When Speed
    Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"; verl's
    rollout correction, token and sequence IS with rejection): the per-token loss is weighted
    by the ratio inside the band and the token (level=token) or the whole sequence
    (level=sequence) is rejected outside it:

      token:     w_t = rho_t,            kept iff low <= rho_t <= high
      sequence:  w_t = prod_t' rho_t',   kept iff low <= prod_t' rho_t' <= high (whole row)
      loss_t <- sg(w_t) * loss_t,  mask_t <- mask_t * kept_t.

    Rejected tokens leave the mask, hence the aggregation's denominator (slime#657 and
    verl#3915 fixed counting them there). As `truncated_is`, pair it with a ratio against the
    trainer (`token_ratio(behaviour=trainer)`) or with `policy_gradient`.
    """
    _band(low, high)
    if level not in LEVELS:
        raise ValueError(f"masked_is level={level!r}: 'token' or 'sequence'")

    def fn(terms):
        log_rho, m = _log_rho(terms, "masked_is")
        require(terms, "loss", by="masked_is")
        if level == "sequence":
            log_rho = jnp.broadcast_to(jnp.sum(log_rho, axis=1, keepdims=True), m.shape)
        keep = _in_band(log_rho, low, high)
        w = sg(jnp.where(keep, jnp.exp(jnp.where(keep, log_rho, 0.0)), 0.0))
        out = _narrow(terms, keep, "masked_is")
        return add_metrics(
            {**out, "loss": terms["loss"] * w}, masked_is_weight_mean=masked_mean(w, out["mask"])
        )

    return stateless(fn)


@register("geometric_rejection", stage="batch", requires=_RHO, provides=("mask",))
def geometric_rejection(low: float = 0.999, high: float = 1.001) -> Transform:
    """Geometric-mean sequence rejection (Liu, Li et al. 2025, "When Speed Kills Stability",
    part 3; verl's `rollout_rs=geometric`): a sequence is rejected whole when the geometric
    mean of its token ratios leaves the band,

      rho_geo_i = exp(mean_t log rho_it),   mask_i <- mask_i * 1[low <= rho_geo_i <= high].

    Length-normalized, so one band serves every length; it is tight (1 +- 1e-3 allows a mean
    per-token deviation of 0.1%).
    """
    _band(low, high)

    def fn(terms):
        log_rho, m = _log_rho(terms, "geometric_rejection")
        keep = _in_band(_row_mean(log_rho, m), low, high)[:, None]
        return _narrow(terms, jnp.broadcast_to(keep, m.shape), "geometric_rejection")

    return stateless(fn)


@register("k3_rejection", stage="batch", requires=_RHO, provides=("mask",))
def k3_rejection(max_kl: float = 1e-3) -> Transform:
    """K3 sequence rejection (verl's rollout correction, `rollout_rs=k3`; the estimator of
    Schulman 2020 in the convention of verl's off-policy metrics): a sequence is rejected whole
    when its mean per-token K3 estimate of KL(pi_sampler || pi_old) exceeds `max_kl`,

      k3_t = rho_t - 1 - log rho_t  (>= 0; E_{y ~ pi_sampler}[k3] = KL(pi_sampler || pi_old)),
      mask_i <- mask_i * 1[mean_t k3_it <= max_kl].

    Reports `k3_rejection_kl`, the mean k3 over the batch's tokens before rejection.
    """
    _positive("max_kl", max_kl)

    def fn(terms):
        log_rho, m = _log_rho(terms, "k3_rejection")
        # kl_estimate's k3 of pi_sampler against pi_old, from log rho (0 off the mask).
        k3 = kl_estimate(0.0, log_rho, "k3")
        keep = (_row_mean(k3, m) <= max_kl)[:, None]
        return _narrow(
            terms,
            jnp.broadcast_to(keep, m.shape),
            "k3_rejection",
            k3_rejection_kl=masked_mean(k3, m),
        )

    return stateless(fn)


@register("m2po", stage="batch", requires=_RHO, provides=("mask",))
def m2po(tau: float = 0.04) -> Transform:
    """M2PO's second-moment mask (Zheng et al. 2025, "Prosperity before Collapse: How Far Can
    Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161, Algorithm 1; AReaL's
    `actor.m2_threshold`): over the batch's tokens, the ones with the largest
    M2_t = (log rho_t)^2 are masked, largest first, until the mean M2 of the kept tokens is
    <= tau:

      sort M2 ascending: s_1 <= ... <= s_n;  k = max{j : (1/j) sum_{i<=j} s_i <= tau}
      (the prefix means do not decrease, so k is where they pass tau; k = n when the batch's
      mean M2 is already <= tau);  keep the k tokens of smallest M2.

    Static shapes: one sort of the batch's N * M values (the masked-out ones sort last).
    Equal M2 values are kept in index order. The paper's final version applies the mask only
    to tokens whose clipping would be active (A > 0 with rho > 1, A < 0 with rho < 1); this is
    Algorithm 1 as first published, on every token. Reports `m2po_m2`, the batch's mean M2
    before masking.
    """
    _positive("tau", tau)

    def fn(terms):
        log_rho, m = _log_rho(terms, "m2po")
        valid = m.reshape(-1) > 0
        n = jnp.sum(valid)
        m2 = jnp.square(log_rho).reshape(-1)
        order = jnp.argsort(jnp.where(valid, m2, jnp.inf), stable=True)
        sorted_m2 = jnp.where(valid[order], m2[order], 0.0)
        j = jnp.arange(1, m2.size + 1)
        prefix_mean = jnp.cumsum(sorted_m2) / j
        k = jnp.sum((prefix_mean <= tau) & (j <= n))
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(m2.size))
        keep = (rank < k).reshape(m.shape)
        return _narrow(terms, keep, "m2po", m2po_m2=jnp.sum(m2) / jnp.maximum(n, 1))

    return stateless(fn)


@register(
    "rollout_kl",
    stage="loss",
    requires=("logp", "sampler_logp", "mask"),
    provides=("loss",),
)
def rollout_kl(coef: float = 1e-3) -> Transform:
    """A KL penalty to the generator (SkyRL's and prime-rl's rollout-KL term): adds
    coef * k2_t to the per-token loss,

      k2_t = 0.5 * (logp_t - sampler_logp_t)^2,

    the k2 estimator (Schulman 2020) of the KL between the trained policy and the policy that
    sampled the tokens. Its gradient, coef * (logp_t - sampler_logp_t) grad logp_t, pulls
    the trained policy's logprobs toward the sampler's; with the trainer's start-of-update
    logprobs (`old_logp`) in place of `logp` the term would be a constant with no gradient.
    At the update's first step logp = pi_old, so k2 = 0.5 (log rho_t)^2 there. Reports
    `rollout_kl`, the mean k2 over the micro-batch's tokens. It masks nothing.
    """
    _positive("coef", coef)

    def fn(terms):
        require(terms, "logp", "sampler_logp", "mask", by="rollout_kl")
        k2 = kl_estimate(terms["logp"], sg(terms["sampler_logp"]), "k2")
        return add_metrics(
            add_loss(terms, coef * k2), rollout_kl=masked_mean(sg(k2), terms["mask"])
        )

    return stateless(fn)
