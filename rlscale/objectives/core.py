"""The transform contract, `Transform(init, update)` over a dict of per-token terms, and `chain`, as
in optax. A loss ends in an aggregation whose (loss_sum, denominator) add exactly over
micro-batches. The terms: docs/objectives.md.

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
