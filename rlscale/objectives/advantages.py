"""Advantage estimators: group baselines (GRPO, Dr.GRPO, RLOO, ScaleRL), REINFORCE++-baseline
and GAE (PPO) with its value loss.

Rows are prompt-major groups of G samples (N = B * G rows of M completion tokens). Rows with
`row_weight` 0 (prompts a filter dropped, kept only for static shapes) are ignored by batch
statistics.
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
from rlscale.objectives.registry import register

BASELINES = ("group_mean", "rloo")
SCALES = ("group_std", "batch_std", "none")


def _batch_moments(a, w):
    """Weighted mean and unbiased variance of rows `a` with weights `w` (dropped rows: 0)."""
    mean = jnp.sum(a * w) / jnp.maximum(jnp.sum(w), 1.0)
    var = jnp.sum(jnp.square(a - mean) * w) / jnp.maximum(jnp.sum(w) - 1.0, 1.0)
    return mean, var


@register(
    "group_advantages",
    stage="batch",
    requires=("reward", "mask", "row_weight"),
    provides=("advantage",),
)
def group_advantages(
    group_size: int, baseline: str = "group_mean", scale: str = "group_std", eps: float = 1e-6
) -> Transform:
    """Outcome advantages from each prompt's group of G rewards, broadcast over tokens.

    A_i = (r_i - b_i) / s, with
      b_i = mean_j r_j over the group ("group_mean", GRPO: Shao et al. 2024), or
            mean_{j != i} r_j ("rloo", leave-one-out: Ahmadian et al. 2024);
      s   = std of the group's rewards ("group_std", GRPO; unbiased, + eps),
            std of the centred rewards r_i - b_i over the whole batch ("batch_std", ScaleRL:
            Khatri et al. 2025), or 1 ("none", Dr.GRPO: Liu et al. 2025).
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r} is not one of {BASELINES}")
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not one of {SCALES}")
    if group_size < 2 and (baseline == "rloo" or scale == "group_std"):
        raise ValueError(f"group_size={group_size}: {baseline}/{scale} needs groups of >= 2")

    def fn(terms):
        require(terms, "reward", "mask", by="group_advantages")
        r = terms["reward"].astype(jnp.float32)
        if r.shape[0] % group_size:
            raise ValueError(f"{r.shape[0]} rows are not whole groups of {group_size}")
        r_BG = r.reshape(-1, group_size)
        if baseline == "group_mean":
            b_BG = jnp.mean(r_BG, axis=1, keepdims=True)
        else:
            b_BG = (jnp.sum(r_BG, axis=1, keepdims=True) - r_BG) / (group_size - 1)
        a_BG = r_BG - b_BG
        if scale == "group_std":
            a_BG = a_BG / (jnp.std(r_BG, axis=1, keepdims=True, ddof=1) + eps)
        a = a_BG.reshape(-1)
        if scale == "batch_std":
            w = terms.get("row_weight", jnp.ones_like(a)).astype(jnp.float32)
            _, var = _batch_moments(a, w)
            a = a / (jnp.sqrt(var) + eps)
        adv_NM = jnp.broadcast_to(a[:, None], terms["mask"].shape)
        return add_metrics(
            {**terms, "advantage": adv_NM}, advantage_mean=masked_mean(adv_NM, terms["mask"])
        )

    return stateless(fn)


@register(
    "reinforce_pp_baseline",
    stage="batch",
    requires=("reward", "mask", "row_weight"),
    provides=("advantage",),
)
def reinforce_pp_baseline(group_size: int, eps: float = 1e-6) -> Transform:
    """REINFORCE++-baseline (Hu et al. 2025, "REINFORCE++: An Efficient RLHF Algorithm with
    Robustness to Both Prompt and Reward Models", arXiv 2501.03262): subtract each prompt's
    group mean reward, then normalize globally over the batch,

      A'_i = r_i - mean_{j in group(i)} r_j
      A_i  = (A'_i - mean_batch A') / (std_batch A' + eps),

    broadcast over the row's tokens. Batch statistics run over rows with `row_weight` > 0
    (std unbiased, as `group_advantages(scale="batch_std")`); rows of dropped prompts count
    in nothing. The paper's global normalization is over tokens; here, with one outcome
    reward per row, over rows: each sample counts once whatever its length.
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")

    def fn(terms):
        require(terms, "reward", "mask", by="reinforce_pp_baseline")
        r = terms["reward"].astype(jnp.float32)
        if r.shape[0] % group_size:
            raise ValueError(f"{r.shape[0]} rows are not whole groups of {group_size}")
        r_BG = r.reshape(-1, group_size)
        a = (r_BG - jnp.mean(r_BG, axis=1, keepdims=True)).reshape(-1)
        w = (terms.get("row_weight", jnp.ones_like(a)) > 0).astype(jnp.float32)
        mean, var = _batch_moments(a, w)
        a = (a - mean) / (jnp.sqrt(var) + eps)
        adv_NM = jnp.broadcast_to(a[:, None], terms["mask"].shape)
        return add_metrics(
            {**terms, "advantage": adv_NM}, advantage_mean=masked_mean(adv_NM, terms["mask"])
        )

    return stateless(fn)


@register(
    "gae",
    stage="batch",
    requires=("reward", "mask", "old_value"),
    provides=("advantage", "returns"),
)
def gae(gamma: float = 1.0, lam: float = 0.95) -> Transform:
    """Generalized advantage estimation (Schulman et al. 2016) with a learned value head.

    The outcome reward arrives at the last unmasked completion token. Over the unmasked
    tokens t < t' (t' the next unmasked one): delta_t = r_t + gamma V_t' - V_t,
    A_t = delta_t + gamma lam A_t', returns R_t = A_t + V_t (no gradient through `old_value`,
    the values recorded before the update). Masked tokens inside a completion (those written
    by forced interruption: context, not actions) are skipped: the recursion passes through
    them unchanged and their values are ignored. Masked tokens get advantage 0.
    """

    def fn(terms):
        require(terms, "reward", "mask", "old_value", by="gae")
        mask = terms["mask"].astype(jnp.float32)
        v = jax.lax.stop_gradient(terms["old_value"]).astype(jnp.float32) * mask
        M = mask.shape[1]
        has_tokens = jnp.any(mask > 0, axis=1)
        last = M - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=1)  # Last unmasked token.
        r_NM = jax.nn.one_hot(last, M) * has_tokens[:, None]
        r_NM = r_NM * terms["reward"][:, None].astype(jnp.float32)

        def step(carry, x):
            adv_next, v_next = carry  # At the next unmasked token (0 past the last).
            r, v_t, m = x
            delta = r + gamma * v_next * m - v_t
            adv = (delta + gamma * lam * adv_next) * m
            keep = m > 0
            return (jnp.where(keep, adv, adv_next), jnp.where(keep, v_t, v_next)), adv

        zeros = jnp.zeros(mask.shape[0])
        _, adv_MN = jax.lax.scan(step, (zeros, zeros), (r_NM.T, v.T, mask.T), reverse=True)
        adv = adv_MN.T
        return add_metrics(
            {**terms, "advantage": adv, "returns": adv + v}, advantage_mean=masked_mean(adv, mask)
        )

    return stateless(fn)


@register(
    "value_loss",
    stage="loss",
    requires=("value", "old_value", "returns", "mask"),
    provides=("loss",),
)
def value_loss(coef: float = 0.5, clip_eps: float | None = 0.2) -> Transform:
    """PPO critic loss: coef * 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2) per token."""

    def fn(terms):
        require(terms, "value", "old_value", "returns", "mask", by="value_loss")
        v, ret = terms["value"].astype(jnp.float32), jax.lax.stop_gradient(terms["returns"])
        loss = jnp.square(v - ret)
        if clip_eps is not None:
            old = jax.lax.stop_gradient(terms["old_value"])
            clipped = old + jnp.clip(v - old, -clip_eps, clip_eps)
            loss = jnp.maximum(loss, jnp.square(clipped - ret))
        loss = coef * 0.5 * loss
        return add_metrics(add_loss(terms, loss), value_loss=masked_mean(loss, terms["mask"]))

    return stateless(fn)
