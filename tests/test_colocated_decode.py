"""Tensor-parallel decode on the trainer's own devices (`pipeline.generator_tensor` > 1 with
`pipeline.generator_devices=0`): the roles time-slice the devices, the trainer shards its
params over fsdp and the generator sees the same devices as a (devices / t, 1, t) mesh, so
it holds 1/t of every split matrix instead of a whole copy per device."""

import json

import jax
import numpy as np
import pytest
from conftest import golden_config, random_decoder_params
from test_rl import assert_golden

from rlscale import model, rl, sharding
from rlscale.planning import planner, report


def test_the_generator_mesh_is_the_trainers_devices_split_tensor_ways():
    """(1, 8, 1) for the trainer, (2, 1, 4) for the generator, over the same 8 devices: a
    matrix whose heads split 4 ways holds a quarter per device, with the same values."""
    train, gen = sharding.role_meshes((1, 8, 1), 0, 4)
    assert dict(gen.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert sharding.same_devices(train, gen) and gen is not train
    cfg = model.get("tiny")  # 4 query heads.
    params = random_decoder_params(cfg, 0)
    trained = sharding.reshard(
        params, sharding.param_shardings(params, train, sharding.TRAIN_RULES)
    )
    decoded = sharding.reshard(
        trained, sharding.param_shardings(params, gen, sharding.SAMPLE_RULES)
    )
    q = decoded["layers"][0]["attn"]["q"][...]
    assert q.addressable_shards[0].data.shape[1] == cfg.num_heads // 4
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(decoded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="tensor axis of 3 does not divide the 8 devices"):
        sharding.role_meshes((1, 8, 1), 0, 3)


def test_a_tensor_axis_that_does_not_divide_the_shared_devices_is_refused():
    config = golden_config("quickstart")
    config.mesh.shape = (1, 4, 1)
    config.pipeline.generator_tensor = 3
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert (
        "pipeline.generator_tensor=3 does not divide the 4 devices the roles share "
        "(mesh.shape=(1, 4, 1), pipeline.generator_devices=0): the generator's mesh is "
        "(devices / generator_tensor, 1, generator_tensor)"
    ) in str(e.value)


def test_a_colocated_tensor_parallel_run_is_the_golden_run(warm, tmp_path):
    """The quickstart's golden run with the trainer on (1, 2, 1) and the generator on the
    same 2 devices as (1, 1, 2): every exact field equal to the recorded one's and the
    rounded ones within `golden_tolerance`, as between two CPUs (the splits change only the
    order of sums; test_rl.test_golden_metrics has the argument). Measured: within 1.5e-7 of
    max(|value|, 1). The engine's programs ran on the tensor mesh."""
    config = golden_config("quickstart")
    config.sft.reuse_from = str(warm)
    config.mesh.shape = (1, 2, 1)
    config.pipeline.generator_tensor = 2
    rl.run(rl.resolve(config), str(tmp_path))
    assert_golden(tmp_path, "quickstart", config)
    entries = json.load(open(tmp_path / "programs.json"))
    meshes = {e["name"]: e["mesh_shape"] for e in entries}
    assert meshes["engine_decode"] == {"data": 1, "fsdp": 1, "tensor": 2}
    assert meshes["update_step"] == {"data": 1, "fsdp": 2, "tensor": 1}


@pytest.mark.slow
def test_the_plan_counts_both_roles_on_the_shared_devices():
    """A plan of the trainer on (1, 4, 1) and the generator on the same devices as (2, 1, 2):
    one "shared" column with both roles' bytes; the generator's params are half of every
    matrix (the tiny model's heads, MLP and vocabulary split) and no norm: the norms are
    replicated in both layouts, so the generator reads the trainer's own buffers. The advice
    for them is the next tensor axis."""
    config = golden_config("quickstart")
    config.mesh.shape = (1, 4, 1)
    config.batch.prompts = 8
    config.pipeline.generator_tensor = 2
    run = rl.resolve(config)
    train, gen = sharding.role_meshes((1, 4, 1), 0, 2)
    cfg = planner.model_config(run, "tiny")
    p = planner.plan_run(run, cfg, train, gen, 16)
    assert list(p.roles) == ["shared"] and p.info["shared_devices"]
    b = p.roles["shared"]
    assert b["params"] > 0 and b["opt_state"] > 0  # The trainer's, beside the generator's.
    norms = (2 * cfg.num_layers + 1) * cfg.d_model
    assert b["generator_params"] == (cfg.num_params() - norms) // 2 * 4
    assert report.advice("generator_params", p.info["settings"]).startswith(
        "pipeline.generator_tensor=4 (now 2"
    )
