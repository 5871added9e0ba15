"""Loss aggregation: per-token losses to (loss_sum, denominator), additive over micro-batches.

The optimizer step's loss is sum(loss_sum) / sum(denominator) over its micro-batches, so
normalization happens exactly once, whatever the split. "prompt_mean" divides a group's loss
by the group's token count: where a micro-batch may hold part of a group
(`batch_layout.Layout.split_groups`), the learner gives it that count over the whole
optimizer step (`group_terms`), so each part contributes exactly its share; otherwise it
counts the tokens of the whole groups each micro-batch holds.

Dimension letters: N rows, M completion tokens, B groups, G samples per group.
"""

import jax.numpy as jnp

from rlscale.objectives.core import Transform, require, stateless
from rlscale.objectives.registry import register

MODES = ("token_mean", "seq_mean_token_mean", "seq_sum", "prompt_mean")
# The terms `group_terms` adds before the micro-batch loop where a micro-batch may hold part
# of a group; "prompt_mean" reads them when present.
GROUP_TERMS = ("group_tokens", "group_lead")


def group_terms(mask_NM, group_size: int) -> dict:
    """Per row, computed once per optimizer step from the mask the loss stage receives:
    `group_tokens` [N], its group's token count, and `group_lead` [N], 1.0 on the first row
    of each group with a token (it alone counts the group in a denominator), else 0."""
    m = mask_NM.astype(jnp.float32)
    tokens_BG = jnp.sum(m, axis=1).reshape(-1, group_size)
    has_BG = (tokens_BG > 0).astype(jnp.int32)
    lead_BG = has_BG * (jnp.cumsum(has_BG, axis=1) == 1)
    group_B = jnp.sum(tokens_BG, axis=1)
    return {
        "group_tokens": jnp.repeat(group_B, group_size),
        "group_lead": lead_BG.reshape(-1).astype(jnp.float32),
    }


@register(
    "aggregate", stage="loss", requires=("loss", "mask"), provides=("loss_sum", "denominator")
)
def aggregate(mode: str, group_size: int | None = None, max_len: int | None = None) -> Transform:
    """Reduces the per-token `loss` with `mask`:

    token_mean           sum_it l / sum_it 1                       (DAPO: Yu et al. 2025)
    seq_mean_token_mean  sum_i (sum_t l / |o_i|) / #rows            (GRPO: Shao et al. 2024)
    seq_sum              sum_it l / (#rows * max_len)               (Dr.GRPO: Liu et al. 2025;
                                                                    max_len defaults to M)
    prompt_mean          sum_p (sum_{i in p, t} l / #tokens_p) / #prompts
                                                                    (ScaleRL: Khatri et al. 2025)

    Rows (and prompts) without tokens count in no denominator. With the `GROUP_TERMS`
    present, prompt_mean's #tokens_p is `group_tokens` (the whole group's, wherever its rows
    run) and a prompt counts once, in the micro-batch holding its `group_lead` row.
    """
    if mode not in MODES:
        raise ValueError(f"aggregation {mode!r} is not one of {MODES}")
    if mode == "prompt_mean" and not group_size:
        raise ValueError("aggregate('prompt_mean') needs group_size")

    def fn(terms):
        require(terms, "loss", "mask", by="aggregate")
        m = terms["mask"].astype(jnp.float32)
        loss = jnp.broadcast_to(terms["loss"], m.shape) * m
        row_tokens = jnp.sum(m, axis=1)
        has_tokens = (row_tokens > 0).astype(jnp.float32)
        if mode == "token_mean":
            total, denom = jnp.sum(loss), jnp.sum(m)
        elif mode == "seq_mean_token_mean":
            total = jnp.sum(jnp.sum(loss, axis=1) / jnp.maximum(row_tokens, 1.0))
            denom = jnp.sum(has_tokens)
        elif mode == "seq_sum":
            total = jnp.sum(loss)
            denom = jnp.sum(has_tokens) * float(max_len or m.shape[1])
        else:
            if m.shape[0] % group_size:
                raise ValueError(f"{m.shape[0]} rows are not whole groups of {group_size}")
            group_loss = jnp.sum(loss, axis=1).reshape(-1, group_size).sum(axis=1)
            if "group_tokens" in terms:  # The step's count: a group may span micro-batches.
                group_tokens = terms["group_tokens"].reshape(-1, group_size)[:, 0]
                denom = jnp.sum(terms["group_lead"] * has_tokens)
            else:
                group_tokens = row_tokens.reshape(-1, group_size).sum(axis=1)
                denom = jnp.sum((group_tokens > 0).astype(jnp.float32))
            total = jnp.sum(group_loss / jnp.maximum(group_tokens, 1.0))
        return {**terms, "loss_sum": total, "denominator": denom}

    return stateless(fn)
