"""Checkpoints (orbax): model params with their model config, and whole runs.

A params checkpoint is a directory holding `model_config.json` (the `ModelConfig` fields) and
an orbax `params/` tree, restored directly onto the target shardings.

A run checkpoint (`RunCheckpointer`) holds everything an interrupted RL run needs to continue
as the same run: the device state (params, optimizer state, RNG key data) and the host state
(data cursor, filter history, counters, resolved config) as JSON. `config_diff` says how a
resumed run's config differs from the saved one.
"""

import dataclasses
import functools
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from rlscale import sections, sharding
from rlscale.model import config as model_config
from rlscale.model import decoder


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(sections.Section):
    """`config.checkpoint`: a run checkpoint every `every` steps and at the end; the last
    `keep` are kept, and every `keep_every`-th step (0: none)."""

    every: int = 20
    keep: int = 3
    keep_every: int = 0

    def problems(self) -> list[str]:
        return sections.at_least("checkpoint.every", self.every, 1) + sections.at_least(
            "checkpoint.keep", self.keep, 1
        )


def save_params(path: str, cfg: model_config.ModelConfig, params) -> None:
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), nnx.to_pure_dict(params), force=True)
    if jax.process_index() == 0:
        with open(os.path.join(path, "model_config.json"), "w") as f:
            json.dump(model_config.as_dict(cfg), f, indent=2)


def load_params(path: str, mesh=None, rules: sharding.Rules = sharding.TRAIN_RULES):
    """(cfg, graphdef, params) from `save_params`; on `mesh` with `rules` if given."""
    path = os.path.abspath(path)
    config_path = os.path.join(path, "model_config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} does not exist: not an rlscale params checkpoint")
    with open(config_path) as f:
        cfg = model_config.from_dict(json.load(f))
    graphdef, abstract = decoder.abstract_model(cfg)
    if mesh is None:
        mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    shardings = sharding.param_shardings(abstract, mesh, rules)
    target = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        nnx.to_pure_dict(abstract),
        nnx.to_pure_dict(shardings),
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.join(path, "params"), target)
    nnx.replace_by_pure_dict(abstract, restored)
    return cfg, graphdef, abstract


# ==========================================================================================
# Run checkpoints: the whole state of an RL run, for exact resume.
# ==========================================================================================

_FORMAT = 1  # Version of the `meta` item's layout.


def _one_writer_per_array() -> None:
    """In one process, orbax's replica-parallel save (each replica of a replicated array writes
    a slice of it) only adds work: one process writes every byte anyway, after slicing each
    array once per device with an eager op (on 8 CPU devices, 1 of a quick run's 2 s per save).
    With several processes it is orbax's default, which spreads the writing over the hosts."""
    current = ocp.type_handlers.get_type_handler(jax.Array)
    if jax.process_count() == 1 and current is not _ONE_WRITER:
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.ERROR)  # Orbax warns that it overrides its default.
        try:
            ocp.type_handlers.register_type_handler(jax.Array, _ONE_WRITER, override=True)
        finally:
            logging.set_verbosity(verbosity)


_ONE_WRITER = ocp.type_handlers.ArrayHandler(use_replica_parallel=False)
_MOVED_ASIDE = re.compile(r"^\d+\.(unreadable|superseded)-\d+$")


class CheckpointError(RuntimeError):
    """No checkpoint of a run could be restored."""


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _words(x):
    """The bits of `x` as uint32 words (64-bit dtypes get a trailing axis of 2)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = jnp.dtype(x.dtype).itemsize * 8
    if bits in (32, 64):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if bits in (8, 16):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
    raise TypeError(f"no fingerprint for dtype {x.dtype}")


def _leaf_fingerprint(x):
    """sum_i w_i * (2 i + 1) mod 2**32 over the words w_i of `x` in row-major order i.

    The odd weights are invertible mod 2**32, so changing any single word always changes the
    fingerprint, and so does swapping two different words. No reshape: each shard sums its own
    part, then one all-reduce.
    """
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride)
        stride = (stride * w.shape[axis]) % (1 << 32)
    return jnp.sum(w * (2 * index + 1), dtype=jnp.uint32)


@functools.cache
def _fingerprinted(dtype) -> bool:
    """Whether `_leaf_fingerprint` covers arrays of `dtype` (None: not an array). Decided once
    per dtype: tracing the fingerprint of every leaf cost 4 ms a leaf at each save."""
    if dtype is None:
        return False
    try:
        jax.eval_shape(_words, jax.ShapeDtypeStruct((), dtype))
    except TypeError:
        return False
    return True


# One computation per device set: the leaves of a state may live on different ones (a step
# counter on one device, params on the mesh), which one jitted call over the tree refuses.
_jitted_fingerprints = jax.jit(lambda leaves: jax.tree.map(_leaf_fingerprint, leaves))


def _fingerprints(leaves: dict) -> dict:
    """{name: fingerprint} of `leaves`, one compiled program per set of devices they live on
    (host arrays: the default device's), not one per leaf shape."""
    groups = {}
    for name, x in leaves.items():
        sharding = getattr(x, "sharding", None)
        devices = frozenset(sharding.device_set) if sharding is not None else None
        groups.setdefault(devices, {})[name] = x
    out = {}
    for group in groups.values():
        out.update(_jitted_fingerprints(group))
    return jax.device_get(out)


def _array_records(tree) -> dict[str, dict]:
    """{key path: {"dtype", "shape", "fingerprint"}} of each leaf of `tree` (no typed keys).

    The fingerprint is None for dtypes it does not cover (int4, complex, ...).
    """
    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    covered = {n: x for n, x in leaves.items() if _fingerprinted(getattr(x, "dtype", None))}
    values = _fingerprints(covered)
    return {
        name: {
            "dtype": str(getattr(x, "dtype", type(x).__name__)),
            "shape": list(np.shape(x)),
            "fingerprint": int(values[name]) if name in values else None,
        }
        for name, x in leaves.items()
    }


def tree_fingerprint(tree) -> str:
    """One fingerprint of a whole tree of arrays (a frozen base's identity in a LoRA run's
    checkpoints): SHA-256 over each leaf's path, dtype, shape and word fingerprint
    (`_leaf_fingerprint`), 16 hex digits."""
    records = json.dumps(_array_records(tree), sort_keys=True)
    return hashlib.sha256(records.encode()).hexdigest()[:16]


def _unwrap_keys(state):
    """Replaces typed PRNG key arrays by their raw data; returns (tree, {path: impl name})."""
    impls = {}

    def unwrap(path, x):
        if _is_key(x):
            impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
            return jax.random.key_data(x)
        return x

    return jax.tree_util.tree_map_with_path(unwrap, state), impls


def _key_data_struct(abstract):
    """The abstract raw data of an abstract typed key array, on the same sharding.

    A `NamedSharding` (or a single device) fits both: the key data's extra trailing axis is
    replicated, since a partition spec shorter than the rank leaves the last axes unsharded.
    """
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(abstract.shape, abstract.dtype))
    return jax.ShapeDtypeStruct(
        data.shape, data.dtype, sharding=getattr(abstract, "sharding", None)
    )


def _restore_target(abstract_state):
    return jax.tree.map(lambda x: _key_data_struct(x) if _is_key(x) else x, abstract_state)


def _rewrap_keys(restored, abstract_state, impls: dict[str, str]):
    def rewrap(path, x, abstract):
        if not _is_key(abstract):
            return x
        name = jax.tree_util.keystr(path)
        if name not in impls:
            raise ValueError(f"{name} is a typed PRNG key but was saved as plain data")
        key = jax.random.wrap_key_data(x, impl=impls[name])
        if key.dtype != abstract.dtype:
            raise ValueError(f"{name}: saved key type {key.dtype}, expected {abstract.dtype}")
        return key

    return jax.tree_util.tree_map_with_path(rewrap, restored, abstract_state)


def _local_path(directory) -> epath.Path:
    directory = os.fspath(directory)
    return epath.Path(directory if "://" in directory else os.path.abspath(directory))


class RunCheckpointer:
    """Saves and restores a whole run: device state (params, optimizer, RNG) and host state.

    A checkpoint is one orbax step directory `DIRECTORY/<step>` with three items: `state` (the
    pytree of arrays, written by tensorstore from every host), `host` (a JSON dict: data cursor,
    filter history, counters, config, ...) and `meta` (a fingerprint of every array and the
    PRNG implementation of every typed key). Orbax writes a step into a temporary directory and
    renames it when complete, so a save cut short leaves only a `<step>.orbax-checkpoint-tmp-*`
    directory, which is never listed as a step and is deleted when the next `RunCheckpointer`
    opens the directory.

    Restoring checks each array against its fingerprint, so a checkpoint whose files were later
    truncated, deleted or altered is detected; `restore` then falls back to the newest readable
    step and moves the bad newer ones aside (renamed `<step>.unreadable-<time>`, never deleted),
    so that the resumed run can save those steps again.

    Saves are asynchronous by default: `save` returns once the arrays are copied to host memory
    (so the caller may donate or overwrite them right away) and the files are written in a
    background thread. `wait()` (or `close()`) blocks until the last save is durable; a process
    that exits without it loses that save (only its temporary directory remains).

    A save also waits for the previous one to finish writing, so saving more often than a
    checkpoint takes to write stalls the caller.

    Example:
        with RunCheckpointer(workdir + "/checkpoints", keep=3, keep_every=1000) as ckpt:
            if ckpt.latest_step() is not None:
                # Shapes, dtypes and the shardings to restore onto, leaf by leaf.
                abstract = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
                )
                step, state, host = ckpt.restore(abstract)
            ...
            ckpt.save(step, state, {"cursor": cursor, "config": config.to_dict()})

    Args:
        directory: Where the step directories live (created if missing).
        keep: Number of most recent checkpoints kept (at least 1).
        keep_every: Also keep, forever, every checkpoint whose step is a multiple of this
            (0: none).
        async_save: Write in a background thread.
    """

    def __init__(self, directory, *, keep: int = 3, keep_every: int = 0, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if keep_every < 0:
            raise ValueError(f"keep_every must be >= 0, got {keep_every}")
        self.directory = _local_path(directory)
        _one_writer_per_array()
        policies = [ocp.checkpoint_managers.LatestN(keep)]
        if keep_every:
            policies.append(ocp.checkpoint_managers.EveryNSteps(keep_every))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    # -- listing ---------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending (a save in flight counts)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed (or in-flight) checkpoint's step, or None."""
        return self._manager.latest_step()

    # -- save ------------------------------------------------------------------------------

    def save(self, step: int, state, host: dict, *, force: bool = False) -> bool:
        """Starts saving checkpoint `step`; returns whether a save was started.

        Args:
            step: The run's step (the number of updates applied to `state`).
            state: A pytree of `jax.Array`s. Typed PRNG key arrays are stored as their raw key
                data and rewrapped on restore, so the caller can pass them as they are.
            host: A JSON-serializable dict. It is copied (through JSON) before this returns, so
                the caller may mutate it during the asynchronous write. JSON turns tuples into
                lists and dict keys into strings.
            force: Save even if checkpoints at `step` or later exist: they are moved aside
                (renamed `<step>.superseded-<time>`) first. This is for a run deliberately
                rewound to an older checkpoint. Without it, a save at a step that is not newer
                than the latest checkpoint does nothing and returns False (for example the final
                save right after a periodic one at the same step).

        Returns:
            True if a save was started, False if it was skipped.
        """
        step = int(step)
        try:
            host = json.loads(json.dumps(host))
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint host state is not JSON-serializable: {e}") from e
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if not force:
                logging.info("checkpoint: step %d is not newer than step %d; skipped", step, latest)
                return False
            self.wait()
            self._move_aside([s for s in self.all_steps() if s >= step], "superseded")
        data, impls = _unwrap_keys(state)
        meta = {"format": _FORMAT, "arrays": _array_records(data), "prng_impls": impls}
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(data),
                host=ocp.args.JsonSave(host),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )

    def wait(self) -> None:
        """Blocks until the last save is committed; raises if it failed."""
        self._manager.wait_until_finished()
        self._manager.check_for_errors()

    # -- restore ---------------------------------------------------------------------------

    def restore(self, abstract_state, step: int | None = None) -> tuple[int, object, dict]:
        """Restores a checkpoint onto the shardings of `abstract_state`.

        Args:
            abstract_state: A pytree of `jax.ShapeDtypeStruct`s with `.sharding`, of the same
                structure as the saved state. Give every leaf a sharding on the mesh: a scalar
                (step, optimizer count) whose sharding is a single device is restored committed
                to that device, and a jitted function then refuses to mix it with mesh arrays.
                A typed key leaf restores as a typed key.
            step: The step to restore; None: the newest readable one. With None, an unreadable
                checkpoint (missing or truncated files, contents that do not match their
                fingerprints, a missing item) is reported with a warning naming the step and the
                reason, and the next older one is tried; once one restores, the unreadable newer
                ones are moved aside. With an explicit step there is no fallback.

        Returns:
            (step, state, host): the step actually restored, the state pytree and the host dict.

        Raises:
            FileNotFoundError: There is no checkpoint (or no checkpoint `step`).
            CheckpointError: No candidate checkpoint could be restored; lists every failure.
        """
        self.wait()
        self._manager.reload()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(
                    f"no checkpoint of step {step} in {self.directory} (steps: {steps})"
                )
            candidates = [int(step)]
        else:
            candidates = steps[::-1]
        failures = []
        for s in candidates:
            try:
                state, host = self._restore_step(abstract_state, s)
            except Exception as e:  # noqa: BLE001 - any failure makes this step unusable.
                reason = f"{type(e).__name__}: {str(e)[:500]}"
                logging.warning(
                    "checkpoint step %d in %s is unreadable (%s)", s, self.directory, reason
                )
                failures.append((s, reason))
                continue
            if failures:
                bad = [f for f, _ in failures]
                logging.warning(
                    "restored checkpoint step %d instead of the newer unreadable step(s) %s",
                    s,
                    bad,
                )
                self._move_aside(bad, "unreadable")
            return s, state, host
        listing = "\n".join(f"  step {s}: {reason}" for s, reason in failures)
        raise CheckpointError(f"no readable checkpoint in {self.directory}:\n{listing}")

    def _restore_step(self, abstract_state, step: int):
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_restore_target(abstract_state)),
                host=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        meta, data = restored["meta"], restored["state"]
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise ValueError(f"unknown checkpoint metadata {str(meta)[:200]}")
        if not isinstance(restored["host"], dict):
            raise ValueError("the host state is not a dict")
        expected, actual = meta["arrays"], _array_records(data)
        if set(expected) != set(actual):
            raise ValueError(
                f"saved arrays {sorted(set(expected) - set(actual))[:5]} are missing from the "
                f"restored state, or {sorted(set(actual) - set(expected))[:5]} were not saved"
            )
        for name, record in actual.items():
            saved = expected[name]
            # A restore onto another dtype (a cast) cannot be checked bit for bit.
            if record["dtype"] != saved["dtype"] or saved["fingerprint"] is None:
                continue
            if record["fingerprint"] != saved["fingerprint"]:
                raise ValueError(
                    f"array {name} ({record['dtype']}{record['shape']}) does not match its "
                    "saved fingerprint: the checkpoint's files are corrupted"
                )
        state = _rewrap_keys(data, abstract_state, meta["prng_impls"])
        return state, restored["host"]

    def _move_aside(self, steps: list[int], why: str) -> None:
        """Renames step directories to `<step>.<why>-<time>` (kept for inspection)."""
        if not steps:
            return
        stamp = int(time.time())
        if jax.process_index() == 0:
            for s in steps:
                src = self.directory / str(s)
                if src.exists():
                    suffix = stamp
                    while (dst := self.directory / f"{s}.{why}-{suffix}").exists():
                        suffix += 1  # Moved aside twice within a second.
                    src.rename(dst)
                    logging.warning("checkpoint step %d moved aside to %s", s, dst)
        if jax.process_count() > 1:
            # The same name on every host (not the time, which differs between hosts).
            multihost_utils.sync_global_devices(
                f"rlscale_checkpoint_{why}_{'_'.join(map(str, steps))}"
            )
        self._manager.reload()

    def moved_aside(self) -> list[str]:
        """Names of step directories moved aside as unreadable or superseded."""
        return sorted(p.name for p in self.directory.iterdir() if _MOVED_ASIDE.match(p.name))

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the last save, then releases the manager's threads."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def config_diff(
    saved: Mapping, current: Mapping, ignore: Sequence[str] = (), defaults: Mapping = None
) -> list[str]:
    """Differences between two nested configs, one line per dotted key, sorted.

    Both sides are compared after a JSON round trip (as a saved config is read back), so a
    tuple equals the list it becomes and an `ml_collections.ConfigDict` can be passed directly.

    Args:
        saved: The config stored with a checkpoint.
        current: The config of the run that resumes from it.
        ignore: Dotted keys whose subtree is not compared: "eval" skips "eval" and "eval.every"
            but not "evaluate"; "eval.every" skips only that key.
        defaults: A config whose values stand for the keys `saved` lacks: a key added to the
            library after the checkpoint was written had its default then, so a resume that
            leaves it there changes nothing.

    Returns:
        Lines like "optim.lr: 0.0001 -> 0.0003", "new.key: (absent) -> 4" or
        "old.key: 4 -> (absent)".
    """
    a, b = _flatten(_as_json(saved)), _flatten(_as_json(current))
    if defaults is not None:
        a = {**_flatten(_as_json(defaults)), **a}

    def ignored(key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in ignore)

    lines = []
    for key in sorted(set(a) | set(b)):
        if ignored(key) or (key in a and key in b and a[key] == b[key]):
            continue
        old = _format_value(a[key]) if key in a else "(absent)"
        new = _format_value(b[key]) if key in b else "(absent)"
        lines.append(f"{key}: {old} -> {new}")
    return lines


def _as_json(config) -> dict:
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    return json.loads(json.dumps(config, default=str))


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict) and (tree or not prefix):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _format_value(value) -> str:
    return json.dumps(value, sort_keys=True)
