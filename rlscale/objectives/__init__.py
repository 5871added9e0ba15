"""Loss objectives as optax-style transforms over per-token terms, registered by name; an
objective is one chain string a config names (`config.objective.chain`):

  objective = build(
      "group_advantages(scale=batch_std) | token_ratio | cispo(eps_max=4.0)"
      " | aggregate(mode=prompt_mean)",
      group_size=G, max_len=M,
  )
  objective.batch   # once per sampled batch: advantages
  objective.loss    # per micro-batch, inside the differentiated loss: (loss_sum, denominator)
  objective.model_terms   # {"logp"}: the model terms the learner computes (the ratio reads
                          # the generator's sampler_logp, which the batch carries)

Importing the package registers every transform (`registry.names()`).
"""

from rlscale.objectives.advantages import gae, group_advantages, reinforce_pp_baseline, value_loss
from rlscale.objectives.aggregate import aggregate
from rlscale.objectives.core import EmptyState, Terms, Transform, chain, stateless
from rlscale.objectives.corrections import (
    geometric_rejection,
    icepop,
    k3_rejection,
    m2po,
    masked_is,
    rollout_kl,
)
from rlscale.objectives.distill import distill_advantage
from rlscale.objectives.moe_aux import moe_aux
from rlscale.objectives.policy import (
    cispo,
    entropy_bonus,
    high_entropy_tokens,
    kl_estimate,
    kl_in_reward,
    kl_penalty,
    policy_gradient,
    ppo_clip,
    sequence_ratio,
    token_ratio,
    truncated_is,
)
from rlscale.objectives.preference import dpo, ipo, kto, simpo
from rlscale.objectives.process import process_advantages
from rlscale.objectives.registry import (
    MODEL_TERMS,
    ByArg,
    Entry,
    Objective,
    build,
    check,
    entries,
    names,
    parse,
    register,
    resolve,
    table,
)

__all__ = [
    "MODEL_TERMS",
    "ByArg",
    "EmptyState",
    "Entry",
    "Objective",
    "Terms",
    "Transform",
    "aggregate",
    "build",
    "chain",
    "check",
    "cispo",
    "distill_advantage",
    "dpo",
    "entries",
    "entropy_bonus",
    "gae",
    "geometric_rejection",
    "group_advantages",
    "high_entropy_tokens",
    "icepop",
    "ipo",
    "k3_rejection",
    "kl_estimate",
    "kl_in_reward",
    "kl_penalty",
    "kto",
    "m2po",
    "masked_is",
    "moe_aux",
    "names",
    "parse",
    "policy_gradient",
    "ppo_clip",
    "process_advantages",
    "register",
    "reinforce_pp_baseline",
    "resolve",
    "rollout_kl",
    "sequence_ratio",
    "simpo",
    "stateless",
    "table",
    "token_ratio",
    "truncated_is",
    "value_loss",
]
