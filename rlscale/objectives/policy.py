"""Policy-gradient terms: importance ratios, PPO clipping, CISPO, truncated importance
sampling, the plain policy gradient, KL to a reference (in the loss or in the reward), the
entropy bonus and high-entropy token selection.

Arrays are [N, M]: N sampled rows, M completion tokens.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlscale.objectives.core import (
    Transform,
    add_loss,
    add_metrics,
    masked_mean,
    require,
    schedule_value,
    stateless,
)
from rlscale.objectives.registry import ByArg, register

sg = jax.lax.stop_gradient


# The behaviour policy mu of a ratio pi_theta / mu, and the term holding its logprobs.
BEHAVIOURS = {"generator": "sampler_logp", "trainer": "old_logp"}
_BEHAVIOUR = ByArg("behaviour", BEHAVIOURS)


def _behaviour_term(behaviour: str) -> str:
    if behaviour not in BEHAVIOURS:
        raise ValueError(
            f"behaviour={behaviour!r} is not one of {tuple(BEHAVIOURS)}: 'generator' divides by "
            "the logprobs the tokens were sampled with (sampler_logp), 'trainer' by the "
            "trainer's recomputation at the start of the update (old_logp)"
        )
    return BEHAVIOURS[behaviour]


@register("token_ratio", stage="loss", requires=("logp", _BEHAVIOUR), provides=("ratio",))
def token_ratio(behaviour: str = "generator") -> Transform:
    """Per-token importance ratio of the trained policy to the behaviour policy mu:

      ratio_t = pi_theta(y_t) / mu(y_t) = exp(logp_t - log mu_t),

    both under the sampler's logits transform (temperature, top-k, top-p).

    behaviour="generator" (default): mu is the policy that sampled the tokens, with the
      logprob the generator computed for each (`sampler_logp`): PPO's pi_theta / pi_theta_old
      with theta_old the policy that collected the data (Schulman et al. 2017), and ScaleRL's
      CISPO weight sg(min(pi_train(theta) / pi_gen(theta_old), eps_max)) (Khatri et al. 2025,
      arXiv 2510.13786). With asynchronous generation (PipelineRL: Piche et al. 2025, arXiv
      2509.19128) a batch's tokens come from older and possibly several policy versions; this
      is the ratio against the one that sampled each. The generator's numerics (precision,
      kernels) enter the ratio too, which is what ScaleRL's FP32 LM head reduces.
    behaviour="trainer": mu is the trainer's recomputation with the params at the start of
      the batch's update (`old_logp`, one more no-gradient forward pass per batch): AReaL's
      proximal policy (Fu et al. 2025, arXiv 2505.24298). The ratio is then a trust region
      around the proximal policy that does not correct for how the tokens were sampled; add
      `truncated_is` after the loss for that correction (Yao et al. 2025), which with
      `ppo_clip` is AReaL's decoupled PPO objective with a truncated behaviour weight.
    """
    term = _behaviour_term(behaviour)

    def fn(terms):
        require(terms, "logp", term, by="token_ratio")
        ratio = jnp.exp(terms["logp"] - sg(terms[term]))
        return {**terms, "ratio": ratio}

    return stateless(fn)


@register(
    "sequence_ratio",
    stage="loss",
    requires=("logp", _BEHAVIOUR, "mask"),
    provides=("ratio",),
)
def sequence_ratio(behaviour: str = "generator") -> Transform:
    """GSPO's sequence ratio, the geometric mean of the row's token ratios (Zheng et al. 2025),
    broadcast over the row's tokens:

      s_i = exp(mean_t (logp_t - log mu_t)),

    mu the behaviour policy as in `token_ratio`: the generator's logprobs (`sampler_logp`,
    default) or the trainer's recomputation at the start of the update (`old_logp`,
    behaviour="trainer"). Aggregate per sequence ("seq_mean_token_mean") so each sequence
    counts once."""
    term = _behaviour_term(behaviour)

    def fn(terms):
        require(terms, "logp", term, "mask", by="sequence_ratio")
        m = terms["mask"].astype(jnp.float32)
        log_r = jnp.sum((terms["logp"] - sg(terms[term])) * m, axis=1)
        s = jnp.exp(log_r / jnp.maximum(jnp.sum(m, axis=1), 1.0))
        return {**terms, "ratio": jnp.broadcast_to(s[:, None], m.shape)}

    return stateless(fn)


@register("ppo_clip", stage="loss", requires=("ratio", "advantage", "mask"), provides=("loss",))
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


@register(
    "cispo", stage="loss", requires=("ratio", "advantage", "logp", "mask"), provides=("loss",)
)
def cispo(
    eps_max: float | None = 4.0, eps_low: float | None = None, eps_high: float | None = None
) -> Transform:
    """CISPO: loss = -sg(w) * A * logp, a REINFORCE step reweighted by a clipped, detached IS
    weight, so every token keeps a gradient (MiniMax-M1: Chen et al. 2025).

    ScaleRL form (Khatri et al. 2025, arXiv 2510.13786): w = min(ratio, eps_max), pass only
    `eps_max`; with `token_ratio`'s default behaviour the ratio is pi_train(theta) /
    pi_gen(theta_old), against the generator's logprobs, as the paper defines it.
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


@register("policy_gradient", stage="loss", requires=("advantage", "logp"), provides=("loss",))
def policy_gradient() -> Transform:
    """REINFORCE: loss = -A * logp (Williams 1992); with RLOO advantages, RLOO."""

    def fn(terms):
        require(terms, "advantage", "logp", by="policy_gradient")
        return add_loss(terms, -sg(terms["advantage"]) * terms["logp"])

    return stateless(fn)


@register(
    "truncated_is",
    stage="loss",
    requires=("loss", "old_logp", "sampler_logp", "mask"),
    provides=("loss",),
)
def truncated_is(cap: float = 2.0, level: str = "token") -> Transform:
    """Truncated importance sampling against the sampler (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"): multiplies the per-token loss by
    sg(min(pi_old / pi_sampler, cap)), per token or per sequence (product over tokens), to
    correct for the mismatch between sampler and trainer numerics or policy lag. pi_old is
    the trainer's recomputation at the start of the update (`old_logp`), pi_sampler the
    generator's logprobs (`sampler_logp`).

    Pair it with a ratio against the trainer (`token_ratio(behaviour=trainer)`) or with no
    ratio (`policy_gradient`): a ratio against the generator (the default) already divides
    by pi_sampler, and this weight would correct for the sampler a second time.
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


@register(
    "kl_penalty", stage="loss", requires=("logp", "ref_logp", "mask", "update"), provides=("loss",)
)
def kl_penalty(coef: float | Callable = 0.001, estimator: str = "k3") -> Transform:
    """KL to the reference policy in the loss (GRPO): + coef * k_t per token, k the configured
    estimator of KL(pi || pi_ref) (`kl_estimate`). `coef` may be a schedule of the `update`
    term (optimizer updates applied so far, optax-style)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")

    def fn(terms):
        require(terms, "logp", "ref_logp", "mask", by="kl_penalty")
        c = schedule_value(coef, terms, by="kl_penalty")
        m = terms["mask"].astype(jnp.float32)
        kl = kl_estimate(terms["logp"], sg(terms["ref_logp"]), estimator)
        terms = add_loss(terms, c * kl)
        return add_metrics(terms, kl=masked_mean(kl, m), kl_coef=jnp.asarray(c))

    return stateless(fn)


@register(
    "kl_in_reward",
    stage="batch",
    requires=("old_logp", "ref_logp", "reward", "mask"),
    provides=("reward",),
)
def kl_in_reward(coef: float = 0.001, estimator: str = "k3") -> Transform:
    """KL to the reference policy subtracted from the reward before advantages (as in RLHF
    PPO): r_i -= coef * sum_t k_t over the row's tokens, k the configured estimator
    (`kl_estimate`) of the trained policy against the reference. The policy's logprobs are
    the trainer's at the start of the update (`old_logp`; in a synchronous run, the sampling
    policy): the penalty is about the policy being trained, not an importance weight, so it
    keeps the trainer's numerics rather than the generator's. Put it before the advantage
    transform in the chain."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")

    def fn(terms):
        require(terms, "old_logp", "ref_logp", "reward", "mask", by="kl_in_reward")
        m = terms["mask"].astype(jnp.float32)
        kl = kl_estimate(terms["old_logp"], sg(terms["ref_logp"]), estimator)
        kl_seq = jnp.sum(sg(kl) * m, axis=1)
        terms = {**terms, "reward": terms["reward"] - coef * kl_seq}
        return add_metrics(terms, kl=masked_mean(kl, m), kl_coef=jnp.asarray(coef))

    return stateless(fn)


@register("entropy_bonus", stage="loss", requires=("entropy", "mask", "update"), provides=("loss",))
def entropy_bonus(coef: float | Callable = 0.001) -> Transform:
    """Adds -coef * entropy_t to the per-token loss. `coef` may be a schedule of the `update`
    term (optimizer updates applied so far)."""

    def fn(terms):
        require(terms, "entropy", "mask", by="entropy_bonus")
        c = schedule_value(coef, terms, by="entropy_bonus")
        terms = add_loss(terms, -c * terms["entropy"])
        return add_metrics(terms, entropy=masked_mean(terms["entropy"], terms["mask"]))

    return stateless(fn)


@register("high_entropy_tokens", stage="loss", requires=("entropy", "mask"), provides=("mask",))
def high_entropy_tokens(rho: float = 0.2) -> Transform:
    """Keeps the loss only on the micro-batch's top-rho fraction of tokens by the current
    policy's entropy (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens
    Drive Effective Reinforcement Learning for LLM Reasoning", arXiv 2506.01939):

      mask_t <- mask_t * 1[H_t >= tau],  tau = the k-th largest entropy over the masked
                                         tokens, k = max(1, ceil(rho * #tokens)),

    so tokens tied with tau are all kept. It narrows `mask` for everything after it: place it
    before the policy loss. The aggregation then normalizes by the kept tokens, as the
    paper's objective (its Eq. 6 puts the indicator on the token-count normaliser too) and
    the authors' code do: the loss stays a mean over the tokens trained on, and rho = 1 is
    the plain objective. The aggregation applies the narrowed mask to the whole per-token
    loss, so a KL or entropy term in the same chain also counts only the kept tokens (the
    paper, on DAPO, has neither). The entropy is data (no gradient); the selection is per
    micro-batch, as in the authors' code, so it depends on the learner's micro-batches
    (`learner.pack_rows`).
    """
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho={rho} must be in (0, 1]")

    def fn(terms):
        require(terms, "entropy", "mask", by="high_entropy_tokens")
        mask = terms["mask"]
        h = sg(terms["entropy"]).astype(jnp.float32)
        n = jnp.sum(mask.astype(jnp.int32))
        # ceil as the authors' code writes it, robust to rho * n landing just above an integer.
        k = jnp.maximum(jnp.floor(n * rho + 0.9999).astype(jnp.int32), 1)
        ranked = -jnp.sort(-jnp.where(mask > 0, h, -jnp.inf).reshape(-1))  # Descending.
        tau = ranked[k - 1]
        keep = (mask > 0) & (h >= tau)
        return add_metrics(
            {**terms, "mask": keep.astype(mask.dtype)},
            high_entropy_frac=jnp.sum(keep) / jnp.maximum(n, 1),
            high_entropy_threshold=jnp.where(n > 0, tau, 0.0),
        )

    return stateless(fn)
