"""The one supervised training loop: a per-example loss and a stream of batches in, params
out. The SFT warm start (`warm_start`, the loss `next_token.batch_loss`), the Bradley-Terry
reward model (`bradley_terry.loss`) and the PRM (`prm.loss`) all train through it.

A `Fit` names what the step is compiled for: the loss, the static description of the
forward pass it reads, and the optimizer's settings (`optim.OptimConfig`: every optimizer is
`optim.make_optimizer`'s). `train_step` is one module-level jitted step over a `TrainState`;
`fit` runs it, calling back every `every` steps (held-out evaluation, early stopping).

A loss is a module-level function `loss(forward, params, batch) -> (loss_sum, denominator,
metrics)`: the sum over the batch's examples and its denominator (`next_token.loss`'s and the
objectives' convention, so accumulation stays exact), and per-batch metrics of its own. The
step minimizes loss_sum / max(denominator, 1).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import tqdm
from absl import logging

from rlscale import optim, sharding


class Fit(NamedTuple):
    """What a supervised step is compiled for (hashable: a jit static argument).

    Attributes:
      loss: `loss(forward, params, batch) -> (loss_sum, denominator, metrics)`, a
        module-level function.
      forward: what `loss` computes its forward pass with (a graphdef, a
        `decoder.ForwardSpec`); hashable.
      optim: the optimizer's settings (`optim.OptimConfig`).
      frozen: param keys that get no update and no optimizer state (`make_optimizer`).
    """

    loss: Callable
    forward: Any
    optim: optim.OptimConfig
    frozen: tuple[str, ...] = ()

    def optimizer(self, params=None) -> optax.GradientTransformation:
        return optim.make_optimizer(self.optim, params, self.frozen)


class TrainState(NamedTuple):
    params: Any
    opt_state: optax.OptState
    step: jax.Array


def init_state(fit: Fit, params) -> TrainState:
    """The state at step 0: `params` with a fresh optimizer state, whose leaves that the
    params' placement does not decide (the step counts) are replicated on the params' mesh, so
    every call of `train_step` sees the same input shardings and compiles once."""
    opt_state = fit.optimizer(params).init(params)
    mesh = _mesh(params)
    if mesh is not None:
        opt_state = sharding.replicate_unplaced(opt_state, mesh)
    # `train_step` donates the state: no buffer in it twice.
    return sharding.distinct_buffers(TrainState(params, opt_state, jnp.zeros((), jnp.int32)))


def _mesh(params):
    for x in jax.tree.leaves(params):
        if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding):
            return x.sharding.mesh
    return None


@functools.partial(jax.jit, static_argnames=("fit",), donate_argnames=("state",))
def train_step(fit: Fit, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One optimizer step on loss_sum / max(denominator, 1) of `batch`. Returns the new state
    and the metrics: `loss` (that mean), `grad_norm` (before clipping) and the loss's own,
    all before the update."""

    def mean_loss(params):
        total, count, metrics = fit.loss(fit.forward, params, batch)
        return total / jnp.maximum(count, 1.0), metrics

    (loss, metrics), grads = jax.value_and_grad(mean_loss, has_aux=True)(state.params)
    updates, opt_state = fit.optimizer(state.params).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, **metrics, "grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state, state.step + 1), metrics


class Progress(NamedTuple):
    """Where a `fit` stands at a callback: the step just taken, the mean training loss over
    the steps since the previous callback, and that step's metrics (`train_step`'s)."""

    step: int
    mean_loss: float
    metrics: dict


def fit(
    spec: Fit,
    params,
    next_batch: Callable[[], Any],
    steps: int,
    *,
    every: int,
    callback: Callable[[Any, Progress], bool | None] | None = None,
    label: str = "",
) -> tuple[Any, Progress]:
    """Up to `steps` steps of `train_step` on `next_batch()`, from `params`. Every `every`
    steps and at the last, `callback(params, progress)`; it returning True stops the fit
    there (early stopping). With a `label`, a progress line between the callbacks every
    `max(every // 6, 25)` steps (`label step N/steps loss L (elapsed, ETA)`, the loss the
    mean since the last line or callback), so a long fit is not silent between its
    evaluations. Returns (params, the last `Progress`)."""
    state = init_state(spec, params)
    loss_sum, since, progress = jnp.zeros((), jnp.float32), 0, None
    start, line_every, mark = time.perf_counter(), max(every // 6, 25), (0.0, 0)
    for step in range(1, steps + 1):
        state, metrics = train_step(spec, state, next_batch())
        loss_sum, since = loss_sum + metrics["loss"], since + 1
        if step % every == 0 or step == steps:
            progress = Progress(step, float(loss_sum) / since, metrics)
            loss_sum, since, mark = jnp.zeros((), jnp.float32), 0, (0.0, 0)
            if callback is not None and callback(state.params, progress):
                break
        elif label and step % line_every == 0:
            elapsed, total = time.perf_counter() - start, float(loss_sum)
            logging.info(
                "%s step %d/%d loss %.3f (%s elapsed, ETA %s)",
                label,
                step,
                steps,
                (total - mark[0]) / (since - mark[1]),  # Since the last line or callback.
                tqdm.tqdm.format_interval(elapsed),
                tqdm.tqdm.format_interval(elapsed * (steps - step) / step),
            )
            mark = (total, since)
    return state.params, progress
