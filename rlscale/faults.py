"""Numeric faults: skip an optimizer step whose loss or gradients are not finite.

One NaN in a gradient would otherwise reach every parameter through Adam's moments and end the
run silently. Inside the jitted update, `guarded_update` applies the step only when the loss
and the global gradient norm are finite, and otherwise returns the state unchanged, bit for bit;
on the host, `SkipCounter` stops the run with a clear error when steps keep being skipped.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from rlscale import sections

State = TypeVar("State")


@dataclasses.dataclass(frozen=True)
class FaultConfig(sections.Section):
    """`config.faults`: non-finite updates in a row before the run stops."""

    max_consecutive_skips: int = 3

    def problems(self) -> list[str]:
        return sections.at_least("faults.max_consecutive_skips", self.max_consecutive_skips, 1)


def global_norm(tree) -> jax.Array:
    """sqrt(sum of squares) over every leaf, in float32 (inf or NaN if any entry is)."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.float32(0)))


def is_finite_step(loss, grads) -> jax.Array:
    """True where `loss` and the global norm of `grads` are both finite.

    A NaN or inf anywhere in `grads` makes the norm non-finite; so does a norm that overflows
    float32 (above ~1.8e19), which is no usable update either.
    """
    return jnp.isfinite(loss).all() & jnp.isfinite(global_norm(grads))


def guarded_update(
    grads, loss, apply_fn: Callable[[Any, State], State], state: State
) -> tuple[State, jax.Array]:
    """`apply_fn(grads, state)` if the step is finite, else `state` unchanged; for use in jit.

    Example (inside the jitted train step):
        def apply(grads, state):
            params, opt_state = state
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        (params, opt_state), ok = faults.guarded_update(grads, loss, apply, (params, opt_state))

    Whatever must advance on every step, skipped or not (the step counter, the RNG), belongs
    outside `state`. On a skipped step the optimizer's own count does not advance either, so
    learning-rate schedules count applied updates.

    Args:
        grads: The gradient pytree.
        loss: The scalar loss the gradients come from.
        apply_fn: `(grads, state) -> new state`, the normal update.
        state: Everything the update changes (params, optimizer state).

    Returns:
        (new state, ok): `ok` is a bool scalar, False when the step was skipped.
    """
    ok = is_finite_step(loss, grads)
    new_state = jax.lax.cond(ok, lambda s: apply_fn(grads, s), lambda s: s, state)
    return new_state, ok


class SkipCounter:
    """Counts consecutive skipped (non-finite) updates on the host; raises past a limit.

    Example:
        skips = SkipCounter(max_consecutive=config.max_skipped_steps)
        ...
        state, ok = train_step(state, batch)
        skips.update(bool(ok), step, last_checkpoint=ckpt.latest_step())

    Args:
        max_consecutive: Raise when this many updates in a row were skipped (at least 1).
    """

    def __init__(self, max_consecutive: int):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0  # Skipped updates since the last applied one.
        self.total = 0  # Skipped updates in this process's lifetime.

    def update(self, ok: bool, step: int, last_checkpoint: int | None = None) -> int:
        """Records one update; returns the current number of consecutive skips.

        Args:
            ok: Whether the update at `step` was applied.
            step: The step of that update.
            last_checkpoint: The newest saved checkpoint's step, for the error message.

        Raises:
            RuntimeError: `max_consecutive` updates in a row were skipped.
        """
        if ok:
            self.consecutive = 0
            return 0
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.max_consecutive:
            where = (
                f"the last good checkpoint is step {last_checkpoint}"
                if last_checkpoint is not None
                else "no checkpoint has been saved yet"
            )
            raise RuntimeError(
                f"{self.consecutive} consecutive non-finite updates (last at step {step}); "
                f"{where}. Skipped updates leave the parameters unchanged, so the fault persists "
                "across batches: resume from that checkpoint with a lower learning rate or "
                "another seed, or inspect the last batches."
            )
        return self.consecutive
