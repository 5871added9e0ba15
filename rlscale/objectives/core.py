"""The objective-transform contract: `Transform(init, update)` and `chain`, as in optax.

A transform acts on `terms`, a dict of arrays for one (micro-)batch of N = B * G sampled rows
laid out prompt-major (row = prompt * G + sample) with M completion tokens each:

  inputs   reward [N], correct [N], mask [N, M], row_weight [N], sampler_logp [N, M],
           old_logp [N, M], old_value [N, M], ref_logp [N, M], teacher_logp [N, M] (a
           distillation teacher's, from the rollout stage); in the loss stage also
           logp [N, M] (differentiable), entropy [N, M], value [N, M] (differentiable) and
           update (scalar int32: optimizer updates applied so far)
  outputs  advantage [N, M], returns [N, M], ratio [N, M], loss [N, M] (per-token loss,
           transforms add to it), loss_sum and denominator (scalars, from `aggregate`),
           metrics (dict)

Each transform reads only what it declares (`registry.register`). `update(terms, state) ->
(terms, state)` returns a new dict; `init() -> state`. A loss is a chain ending in an
aggregation, whose (loss_sum, denominator) are both additive over micro-batches holding whole
groups, so accumulation normalizes once per optimizer step: loss = sum(loss_sum) /
sum(denominator).

Dimension letters: B prompts, G samples per prompt, N = B * G rows, M completion tokens.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

Terms = dict[str, Any]


class Transform(NamedTuple):
    init: Callable[[], Any]
    update: Callable[[Terms, Any], tuple[Terms, Any]]


class EmptyState(NamedTuple):
    pass


def stateless(fn: Callable[[Terms], Terms]) -> Transform:
    """A transform without state from a function of the terms."""
    return Transform(EmptyState, lambda terms, state: (fn(terms), state))


def chain(*transforms: Transform) -> Transform:
    """Applies transforms in order, each seeing the previous one's terms (optax.chain)."""

    def init():
        return tuple(t.init() for t in transforms)

    def update(terms, state):
        new_state = []
        for t, s in zip(transforms, state, strict=True):
            terms, s = t.update(terms, s)
            new_state.append(s)
        return terms, tuple(new_state)

    return Transform(init, update)


def require(terms: Terms, *names: str, by: str):
    missing = [n for n in names if n not in terms]
    if missing:
        raise KeyError(f"{by} needs term(s) {missing}; present: {sorted(terms)}")


def masked_mean(x, mask):
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def add_metrics(terms: Terms, **metrics) -> Terms:
    return {**terms, "metrics": {**terms.get("metrics", {}), **metrics}}


def add_loss(terms: Terms, loss_NM) -> Terms:
    return {**terms, "loss": terms.get("loss", 0.0) + loss_NM}


def schedule_value(coef: float | Callable, terms: Terms, by: str):
    """A coefficient given as a number, or as a schedule of the `update` term (optimizer
    updates applied so far, optax-style)."""
    if not callable(coef):
        return coef
    require(terms, "update", by=by)
    return coef(terms["update"])
