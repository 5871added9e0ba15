"""Policy-gradient terms: importance ratios, PPO clipping, CISPO, truncated importance
sampling, the plain policy gradient, KL to a reference and the entropy bonus."""

from collections.abc import Callable

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

sg = jax.lax.stop_gradient


def token_ratio() -> Transform:
    """ratio_t = exp(logp_t - old_logp_t) (PPO: Schulman et al. 2017)."""

    def fn(terms):
        require(terms, "logp", "old_logp", by="token_ratio")
        ratio = jnp.exp(terms["logp"] - sg(terms["old_logp"]))
        return {**terms, "ratio": ratio}

    return stateless(fn)


def sequence_ratio() -> Transform:
    """GSPO's sequence ratio s_i = exp(mean_t (logp_t - old_logp_t)), the geometric mean of the
    token ratios (Zheng et al. 2025), broadcast over the row's tokens. Aggregate per sequence
    ("seq_mean_token_mean") so each sequence counts once."""

    def fn(terms):
        require(terms, "logp", "old_logp", "mask", by="sequence_ratio")
        m = terms["mask"].astype(jnp.float32)
        log_r = jnp.sum((terms["logp"] - sg(terms["old_logp"])) * m, axis=1)
        s = jnp.exp(log_r / jnp.maximum(jnp.sum(m, axis=1), 1.0))
        return {**terms, "ratio": jnp.broadcast_to(s[:, None], m.shape)}

    return stateless(fn)


def ppo_clip(
    eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None
) -> Transform:
    """Clipped surrogate: loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A).

    Separate eps_low/eps_high is DAPO's clip-higher (Yu et al. 2025). `dual_clip` c > 1 also
    bounds the loss of negative-advantage tokens at -c A (Ye et al. 2020).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1")

    def fn(terms):
        require(terms, "ratio", "advantage", "mask", by="ppo_clip")
        r, a = terms["ratio"], sg(terms["advantage"])
        unclipped = -a * r
        clipped = -a * jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high)
        loss = jnp.maximum(unclipped, clipped)
        if dual_clip is not None:
            loss = jnp.where(a < 0, jnp.minimum(loss, -a * dual_clip), loss)
        mask = terms["mask"]
        return add_metrics(
            add_loss(terms, loss),
            clip_frac=masked_mean((clipped > unclipped).astype(jnp.float32), mask),
            clip_frac_low=masked_mean(((r < 1 - eps_low) & (a < 0)).astype(jnp.float32), mask),
            clip_frac_high=masked_mean(((r > 1 + eps_high) & (a > 0)).astype(jnp.float32), mask),
            ratio_mean=masked_mean(r, mask),
        )

    return stateless(fn)


def cispo(
    eps_max: float | None = 4.0, eps_low: float | None = None, eps_high: float | None = None
) -> Transform:
    """CISPO: loss = -sg(w) * A * logp, a REINFORCE step reweighted by a clipped, detached IS
    weight, so every token keeps a gradient (MiniMax-M1: Chen et al. 2025).

    ScaleRL form (Khatri et al. 2025): w = min(ratio, eps_max), pass only `eps_max`.
    Two-sided form: w = clip(ratio, 1 - eps_low, 1 + eps_high), pass `eps_low` and `eps_high`
    (and `eps_max=None`).
    """
    two_sided = eps_low is not None or eps_high is not None
    if two_sided and (eps_low is None or eps_high is None or eps_max is not None):
        raise ValueError(
            "cispo: pass eps_max alone (ScaleRL form) or eps_low and eps_high "
            "with eps_max=None (two-sided form)"
        )
    if not two_sided and eps_max is None:
        raise ValueError("cispo: eps_max is required for the ScaleRL form")

    def fn(terms):
        require(terms, "ratio", "advantage", "logp", "mask", by="cispo")
        r = sg(terms["ratio"])
        w = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high) if two_sided else jnp.minimum(r, eps_max)
        loss = -w * sg(terms["advantage"]) * terms["logp"]
        clipped = (w != r).astype(jnp.float32)
        return add_metrics(
            add_loss(terms, loss),
            clip_frac=masked_mean(clipped, terms["mask"]),
            ratio_mean=masked_mean(r, terms["mask"]),
        )

    return stateless(fn)


def policy_gradient() -> Transform:
    """REINFORCE: loss = -A * logp (Williams 1992); with RLOO advantages, RLOO."""

    def fn(terms):
        require(terms, "advantage", "logp", by="policy_gradient")
        return add_loss(terms, -sg(terms["advantage"]) * terms["logp"])

    return stateless(fn)


def truncated_is(cap: float = 2.0, level: str = "token") -> Transform:
    """Truncated importance sampling against the sampler (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"): multiplies the per-token loss by
    sg(min(pi_old / pi_sampler, cap)), per token or per sequence (product over tokens), to
    correct for the mismatch between sampler and trainer numerics or policy lag.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"truncated_is level={level!r}: 'token' or 'sequence'")

    def fn(terms):
        require(terms, "loss", "old_logp", "sampler_logp", "mask", by="truncated_is")
        m = terms["mask"].astype(jnp.float32)
        log_w = (terms["old_logp"] - terms["sampler_logp"]) * m
        if level == "sequence":
            log_w = jnp.broadcast_to(jnp.sum(log_w, axis=1, keepdims=True), m.shape)
        w = sg(jnp.minimum(jnp.exp(log_w), cap))
        return add_metrics(
            {**terms, "loss": terms["loss"] * w},
            tis_weight_mean=masked_mean(w, m),
            tis_capped_frac=masked_mean((jnp.exp(log_w) > cap) * 1.0, m),
        )

    return stateless(fn)


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp, ref_logp, estimator: str):
    """Per-token estimates of KL(pi || pi_ref) from samples of pi (Schulman 2020):
    k1 = logp - ref_logp, k2 = (logp - ref_logp)^2 / 2, k3 = exp(ref - logp) - 1 - (ref - logp).
    """
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    if estimator == "k3":
        return jnp.exp(log_r) - 1.0 - log_r
    raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")


def _schedule(coef: float | Callable) -> Callable:
    return coef if callable(coef) else (lambda step: coef)


def kl_penalty(
    coef: float | Callable = 0.001, estimator: str = "k3", where: str = "loss"
) -> Transform:
    """KL to the reference policy, in the loss (GRPO: + coef * KL per token) or subtracted from
    the reward before advantages (`where="reward"`: r_i -= coef * sum_t k1_t, as in RLHF PPO;
    put it before the advantage transform in the chain). `coef` may be a schedule of the
    update count (optax-style)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")
    if where not in ("loss", "reward"):
        raise ValueError(f"kl_penalty where={where!r}: 'loss' or 'reward'")
    schedule = _schedule(coef)

    def update(terms, count):
        require(terms, "logp", "ref_logp", "mask", by="kl_penalty")
        c = schedule(count)
        m = terms["mask"].astype(jnp.float32)
        kl = kl_estimate(terms["logp"], sg(terms["ref_logp"]), estimator)
        if where == "loss":
            terms = add_loss(terms, c * kl)
        else:
            require(terms, "reward", by="kl_penalty(where='reward')")
            kl_seq = jnp.sum(sg(kl) * m, axis=1)
            terms = {**terms, "reward": terms["reward"] - c * kl_seq}
        return add_metrics(terms, kl=masked_mean(kl, m), kl_coef=jnp.asarray(c)), count + 1

    return Transform(lambda: jnp.zeros((), jnp.int32), update)


def entropy_bonus(coef: float | Callable = 0.001) -> Transform:
    """Adds -coef * entropy_t to the per-token loss (needs the `entropy` term)."""
    schedule = _schedule(coef)

    def update(terms, count):
        require(terms, "entropy", "mask", by="entropy_bonus")
        c = schedule(count)
        terms = add_loss(terms, -c * terms["entropy"])
        return add_metrics(terms, entropy=masked_mean(terms["entropy"], terms["mask"])), count + 1

    return Transform(lambda: jnp.zeros((), jnp.int32), update)
