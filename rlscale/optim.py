"""The optimizer of every trained model (the RL learner, the SFT warm start, the reward model
and the PRM): AdamW with warmup, a constant or cosine schedule and global-norm clipping,
float32 master weights under low-precision params, and optionally parts of the params frozen.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rlscale import sections

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig(sections.Section):
    """`make_optimizer`'s settings, with the names and meaning of the RL config's `optim`
    section (which sets every one); frozen (hashable), so a jitted step can take them as a
    static argument. The defaults are AdamW's.

    Attributes:
      lr: the peak learning rate, reached after `warmup_steps` of linear warmup from 0.
      warmup_steps: steps of linear warmup.
      schedule: after the warmup, "constant" or "cosine" (decayed over `decay_steps` to
        `final_lr_frac` x lr, then held).
      decay_steps, final_lr_frac: the cosine decay.
      grad_clip: the global-norm clip of the gradients.
      b1, b2, eps, weight_decay: AdamW's.
    """

    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: str = "constant"
    decay_steps: int = 1000
    final_lr_frac: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def problems(self) -> list[str]:
        problems = []
        if not isinstance(self.lr, (int, float)) or self.lr < 0:
            problems.append(f"optim.lr={self.lr!r} must be a number >= 0")
        if self.schedule not in SCHEDULES:
            problems.append(f"optim.schedule={self.schedule!r} is not 'constant' or 'cosine'")
        return problems

    @classmethod
    def of(cls, c) -> "OptimConfig":
        """The settings of `c`, any object with these fields (a `scalar_head.TrainSettings`)."""
        return cls(**{f.name: getattr(c, f.name) for f in dataclasses.fields(cls)})


def warmup_cosine(lr: float, steps: int, weight_decay: float = 1e-4) -> OptimConfig:
    """The SFT warm start's schedule: linear warmup over min(20, steps // 2) steps, then a
    cosine decay to lr / 10 at `steps`; AdamW's default moments and weight decay, clipped at
    global norm 1 (the chain `optax.warmup_cosine_decay_schedule` + `optax.adamw` builds)."""
    warmup = min(20, steps // 2)
    return OptimConfig(
        lr=lr,
        warmup_steps=warmup,
        schedule="cosine",
        decay_steps=steps - warmup,
        final_lr_frac=0.1,
        weight_decay=weight_decay,
    )


def make_optimizer(c, params=None, frozen: tuple[str, ...] = ()) -> optax.GradientTransformation:
    """AdamW with warmup, a constant or cosine schedule and global-norm clipping (`c`: an
    `OptimConfig`, or anything with its fields). With low-precision `params` (bfloat16), it
    keeps float32 master weights and float32 moments (`master_weights`). Params under a key
    named in `frozen` (e.g. "lm_head") get no update and no optimizer state.

    A hashable `c` (an `OptimConfig`) gives one optimizer per settings: the learner's update
    is compiled for its optimizer (a static argument), so runs in one process with the same
    settings share their compiled programs."""
    low = any(jnp.dtype(x.dtype) != jnp.float32 for x in jax.tree.leaves(params))
    try:
        hash(c)
    except TypeError:  # Unhashable settings (a namespace of the fields): built each time.
        return _optimizer.__wrapped__(c, low, tuple(frozen))
    return _optimizer(c, low, tuple(frozen))


@functools.cache
def _optimizer(c, low_precision: bool, frozen: tuple[str, ...]) -> optax.GradientTransformation:
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
    optimizer = master_weights(optimizer) if low_precision else optimizer
    if not frozen:
        return optimizer
    return optax.multi_transform(
        {"train": optimizer, "frozen": optax.set_to_zero()}, _labeller(frozen)
    )


def tree_bytes(tree) -> int:
    """The bytes of a tree's arrays (its global sizes, not per device): what an optimizer
    state holds."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _labeller(frozen: tuple[str, ...]):
    """Each leaf's label: "frozen" under a key in `frozen`, else "train"."""

    def labels(params):
        def label(path, _):
            return "frozen" if any(getattr(k, "key", None) in frozen for k in path) else "train"

        return jax.tree_util.tree_map_with_path(label, params)

    return labels


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
