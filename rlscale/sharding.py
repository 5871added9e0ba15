"""Meshes, logical-to-mesh rule tables, sharded initialization and resharding.

Every parameter and cache array names its dimensions with logical axes (`embed`, `heads`, ...).
A rule table maps each logical axis to mesh axes; there is one table for training (FSDP over
`fsdp`, tensor parallelism over `tensor`, batch over `data` and `fsdp`) and one for sampling
(weights replicated across `data` and `fsdp`, tensor parallel over `tensor`, batch over `data`
and `fsdp`). Moving params between the two is `reshard`.
"""

from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

TRAIN_RULES: Rules = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("seq", None),
    ("cache_seq", None),
)

# Sampling keeps whole weights on each (data, fsdp) replica: no all-gather per decode step.
SAMPLE_RULES: Rules = tuple(
    (name, None if name == "embed" else target) for name, target in TRAIN_RULES
)

RULES = {"train": TRAIN_RULES, "sample": SAMPLE_RULES}


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices=None) -> Mesh:
    """A mesh over axes (data, fsdp, tensor); one entry of `shape` may be -1 (fill).

    Args:
      shape: sizes of (data, fsdp, tensor).
      devices: defaults to all devices (all hosts' devices under `jax.distributed`).
    """
    devices = np.asarray(jax.devices() if devices is None else devices)
    shape = [int(s) for s in shape]
    if len(shape) != len(MESH_AXES):
        raise ValueError(
            f"mesh shape {tuple(shape)} must have {len(MESH_AXES)} entries for axes {MESH_AXES}"
        )
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {tuple(shape)}: sizes must be positive, at most one -1")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if devices.size % known:
            raise ValueError(
                f"mesh shape {tuple(shape)} cannot be filled from {devices.size} devices"
            )
        shape[shape.index(-1)] = devices.size // known
    needed = int(np.prod(shape))
    if needed < devices.size and jax.process_count() == 1 and devices.size % needed == 0:
        devices = devices[:needed]  # A smaller mesh on one host: its first devices.
    if needed != devices.size:
        raise ValueError(
            f"mesh shape {tuple(shape)} needs {needed} devices, have {devices.size}"
            + (f" over {jax.process_count()} processes" if jax.process_count() > 1 else "")
        )
    # Auto axes: XLA propagates shardings from the annotated inputs and outputs. make_mesh
    # orders devices for the physical topology (TPU ICI rings) where it knows one.
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(shape), MESH_AXES, auto, devices=list(devices.flat))


def logical_to_spec(
    axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    A mesh axis is used at most once per array (first logical axis wins) and is dropped for a
    dimension it does not divide (that dimension is then replicated), so e.g. 2 kv heads on a
    4-way tensor axis replicate instead of failing.
    """
    table = dict(rules)
    used, spec = set(), []
    for i, name in enumerate(axes):
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; rules cover {sorted(table)}")
        target = table.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        kept = []
        for ax in mesh_axes:
            size = int(np.prod([mesh.shape[a] for a in kept + [ax]]))
            if ax in used or (shape is not None and shape[i] % size):
                continue
            kept.append(ax)
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def tree_shardings(abstract_tree, logical_tree, mesh: Mesh, rules: Rules):
    """NamedShardings for a pytree of arrays given a matching pytree of logical-axis tuples."""

    def one(x, axes):
        return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, x.shape))

    return jax.tree.map(
        one,
        abstract_tree,
        logical_tree,
        is_leaf=lambda t: isinstance(t, tuple) and all(isinstance(a, str | None) for a in t),
    )


def param_logical_axes(params):
    """The `axes` metadata of every parameter, as a pytree shaped like `params`."""
    return jax.tree.map(
        lambda v: v.get_metadata()["axes"], params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def param_shardings(params, mesh: Mesh, rules: Rules):
    """NamedShardings for a params pytree (abstract or concrete)."""

    def one(v):
        spec = logical_to_spec(v.get_metadata()["axes"], rules, mesh, v.shape)
        return v.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_sharded(cfg, rng, mesh: Mesh, rules: Rules = TRAIN_RULES):
    """(graphdef, params) with every parameter created directly on its shards.

    The shapes come from `nnx.eval_shape` and the init is jitted with `out_shardings`, so a
    large model is never materialized on one device.
    """
    from rlscale.model import decoder  # Deferred: sharding is imported by the model's users.

    graphdef, abstract = decoder.abstract_model(cfg)
    shardings = param_shardings(abstract, mesh, rules)
    params = jax.jit(lambda r: decoder.init_params(cfg, r), out_shardings=shardings)(rng)
    return graphdef, params


def reshard(tree, shardings):
    """Moves a pytree to new shardings (e.g. train layout -> sample layout)."""
    return jax.device_put(tree, shardings)


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = SAMPLE_RULES) -> NamedSharding:
    """Sharding of a [B, ...] array: batch over the rule table's batch axes, rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def batch_divisor(mesh: Mesh, rules: Rules = SAMPLE_RULES) -> int:
    """How many ways the batch dimension is split: a batch must be a multiple of this."""
    target = dict(rules)["batch"]
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    return int(np.prod([mesh.shape[a] for a in axes]))


def log_layout(params, name: str = "params"):
    for path, v in jax.tree_util.tree_flatten_with_path(params)[0]:
        logging.debug("%s%s %s %s", name, jax.tree_util.keystr(path), v.shape, v.sharding)
