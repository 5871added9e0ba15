"""Loss objectives as optax-style transforms over per-token terms; a recipe is a `chain`.

scalerl = chain(
    group_advantages(G, baseline="group_mean", scale="batch_std"),
    token_ratio(),
    cispo(eps_max=4.0),
    aggregate("prompt_mean", group_size=G),
)
"""

from rlscale.objectives.advantages import gae, group_advantages, value_loss
from rlscale.objectives.aggregate import aggregate
from rlscale.objectives.core import EmptyState, Terms, Transform, chain, stateless
from rlscale.objectives.policy import (
    cispo,
    entropy_bonus,
    kl_estimate,
    kl_penalty,
    policy_gradient,
    ppo_clip,
    sequence_ratio,
    token_ratio,
    truncated_is,
)

__all__ = [
    "EmptyState",
    "Terms",
    "Transform",
    "aggregate",
    "chain",
    "cispo",
    "entropy_bonus",
    "gae",
    "group_advantages",
    "kl_estimate",
    "kl_penalty",
    "policy_gradient",
    "ppo_clip",
    "sequence_ratio",
    "stateless",
    "token_ratio",
    "truncated_is",
    "value_loss",
]
