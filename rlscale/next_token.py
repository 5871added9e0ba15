"""Next-token training's loss, as the one supervised loop (`supervised`) trains with it: the
supervised warm start (`warm_start`) and the benchmarks. Dimension letters: B batch, T
tokens, V vocab.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlscale.model import decoder


class Batch(NamedTuple):
    """Token ids [B, T], which are real [B, T], and which are targets [B, T] (None: every
    real token after the first)."""

    tokens_BT: jax.Array
    mask_BT: jax.Array
    target_mask_BT: jax.Array | None = None


def loss(graphdef, params, tokens_BT, mask_BT, target_mask_BT=None):
    """Mean cross-entropy of token t+1 given tokens <= t, over positions where both are real
    (and, with `target_mask_BT`, where token t+1 is a target: e.g. only completions in SFT).

    Returns (sum of token losses, number of predicted tokens), so callers that accumulate over
    micro-batches normalize once.
    """
    positions = decoder.positions_from_mask(mask_BT)
    logits_BTV, _ = decoder.forward(graphdef, params, tokens_BT, positions, mask_BT)
    # Targets shifted left; the last position predicts nothing (weight 0). Shifting the small
    # targets rather than slicing the [B, T, V] logits avoids copying the logits.
    target_BT = jnp.roll(tokens_BT, -1, axis=1)
    weight_BT = mask_BT & jnp.roll(mask_BT, -1, axis=1)
    if target_mask_BT is not None:
        weight_BT = weight_BT & jnp.roll(target_mask_BT, -1, axis=1)
    weight_BT = weight_BT.at[:, -1].set(False).astype(jnp.float32)
    logits_BTV = logits_BTV.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits_BTV, target_BT[..., None], axis=-1)[..., 0]
    nll_BT = jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit
    return jnp.sum(nll_BT * weight_BT), jnp.sum(weight_BT)


def batch_loss(graphdef, params, batch: Batch):
    """`loss` of a `Batch`, as `supervised.train_step` reads a loss: (sum, count, metrics),
    `tokens` the number of predicted tokens."""
    total, count = loss(graphdef, params, *batch)
    return total, count, {"tokens": count}
