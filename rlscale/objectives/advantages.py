"""Advantage estimators: group baselines (GRPO, Dr.GRPO, RLOO, ScaleRL) and GAE (PPO).

Rows are prompt-major groups of `group_size` samples. Rows with `row_weight` 0 (prompts a
filter dropped, kept only for static shapes) are ignored by batch statistics.
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

BASELINES = ("group_mean", "rloo")
SCALES = ("group_std", "batch_std", "none")


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
        r_PG = r.reshape(-1, group_size)
        if baseline == "group_mean":
            b_PG = jnp.mean(r_PG, axis=1, keepdims=True)
        else:
            b_PG = (jnp.sum(r_PG, axis=1, keepdims=True) - r_PG) / (group_size - 1)
        a_PG = r_PG - b_PG
        if scale == "group_std":
            a_PG = a_PG / (jnp.std(r_PG, axis=1, keepdims=True, ddof=1) + eps)
        a = a_PG.reshape(-1)
        if scale == "batch_std":
            w = terms.get("row_weight", jnp.ones_like(a)).astype(jnp.float32)
            mean = jnp.sum(a * w) / jnp.maximum(jnp.sum(w), 1.0)
            var = jnp.sum(jnp.square(a - mean) * w) / jnp.maximum(jnp.sum(w) - 1.0, 1.0)
            a = a / (jnp.sqrt(var) + eps)
        adv_NT = jnp.broadcast_to(a[:, None], terms["mask"].shape)
        return add_metrics(
            {**terms, "advantage": adv_NT}, advantage_mean=masked_mean(adv_NT, terms["mask"])
        )

    return stateless(fn)


def gae(gamma: float = 1.0, lam: float = 0.95) -> Transform:
    """Generalized advantage estimation (Schulman et al. 2016) with a learned value head.

    The outcome reward arrives at the last completion token. delta_t = r_t + gamma V_{t+1} - V_t,
    A_t = sum_l (gamma lam)^l delta_{t+l}, returns R_t = A_t + V_t (no gradient through
    `old_value`, the values recorded before the update).
    """

    def fn(terms):
        require(terms, "reward", "mask", "old_value", by="gae")
        mask = terms["mask"].astype(jnp.float32)
        v = jax.lax.stop_gradient(terms["old_value"]).astype(jnp.float32) * mask
        length = jnp.sum(mask, axis=1).astype(jnp.int32)
        T = mask.shape[1]
        last = jax.nn.one_hot(length - 1, T) * (length[:, None] > 0)
        r_NT = last * terms["reward"][:, None].astype(jnp.float32)
        v_next = jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], axis=1)
        delta = r_NT + gamma * v_next * mask - v

        def step(carry, x):
            d, m = x
            carry = (d + gamma * lam * carry) * m
            return carry, carry

        _, adv_TN = jax.lax.scan(step, jnp.zeros(mask.shape[0]), (delta.T, mask.T), reverse=True)
        adv = adv_TN.T
        return add_metrics(
            {**terms, "advantage": adv, "returns": adv + v}, advantage_mean=masked_mean(adv, mask)
        )

    return stateless(fn)


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
