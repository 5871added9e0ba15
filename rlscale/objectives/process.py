"""Process supervision: per-step rewards (a process reward model's) turned into per-token
advantages.

`step_reward` [N, M] holds each step's reward at the position of the step's last completion
token and 0 elsewhere; `step_mask` [N, M] is 1 exactly at those positions (so a step whose
reward is 0 still counts in the group's statistics). The rollout stage provides both, from a
`prm.ProcessRewardModel` (`step_rewards`: the PRM's probability that the prefix
through the step leads to a correct answer). Arrays are [N, M].

Dimension letters: B prompts, G samples per prompt, N = B * G sampled rows (prompt-major), M
completion tokens, X = G * M a group's tokens, flattened.
"""

import jax
import jax.numpy as jnp

from rlscale.objectives.core import Transform, add_metrics, masked_mean, require, stateless
from rlscale.objectives.registry import ByArg, register

# How the process advantage meets an advantage already in the terms (the outcome one).
MIXES = {"replace": (), "add": "advantage"}
NORMALIZATIONS = ("group", "none")


def reverse_cumsum(x_NM):
    """y_t = sum_{t' >= t} x_t' along the last axis (an undiscounted return-to-go)."""
    return jnp.flip(jnp.cumsum(jnp.flip(x_NM, -1), axis=-1), -1)


@register(
    "process_advantages",
    stage="batch",
    requires=("step_reward", "step_mask", "mask", ByArg("mix", MIXES)),
    provides=("advantage",),
)
def process_advantages(
    group_size: int,
    coef: float = 1.0,
    mix: str = "replace",
    normalize: str = "group",
    eps: float = 1e-6,
) -> Transform:
    """Process-supervised advantages (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300,
    section 4.1.3; Uesato et al. 2022, arXiv 2211.14275; Lightman et al. 2023, "Let's Verify
    Step by Step"). Output i of a group has K_i steps; step j ends at token index(j) with
    reward r_i^index(j). With R the set of every step reward of the group's G outputs,

      r~_i^index(j) = (r_i^index(j) - mean(R)) / (std(R) + eps)          normalize="group"
      r~_i^index(j) = r_i^index(j)                                        normalize="none"

      A_i,t = coef * sum_{j: index(j) >= t} r~_i^index(j)                 mix="replace"
      A_i,t = A_i,t^outcome + coef * sum_{j: index(j) >= t} r~_i^index(j)   mix="add"

    so a token is credited with the (normalized) rewards of its own step and every later one:
    an undiscounted return-to-go over steps. std is unbiased over R (as `group_advantages`'
    group_std); a group with one step in all has std 0 and r~ = 0. The policy gradient of
    this advantage is sum_i sum_j r~_i^index(j) grad log pi(o_i,<=index(j)): each step's
    reward weights the log-probability of the prefix it ends.

    mix="add" keeps the advantage an earlier batch transform provided (the outcome one, e.g.
    `group_advantages`) and adds the process term: the verifier still decides which answers
    are right, the PRM shapes the steps. normalize="none" with mix="add" is the outcome
    advantage plus coef times the raw step rewards' return-to-go.

    Tokens after a row's last step get no process advantage (the rollout stage places the
    last step's reward at the completion's last token, so there are none); masked tokens
    (forced interruptions, padding) get advantage 0, though a step ending on one still counts.

    The stage is the batch stage, like `group_advantages`: the statistics are over whole
    groups, computed once per sampled batch.
    """
    if mix not in MIXES:
        raise ValueError(
            f"mix={mix!r} is not one of {tuple(MIXES)}: 'replace' makes the process advantage "
            "the whole advantage (DeepSeekMath's process supervision), 'add' adds it to the "
            "advantage already computed (the outcome one)"
        )
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r} is not one of {NORMALIZATIONS}")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")

    def fn(terms):
        require(terms, "step_reward", "step_mask", "mask", by="process_advantages")
        m = terms["mask"].astype(jnp.float32)
        s = terms["step_mask"].astype(jnp.float32)
        r = jax.lax.stop_gradient(terms["step_reward"]).astype(jnp.float32) * s
        N, M = m.shape
        if N % group_size:
            raise ValueError(f"{N} rows are not whole groups of {group_size}")
        if normalize == "group":
            r_BX, s_BX = r.reshape(-1, group_size * M), s.reshape(-1, group_size * M)
            n_B = jnp.sum(s_BX, axis=1, keepdims=True)
            mean_B = jnp.sum(r_BX, axis=1, keepdims=True) / jnp.maximum(n_B, 1.0)
            centred_BX = (r_BX - mean_B) * s_BX
            var_B = jnp.sum(jnp.square(centred_BX), axis=1, keepdims=True) / jnp.maximum(
                n_B - 1.0, 1.0
            )
            r = (centred_BX / (jnp.sqrt(var_B) + eps)).reshape(N, M)
        process_NM = coef * reverse_cumsum(r) * m
        adv = process_NM
        if mix == "add":
            require(terms, "advantage", by="process_advantages(mix=add)")
            adv = terms["advantage"] + process_NM
        steps = jnp.maximum(jnp.sum(s), 1.0)
        return add_metrics(
            {**terms, "advantage": adv},
            step_reward_mean=jnp.sum(terms["step_reward"].astype(jnp.float32) * s) / steps,
            steps_per_row=jnp.sum(s) / N,
            process_advantage_mean=masked_mean(process_NM, m),
        )

    return stateless(fn)
