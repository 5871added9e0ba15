"""TPU slices the planner compiles for with no TPU attached: their names, libtpu's view of
them, and the programs moved onto their devices.

libtpu compiles for a slice it is only described (`jax.experimental.topologies`): the
devices of `get_topology_desc(platform="tpu", topology_name="v5p:2x4x4")` carry no memory,
but a program whose arguments are sharded over them lowers and compiles with the TPU
compiler, and its `memory_analysis()` is the TPU compiler's own. The planner builds every
part on fake CPU devices (the learner places its batch, which needs devices that hold
memory) and `retarget`s each program's arguments and static arguments onto the slice's
devices, the same mesh shape and shardings, just before it compiles.

Slice names are Cloud TPU's (`SLICES`): `v5p-N` counts TensorCores (two per chip, one JAX
device per chip: megacore), `v5e-N` (`v5litepod-N`) and `v6e-N` chips. libtpu's own names
(`v5p:2x4x4`, `v5e:4x4`, `v6e:8x8`) are accepted too.
"""

import dataclasses
import importlib.metadata
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

# generation: (the `report.ACCELERATORS` key, TensorCores counted per chip in slice names,
# chips -> the slice's shape in chips, as Cloud TPU's slice table lists them).
_SQUARE = {4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
SLICES = {
    "v5p": (
        "tpu_v5p",
        2,
        {
            4: (2, 2, 1),
            8: (2, 2, 2),
            16: (2, 2, 4),
            32: (2, 4, 4),
            64: (4, 4, 4),
            128: (4, 4, 8),
            256: (4, 8, 8),
            512: (8, 8, 8),
            1024: (8, 8, 16),
            2048: (8, 16, 16),
            4096: (16, 16, 16),
        },
    ),
    "v5e": ("tpu_v5e", 1, _SQUARE),
    "v6e": ("tpu_v6e", 1, _SQUARE),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice.

    Attributes:
      generation: `v5p`, `v5e` or `v6e`.
      shape: its chips along each axis (libtpu's topology, `topology_name`).
      accelerator: its `report.ACCELERATORS` key.
      cores_per_chip: TensorCores per chip in its Cloud TPU name (`name`).
    """

    generation: str
    shape: tuple[int, ...]
    accelerator: str
    cores_per_chip: int

    @property
    def chips(self) -> int:
        """Chips, one JAX device each."""
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        """Cloud TPU's name: `v5p-64`."""
        return f"{self.generation}-{self.chips * self.cores_per_chip}"

    @property
    def topology_name(self) -> str:
        """libtpu's name: `v5p:2x4x4`."""
        return f"{self.generation}:{'x'.join(map(str, self.shape))}"

    def describe(self) -> str:
        return (
            f"TPU {self.generation} {'x'.join(map(str, self.shape))} ({self.name}, "
            f"{self.chips} chips)"
        )


def parse(name: str) -> Slice:
    """The slice a Cloud TPU name (`v5p-64`, `v5litepod-16`, `v6e-32`) or a libtpu topology
    name (`v5p:2x4x4`) names.

    Raises:
      ValueError: naming the generations and sizes known, for a name that is neither.
    """
    text = name.strip().lower()
    sep = ":" if ":" in text else "-"
    generation, _, size = text.partition(sep)
    generation = _ALIASES.get(generation, generation)
    if generation in SLICES and size:
        accelerator, cores, shapes = SLICES[generation]
        try:
            if sep == ":":
                shape = tuple(int(s) for s in size.split("x"))
                if len(shape) != len(next(iter(shapes.values()))) or min(shape) < 1:
                    raise ValueError
            else:
                shape = shapes[int(size) // cores] if int(size) % cores == 0 else None
            if shape is not None:
                return Slice(generation, shape, accelerator, cores)
        except (ValueError, KeyError):
            pass
    known = "; ".join(
        f"{g}-{{{','.join(str(c * cores) for c in shapes)}}}"
        for g, (_, cores, shapes) in SLICES.items()
    )
    raise ValueError(
        f"{name!r} is not a TPU slice: expected a Cloud TPU name ({known}) or a libtpu "
        "topology name such as v5p:2x4x4 or v6e:4x4"
    )


def of(accelerator: str, chips: int) -> Slice | None:
    """The `accelerator`'s (`tpu_v5p`) slice of `chips` chips in `SLICES`, or None."""
    for generation, (key, cores, shapes) in SLICES.items():
        if key == accelerator and chips in shapes:
            return Slice(generation, shapes[chips], key, cores)
    return None


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None where it is not installed."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def devices(s: Slice) -> list:
    """The slice's devices as libtpu describes them (no TPU needed), ordered by id."""
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="tpu", topology_name=s.topology_name)
    return sorted(desc.devices, key=lambda d: d.id)


def mesh_onto(mesh: Mesh, targets: list) -> Mesh:
    """`mesh` with its device of id i replaced by `targets[i]`: the same shape, axes and
    axis types, on the target's devices."""
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    picked = np.empty(ids.shape, dtype=object)
    for index, i in np.ndenumerate(ids):
        picked[index] = targets[i]
    return Mesh(picked, mesh.axis_names, axis_types=mesh.axis_types)


def retarget(tree, targets: list):
    """`tree` (a program's arguments or static arguments) moved onto `targets`: every array
    or abstract array becomes an abstract array sharded as before (same spec and memory kind)
    over `mesh_onto` its mesh, and every `Mesh` in a named tuple or dataclass (the static
    specializations, `ForwardSpec`, `_Layout`) is replaced the same way. What holds no mesh
    is returned as it is."""
    meshes: dict = {}

    def onto(mesh):
        if id(mesh) not in meshes:
            meshes[id(mesh)] = (mesh, mesh_onto(mesh, targets))
        return meshes[id(mesh)][1]

    def leaf(x):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and isinstance(
            x.sharding, NamedSharding
        ):
            s = x.sharding
            moved = NamedSharding(onto(s.mesh), s.spec, memory_kind=s.memory_kind)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=moved)
        return _static(x, onto)

    return jax.tree.map(leaf, tree)


def _static(x, onto):
    """`x` with each `Mesh` in it (itself, or a field of a named tuple or a dataclass, at any
    depth) replaced by `onto(mesh)`; `x` itself where it holds none."""
    if isinstance(x, Mesh):
        return onto(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        fields = [_static(v, onto) for v in x]
        changed = any(a is not b for a, b in zip(fields, x))
        return x._replace(**dict(zip(x._fields, fields))) if changed else x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        values = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
        moved = {k: _static(v, onto) for k, v in values.items()}
        changed = {k: v for k, v in moved.items() if v is not values[k]}
        return dataclasses.replace(x, **changed) if changed else x
    return x
