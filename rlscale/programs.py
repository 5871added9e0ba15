"""Compiled programs and what they cost: each jitted function is compiled ahead of time once
per input signature, and its compiled cost (`cost_analysis`, `memory_analysis`: per device for
a sharded program) is recorded, so the work a mesh divides is read from the program itself.

`Programs.run(name, fn, args, static)` replaces `fn(*args, **static)`: it lowers and compiles
on a new signature (shapes, dtypes, shardings of `args`; the values of `static`), keeps the
executable and calls it; `prefetch` compiles a signature in the background ahead of its first
`run`; `write(path)` saves one JSON entry per compiled program.

Executables are kept for the process, shared by every `Programs`: a second run in the same
process (a notebook's next cell, a sweep, the tests) reuses what the first compiled, where
JAX's own caches would still trace and lower each program again.
"""

import collections
import concurrent.futures
import copy
import json
import os
import threading

import jax
import numpy as np


def _signature(args, static) -> tuple:
    leaves, treedef = jax.tree.flatten(args)

    def leaf(x):
        # An array and its abstract value (`prefetch`) share a signature, as do equivalent
        # shardings (P() vs P(None)).
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and x.sharding is not None:
            return (
                x.shape,
                str(x.dtype),
                x.sharding._to_xla_hlo_sharding(x.ndim),
                x.sharding._device_assignment,
            )
        if isinstance(x, np.ndarray):
            return (x.shape, str(x.dtype))
        return (type(x).__name__,)

    return (treedef, tuple(map(leaf, leaves)), tuple(sorted(static.items(), key=lambda kv: kv[0])))


def cost(compiled) -> dict:
    """Per-device FLOPs, bytes accessed and memory of a compiled program."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # Older JAX: one dict per module.
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    memory = compiled.memory_analysis()
    return {
        "flops_per_device": float(analysis.get("flops", 0.0)),
        "bytes_accessed_per_device": float(analysis.get("bytes accessed", 0.0)),
        "argument_bytes": int(getattr(memory, "argument_size_in_bytes", 0)),
        "output_bytes": int(getattr(memory, "output_size_in_bytes", 0)),
        "temp_bytes": int(getattr(memory, "temp_size_in_bytes", 0)),
    }


class _Compiled:
    """The process's executables by (function, signature), the most recently used `size`."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._executables: collections.OrderedDict = collections.OrderedDict()

    def get(self, fn, signature, args, static):
        """`fn`'s executable for `args` and `static`, whose signature is `signature`."""
        key = (fn, signature)
        with self._lock:
            executable = self._executables.get(key)
            if executable is not None:
                self._executables.move_to_end(key)
                return executable
        # Compiled outside the lock: other programs compile meanwhile.
        executable = fn.lower(*args, **static).compile()
        with self._lock:
            self._executables[key] = executable
            while len(self._executables) > self.size:
                self._executables.popitem(last=False)
        return executable


_COMPILED = _Compiled(size=256)


class Programs:
    """The compiled programs of a run, with their costs.

    Args:
      mesh: recorded with each entry (its shape and device count).
    """

    def __init__(self, mesh):
        self.mesh = mesh
        self._executables = {}
        self._pending: dict = {}  # Signature -> future of its executable (`prefetch`).
        self._compiler = None
        self.entries: list[dict] = []

    def on(self, mesh) -> "Programs":
        """The same record, for programs that run on another mesh (the generator's)."""
        view = copy.copy(self)
        view.mesh = mesh
        return view

    def prefetch(self, name: str, fn, args: tuple, static: dict | None = None) -> None:
        """Starts compiling `fn` for the signature of `args` (arrays, or `ShapeDtypeStruct`s
        with shardings) in a background thread (one at a time): the first `run` with that
        signature waits for it instead of compiling. The host keeps working meanwhile (and an
        accelerator keeps running what it was given)."""
        static = static or {}
        key = (name, _signature(args, static))
        if key in self._executables or key in self._pending:
            return
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, "rlscale-compile")
        self._pending[key] = self._compiler.submit(_COMPILED.get, fn, key[1], args, static)

    def run(self, name: str, fn, args: tuple, static: dict | None = None):
        """`fn(*args, **static)` through an executable compiled for this signature."""
        static = static or {}
        key = (name, _signature(args, static))
        executable = self._executables.get(key)
        if executable is None:
            pending = self._pending.pop(key, None)
            if pending:
                executable = pending.result()
            else:
                executable = _COMPILED.get(fn, key[1], args, static)
            self._executables[key] = executable
            self.entries.append(
                {
                    "name": name,
                    "variant": sum(e["name"] == name for e in self.entries),  # Nth signature.
                    **cost(executable),
                    "mesh_shape": dict(self.mesh.shape),
                    "devices": int(self.mesh.devices.size),
                }
            )
        return executable(*args)

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.entries, f, indent=2)
