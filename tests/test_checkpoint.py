"""Params checkpoints: exact round trip, restored directly onto a mesh."""

import jax
import numpy as np
import pytest

from rlscale import checkpoint, model, sharding


def test_params_round_trip_onto_mesh(tmp_path):
    cfg = model.get("tiny", attn_bias=True)
    params = model.init_params(cfg, jax.random.key(3))
    checkpoint.save_params(str(tmp_path / "ck"), cfg, params)
    mesh = sharding.make_mesh((2, 2, 2))
    cfg2, graphdef, restored = checkpoint.load_params(str(tmp_path / "ck"), mesh=mesh)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(a, b)
    gate = restored["layers"][1]["mlp"]["gate"][...]
    assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    with pytest.raises(FileNotFoundError, match="not an rlscale params checkpoint"):
        checkpoint.load_params(str(tmp_path / "missing"))
