"""Loss aggregation: per-token losses to (loss_sum, denominator), additive over micro-batches.

The optimizer step's loss is sum(loss_sum) / sum(denominator) over its micro-batches, so
normalization happens exactly once, whatever the split (micro-batches must hold whole groups
for "prompt_mean").
"""

import jax.numpy as jnp

from rlscale.objectives.core import Transform, require, stateless
from rlscale.objectives.registry import register

MODES = ("token_mean", "seq_mean_token_mean", "seq_sum", "prompt_mean")


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

    Rows (and prompts) without tokens count in no denominator.
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
            group_tokens = row_tokens.reshape(-1, group_size).sum(axis=1)
            total = jnp.sum(group_loss / jnp.maximum(group_tokens, 1.0))
            denom = jnp.sum((group_tokens > 0).astype(jnp.float32))
        return {**terms, "loss_sum": total, "denominator": denom}

    return stateless(fn)
