"""The optimizer of every trained model (the RL learner, the reward model): AdamW with warmup,
a constant or cosine schedule and global-norm clipping, and float32 master weights under
low-precision params."""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rlscale import sections

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig(sections.Section):
    """`config.optim`: AdamW's settings, its warmup and schedule, and the clipping norm."""

    lr: float = 1e-4
    warmup_steps: int = 5
    schedule: str = "constant"
    decay_steps: int = 1000
    final_lr_frac: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0

    def problems(self) -> list[str]:
        problems = []
        if not isinstance(self.lr, (int, float)) or self.lr < 0:
            problems.append(f"optim.lr={self.lr!r} must be a number >= 0")
        if self.schedule not in SCHEDULES:
            problems.append(f"optim.schedule={self.schedule!r} is not 'constant' or 'cosine'")
        return problems


def make_optimizer(c, params=None) -> optax.GradientTransformation:
    """AdamW with warmup, a constant or cosine schedule and global-norm clipping
    (an `OptimConfig`, or any object with its fields). With low-precision `params`
    (bfloat16), it keeps float32 master weights and float32 moments (`master_weights`)."""
    warmup = optax.linear_schedule(0.0, c.lr, max(c.warmup_steps, 1))
    if c.schedule == "cosine":
        main = optax.cosine_decay_schedule(c.lr, max(c.decay_steps, 1), alpha=c.final_lr_frac)
    elif c.schedule == "constant":
        main = optax.constant_schedule(c.lr)
    else:
        raise ValueError(f"optim.schedule={c.schedule!r} is not 'constant' or 'cosine'")
    lr = optax.join_schedules([warmup, main], [c.warmup_steps])
    optimizer = optax.chain(
        optax.clip_by_global_norm(c.grad_clip),
        optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay),
    )
    low = [x for x in jax.tree.leaves(params) if jnp.dtype(x.dtype) != jnp.float32]
    return master_weights(optimizer) if low else optimizer


class MasterState(NamedTuple):
    master: Any  # float32 copies of the params.
    inner: Any  # The wrapped optimizer's state, over the float32 copies.


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Mixed-precision training: low-precision (bfloat16) params for the forward and backward
    passes, float32 master weights and optimizer state (Micikevicius et al. 2018, "Mixed
    Precision Training").

    The wrapped optimizer sees float32 gradients and updates the float32 masters; the update
    it returns moves each low-precision param exactly onto its master rounded to the param's
    dtype (the difference is taken in float32, where it is exact, and `optax.apply_updates`
    adds it in float32 before casting back). Small updates accumulate in the masters instead
    of vanishing in bfloat16 rounding.
    """

    def init(params):
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return MasterState(master, inner.init(master))

    def update(grads, state, params=None):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        to_master = jax.tree.map(
            lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32),
            master,
            params,
        )
        return to_master, MasterState(master, inner_state)

    return optax.GradientTransformation(init, update)
