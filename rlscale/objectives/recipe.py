"""Builds a recipe's transforms from its config (`config.objective`).

The stages always compose in this order; a config switches each one on or picks its variant:

  full batch   [kl in reward] -> advantages (group baseline | GAE)
  micro-batch  ratio (token | sequence) -> policy loss (ppo_clip | cispo | cispo_two_sided | pg)
               -> [truncated IS] -> [KL in loss] -> [entropy bonus] -> [value loss]
               -> aggregate

Advantages use batch statistics, so they are computed once per sampled batch; the micro-batch
chain ends in an aggregation whose (sum, denominator) accumulate exactly.
"""

import ml_collections

from rlscale.objectives import advantages, core, policy
from rlscale.objectives.aggregate import MODES as AGGREGATIONS
from rlscale.objectives.aggregate import aggregate

POLICY_LOSSES = ("ppo_clip", "cispo", "cispo_two_sided", "pg")
RATIOS = ("token", "sequence")
ADVANTAGES = ("group", "gae")


def default_config(**overrides) -> ml_collections.ConfigDict:
    """Every objective knob, with GRPO's values; recipes override what they change."""
    c = ml_collections.ConfigDict(
        dict(
            advantages=dict(
                name="group", baseline="group_mean", scale="group_std", gamma=1.0, lam=0.95
            ),
            ratio="token",
            policy=dict(name="ppo_clip", eps_low=0.2, eps_high=0.2, dual_clip=0.0, eps_max=4.0),
            tis=dict(cap=0.0, level="token"),  # cap 0: off.
            kl=dict(coef=0.0, estimator="k3", where="loss"),  # coef 0: off (no reference model).
            entropy_coef=0.0,
            value=dict(coef=0.0, clip_eps=0.2),  # > 0 trains a value head (PPO with a critic).
            aggregate="seq_mean_token_mean",
        )
    )
    if overrides:
        c.update_from_flattened_dict(overrides)
    return c


def validate(c, group_size: int) -> list[str]:
    """Every problem with an objective config, as messages naming the key."""
    problems = []
    if c.advantages.name not in ADVANTAGES:
        problems.append(
            f"objective.advantages.name={c.advantages.name!r} is not one of {ADVANTAGES}"
        )
    if c.advantages.name == "group":
        if c.advantages.baseline not in advantages.BASELINES:
            problems.append(
                f"objective.advantages.baseline={c.advantages.baseline!r} is not "
                f"one of {advantages.BASELINES}"
            )
        if c.advantages.scale not in advantages.SCALES:
            problems.append(
                f"objective.advantages.scale={c.advantages.scale!r} is not one of "
                f"{advantages.SCALES}"
            )
        if group_size < 2:
            problems.append(f"group advantages need group_size >= 2, got {group_size}")
    if c.advantages.name == "gae" and c.value.coef <= 0:
        problems.append(
            "objective.advantages.name='gae' (PPO with a critic) needs a value "
            "head: set objective.value.coef > 0"
        )
    if c.ratio not in RATIOS:
        problems.append(f"objective.ratio={c.ratio!r} is not one of {RATIOS}")
    if c.policy.name not in POLICY_LOSSES:
        problems.append(f"objective.policy.name={c.policy.name!r} is not one of {POLICY_LOSSES}")
    if c.aggregate not in AGGREGATIONS:
        problems.append(f"objective.aggregate={c.aggregate!r} is not one of {AGGREGATIONS}")
    if c.kl.estimator not in policy.KL_ESTIMATORS:
        problems.append(
            f"objective.kl.estimator={c.kl.estimator!r} is not one of {policy.KL_ESTIMATORS}"
        )
    if c.kl.where not in ("loss", "reward"):
        problems.append(f"objective.kl.where={c.kl.where!r} is not 'loss' or 'reward'")
    if c.tis.level not in ("token", "sequence"):
        problems.append(f"objective.tis.level={c.tis.level!r} is not 'token' or 'sequence'")
    if c.policy.dual_clip and c.policy.dual_clip <= 1:
        problems.append(f"objective.policy.dual_clip={c.policy.dual_clip} must be > 1 (or 0)")
    return problems


def build(c, group_size: int, max_len: int) -> tuple[core.Transform, core.Transform]:
    """(full-batch advantage transform, micro-batch loss transform)."""
    problems = validate(c, group_size)
    if problems:
        raise ValueError("Invalid objective config:\n  " + "\n  ".join(problems))
    batch = []
    if c.kl.coef and c.kl.where == "reward":
        batch.append(policy.kl_penalty(c.kl.coef, c.kl.estimator, where="reward"))
    if c.advantages.name == "group":
        batch.append(
            advantages.group_advantages(group_size, c.advantages.baseline, c.advantages.scale)
        )
    else:
        batch.append(advantages.gae(c.advantages.gamma, c.advantages.lam))
    micro = [policy.token_ratio() if c.ratio == "token" else policy.sequence_ratio()]
    p = c.policy
    if p.name == "ppo_clip":
        micro.append(policy.ppo_clip(p.eps_low, p.eps_high, p.dual_clip or None))
    elif p.name == "cispo":
        micro.append(policy.cispo(eps_max=p.eps_max))
    elif p.name == "cispo_two_sided":
        micro.append(policy.cispo(eps_max=None, eps_low=p.eps_low, eps_high=p.eps_high))
    else:
        micro.append(policy.policy_gradient())
    if c.tis.cap:
        micro.append(policy.truncated_is(c.tis.cap, c.tis.level))
    if c.kl.coef and c.kl.where == "loss":
        micro.append(policy.kl_penalty(c.kl.coef, c.kl.estimator, where="loss"))
    if c.entropy_coef:
        micro.append(policy.entropy_bonus(c.entropy_coef))
    if c.value.coef:
        micro.append(advantages.value_loss(c.value.coef, c.value.clip_eps or None))
    micro.append(aggregate(c.aggregate, group_size=group_size, max_len=max_len))
    return core.chain(*batch), core.chain(*micro)


def needs(c) -> dict:
    """Which model passes the recipe needs: a reference model, a value head, entropies."""
    return {
        "ref": bool(c.kl.coef),
        "value": c.advantages.name == "gae" or bool(c.value.coef),
        "entropy": bool(c.entropy_coef),
    }
