"""Run checkpoints: exact round trip onto a mesh, retention, async saves, damaged checkpoints."""

import logging
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import subprocess_env
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlscale import checkpoint, sharding

HOST = {
    "cursor": {"epoch": 1, "position": 37, "order_seed": 5},
    "pass_rate": {"12": [1, 0, 1], "40": [0]},
    "retired": [3, 9, 27],
    "flops": 1.25e15,
    "metrics_offset": 4096,
    "config": {"optim": {"lr": 1e-4}, "steps": 100},
}


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh((2, 4, 1))


def weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(8, 12)).astype(np.float32)


def make_state(mesh, seed: int = 0):
    """A small train state: sharded params and Adam moments, a step counter and a typed key."""
    rng = np.random.default_rng(seed + 1000)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    w = weights(seed)
    return {
        "params": {
            "w": put(w, P("data", "fsdp")),
            "b": put(rng.normal(size=(12,)).astype(jnp.bfloat16), P("fsdp")),
        },
        "opt": {"mu": put(w * 0.1, P("data", "fsdp")), "count": put(np.int32(seed + 3), P())},
        "step": jnp.int32(seed),
        "rng": put(jax.random.key(seed), P()),
    }


def abstract(state, mesh=None):
    """The restore target: each leaf's shape, dtype and sharding.

    Uncommitted leaves (a scalar made with `jnp.int32(0)`) report a single-device sharding;
    restored onto it they would be committed to device 0 and could not be mixed with mesh arrays
    in one jitted call, so with `mesh` they are restored replicated over it instead.
    """

    def target(x):
        shard = x.sharding
        if mesh is not None and not isinstance(shard, NamedSharding):
            shard = NamedSharding(mesh, P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard)

    return jax.tree.map(target, state)


def assert_same_state(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def save_steps(directory, mesh, steps, **kwargs):
    with checkpoint.RunCheckpointer(directory, async_save=False, **kwargs) as ckpt:
        for s in steps:
            assert ckpt.save(s, make_state(mesh, s), HOST | {"step": s})


def data_file(step_dir: pathlib.Path) -> pathlib.Path:
    """The file holding the arrays' chunks (orbax's OCDBT layout: after a save, the per-process
    trees are merged into `state/d/`)."""
    files = list((step_dir / "state" / "d").iterdir())
    assert len(files) == 1, files
    return files[0]


def test_round_trip_onto_mesh(tmp_path, mesh):
    state = make_state(mesh, seed=4)
    with checkpoint.RunCheckpointer(tmp_path / "ck") as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(4, state, HOST)
        ckpt.wait()
    # A fresh checkpointer, as in a new process.
    with checkpoint.RunCheckpointer(tmp_path / "ck") as ckpt:
        assert ckpt.all_steps() == [4] and ckpt.latest_step() == 4
        step, restored, host = ckpt.restore(abstract(state))
    assert step == 4 and host == HOST
    assert_same_state(restored, state)
    assert restored["params"]["w"].sharding.spec == P("data", "fsdp")
    assert restored["params"]["b"].sharding.spec == P("fsdp")
    assert restored["rng"].dtype == state["rng"].dtype
    # Same key => same random stream after resume.
    np.testing.assert_array_equal(
        jax.random.uniform(restored["rng"], (3,)), jax.random.uniform(state["rng"], (3,))
    )
    # Onto another layout (one device): the same values.
    one = NamedSharding(sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1]), P())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), state)
    with checkpoint.RunCheckpointer(tmp_path / "ck") as ckpt:
        _, single, _ = ckpt.restore(target)
    assert_same_state(single, state)
    assert single["params"]["w"].sharding == one


def test_optax_state_round_trip(tmp_path, mesh):
    """An optimizer state (nested NamedTuples, empty states, a schedule count) keeps its type."""
    params = make_state(mesh, 2)["params"]
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.linear_schedule(1e-3, 0.0, 100), weight_decay=0.1),
    )
    grads = jax.tree.map(lambda x: x * 0.5, params)
    _, opt = tx.update(grads, tx.init(params), params)
    state = {"params": params, "opt": opt}
    with checkpoint.RunCheckpointer(tmp_path / "ck", async_save=False) as ckpt:
        ckpt.save(1, state, {})
        _, restored, _ = ckpt.restore(abstract(state, mesh))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert restored["opt"][1][0].count.sharding == NamedSharding(mesh, P())
    assert_same_state(restored, state)
    # The next update from the restored state equals the uninterrupted one.
    assert_same_state(
        tx.update(grads, restored["opt"], restored["params"]), tx.update(grads, opt, params)
    )


def test_async_save_is_safe_to_overwrite(tmp_path, mesh):
    """After `save` returns, the caller may delete (donate) the arrays and mutate the host dict."""
    state = make_state(mesh, seed=1)
    expected = jax.tree.map(lambda x: x.copy(), state)
    host = {"cursor": [1, 2]}
    with checkpoint.RunCheckpointer(tmp_path / "ck", async_save=True) as ckpt:
        assert ckpt.save(1, state, host)
        for leaf in jax.tree.leaves(state):
            leaf.delete()
        host["cursor"].append(3)
        ckpt.wait()
        assert ckpt.latest_step() == 1
        assert (tmp_path / "ck" / "1" / "commit_success.txt").exists()
        _, restored, saved_host = ckpt.restore(abstract(expected))
    assert_same_state(restored, expected)
    assert saved_host == {"cursor": [1, 2]}


def test_retention(tmp_path, mesh):
    save_steps(tmp_path / "ck", mesh, range(1, 10), keep=2, keep_every=4)
    kept = [4, 8, 9]  # The last two, plus every multiple of 4.
    with checkpoint.RunCheckpointer(tmp_path / "ck") as ckpt:
        assert ckpt.all_steps() == kept
    assert sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.is_dir()) == kept
    save_steps(tmp_path / "last", mesh, range(1, 5), keep=1)
    assert [p.name for p in (tmp_path / "last").iterdir() if p.is_dir()] == ["4"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        checkpoint.RunCheckpointer(tmp_path / "x", keep=0)


def test_save_not_newer_is_skipped_and_force_rewinds(tmp_path, mesh):
    save_steps(tmp_path / "ck", mesh, [1, 2, 3])
    with checkpoint.RunCheckpointer(tmp_path / "ck", async_save=False) as ckpt:
        assert not ckpt.save(3, make_state(mesh, 9), HOST)
        assert not ckpt.save(2, make_state(mesh, 9), HOST)
        assert ckpt.all_steps() == [1, 2, 3]
        # A run rewound to step 1 writes a new future: steps 2 and 3 are moved aside.
        assert ckpt.save(2, make_state(mesh, 9), {"rewound": True}, force=True)
        assert ckpt.all_steps() == [1, 2]
        assert [n.split("-")[0] for n in ckpt.moved_aside()] == ["2.superseded", "3.superseded"]
        step, restored, host = ckpt.restore(abstract(make_state(mesh)))
    assert step == 2 and host == {"rewound": True}
    assert_same_state(restored, make_state(mesh, 9))


def test_host_state_must_be_json(tmp_path, mesh):
    with checkpoint.RunCheckpointer(tmp_path / "ck", async_save=False) as ckpt:
        with pytest.raises(TypeError, match="not JSON-serializable"):
            ckpt.save(1, make_state(mesh), {"ids": {1, 2}})
        assert ckpt.all_steps() == []


def damage_truncate(step_dir: pathlib.Path):
    path = data_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_flip(step_dir: pathlib.Path):
    """Flips bits in the middle of the (compressed) array data, keeping the file's size."""
    path = data_file(step_dir)
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def damage_swap_state(step_dir: pathlib.Path):
    """Replaces the arrays by the previous step's: readable, but not what step 3 saved."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(step_dir.parent / "2" / "state", step_dir / "state")


def damage_delete_data(step_dir: pathlib.Path):
    data_file(step_dir).unlink()


def damage_delete_host(step_dir: pathlib.Path):
    shutil.rmtree(step_dir / "host")


@pytest.mark.parametrize(
    "damage,reason",
    [
        (damage_truncate, ""),
        (damage_flip, ""),
        (damage_swap_state, "does not match its saved fingerprint"),
        (damage_delete_data, ""),
        (damage_delete_host, "host"),
    ],
)
def test_damaged_latest_falls_back(tmp_path, mesh, caplog, damage, reason):
    save_steps(tmp_path / "ck", mesh, [1, 2, 3])
    damage(tmp_path / "ck" / "3")
    with caplog.at_level(logging.WARNING):
        with checkpoint.RunCheckpointer(tmp_path / "ck", async_save=False) as ckpt:
            step, restored, host = ckpt.restore(abstract(make_state(mesh)))
            assert step == 2 and host["step"] == 2
            assert_same_state(restored, make_state(mesh, 2))
            # The bad step is kept for inspection but no longer listed, so it can be saved again.
            assert ckpt.all_steps() == [1, 2]
            assert ckpt.moved_aside()[0].startswith("3.unreadable-")
            assert ckpt.save(3, make_state(mesh, 3), HOST)
            assert ckpt.restore(abstract(make_state(mesh)))[0] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3" in w and "unreadable" in w and reason in w for w in warnings), warnings


KILLED_MID_SAVE = """
import os, sys
import jax.numpy as jnp
from rlscale import checkpoint
ckpt = checkpoint.RunCheckpointer(sys.argv[1])
for step in (1, 2):
    ckpt.save(step, {"w": jnp.full((4096, 4096), float(step))}, {"step": step})
    if step == 1:
        ckpt.wait()
os._exit(0)  # The process dies right after starting the second save, without wait().
"""


def test_save_killed_midway_is_ignored_and_cleaned(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_MID_SAVE)
    env = subprocess_env()
    subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], env=env, check=True)
    # Orbax wrote step 2 into a temporary directory and never renamed it.
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["1", "2.orbax-checkpoint-tmp"]
    target = {
        "w": jax.ShapeDtypeStruct(
            (4096, 4096), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
        )
    }
    with checkpoint.RunCheckpointer(tmp_path / "ck", async_save=False) as ckpt:
        assert ckpt.all_steps() == [1]
        step, state, host = ckpt.restore(target)
        assert step == 1 and host == {"step": 1} and float(state["w"][7, 9]) == 1.0
        assert ckpt.save(2, {"w": state["w"] + 1}, {"step": 2})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["1", "2"]


def test_explicit_step_and_none_readable(tmp_path, mesh):
    save_steps(tmp_path / "ck", mesh, [1, 2])
    target = abstract(make_state(mesh))
    with checkpoint.RunCheckpointer(tmp_path / "ck") as ckpt:
        step, restored, _ = ckpt.restore(target, step=1)
        assert step == 1
        assert_same_state(restored, make_state(mesh, 1))
        with pytest.raises(FileNotFoundError, match="no checkpoint of step 5"):
            ckpt.restore(target, step=5)
    for s in (1, 2):
        damage_truncate(tmp_path / "ck" / str(s))
    with checkpoint.RunCheckpointer(tmp_path / "ck") as ckpt:
        with pytest.raises(checkpoint.CheckpointError) as e:
            ckpt.restore(target)
        # Nothing is moved aside when nothing could be restored.
        assert ckpt.all_steps() == [1, 2] and ckpt.moved_aside() == []
    assert "no readable checkpoint" in str(e.value)
    assert "step 2:" in str(e.value) and "step 1:" in str(e.value)
    with checkpoint.RunCheckpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            ckpt.restore(target)


def test_wrong_structure_is_not_taken_for_corruption(tmp_path, mesh):
    save_steps(tmp_path / "ck", mesh, [1, 2])
    target = abstract(make_state(mesh))
    target["params"]["extra"] = jax.ShapeDtypeStruct((2,), jnp.float32)
    with checkpoint.RunCheckpointer(tmp_path / "ck") as ckpt:
        with pytest.raises(checkpoint.CheckpointError):
            ckpt.restore(target)
        assert ckpt.all_steps() == [1, 2]


def test_fingerprint_detects_single_word_changes():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32))
    base = int(checkpoint._leaf_fingerprint(x))
    # Any one word changed, and two different words swapped, change the fingerprint.
    assert int(checkpoint._leaf_fingerprint(x.at[4, 6].set(np.nextafter(x[4, 6], 9)))) != base
    assert int(checkpoint._leaf_fingerprint(x.at[0, 0].set(x[1, 0]).at[1, 0].set(x[0, 0]))) != base
    # Independent NumPy re-derivation.
    w = np.asarray(x).view(np.uint32).reshape(-1).astype(np.uint64)
    expected = int((w * (2 * np.arange(w.size, dtype=np.uint64) + 1)).sum() % (1 << 32))
    assert base == expected
    for dtype in (jnp.bfloat16, jnp.int8, jnp.bool_, jnp.uint32):
        assert checkpoint._leaf_fingerprint(x.astype(dtype)).dtype == jnp.uint32


def test_config_diff():
    saved = {"optim": {"lr": 1e-4, "b2": 0.95}, "steps": 100, "eval": {"every": 10, "n": 64}}
    current = ml_collections.ConfigDict(
        {
            "optim": {"lr": 3e-4, "b2": 0.95, "clip": 1.0},
            "steps": 500,
            "eval": {"every": 20, "n": 64},
            "sampling": {"buckets": (32, 64)},
        }
    )
    assert checkpoint.config_diff(saved, current) == [
        "eval.every: 10 -> 20",
        "optim.clip: (absent) -> 1.0",
        "optim.lr: 0.0001 -> 0.0003",
        "sampling.buckets: (absent) -> [32, 64]",
        "steps: 100 -> 500",
    ]
    assert checkpoint.config_diff(saved, current, ignore=("steps", "eval.every", "sampling")) == [
        "optim.clip: (absent) -> 1.0",
        "optim.lr: 0.0001 -> 0.0003",
    ]
    # Prefixes match whole dotted components; tuples equal the lists JSON turns them into.
    assert checkpoint.config_diff({"stepsize": 1}, {"stepsize": 2}, ignore=("steps",)) == [
        "stepsize: 1 -> 2"
    ]
    assert checkpoint.config_diff({"a": [1, 2], "b": "x"}, {"a": (1, 2), "b": "x"}) == []
    # A key the saved config lacks (added to the library since) compares as its default.
    defaults = {"optim": {"clip": 1.0}, "sampling": {"buckets": (16,)}}
    assert checkpoint.config_diff(saved, current, ("steps", "eval"), defaults) == [
        "optim.lr: 0.0001 -> 0.0003",
        "sampling.buckets: [16] -> [32, 64]",
    ]
    assert checkpoint.config_diff({"a": {"b": 1}}, {"a": 2}) == [
        "a: (absent) -> 2",
        "a.b: 1 -> (absent)",
    ]
    assert checkpoint.config_diff({"n": "x"}, {}) == ['n: "x" -> (absent)']
    assert checkpoint.config_diff({}, {}) == []
