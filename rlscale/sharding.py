"""Meshes, logical-to-mesh rule tables, parameter shardings and resharding.

Every parameter and cache array names its dimensions with logical axes (`embed`, `heads`, ...).
A rule table maps each logical axis to mesh axes; there is one table for training (FSDP over
`fsdp`, tensor parallelism over `tensor`, batch over `data` and `fsdp`) and one for sampling
(weights replicated across `data` and `fsdp`, tensor parallel over `tensor`, batch over `data`
and `fsdp`). Moving params between the two is `reshard`.

A mixture-of-experts model may add a fourth mesh axis, `expert` (`make_mesh` with four sizes):
its experts shard over it and, everywhere else, it is one more batch axis. A mesh axis a rule
names but the mesh lacks is skipped, so three-axis meshes lay out as they always have.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlscale import sections

MESH_AXES = ("data", "fsdp", "tensor")
EXPERT_MESH_AXES = MESH_AXES + ("expert",)  # A four-entry mesh shape: expert parallelism.
BATCH_AXES = ("data", "fsdp", "expert")

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
    ("expert", "expert"),
    ("expert_mlp", None),
)

# Sampling keeps whole weights on each (data, fsdp) replica: no all-gather per decode step.
SAMPLE_RULES: Rules = tuple(
    (name, None if name == "embed" else target) for name, target in TRAIN_RULES
)

RULES = {"train": TRAIN_RULES, "sample": SAMPLE_RULES}


@dataclasses.dataclass(frozen=True)
class MeshConfig(sections.Section):
    """`config.mesh`: the sizes of (data, fsdp, tensor), or of (data, fsdp, tensor, expert)
    for expert parallelism; -1 takes the remaining devices (the mesh builder's rules are
    checked against the devices by `rl.checks`)."""

    shape: tuple = (-1, 1, 1)


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices=None) -> Mesh:
    """A mesh over axes (data, fsdp, tensor), or (data, fsdp, tensor, expert) given four
    sizes; one entry of `shape` may be -1 (fill).

    Args:
      shape: sizes of (data, fsdp, tensor) or (data, fsdp, tensor, expert).
      devices: defaults to all devices (all hosts' devices under `jax.distributed`).
    """
    devices = np.asarray(jax.devices() if devices is None else devices)
    shape = [int(s) for s in shape]
    axes = EXPERT_MESH_AXES if len(shape) == len(EXPERT_MESH_AXES) else MESH_AXES
    if len(shape) != len(axes):
        raise ValueError(
            f"mesh shape {tuple(shape)} must have {len(MESH_AXES)} entries for axes {MESH_AXES} "
            f"or {len(EXPERT_MESH_AXES)} for {EXPERT_MESH_AXES}"
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
    auto = (jax.sharding.AxisType.Auto,) * len(axes)
    return jax.make_mesh(tuple(shape), axes, auto, devices=list(devices.flat))


def role_meshes(
    shape: Sequence[int], generator_devices: int, generator_tensor: int = 1
) -> tuple[Mesh, Mesh]:
    """(trainer mesh, generator mesh). The generator takes the first `generator_devices`
    devices as a (generator_devices / generator_tensor, 1, generator_tensor) mesh: data
    parallel over its decode slots, tensor parallel (`SAMPLE_RULES`: heads, kv heads where
    they divide, MLP, vocabulary) within each group of `generator_tensor` devices; the
    trainer the rest, in `shape`. With 0, the roles time-slice every device: one mesh, the
    generator split over the trainer's own tensor axis; or with `generator_tensor` > 1 the
    trainer's devices seen again as a (devices / generator_tensor, 1, generator_tensor)
    mesh, so a trainer that shards its params over fsdp decodes tensor parallel instead of
    holding a whole copy per device (colocated, as verl's rollout on the training GPUs)."""
    if not generator_devices:
        mesh = make_mesh(shape)
        if generator_tensor == 1:
            return mesh, mesh
        n = mesh.devices.size
        if generator_tensor < 1 or n % generator_tensor:
            raise ValueError(
                f"a generator tensor axis of {generator_tensor} does not divide the "
                f"{n} devices the roles share"
            )
        shape = (n // generator_tensor, 1, generator_tensor)
        return mesh, make_mesh(shape, mesh.devices.reshape(-1))
    devices = jax.devices()
    if not 0 < generator_devices < len(devices):
        raise ValueError(
            f"{generator_devices} generator devices leave no trainer devices of {len(devices)}"
        )
    if generator_tensor < 1 or generator_devices % generator_tensor:
        raise ValueError(
            f"a generator tensor axis of {generator_tensor} does not divide its "
            f"{generator_devices} devices"
        )
    data = generator_devices // generator_tensor
    gen = make_mesh((data, 1, generator_tensor), devices[:generator_devices])
    return make_mesh(shape, devices[generator_devices:]), gen


def same_devices(a: Mesh, b: Mesh) -> bool:
    """Whether meshes `a` and `b` hold the same devices (the roles share them)."""
    return {d.id for d in a.devices.flat} == {d.id for d in b.devices.flat}


def logical_to_spec(
    axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    A mesh axis is used at most once per array (first logical axis wins) and is dropped for a
    dimension it does not divide (that dimension is then replicated), so e.g. 2 kv heads on a
    4-way tensor axis replicate instead of failing; one the mesh lacks (`expert` on a
    three-axis mesh) is dropped too.
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
            if ax not in mesh.axis_names:
                continue
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


def reshard(tree, shardings, copy: bool = False):
    """Moves a pytree to new shardings (e.g. train layout -> sample layout). Leaves already
    in place are returned as they are unless `copy`: a consumer that keeps them while their
    owner donates its buffers (the pipeline's generator, during updates) needs copies."""
    return jax.device_put(tree, shardings, may_alias=False if copy else None)


def distinct_buffers(tree):
    """`tree` with every array leaf that shares a device buffer with an earlier leaf copied.
    A jitted step that donates the tree fails on a buffer given twice ("Attempt to donate the
    same buffer twice"), and JAX may hand out one buffer for two equal values: on a GPU (jax
    0.11) a zero critic bias and its zero optimizer moment came back as one."""
    seen = set()

    def one(x):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x  # Traced (the planner's abstract init): no buffers yet.
        keys = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        if keys & seen:
            x = jax.device_put(x, x.sharding, may_alias=False)
            keys = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        seen.update(keys)
        return x

    return jax.tree.map(one, tree)


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = SAMPLE_RULES) -> NamedSharding:
    """Sharding of a [B, ...] array: batch over the rule table's batch axes, rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def batch_divisor(mesh: Mesh, rules: Rules = SAMPLE_RULES) -> int:
    """How many ways the batch dimension is split: a batch must be a multiple of this."""
    target = dict(rules)["batch"]
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    return int(np.prod([mesh.shape[a] for a in axes if a in mesh.axis_names]))


def log_layout(params, name: str = "params"):
    for path, v in jax.tree_util.tree_flatten_with_path(params)[0]:
        logging.debug("%s%s %s %s", name, jax.tree_util.keystr(path), v.shape, v.sharding)


# ==========================================================================================
# Placement: host data <-> global arrays. Every process holds the same host data (the prompt
# stream and the scored rollouts are replicated); each device receives only its rows.
# ==========================================================================================


def local_rows(sharding: NamedSharding, num_rows: int) -> slice:
    """The rows of a [num_rows, ...] array (sharded on dim 0 by `sharding`) that this
    process's devices hold: one contiguous block, as `jax.make_mesh` orders devices."""
    spans = {
        (idx[0].start or 0, num_rows if idx[0].stop is None else idx[0].stop)
        for idx in sharding.addressable_devices_indices_map((num_rows,)).values()
    }
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    if sum(e - s for s, e in spans) != hi - lo:
        raise ValueError(f"this process's rows of a batch of {num_rows} are not contiguous")
    return slice(lo, hi)


def put_batch(tree, mesh: Mesh, rules: Rules, axis: int = 0):
    """Host arrays (the full batch, on every process) -> global arrays with dim `axis`
    sharded over the rule table's batch axes. The one place host data becomes device data."""

    def one(x):
        x = np.asarray(x)
        logical = tuple("batch" if i == axis else None for i in range(x.ndim))
        s = NamedSharding(mesh, logical_to_spec(logical, rules, mesh))
        rows = local_rows(batch_sharding(mesh, 1, rules), x.shape[axis])
        local = x[(slice(None),) * axis + (rows,)]
        return jax.make_array_from_process_local_data(s, local, x.shape)

    return jax.tree.map(one, tree)


def fetch(tree):
    """Global arrays -> host NumPy arrays with every element, on every process (an all-gather
    across processes when they span several). The one way device results reach the host."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree
    )


def process_share(num_rows: int) -> slice:
    """The rows of a host batch this process works on (scores, decodes): an even split."""
    per = -(-num_rows // jax.process_count())
    start = min(jax.process_index() * per, num_rows)
    return slice(start, min(start + per, num_rows))


def gather_host(x, num_rows: int) -> np.ndarray:
    """Each process's `process_share(num_rows)` rows of a host array -> the whole array, on
    every process. Single process: `x` itself."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x
    per = -(-num_rows // jax.process_count())
    padded = np.zeros((per, *x.shape[1:]), x.dtype)
    padded[: len(x)] = x
    return np.asarray(multihost_utils.process_allgather(padded, tiled=True))[:num_rows]


def sum_over_processes(x) -> np.ndarray:
    """A host array summed over processes (counts each process made of its share)."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x
    return np.asarray(multihost_utils.process_allgather(x)).sum(axis=0)


def replicate(tree, mesh: Mesh):
    """Small host-identical values (fresh optimizer counts, RNG keys) -> copies on every
    device of the mesh (under several processes too, where `device_put` cannot reach)."""
    return _replicator(mesh)(tree)


def replicate_unplaced(tree, mesh: Mesh):
    """Every leaf not yet placed on a mesh (a fresh optimizer count, a head made on the host),
    replicated on `mesh`; the others as they are. Jitted steps then see the same input
    shardings at every call (an uncommitted array compiles another program)."""
    spec = NamedSharding(mesh, PartitionSpec())

    def place(x):
        return (
            x
            if isinstance(getattr(x, "sharding", None), NamedSharding)
            else jax.device_put(x, spec)
        )

    return jax.tree.map(place, tree)


@functools.cache
def _replicator(mesh: Mesh):
    """One jitted identity per mesh: a fresh one per call would compile every time."""
    return jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, PartitionSpec()))
