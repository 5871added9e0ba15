"""Tensor-parallel decode (`pipeline.generator_tensor`): the generator's own mesh, or the
trainer's in sync mode, split over `tensor` by `sharding.SAMPLE_RULES` samples what the
unsplit generator samples, holds a tensor-th of the weights per device, and bad sizes fail
at start-up naming the key."""

import jax
import numpy as np
import pytest
from conftest import golden_config, random_decoder_params, rounding
from test_determinism import REDUCTIONS, TERMS

from rlscale import model, programs, rl, sections, sharding
from rlscale.planning import inputs, planner, report
from rlscale.sampling import SamplingConfig
from rlscale.sampling.generator import Generator, Request
from rlscale.sampling.sampler import _Layout

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]
SCFG = SamplingConfig(max_new_tokens=10, num_samples=2, temperature=1.0, buckets=(8,))
SLOTS = 4


@pytest.fixture(scope="module")
def policy():
    cfg = model.get("tiny")  # 4 query heads, 2 kv heads, MLP 128, vocabulary 256.
    graphdef, _ = model.abstract_model(cfg)
    return cfg, graphdef, random_decoder_params(cfg, 0)


@pytest.fixture(scope="module")
def unsplit(policy):
    """`_generate` on 4 devices, data parallel only: (4, 1, 1)."""
    _, mesh = sharding.role_meshes((1, 4, 1), 4, 1)
    return _generate(policy, mesh)


def _generate(policy, mesh):
    """Every prompt's samples on `mesh` (same request keys whatever the mesh), the sampled
    tokens and logprobs, and the `Programs` that compiled the engine."""
    cfg, graphdef, params = policy
    progs = programs.Programs(mesh)
    gen = Generator(graphdef, cfg, SCFG, slots=SLOTS, max_prompt_len=8, mesh=mesh, programs=progs)
    shardings = sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES)
    gen.set_params(sharding.reshard(params, shardings), 0)
    rng = jax.random.key(5)
    gen.submit([Request(i, p, jax.random.fold_in(rng, i)) for i, p in enumerate(PROMPTS)])
    done = []
    while gen.busy:
        done += gen.step(4).completed
    done.sort(key=lambda c: c.request.id)
    tokens = np.concatenate([c.tokens_GM for c in done])
    logprobs = np.concatenate([c.logprobs_GM for c in done])
    mask = np.concatenate([c.mask_GM for c in done])
    return tokens, logprobs, mask, gen, progs


@pytest.mark.parametrize(
    "tensor, shape",
    [
        (2, None),  # Generator mesh (2, 1, 2): query and kv heads split.
        (4, None),  # (1, 1, 4): query heads split, the 2 kv heads replicated.
        (4, (1, 2, 4)),  # Sync mode: the trainer's mesh, its own tensor axis.
    ],
)
def test_tensor_parallel_decode_samples_what_one_device_per_replica_samples(
    policy, unsplit, tensor, shape
):
    """The same request keys on a generator mesh of 4 devices, data parallel only (4, 1, 1),
    and split `tensor` ways: the same tokens, and logprobs within float32 rounding. Tensor
    parallelism changes only the order of the sums: each device adds its heads', MLP
    columns' and vocabulary shard's share, and an all-reduce adds the shares. So each of the
    `REDUCTIONS` a logprob passes through moves by at most `rounding(TERMS)` of its terms'
    magnitudes, as between the sampler and the trainer (test_determinism): |dlogp| <=
    REDUCTIONS rounding(TERMS) (1 + |logp|). (A flipped token would need a draw within
    about 1e-6 of a boundary.) In sync mode (`shape`: the trainer's mesh, shared) the
    generator decodes on the trainer's tensor axis."""
    if shape is None:
        _, mesh = sharding.role_meshes((1, 4, 1), 4, tensor)
    else:
        mesh, gen_mesh = sharding.role_meshes(shape, 0)
        assert gen_mesh is mesh
    assert dict(mesh.shape)["tensor"] == tensor
    tokens, logprobs, mask, _, _ = unsplit
    got_tokens, got_logprobs, got_mask, gen, _ = _generate(policy, mesh)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_array_equal(got_mask, mask)
    assert mask.sum() > len(PROMPTS) * SCFG.num_samples  # Several tokens per sample.
    tol = REDUCTIONS * rounding(TERMS) * (1.0 + np.abs(logprobs))
    assert np.all(np.abs(got_logprobs - logprobs)[mask] <= tol[mask])
    # The cache's kv heads: split where the axis divides them (2 kv heads), else whole.
    cfg = policy[0]
    K = cfg.num_kv_heads
    k = gen.state.cache.k[0]
    assert k.addressable_shards[0].data.shape[1] == (K // tensor if K % tensor == 0 else K)


def _per_device_bytes(tree) -> int:
    """Bytes of the arrays' shards on the first device of their mesh."""
    device = jax.tree.leaves(tree)[0].sharding.mesh.devices.flat[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


@pytest.mark.parametrize("tensor", [2, 4])
def test_generator_param_bytes_fall_by_the_tensor_axis(policy, tensor):
    """Per device, the generator's params on a (4 / tensor, 1, tensor) mesh against (4, 1,
    1), read from the arrays' own shards: every weight with a query-head, MLP or vocabulary
    dimension holds a tensor-th; the kv projections a tensor-th where the axis divides the
    2 kv heads (tensor 2), whole where it does not (4); the norms' scales whole. Counted by
    hand from the architecture."""
    cfg, _, params = policy
    _, one = sharding.role_meshes((1, 4, 1), 4, 1)
    _, split = sharding.role_meshes((1, 4, 1), 4, tensor)
    put = {
        m: sharding.reshard(params, sharding.param_shardings(params, m, sharding.SAMPLE_RULES))
        for m in (one, split)
    }
    D, H, K, E, F, V, L = (
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.mlp_dim,
        cfg.vocab_size,
        cfg.num_layers,
    )
    kv = 2 * D * K * E / (tensor if K % tensor == 0 else 1)  # k and v.
    per_layer = 2 * D * H * E / tensor + kv + 3 * D * F / tensor + 2 * D  # q, o; MLP; norms.
    head = 0 if cfg.tie_embeddings else V * D / tensor
    expected = 4 * (L * per_layer + V * D / tensor + head + D)  # float32; the final norm.
    assert _per_device_bytes(put[split]) == expected
    assert _per_device_bytes(put[one]) == 4 * cfg.num_params(include_embedding=True)


@pytest.mark.parametrize("name, tensor", [("llama3_8b", 8), ("qwen2.5_7b", 4)])
def test_real_size_generator_params_fall_by_the_tensor_axis(name, tensor):
    """At real sizes, from the abstract params' shardings (shard shapes, nothing allocated):
    a tensor-th per device, within 0.1% (the norms' scales, whole; every head count divides
    here: llama3_8b 32 and 8 kv heads on 8, qwen2.5_7b 28 and 4 on 4)."""
    cfg = model.get(name, num_layers=2)  # Each layer as the model's: a quicker trace.
    one = sharding.make_mesh((8, 1, 1))
    split = sharding.make_mesh((8 // tensor, 1, tensor))
    bytes_ = {
        m: planner.device_bytes(planner.abstract_params(cfg, m, sharding.SAMPLE_RULES)[1])
        for m in (one, split)
    }
    assert bytes_[one] == 2 * cfg.num_params()  # bfloat16, whole on each device.
    assert bytes_[split] == pytest.approx(bytes_[one] / tensor, rel=1e-3)


def test_tensor_parallel_decode_divides_the_work(policy):
    """Per device, the compiled decode step on (2, 1, 2) does half the FLOPs of (2, 1, 1)
    (the same slots per device, half the heads, MLP columns and vocabulary each), read from
    the compiled program's cost analysis (up to the unsplit norms and sampling)."""
    flops = {}
    for tensor in (1, 2):
        mesh = sharding.make_mesh((2, 1, tensor), jax.devices()[: 2 * tensor])
        *_, progs = _generate(policy, mesh)
        (entry,) = [e for e in progs.entries if e["name"] == "engine_decode"]
        flops[tensor] = entry["flops_per_device"]
    assert flops[2] == pytest.approx(flops[1] / 2, rel=0.15), flops


def _problems(**pipeline) -> list[str]:
    c = golden_config("quickstart")  # The tiny model.
    c.mesh.shape = (1, 2, 1)
    c.batch.prompts = 8
    c.pipeline.update(pipeline)
    try:
        rl.resolve(c)
    except sections.InvalidConfigError as e:
        return e.problems
    return []


def test_bad_generator_tensor_fails_at_start_up_naming_the_key():
    """What start-up refuses: a size below 1, one that does not divide the generator's
    devices, one that does not divide the query heads (tiny: 4; its 2 kv heads may
    replicate). On shared devices a tensor axis is allowed (`test_colocated_decode`)."""
    ok = dict(mode="pipeline", generator_devices=4, slots=4)
    assert _problems(**ok, generator_tensor=4) == []
    six = {**ok, "generator_devices": 6, "slots": 12}
    assert _problems(**six, generator_tensor=2) == []
    assert _problems(**ok, generator_tensor=0) == [
        "pipeline.generator_tensor=0 must be an integer >= 1 (1: no tensor axis)"
    ]
    assert _problems(mode="sync", generator_tensor=2) == []  # Shared: test_colocated_decode.
    assert _problems(**ok, generator_tensor=3) == [
        "pipeline.generator_tensor=3 does not divide pipeline.generator_devices=4: the "
        "generator's mesh is (generator_devices / generator_tensor, 1, generator_tensor)"
    ]
    assert _problems(**six, generator_tensor=3) == [
        "pipeline.generator_tensor=3 does not divide the policy's 4 query heads (2 kv "
        "heads): tensor-parallel decode splits the query heads (kv heads are replicated "
        "where they do not divide); use one of [2, 4] (or 1)"
    ]


def test_plan_devices_count_the_generators_own():
    """The planner's target: `--mesh` is the trainer's; the devices planned are its product
    plus `pipeline.generator_devices`, and a `--devices` that differs names both."""
    flags = dict(
        model="tiny",
        mesh="1,4,1",
        devices=None,
        platform="cpu",
        accelerator=None,
        hbm_gib=None,
        prompt_len=None,
        config_mesh=(1, 1, 1),
        buckets=(16, 64),
        generator_devices=4,
    )
    problems, target = inputs.check_target(**flags)
    assert problems == [] and target.devices == 8
    problems, _ = inputs.check_target(**{**flags, "devices": 4})
    assert problems == [
        "--mesh=1,4,1 has 8 devices (data x fsdp x tensor, plus "
        "pipeline.generator_devices=4) but --devices=4; they must be equal"
    ]


@pytest.mark.slow
def test_plan_of_a_tensor_parallel_generator():
    """A plan with the generator on its own 4 devices, 2 ways tensor parallel: its column
    holds half of every weight matrix (the tiny model's 4 query, 2 kv heads, MLP and
    vocabulary all split; the norms whole) and the engine state of its (2, 1, 2) mesh, the
    table says how the heads split, and the advice for its weights names the next
    `pipeline.generator_tensor`."""
    config = golden_config("quickstart")
    config.mesh.shape = (1, 4, 1)
    config.batch.prompts = 8
    config.pipeline.update(mode="pipeline", generator_devices=4, generator_tensor=2)
    run = rl.resolve(config)
    train, gen = sharding.role_meshes((1, 4, 1), 4, 2)
    cfg = planner.model_config(run, "tiny")
    p = planner.plan_run(run, cfg, train, gen, 16)
    norms = (2 * cfg.num_layers + 1) * cfg.d_model
    b = p.roles["generator"]
    itemsize = 4  # float32 params.
    assert b["generator_params"] == ((cfg.num_params() - norms) // 2 + norms) * itemsize
    scfg = planner.sampling_config(run)
    layout = _Layout(gen, sharding.SAMPLE_RULES)
    state = planner.abstract_engine_state(cfg, scfg, run.pipeline.slots, 16, layout)
    assert b["kv_cache"] == planner.device_bytes(state)
    k = state.cache.k[0]
    assert k.sharding.shard_shape(k.shape)[1] == cfg.num_kv_heads // 2
    text = report.table(p, report.ACCELERATORS["h100"], 80e9, "here", "tiny", "quickstart")
    assert (
        "  generator tensor axis 2: 2 of 4 query heads and 1 of 2 kv heads per device; params "
        f"{report.size(b['generator_params'])} + KV cache {report.size(b['kv_cache'])} per "
        "device"
    ) in text.splitlines()
    assert report.advice("generator_params", p.info["settings"]).startswith(
        "pipeline.generator_tensor=4 (now 2"
    )


def test_plan_models_the_configured_attention():
    """The planned model computes with the run's `model.attention` (the update it compiles
    is the run's), not the architecture's default."""
    config = golden_config("quickstart")
    config.model.attention = "dot_product"
    assert planner.model_config(rl.resolve(config), "tiny").attention == "dot_product"
