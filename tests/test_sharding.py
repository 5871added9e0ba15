"""Sharding tests: mesh building, rule tables, sharded == single-device, resharding."""

import ast
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rlscale import model, sharding


def test_make_mesh_fill_and_errors():
    assert dict(sharding.make_mesh((-1, 2, 1)).shape) == {"data": 4, "fsdp": 2, "tensor": 1}
    assert dict(sharding.make_mesh((2, -1, 2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="cannot be filled from 8 devices"):
        sharding.make_mesh((3, -1, 1))
    # A smaller mesh on one host takes the first devices (a 1-device run in a test process).
    small = sharding.make_mesh((2, 2, 1))
    assert list(small.devices.flat) == jax.devices()[:4]
    with pytest.raises(ValueError, match="needs 3 devices, have 8"):
        sharding.make_mesh((3, 1, 1))
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.make_mesh((-1, -1, 1))


def test_logical_to_spec_rules():
    mesh = sharding.make_mesh((2, 2, 2))
    spec = sharding.logical_to_spec(
        ("embed", "heads", "head_dim"), sharding.TRAIN_RULES, mesh, (64, 4, 16)
    )
    assert spec == P("fsdp", "tensor", None)
    spec = sharding.logical_to_spec(
        ("embed", "heads", "head_dim"), sharding.SAMPLE_RULES, mesh, (64, 4, 16)
    )
    assert spec == P(None, "tensor", None)
    # A dimension the mesh axis does not divide is replicated instead of failing.
    assert sharding.logical_to_spec(("kv_heads",), sharding.TRAIN_RULES, mesh, (1,)) == P(None)
    assert sharding.logical_to_spec(("batch", None), sharding.TRAIN_RULES, mesh, (8, 3)) == P(
        ("data", "fsdp"), None
    )
    assert sharding.logical_to_spec(("batch",), sharding.TRAIN_RULES, mesh, (2,)) == P("data")
    with pytest.raises(ValueError, match="logical axis 'experts' has no rule"):
        sharding.logical_to_spec(("experts",), sharding.TRAIN_RULES, mesh)


@pytest.mark.slow
def test_sharded_init_equals_single_device_init():
    cfg = model.get("tiny")
    mesh = sharding.make_mesh((2, 2, 2))
    _, sharded = model.init_sharded(cfg, jax.random.key(0), mesh)
    single = model.init_params(cfg, jax.random.key(0))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_array_equal(a, b)
    q = sharded["layers"][0]["attn"]["q"][...]
    assert q.sharding.spec == P("fsdp", "tensor", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (32, 2, 16)


@pytest.mark.parametrize("rules", ["train", "sample"])
def test_forward_on_2x2x2_mesh_equals_single_device(rules):
    cfg = model.get("tiny")
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    mesh = sharding.make_mesh((2, 2, 2))
    table = sharding.RULES[rules]
    sharded = sharding.reshard(params, sharding.param_shardings(params, mesh, table))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (8, 12)), jnp.int32)
    mask = jnp.asarray(np.arange(12)[None] >= rng.integers(0, 6, (8, 1)))
    pos = model.positions_from_mask(mask)
    batch = sharding.batch_sharding(mesh, 2, table)
    fwd = jax.jit(model.forward, static_argnums=0)
    expected, _ = fwd(graphdef, params, tokens, pos, mask)
    got, _ = fwd(graphdef, sharded, *jax.device_put((tokens, pos, mask), batch))
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.slow
def test_reshard_train_to_sample_layout_keeps_values():
    cfg = model.get("tiny")
    mesh = sharding.make_mesh((2, 2, 2))
    _, train = model.init_sharded(cfg, jax.random.key(0), mesh)
    sample = sharding.reshard(train, sharding.param_shardings(train, mesh, sharding.SAMPLE_RULES))
    for a, b in zip(jax.tree.leaves(train), jax.tree.leaves(sample)):
        np.testing.assert_array_equal(a, b)
    assert sample["layers"][0]["mlp"]["gate"][...].sharding.spec == P(None, "tensor")
    assert train["layers"][0]["mlp"]["gate"][...].sharding.spec == P("fsdp", "tensor")


def _imported_modules(module) -> set[str]:
    """Every module an `import` statement in `module`'s source names, deferred ones included
    (`from a import b` counts as both `a` and `a.b`: `b` may be a submodule)."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_sharding_imports_nothing_from_the_model():
    """Imports point down: the model package uses `sharding`, never the other way round (a
    deferred import inside a function once hid this cycle)."""
    imported = _imported_modules(sharding)
    assert "jax" in imported  # The walk sees the module's imports.
    upward = sorted(n for n in imported if n == "rlscale.model" or n.startswith("rlscale.model."))
    assert upward == [], f"rlscale.sharding imports {upward}"
