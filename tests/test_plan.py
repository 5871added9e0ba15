"""The AOT planner (`rlscale.planning`: `planner`, `inputs`, `report`; `python -m
rlscale.main.plan`): per-device bytes against the model's own parameter count and against
the arrays a run really allocates, FLOPs per step independent of how the batch is split, the
flag checks, the verdict, the JSON, and the CLI's bad input."""

import dataclasses
import functools
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT, load_config, subprocess_env
from jax.sharding import NamedSharding, PartitionSpec

from rlscale import model, rl, sharding
from rlscale.model import lora, moe
from rlscale.planning import hlo, inputs, planner, report, topology
from rlscale.rl import checks
from rlscale.rl import setup as rl_setup
from rlscale.sampling import generator
from rlscale.sampling.sampler import _Layout
from rlscale.scaling import compute


def _norm_params(cfg) -> int:
    """Parameters of the RMSNorm scales: replicated by every rule table."""
    return (2 * cfg.num_layers + 1) * cfg.d_model + (2 * cfg.head_dim * cfg.num_layers) * int(
        cfg.qk_norm
    )


@pytest.mark.parametrize("shape", [(1, 8, 1), (1, 4, 2), (2, 2, 2), (8, 1, 1)])
def test_param_bytes_are_the_model_split_over_fsdp_and_tensor(shape):
    """Independent reference: the config's parameter count (`num_params`) x bytes per param,
    the matrices split fsdp x tensor ways (data replicates) and the norm scales whole."""
    cfg = model.get("tiny", param_dtype="bfloat16")
    mesh = sharding.make_mesh(shape)
    _, params = planner.abstract_params(cfg, mesh, sharding.TRAIN_RULES)
    shards = shape[1] * shape[2]
    norms = _norm_params(cfg)
    assert planner.device_bytes(params) == ((cfg.num_params() - norms) // shards + norms) * 2


@pytest.mark.parametrize("name,shape", [("llama3_8b", (1, 8, 1)), ("qwen2.5_7b", (1, 4, 2))])
def test_real_size_param_bytes_within_5_percent_of_an_eighth(name, shape):
    """The issue's check at the real sizes, without compiling (the CLI does the same)."""
    cfg = model.get(name)
    _, params = planner.abstract_params(cfg, sharding.make_mesh(shape), sharding.TRAIN_RULES)
    eighth = cfg.num_params() * 2 / 8  # bfloat16 params.
    assert abs(planner.device_bytes(params) / eighth - 1) < 0.05


def _learner_config(**learner):
    c = load_config("grpo")  # Reads `ref_logp`: a reference to account.
    c.learner.update(learner)
    return c


def test_abstract_train_state_is_learner_init():
    """The planner's abstract state has the tree, shapes, dtypes and shardings that
    `Learner.init` gives real arrays (bfloat16 params: float32 masters and moments), and its
    bytes per device are those of the real arrays' shards."""
    cfg = model.get("tiny", param_dtype="bfloat16", dtype="bfloat16")
    mesh = sharding.make_mesh((2, 2, 2))
    config = _learner_config()
    graphdef, params = model.init_sharded(cfg, jax.random.key(0), mesh)
    learn = rl_setup.make_learner(rl.resolve(config), graphdef, params, mesh, None)
    value = sharding.replicate({"w": jnp.zeros((cfg.d_model,)), "b": jnp.zeros(())}, mesh)
    real = learn.init(params, value)

    _, abstract_params = planner.abstract_params(cfg, mesh, sharding.TRAIN_RULES)
    abstract_value = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), value
    )
    abstract = planner.abstract_train_state(learn, abstract_params, abstract_value)
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
        assert (a.shape, a.dtype) == (r.shape, r.dtype)
        assert a.sharding.is_equivalent_to(r.sharding, r.ndim), (a.sharding, r.sharding)
    master = [x for x in jax.tree.leaves(real.opt_state) if x.dtype == jnp.float32]
    assert sum(x.size for x in master) >= 3 * cfg.num_params()  # Masters, mu, nu.

    def shard_bytes(tree):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    for field in ("params", "opt_state"):
        got = planner.device_bytes(getattr(abstract, field))
        assert got == shard_bytes(getattr(real, field)), field


def test_kv_cache_bytes_are_the_engines():
    """The abstract engine state's bytes per device equal those of the state a real
    `Generator` allocates."""
    config = load_config("quickstart")
    cfg = model.get("tiny")
    mesh = sharding.make_mesh((2, 2, 2))
    scfg = planner.sampling_config(rl.resolve(config))
    slots, P = config.batch.prompts * config.batch.group_size, scfg.buckets[-1]
    graphdef, _ = model.abstract_model(cfg)
    real = generator.Generator(graphdef, cfg, scfg, slots, P, mesh)
    layout = _Layout(mesh, sharding.SAMPLE_RULES)
    abstract = planner.abstract_engine_state(cfg, scfg, slots, P, layout)
    expected = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(real.state))
    assert planner.device_bytes(abstract) == expected


# A model whose matmuls dominate its FLOPs (the norms, softmax and optimizer are ~1%).
WIDE = dict(d_model=256, mlp_dim=1024, num_heads=4, head_dim=64, num_kv_heads=2)


@pytest.fixture(scope="module")
def tiny_plan():
    config = load_config("quickstart")
    config.mesh.shape = (1, 2, 1)
    train, gen = sharding.role_meshes((1, 2, 1), 0)
    cfg = dataclasses.replace(planner.model_config(rl.resolve(config), "tiny"), **WIDE)
    p = planner.plan_run(rl.resolve(config), cfg, train, gen, 64)
    return config, cfg, p


@pytest.mark.slow
def test_plan_json_and_terms(tiny_plan):
    config, cfg, p = tiny_plan
    h100 = report.ACCELERATORS["h100"]
    out = json.loads(json.dumps(report.to_json(p, h100, model="tiny")))
    b = out["per_device_bytes"]
    assert {"params", "opt_state", "grads", "temp", "kv_cache", "total"} <= set(b)
    norms = _norm_params(cfg)
    value_head = (cfg.d_model + 1) * 4
    assert b["params"] == ((cfg.num_params() - norms) // 2 + norms) * 4 + value_head
    assert b["grads"] == b["params"]  # Float32 accumulators of float32 params, same layout.
    # Sampling keeps whole matrices on each fsdp replica: a copy of every one.
    assert b["generator_params"] == (cfg.num_params() - norms) * 4  # The norms stay shared.
    assert out["flops_per_device"] == pytest.approx(
        sum(e["flops_per_step"] for e in out["programs"].values())
    )
    decode = out["programs"]["engine_decode"]
    assert decode["calls_per_step"] == config.sampling.max_new_tokens
    # The roofline bound: the roles share devices, so the phases add up; each decode step
    # reads at least the weights and the cache.
    s = out["step_seconds"]
    assert s["step"] == pytest.approx(s["update"] + s["prefill"] + s["decode"])
    assert s["decode"] >= decode["calls_per_step"] * out["decode_bytes"] / h100.hbm_bandwidth
    assert s["update"] == pytest.approx(
        out["programs"]["update_step"]["flops_per_step"] / h100.peak_flops
    )


def test_generator_flops_match_the_analytic_count(tiny_plan):
    """Independent reference (`scaling.compute`): a decode step is one token's forward pass
    per slot over the cache's columns, its slots split over the batch axes (fsdp=2); the
    prefill is the forward pass of the admitted prompts, the head at their last position
    only, its rows split over the batch axes as the slots are (each device prefills the
    requests whose samples it holds)."""
    config, cfg, p = tiny_plan
    S, R, P = p.info["slots"], p.info["prefill_rows"], p.info["prompt_bucket"]
    assert R == p.info["prefill_requests"] == config.batch.prompts  # 4 per shard, no padding.
    C = P + config.sampling.max_new_tokens
    decode = p.programs["engine_decode"]
    assert decode["loop_factor"] == 1.0  # A while_loop: one decode step per call counted.
    assert decode["flops_per_device"] == pytest.approx(
        compute.forward_flops(cfg, S, C) / 2, rel=0.02
    )
    head = 2 * R * (P - 1) * cfg.vocab_size * cfg.d_model  # Not computed before the last.
    prefill = compute.forward_flops(cfg, R * P, P) - head
    insert = p.programs["engine_insert"]
    assert insert["calls_per_step"] == 1
    assert insert["flops_per_step"] == pytest.approx(prefill / 2, rel=0.02)


def test_check_target_defaults_and_every_problem_at_once():
    """The flags' values alone: the defaults come from the config's mesh and buckets and the
    platform's accelerator; bad values are all reported, each naming its flag."""
    flag_values = dict(
        model="tiny",
        mesh=None,
        devices=None,
        platform="tpu",
        accelerator=None,
        hbm_gib=None,
        prompt_len=None,
        config_mesh=(1, 4, 2),
        buckets=(16, 64),
    )
    problems, target = inputs.check_target(**flag_values)
    assert problems == []
    assert target == inputs.Target(
        (1, 4, 2),
        8,
        "tpu_v5p",
        report.ACCELERATORS["tpu_v5p"].hbm_bytes,
        64,
        topology.parse("v5p-16"),  # The accelerator's slice of 8 chips.
    )
    bad = {**flag_values, "mesh": "2,x,1", "accelerator": "a100", "prompt_len": 65}
    problems, _ = inputs.check_target(**bad)
    assert problems == [
        "--mesh=2,x,1: expected three positive sizes data,fsdp,tensor (or four: "
        "data,fsdp,tensor,expert)",
        "--accelerator=a100: not one of h100, h200, tpu_v5e, tpu_v5p, tpu_v6e",
        "--prompt_len=65 is longer than the largest prompt bucket (sampling.buckets=(16, 64))",
    ]
    problems, target = inputs.check_target(**{**flag_values, "hbm_gib": 0.5})
    assert problems == [] and target.hbm_bytes == report.GIB / 2


def test_verdict_names_the_largest_term_and_its_knobs(tiny_plan):
    _, _, p = tiny_plan
    total = p.per_device_bytes["total"]
    assert report.verdict(p, total) == (
        True,
        f"FITS: {report.size(total)} of {report.size(total)} per device",
    )
    fits, message = report.verdict(p, total - 1)
    big = max(planner.TERMS, key=lambda k: p.per_device_bytes[k])
    assert not fits
    assert f"the largest term is {big}" in message
    assert report.advice(big, p.info["settings"]) in message


def _pack_problems(config, longest_prompt):
    run = rl.resolve(config)
    return checks.pack_problems(run.learner, run.batch, run.sampling, longest_prompt)


def test_next_pack_rows_is_half_while_the_checks_accept_it():
    """The knob that bounds a micro-batch is `pack_rows`, halved down to one row: below a
    group a micro-batch holds part of one (`Layout.split_groups`), which the run's checks
    accept unless prompt_mean follows a loss-stage transform that narrows the mask
    (`checks.split_problems`). One sequence per row (the smoke config): 8 prompts x 4 on a
    batch split 8 ways leave 4 rows per shard (a minibatch's), 32 prompts 16."""
    config = load_config("quickstart")
    config.mesh.shape = (2, 4, 1)
    mesh = sharding.make_mesh((2, 4, 1))
    assert planner.next_pack_rows(rl.resolve(config), mesh, 16) == 2
    config.batch.prompts = 32
    assert planner.next_pack_rows(rl.resolve(config), mesh, 16) == 8
    for rows in (1, 2, 3, 4, 8):  # Packing holds any number of rows.
        config.learner.pack_rows = rows
        assert not _pack_problems(config, 16)
        assert planner.next_pack_rows(rl.resolve(config), mesh, 16) == rows // 2
    narrowed = load_config("quickstart", "smoke,entropy_rho=0.2")  # Narrows, then prompt_mean.
    narrowed.mesh.shape = (2, 4, 1)
    narrowed.learner.pack_rows = 8
    assert planner.next_pack_rows(rl.resolve(narrowed), mesh, 16) == 4
    narrowed.learner.pack_rows = 4  # The group size: half would split groups.
    assert planner.next_pack_rows(rl.resolve(narrowed), mesh, 16) == 0
    narrowed.learner.pack_rows = 2
    with pytest.raises(ValueError, match="learner.pack_rows=2 below batch.group_size=4"):
        rl.resolve(narrowed)


def test_temp_advice_names_each_knob_with_its_value():
    settings = {
        "mesh": (2, 4, 1),
        "param_dtype": "float32",
        "pack_rows": 16,
        "next_pack_rows": 8,
        "remat": "none",
        "logprob_chunk": 1024,
        "slots": 32,
        "max_new_tokens": 32,
    }
    assert report.advice("temp", settings) == (
        "learner.pack_rows=8 (now 16), learner.remat=dots (now none), "
        "learner.logprob_chunk=256 (now 1024), more data x fsdp devices (--mesh=2,4,1)"
    )
    # Every knob at its limit: only more devices are left.
    spent = {**settings, "next_pack_rows": 0, "remat": "full", "logprob_chunk": 1}
    assert report.advice("temp", spent) == "more data x fsdp devices (--mesh=2,4,1)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,learner",
    [
        ((1, 2, 1), {}),
        # One sequence per row, a group's 4 rows per shard at a time: a loop over 4
        # micro-batches per step, each over chunks of 8 tokens.
        ((2, 1, 2), dict(pack_length=0, pack_rows=4, logprob_chunk=8)),
        ((1, 2, 1), dict(remat="full")),
    ],
)
def test_update_flops_match_the_analytic_count(shape, learner):
    """Independent reference: `scaling.compute`'s 2 FLOPs per matmul parameter per token plus
    attention over the whole sequence, forward and backward (twice the forward), per device.
    XLA counts a loop body once; the planner's loop factor restores every micro-batch and
    every logprob chunk, and the count divides over data x fsdp x tensor. With `remat=full`
    the backward pass recomputes each block's forward but its MLP down-projection, whose
    output no gradient needs. With chunked vocabulary terms (`learner.logprob_chunk` below a
    shard's forward-row tokens in a micro-batch) the head runs on whole chunks, padding
    included, and the backward pass recomputes each chunk's logits: one more head forward."""
    config = load_config("quickstart")  # No old or reference terms: only the training pass.
    config.mesh.shape = shape
    config.learner.update(learner)
    cfg = model.get("tiny", **WIDE)
    mesh = sharding.make_mesh(shape)
    P = 64
    entry = planner.compile_update(rl.resolve(config), cfg, mesh, P)[-1]
    rows, T = config.batch.prompts * config.batch.group_size, P + config.sampling.max_new_tokens
    forward = compute.forward_flops(cfg, rows * T, T)
    expected = 3 * forward
    if learner.get("remat") == "full":
        head = cfg.vocab_size * cfg.d_model
        expected += forward - 2 * rows * T * (cfg.num_layers * cfg.d_model * cfg.mlp_dim + head)
    row_T, c = rl_setup.learner_layout(config).rows(rows, P, T - P, shape[0] * shape[1])
    X, chunk, head = c * row_T, config.learner.logprob_chunk, cfg.vocab_size * cfg.d_model
    if chunk < X:  # Every micro-batch's head positions, padded to whole chunks.
        padded = rows * T * (-(-X // chunk) * chunk) / X
        expected += 3 * 2 * head * (padded - rows * T) + 2 * head * padded
    got = entry["flops_per_device"] * entry["loop_factor"]
    assert got == pytest.approx(expected / mesh.devices.size, rel=0.02)
    if learner.get("pack_rows"):
        assert entry["flops_per_device"] < 0.6 * got  # What XLA alone reports.


def _cli(*args):
    env = subprocess_env()
    return subprocess.run(
        [sys.executable, "-m", "rlscale.main.plan", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_bad_input_every_problem_at_once():
    r = _cli(
        "--config=configs/quickstart.py:smoke",
        "--model=llama3_7b",
        "--mesh=2,2,2",
        "--devices=4",
        "--config.learner.logprob_chunk=0",
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    for text in (
        "--mesh=2,2,2 has 8 devices (data x fsdp x tensor) but --devices=4",
        "--model=llama3_7b: no such model; did you mean llama3_8b or llama3_1b? known: tiny,",
        "learner.logprob_chunk=0 must be an integer >= 1",
    ):
        assert text in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_cli_budget_too_small_exits_naming_the_largest_term(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli(
        "--config=configs/quickstart.py:smoke",
        "--model=tiny",
        "--mesh=1,1,1",
        "--hbm_gib=0.001",
        f"--out={out}",
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    saved = json.loads(out.read_text())
    b = saved["per_device_bytes"]
    big = max(planner.TERMS, key=lambda k: b[k])
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: DOES NOT FIT: {report.size(b['total'])} per device > 1.0 MiB")
    assert f"the largest term is {big}" in line
    assert "params" in r.stdout and "kv_cache" in r.stdout  # The table comes first.
    assert saved["fits"] is False and saved["flops_per_device"] > 0
    assert "1 fake CPU devices" in saved["compiled_on"]


# ------------------------------------------------------------------------------------------
# TPU slices: compiled for by libtpu with no TPU attached (`rlscale.planning.topology`).
# ------------------------------------------------------------------------------------------

# Cloud TPU's slice tables (cloud.google.com/tpu/docs/v5p, v5e, v6e): name -> chips per axis.
CLOUD_SLICES = {
    "v5p-8": (2, 2, 1),
    "v5p-64": (2, 4, 4),
    "v5p-128": (4, 4, 4),
    "v5p-1024": (8, 8, 8),
    "v5litepod-16": (4, 4),
    "v5e-256": (16, 16),
    "v6e-8": (2, 4),
    "v6e-32": (4, 8),
}


@pytest.mark.parametrize("name,shape", CLOUD_SLICES.items())
def test_tpu_slice_names_are_cloud_tpus(name, shape):
    """A Cloud TPU name gives libtpu the slice's shape in chips (v5p names count two
    TensorCores a chip, v5e and v6e names chips); libtpu's own name gives the same slice."""
    s = topology.parse(name)
    assert s.shape == shape and s.chips == math.prod(shape)
    generation = name.split("-")[0].replace("v5litepod", "v5e")
    assert s.topology_name == f"{generation}:{'x'.join(map(str, shape))}"
    assert s.accelerator == f"tpu_{generation}"
    assert topology.parse(s.topology_name) == s
    assert topology.of(s.accelerator, s.chips) == s
    per_chip = 2 if generation == "v5p" else 1
    assert s.name == f"{generation}-{s.chips * per_chip}"


def test_tpu_slice_bad_names_list_the_known_ones():
    for bad in ("v5p-63", "v5p-2", "v4-8", "v6e:4x4x4", "v5e-", "h100"):
        with pytest.raises(ValueError, match="is not a TPU slice: expected a Cloud TPU name"):
            topology.parse(bad)
    assert topology.of("h100", 8) is None and topology.of("tpu_v5e", 3) is None


def test_check_target_tpu_slice_every_problem_at_once():
    """The slice sets the devices' count, the accelerator and its memory; a mesh of another
    size, another accelerator and a slice without `--platform tpu` are refused, naming the
    flags."""
    flag_values = dict(
        model="tiny",
        mesh="1,16,2",
        devices=None,
        platform="tpu",
        accelerator=None,
        hbm_gib=None,
        prompt_len=None,
        config_mesh=(1, 8, 1),
        buckets=(64,),
        topology_name="v6e-32",
    )
    problems, target = inputs.check_target(**flag_values)
    assert problems == []
    assert target.tpu == topology.parse("v6e:4x8") and target.devices == 32
    assert (target.accelerator, target.hbm_bytes) == ("tpu_v6e", 32e9)
    bad = {**flag_values, "mesh": None, "accelerator": "tpu_v5p"}
    problems, _ = inputs.check_target(**bad)
    assert problems == [
        "--accelerator=tpu_v5p but --topology=v6e-32 is a tpu_v6e slice",
        "--mesh=1,8,1 plans 8 devices but --topology=v6e-32 has 32 chips (a device each); "
        "they must be equal, e.g. --mesh=1,32,1",
    ]
    problems, _ = inputs.check_target(**{**flag_values, "platform": "cpu"})
    assert problems == ["--topology=v6e-32 names a TPU slice: it needs --platform=tpu"]
    problems, _ = inputs.check_target(**{**flag_values, "topology_name": "v6e-33"})
    assert len(problems) == 1 and problems[0].startswith("--topology=v6e-33: 'v6e-33' is not")


def test_platform_tpu_without_libtpu_is_one_error_line(monkeypatch):
    """The suite's environment has no libtpu: `--platform tpu` fails at start-up in one
    line saying what to install (and nothing else is wrong with the command)."""
    monkeypatch.setattr(topology, "libtpu_version", lambda: None)
    (message,) = inputs.missing_libtpu("tpu")
    assert message.startswith("--platform=tpu compiles with libtpu, which is not installed")
    assert inputs.missing_libtpu("cpu") == []


@pytest.mark.skipif(topology.libtpu_version() is not None, reason="libtpu is installed")
def test_cli_platform_tpu_without_libtpu():
    r = _cli(
        "--config=configs/quickstart.py:smoke",
        "--model=tiny",
        "--platform=tpu",
        "--topology=v5p-16",
        "--mesh=1,8,1",
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: --platform=tpu compiles with libtpu, which is not installed")


def test_retarget_moves_a_program_onto_other_devices():
    """`topology.retarget` keeps each array's shape, dtype, spec and memory kind and each
    mesh's shape and axes, on the target devices (device i -> targets[i]), in the arguments
    and in the static ones (a `_Layout`'s mesh): the program then compiles for the targets."""
    mesh = sharding.make_mesh((1, 2, 2), jax.devices()[:4])
    targets = jax.devices()[::-1]
    x = jax.device_put(jnp.zeros((4, 8)), NamedSharding(mesh, PartitionSpec("fsdp", "tensor")))
    y = jax.ShapeDtypeStruct(
        (8,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("tensor"), "pinned_host")
    )
    layout = _Layout(mesh, sharding.SAMPLE_RULES)
    (mx, my), static = topology.retarget(((x, y), {"layout": layout, "n": 3}), targets)
    moved = [targets[d.id] for d in mesh.devices.flat]
    for a, b in ((x, mx), (y, my)):
        assert isinstance(b, jax.ShapeDtypeStruct)
        assert (b.shape, b.dtype, b.sharding.spec) == (a.shape, a.dtype, a.sharding.spec)
        assert b.sharding.memory_kind == a.sharding.memory_kind
        assert list(b.sharding.mesh.devices.flat) == moved
    assert list(static["layout"].mesh.devices.flat) == moved and static["n"] == 3
    assert static["layout"].mesh.axis_names == mesh.axis_names
    assert static["layout"].rules == layout.rules

    @functools.partial(jax.jit, static_argnames="layout")
    def double(x, *, layout):
        spec = PartitionSpec(None, "fsdp")
        return jax.lax.with_sharding_constraint(2 * x, NamedSharding(layout.mesh, spec))

    progs = planner.Compiler(mesh, targets)
    progs.run("double", double, (x,), {"layout": layout})
    assert set(planner.executable_devices(progs.compiled["double"])) == set(moved)
    assert progs.entry("double")["device_kind"] == moved[0].device_kind


@pytest.mark.slow
@pytest.mark.skipif(
    topology.libtpu_version() is None,
    reason="needs libtpu (pip install -e '.[tpu]'); the suite's environment has none",
)
def test_update_compiles_for_a_tpu_slice_without_a_tpu():
    """libtpu compiles the learner's update for a v5e-4 with no TPU attached: the program
    is for the slice's devices, its FLOPs are `scaling.compute`'s count (as on XLA:CPU:
    `test_update_flops_match_the_analytic_count`), and its arguments hold the train state."""
    config = load_config("quickstart")
    config.mesh.shape = (1, 4, 1)
    cfg = model.get("tiny", **WIDE)
    mesh = sharding.make_mesh((1, 4, 1))
    targets = topology.devices(topology.parse("v5e-4"))
    P = 64
    _, _, state, _, entry = planner.compile_update(rl.resolve(config), cfg, mesh, P, targets)
    assert entry["device_kind"] == targets[0].device_kind
    assert targets[0].platform == "tpu"
    rows, T = config.batch.prompts * config.batch.group_size, P + config.sampling.max_new_tokens
    expected = 3 * compute.forward_flops(cfg, rows * T, T) / 4
    assert entry["flops_per_device"] * entry["loop_factor"] == pytest.approx(expected, rel=0.02)
    assert entry["argument_bytes"] >= planner.device_bytes(state)


# ------------------------------------------------------------------------------------------
# Mixtures of experts and LoRA.
# ------------------------------------------------------------------------------------------


def test_model_flops_count_a_mixture_of_experts_active_params_by_hand():
    """`scaling.compute` counts the parameters a token reads. tiny_moe (D 64, 4 heads and 2 kv
    heads of 16, QK-norm, 2 layers of 8 experts of width 32, top-2, untied head of 256):
    per layer attention 64*64 + 2*64*32 + 64*64 + 2*16 (q, k, v, o, QK-norm) = 12,320 and its
    two norms 128; router 64*8 = 512 and 2 experts x 3 x 64*32 = 12,288; then the final norm
    64 and the head 64*256 = 16,384: 66,944 matmul parameters, where all 8 experts would
    give 2 * 6 * 3 * 64 * 32 = 73,728 more. A dense model is counted as before."""
    cfg = model.get("tiny_moe")
    assert compute.matmul_params(cfg) == 2 * (12_320 + 128 + 512 + 12_288) + 64 + 16_384
    assert cfg.num_params(include_embedding=False) - compute.matmul_params(cfg) == 73_728
    assert compute.forward_flops(cfg, 10, 0) == 10 * 2 * 66_944
    attn = 4 * 2 * 4 * 16 * 32  # 4 x layers x heads x head_dim x context.
    assert compute.train_flops(cfg, 10, 32) == 3 * 10 * (2 * 66_944 + attn)
    dense = model.get("tiny")
    assert compute.matmul_params(dense) == dense.num_params(include_embedding=False)
    big = model.get("qwen3_30b_a3b")  # 3.3B active, less the 0.31B-parameter embedding.
    assert compute.matmul_params(big) == moe.active_params(big) - 151_936 * 2048


def test_collectives_read_from_the_hlo_by_hand():
    """A program with one of each collective over 8 devices, one under the dispatch's named
    scope: per kind its count and the bytes each device sends (R its result bytes: an
    all-gather of 4 x 16 float32 rows per device R = 32 x 16 x 4 = 2,048 and sends 7/8 R; a
    reduce-scatter of 32 x 16 rows, R = 256, sends 7 R; an all-to-all of 8 x 2 x 16, R =
    1,024, sends 7/8 R; a psum of 16 floats, R = 64, sends 2 x 7/8 R)."""
    mesh = sharding.make_mesh((1, 1, 1, 8))
    P = PartitionSpec

    def local(a, b, c, d):
        with jax.named_scope(hlo.DISPATCH_SCOPE + "test"):
            swapped = jax.lax.all_to_all(c, "expert", 0, 0, tiled=True)
        return (
            jax.lax.all_gather(a, "expert", tiled=True),
            jax.lax.psum_scatter(b, "expert", tiled=True),
            swapped,
            jax.lax.psum(d, "expert"),
        )

    specs = (P("expert"), P(), P("expert"), P())
    out_specs = (P(), P("expert"), P("expert"), P())
    mapped = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
    fn = jax.jit(mapped)
    shapes = [(32, 16), (32, 16), (64, 2, 16), (16,)]
    args = [
        jax.ShapeDtypeStruct(x, jnp.float32, sharding=NamedSharding(mesh, s))
        for x, s in zip(shapes, specs)
    ]
    found = hlo.collectives(fn.lower(*args).compile().as_text())
    assert found["all"] == {
        "all-gather": {"count": 1, "bytes": 2048 * 7 / 8},
        "reduce-scatter": {"count": 1, "bytes": 256 * 7},
        "all-to-all": {"count": 1, "bytes": 1024 * 7 / 8},
        "all-reduce": {"count": 1, "bytes": 2 * 64 * 7 / 8},
    }
    assert found["expert_dispatch"] == {"all-to-all": {"count": 1, "bytes": 1024 * 7 / 8}}
    line = "x = f32[8] all-gather(y), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}"
    assert hlo.group_size(line) == 4 and hlo.collectives(line)["all"]["all-gather"]["bytes"] == 24
    assert hlo.group_size("all-reduce(y), replica_groups=[2,4]<=[8]") == 4


@pytest.mark.slow
def test_moe_update_plan_on_an_expert_axis():
    """tiny_moe's update on a (1, 1, 1, 8) mesh, all-to-all dispatch: one expert per
    device, each expert's weights an eighth on each device (the planned params hold 1/8 of
    the experts and the rest whole), and the dispatch's collectives two all-to-alls per
    sparse layer in the forward and two in the backward, no all-gather."""
    config = load_config("quickstart")
    config.mesh.shape = (1, 1, 1, 8)
    config.model.update(num_experts=8, experts_per_token=2, moe_intermediate_size=32)
    config.model.update(expert_dispatch="all_to_all")
    run = rl.resolve(config)
    cfg = planner.model_config(run, "tiny_moe")
    assert cfg.expert_dispatch == "all_to_all"
    mesh = sharding.make_mesh((1, 1, 1, 8))
    assert planner.experts_info(cfg, mesh) == {
        "num_experts": 8,
        "experts_per_token": 2,
        "expert_axis": 8,
        "experts_per_device": 1,
        "active_params": moe.active_params(cfg),
        "dispatch": "all_to_all",
        "capacity_factor": 1.25,
    }
    _, params, _, _, entry = planner.compile_update(run, cfg, mesh, 64)
    experts = 2 * 3 * 8 * 64 * 32  # Layers x (gate, up, down) x e x D x F.
    norms = _norm_params(cfg)
    assert planner.device_bytes(params) == 4 * (cfg.num_params() - experts * 7 // 8)
    assert norms < cfg.num_params()  # The norms, like every non-expert leaf, whole.
    dispatch = entry["collectives"]["expert_dispatch"]
    assert dispatch["all-to-all"]["count"] == 4 * len(cfg.moe_layers), dispatch
    assert "all-gather" not in dispatch and "reduce-scatter" not in dispatch


@pytest.mark.slow
def test_lora_plan_trains_adapters_and_counts_the_merged_copy():
    """A LoRA run of `tiny` on one device (rank 4, every projection): the trained params are
    the adapters and the value head, the optimizer state their two float32 moments (and
    step counts), the reference is the base, and the generator's params are the merged
    copy of the adapted weights (2 layers x (q 64*64 + k, v 64*32 + o 64*64 + gate, up,
    down 3*64*128) = 73,728 float32), which full fine-tuning in sync mode shares."""
    config = load_config("quickstart")
    config.mesh.shape = (1, 1, 1)
    config.lora.rank = 4
    run = rl.resolve(config)
    cfg = planner.model_config(run, "tiny")
    train, gen = sharding.role_meshes((1, 1, 1), 0)
    p = planner.plan_run(run, cfg, train, gen, 64)
    b = p.per_device_bytes
    _, base = planner.abstract_params(cfg, train, sharding.TRAIN_RULES)
    adapters = lora.num_params(jax.eval_shape(lambda: lora.init(base, run.lora, jax.random.key(0))))
    trained = adapters + cfg.d_model + 1  # And the value head.
    assert p.info["trained_params"] == adapters
    assert b["params"] == 4 * trained
    assert 8 * trained <= b["opt_state"] <= 8 * trained + 64
    assert b["ref_params"] == 4 * cfg.num_params()
    assert b["generator_params"] == 4 * 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)
    assert "lora_merge" not in p.programs  # Its temporaries count, its FLOPs do not.


def test_temp_advice_names_the_all_to_all_dispatch_on_an_expert_axis():
    settings = {
        "mesh": (1, 1, 1, 8),
        "param_dtype": "bfloat16",
        "pack_rows": 8,
        "next_pack_rows": 0,
        "remat": "full",
        "logprob_chunk": 1,
        "slots": 32,
        "max_new_tokens": 32,
        "expert_dispatch": "all_gather",
    }
    assert report.advice("temp", settings) == (
        "model.expert_dispatch=all_to_all (now all_gather; it drops past capacity), "
        "more data x fsdp devices (--mesh=1,1,1,8)"
    )
    assert "expert_dispatch" not in report.advice("temp", {**settings, "expert_dispatch": None})
