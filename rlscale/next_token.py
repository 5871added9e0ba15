"""Next-token training: the loss, the train state and a jitted train step.

Used by the benchmarks and by the supervised warm start (`warm_start`). Dimension letters:
B batch, T tokens, V vocab.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from rlscale.model import decoder


class TrainState(NamedTuple):
    params: object
    opt_state: optax.OptState
    step: jax.Array


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


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


def make_train_step(graphdef, optimizer: optax.GradientTransformation, donate: bool = True):
    """A jitted `train_step(state, tokens_BT, mask_BT, target_mask_BT=None) -> (state, metrics)`."""

    def train_step(state: TrainState, tokens_BT, mask_BT, target_mask_BT=None):
        def loss_fn(params):
            total, count = loss(graphdef, params, tokens_BT, mask_BT, target_mask_BT)
            return total / jnp.maximum(count, 1.0), count

        (mean_loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": mean_loss, "tokens": count, "grad_norm": optax.tree.norm(grads)}
        return TrainState(params, opt_state, state.step + 1), metrics

    return jax.jit(train_step, donate_argnums=(0,) if donate else ())
