"""Preference losses, each a whole loss stage: DPO, IPO and SimPO on pairs (rows 2p chosen, 2p + 1
rejected), KTO on labelled rows. Formulas: docs/objectives.md.

Arrays are [N, M]: N = B * G rows (prompt-major), M completion tokens; B = N / 2 pairs
(G = 2) in the pair losses.
"""

import jax
import jax.numpy as jnp

from rlscale.objectives.core import Transform, add_metrics, require, stateless
from rlscale.objectives.registry import register

sg = jax.lax.stop_gradient


def _row_sums(x_NM, mask_NM):
    """sum_t mask * x per row, and |y| = sum_t mask. `where`, not a product, so a value in a
    masked position (padding) never reaches the sum or its gradient."""
    m = mask_NM > 0
    return jnp.sum(jnp.where(m, x_NM, 0.0), axis=1), jnp.sum(m, axis=1).astype(jnp.float32)


def _log_ratio(terms, by: str):
    """s_i = sum_t mask (logp - sg(ref_logp)) and |y_i|."""
    require(terms, "logp", "ref_logp", "mask", by=by)
    return _row_sums(terms["logp"] - sg(terms["ref_logp"]), terms["mask"])


def _pairs(x_N, by: str):
    """Rows 0, 2, 4, ... (chosen) and 1, 3, 5, ... (rejected)."""
    n = x_N.shape[0]
    if n % 2:
        raise ValueError(
            f"{by}: {n} rows are not whole preference pairs (groups of 2 rows: chosen, rejected)"
        )
    x_B2 = x_N.reshape(n // 2, 2)
    return x_B2[:, 0], x_B2[:, 1]


def _check_pairs(name: str, group_size: int):
    if group_size != 2:
        raise ValueError(
            f"{name}: group_size={group_size}: preference pairs are groups of 2 rows (row 2p "
            "chosen, row 2p + 1 rejected); set batch.group_size = 2"
        )


def _positive(name: str, **values):
    for k, v in values.items():
        if not v > 0:
            raise ValueError(f"{name}: {k}={v} must be > 0")


def _reduce_pairs(terms, loss_B, tokens_N, by: str, reward_c_B, reward_r_B):
    """`loss_sum` over the pairs with tokens on both sides, `denominator` their number, and
    the implicit-reward metrics over them."""
    tokens_c, tokens_r = _pairs(tokens_N, by)
    valid_B = (tokens_c > 0) & (tokens_r > 0)
    v = valid_B.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(v), 1.0)
    margin_B = reward_c_B - reward_r_B
    terms = {
        **terms,
        "loss_sum": jnp.sum(jnp.where(valid_B, loss_B, 0.0)),
        "denominator": jnp.sum(v),
    }
    return add_metrics(
        terms,
        implicit_reward_chosen=jnp.sum(v * reward_c_B) / n,
        implicit_reward_rejected=jnp.sum(v * reward_r_B) / n,
        implicit_reward_margin=jnp.sum(v * margin_B) / n,
        implicit_reward_accuracy=jnp.sum(v * (margin_B > 0)) / n,
    )


@register(
    "dpo",
    stage="loss",
    requires=("logp", "ref_logp", "mask"),
    provides=("loss_sum", "denominator"),
)
def dpo(beta: float = 0.1, label_smoothing: float = 0.0, group_size: int = 2) -> Transform:
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290), per pair:

      loss = -log sigmoid(beta h),   h = s_c - s_r,

    and with label_smoothing eps the conservative DPO form (cDPO: Mitchell 2023, as in TRL),
    for preference labels flipped with probability eps:

      loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).

    d loss / d s_c = -d loss / d s_r = -beta ((1 - eps) sigmoid(-beta h) - eps sigmoid(beta h)),
    so each token of the chosen row gets that weight times its mask. Implicit reward: beta s_i.
    """
    _check_pairs("dpo", group_size)
    _positive("dpo", beta=beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo: label_smoothing={label_smoothing} must be in [0, 0.5)")

    def fn(terms):
        s_N, tokens_N = _log_ratio(terms, by="dpo")
        s_c, s_r = _pairs(s_N, by="dpo")
        z = beta * (s_c - s_r)
        loss_B = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z)
        if label_smoothing:
            loss_B = loss_B - label_smoothing * jax.nn.log_sigmoid(-z)
        return _reduce_pairs(terms, loss_B, tokens_N, "dpo", beta * s_c, beta * s_r)

    return stateless(fn)


@register(
    "ipo",
    stage="loss",
    requires=("logp", "ref_logp", "mask"),
    provides=("loss_sum", "denominator"),
)
def ipo(tau: float = 0.1, group_size: int = 2) -> Transform:
    """Identity Preference Optimization (Azar et al. 2023, "A General Theoretical Paradigm to
    Understand Learning from Human Preferences", arXiv 2310.12036), per pair:

      loss = (h_bar - 1 / (2 tau))^2,   h_bar = s_c / |y_c| - s_r / |y_r|,

    a regression of the margin onto 1 / (2 tau), so its minimum (0) is at h_bar = 1 / (2 tau)
    and a smaller tau asks for a larger margin (weaker regularization to the reference).

    The margin uses per-token-averaged log-ratios, as TRL's IPO does, where the paper writes
    the log-ratios of whole sequences: with sums the fixed target 1 / (2 tau) would mean a
    different per-token push for every completion length (a long pair reaches it with a
    small per-token change, a short one needs a large one), so one tau could not suit a
    batch of ragged lengths; averaged, tau means the same at every length, and values tuned
    with TRL carry over. Implicit reward: the averaged log-ratio s_i / |y_i|, so
    `implicit_reward_margin` is h_bar, whose target is 1 / (2 tau).
    """
    _check_pairs("ipo", group_size)
    _positive("ipo", tau=tau)

    def fn(terms):
        s_N, tokens_N = _log_ratio(terms, by="ipo")
        s_bar_c, s_bar_r = _pairs(s_N / jnp.maximum(tokens_N, 1.0), by="ipo")
        loss_B = jnp.square(s_bar_c - s_bar_r - 1.0 / (2.0 * tau))
        return _reduce_pairs(terms, loss_B, tokens_N, "ipo", s_bar_c, s_bar_r)

    return stateless(fn)


@register("simpo", stage="loss", requires=("logp", "mask"), provides=("loss_sum", "denominator"))
def simpo(beta: float = 2.0, gamma: float = 0.5, group_size: int = 2) -> Transform:
    """Simple Preference Optimization (Meng et al. 2024, arXiv 2405.14734), reference free
    and length normalized, per pair:

      loss = -log sigmoid(r_c - r_r - gamma),   r_i = (beta / |y_i|) sum_t mask_it logp_it,

    gamma the target reward margin. It reads no `ref_logp`, so the learner runs no reference
    model for it. Implicit reward: r_i (the margin metric is r_c - r_r, without gamma).
    """
    _check_pairs("simpo", group_size)
    _positive("simpo", beta=beta)

    def fn(terms):
        require(terms, "logp", "mask", by="simpo")
        logp_N, tokens_N = _row_sums(terms["logp"], terms["mask"])
        r_c, r_r = _pairs(beta * logp_N / jnp.maximum(tokens_N, 1.0), by="simpo")
        loss_B = -jax.nn.log_sigmoid(r_c - r_r - gamma)
        return _reduce_pairs(terms, loss_B, tokens_N, "simpo", r_c, r_r)

    return stateless(fn)


@register(
    "kto",
    stage="loss",
    requires=("logp", "ref_logp", "mask", "correct"),
    provides=("loss_sum", "denominator"),
)
def kto(
    beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
) -> Transform:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv 2402.01306), on unpaired
    rows labelled desirable (`correct` true) or undesirable, with r_i = s_i:

      loss_i = w_D (1 - sigmoid(beta (r_i - z0)))   desirable,
      loss_i = w_U (1 - sigmoid(beta (z0 - r_i)))   undesirable,

    loss_sum = sum_i loss_i over rows with tokens, denominator = their number. Any group
    size works: rows are not paired.

    The reference point z0 estimates KL(pi_theta || pi_ref) and carries no gradient:

      z0 = max(0, sg(mean_i s_i)) over the micro-batch's rows with tokens.

    The rows are sampled from the policy (the generator's, the trained one up to policy lag),
    so mean_i s_i is the Monte Carlo (k1) estimate of the sequence-level KL; the paper and TRL
    instead score each prompt with another example's completion (mismatched pairs), because
    offline preference data is not sampled from the policy, which costs extra forward passes
    here for no better estimate. As in the paper the estimate is clamped at 0. It is a
    statistic of the micro-batch, as TRL's is of its batch, so the loss (not its form)
    depends on the learner's micro-batches (`learner.pack_rows`). Metrics: `kto_z0`, the
    fraction of desirable rows
    `kto_desirable_frac`, and the mean implicit reward beta s_i of each label
    (`implicit_reward_desirable`, `implicit_reward_undesirable`).
    """
    _positive("kto", beta=beta)
    for k, v in (
        ("desirable_weight", desirable_weight),
        ("undesirable_weight", undesirable_weight),
    ):
        if not v >= 0:
            raise ValueError(f"kto: {k}={v} must be >= 0")

    def fn(terms):
        require(terms, "correct", by="kto")
        s_N, tokens_N = _log_ratio(terms, by="kto")
        has = (tokens_N > 0).astype(jnp.float32)
        n = jnp.maximum(jnp.sum(has), 1.0)
        z0 = jnp.maximum(sg(jnp.sum(has * s_N) / n), 0.0)
        desirable = terms["correct"].astype(bool)
        loss_N = jnp.where(
            desirable,
            desirable_weight * (1.0 - jax.nn.sigmoid(beta * (s_N - z0))),
            undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (z0 - s_N))),
        )
        d = has * desirable
        u = has * ~desirable
        terms = {**terms, "loss_sum": jnp.sum(has * loss_N), "denominator": jnp.sum(has)}
        return add_metrics(
            terms,
            kto_z0=z0,
            kto_desirable_frac=jnp.sum(d) / n,
            implicit_reward_desirable=jnp.sum(d * beta * s_N) / jnp.maximum(jnp.sum(d), 1.0),
            implicit_reward_undesirable=jnp.sum(u * beta * s_N) / jnp.maximum(jnp.sum(u), 1.0),
        )

    return stateless(fn)
