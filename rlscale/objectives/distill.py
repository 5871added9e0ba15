"""On-policy distillation: a teacher's per-token reverse KL on the student's own samples, as
the advantage.

`teacher_logp` [N, M] is the teacher's logprob of each sampled completion token, computed once
per batch by the rollout stage (`rl.rollouts.Teacher`: data, no gradient, like
`sampler_logp`). Arrays are [N, M]: N sampled rows, M completion tokens.
"""

import jax
import jax.numpy as jnp

from rlscale.objectives.core import Transform, add_metrics, masked_mean, require, stateless
from rlscale.objectives.registry import ByArg, register

# How the distillation advantage meets an advantage already in the terms (the verifier's).
MIXES = {"replace": (), "add": "advantage"}


@register(
    "distill_advantage",
    stage="loss",
    requires=("sampler_logp", "teacher_logp", "mask", ByArg("mix", MIXES)),
    provides=("advantage",),
)
def distill_advantage(coef: float = 1.0, mix: str = "replace") -> Transform:
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649; Thinking Machines
    2025, "On-Policy Distillation"; Qwen3 technical report 2025): the student samples, the
    teacher scores the sampled tokens, and each token's reverse KL estimate is its negative
    advantage, with no discounting (a token is credited only with its own term):

      A_t = -coef * (log pi_student(y_t) - log pi_teacher(y_t)) * mask_t      mix="replace"
      A_t = A_t^verifier - coef * (log pi_student(y_t) - log pi_teacher(y_t)) * mask_t
                                                                              mix="add"

    log pi_student is the generator's logprob of the token (`sampler_logp`: the policy that
    sampled it, the one the ratio divides by), log pi_teacher the teacher's (`teacher_logp`),
    both at the sampling temperature. Minimizing the expected per-token reverse KL
    E_{y ~ pi_student} [log pi_student(y) - log pi_teacher(y)] with a policy gradient is
    the GKD objective with divergence KL(student || teacher) on on-policy data (lambda = 1).
    The policy loss that follows (`cispo`, `ppo_clip`, `policy_gradient`) takes the [N, M]
    advantage as it takes a broadcast outcome advantage.

    mix="add" keeps the advantage an earlier transform provided (the verifier's, e.g.
    `group_advantages`) and adds the distillation term to it, as a per-token KL to the teacher
    in the reward: the verifier still decides which answers are right, the teacher shapes
    every token. mix="replace" (default) ignores the verifier: pure distillation.

    The stage is the loss stage, like `kl_penalty`: the term needs no batch statistics, so
    it is the same per micro-batch, and its metric `reverse_kl` (mean over trained tokens of
    log pi_student - log pi_teacher) reaches the step's metrics line.
    """
    if mix not in MIXES:
        raise ValueError(
            f"mix={mix!r} is not one of {tuple(MIXES)}: 'replace' makes the teacher's reverse KL "
            "the whole advantage, 'add' adds it to the advantage already computed"
        )

    def fn(terms):
        require(terms, "sampler_logp", "teacher_logp", "mask", by="distill_advantage")
        m = terms["mask"].astype(jnp.float32)
        reverse_kl = jax.lax.stop_gradient(terms["sampler_logp"] - terms["teacher_logp"]) * m
        adv = -coef * reverse_kl
        if mix == "add":
            require(terms, "advantage", by="distill_advantage(mix=add)")
            adv = terms["advantage"] + adv
        return add_metrics({**terms, "advantage": adv}, reverse_kl=masked_mean(reverse_kl, m))

    return stateless(fn)
