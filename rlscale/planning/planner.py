"""Planning a run before launching it: what each device of a target mesh holds and computes
in one RL step, read from the run's own programs compiled ahead of time, without
materializing a single parameter.

`plan_run` builds the learner and the generator engine the way `rl/setup.py` does, but from
abstract arrays (`jax.ShapeDtypeStruct`s carrying the shardings of `sharding`'s rule
tables), then lowers and compiles the learner's `update_step` (through `Learner.update`, on
a worst-case batch: every completion `sampling.max_new_tokens` long) and the engine's
`insert` (prefill) and `decode` programs. Per device it accounts the `TERMS` (the trained
params, optimizer state, reference, the generator's copy of the policy, its KV cache, the
update's gradient accumulators and other temporaries, the engine's temporaries) and their
`total`, the state every phase keeps plus the larger of the update's and the generator's
working memory (`_with_total`); docs/pods_and_planning.md#plan-a-run says what each holds.

FLOPs per step come from the compiled programs' cost analysis (`programs.cost`), each scaled
by its loops' trip counts (`loop_factor`; a decode call per decode step of a worst-case
batch, an update's micro-batch loop at the micro-batches that batch fills), beside
`scaling.compute`'s count of the step's useful work (`model_flops`), and each program's
collectives (`hlo`): docs/pods_and_planning.md#plan-a-run. With `fused_attention`,
attention is planned as a fused kernel's memory (`fused`).

What a plan says against an accelerator (the table, the verdict on a memory budget, the
knobs to turn, the step-time bound) is `report`'s; the checks of what a plan is asked for
are `inputs`'.
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rlscale import model, programs, saved_policy, sharding
from rlscale.data import tasks
from rlscale.model import decoder, lora, moe
from rlscale.planning import fused, hlo, topology
from rlscale.planning.flops import loop_factor, model_flops
from rlscale.rl import checks
from rlscale.rl import rollouts as rollouts_lib
from rlscale.rl import setup as rl_setup
from rlscale.sampling import SamplingConfig, engine, precision
from rlscale.sampling.sampler import _Layout

# The byte terms of `Plan.per_device_bytes`, in the order they are printed.
TERMS = (
    "params",
    "opt_state",
    "ref_params",
    "generator_params",
    "kv_cache",
    "grads",
    "temp",
    "generator_temp",
)


# ------------------------------------------------------------------------------------------
# Abstract arrays and their bytes per device.
# ------------------------------------------------------------------------------------------


def leaf_bytes(x) -> int:
    """Bytes of one device's shard of `x` (abstract or concrete, with a sharding)."""
    shape = x.shape if x.sharding is None else x.sharding.shard_shape(x.shape)
    return math.prod(shape) * x.dtype.itemsize  # A PRNG key's dtype has its data's size.


def device_bytes(tree, memory_kind: str = "device") -> int:
    """Bytes per device of the leaves of `tree` in `memory_kind` (`device`, or `pinned_host`
    for host-offloaded arrays). Every shard of a `NamedSharding` has the same shape: the rule
    tables split only dimensions a mesh axis divides."""

    def kind(x):
        return getattr(x.sharding, "memory_kind", None) or "device"

    return sum(leaf_bytes(x) for x in jax.tree.leaves(tree) if kind(x) == memory_kind)


def _abstract(x, s):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)


def abstract_params(model_cfg, mesh, rules):
    """(graphdef, params): every parameter a `ShapeDtypeStruct` with its sharding under
    `rules` on `mesh`; nothing is allocated."""
    graphdef, shapes = decoder.abstract_model(model_cfg)
    shardings = sharding.param_shardings(shapes, mesh, rules)
    return graphdef, jax.tree.map(_abstract, shapes, shardings)


def abstract_train_state(learn, params, value_params):
    """The `TrainState` that `learn.init(params, value_params)` returns, abstract.

    The shapes and dtypes are `init`'s own (`jax.eval_shape`); the shardings are those `init`
    gives concrete arrays: a subtree shaped like (params, value_params) or like params (the
    optimizer's moments, master weights) is laid out as they are, and everything else
    (counts, the objective's states) is replicated.
    """
    shapes = jax.eval_shape(learn.init, params, value_params)
    replicated = NamedSharding(learn.mesh, PartitionSpec())
    targets = [(params, value_params), params]
    treedefs = [jax.tree.structure(t) for t in targets]

    def match(x):
        try:
            return jax.tree.structure(x) in treedefs
        except TypeError:
            return False

    def assign(subtree):
        if jax.tree.structure(subtree) in treedefs:
            target = targets[treedefs.index(jax.tree.structure(subtree))]
            return jax.tree.map(lambda x, t: _abstract(x, t.sharding), subtree, target)
        return _abstract(subtree, replicated)

    return jax.tree.map(assign, shapes, is_leaf=match)


def executable_devices(executable) -> list:
    """The devices a compiled program is for (those its first argument is sharded over)."""
    return list(jax.tree.leaves(executable.input_shardings)[0]._device_assignment)


class Compiler(programs.Programs):
    """A `programs.Programs` that compiles and records but never runs: `run` returns the
    outputs' abstract values, so a part built to call it (`Learner.update`) goes through its
    real host path up to the compiled call. Each entry adds `loop_factor` and the kind of
    device compiled for (`device_kind`), and keeps its executable (`compiled`). With
    `targets` (a TPU slice's devices, `topology.devices`), each program compiles for them
    instead of the devices its arguments are on (`topology.retarget`)."""

    def __init__(self, mesh, targets: list | None = None):
        super().__init__(mesh)
        self.targets = targets
        self.compiled: dict[str, Any] = {}
        self.jaxprs: dict[str, Any] = {}

    def run(self, name: str, fn, args: tuple, static: dict | None = None):
        static = static or {}
        if self.targets:
            args, static = topology.retarget((args, static), self.targets)
        traced = fn.trace(*args, **static)
        executable = traced.lower().compile()
        self.compiled[name], self.jaxprs[name] = executable, traced.jaxpr
        self.entries.append(
            {
                "name": name,
                **programs.cost(executable),
                "loop_factor": loop_factor(traced.jaxpr),
                "collectives": hlo.collectives(executable.as_text()),
                "device_kind": executable_devices(executable)[0].device_kind,
                "mesh_shape": dict(self.mesh.shape),
                "devices": int(self.mesh.devices.size),
            }
        )
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            traced.out_info,
        )

    def entry(self, name: str) -> dict:
        return next(e for e in self.entries if e["name"] == name)


# ------------------------------------------------------------------------------------------
# The run's parts, abstract.
# ------------------------------------------------------------------------------------------


def model_config(config, name: str, **overrides):
    """The architecture `name` (with `overrides` of its fields, such as `num_layers`) with the
    numerics, attention implementation (`model.attention`) and expert dispatch the run would
    give it. A run from a Hugging Face checkpoint
    (`init.hf_checkpoint`; every task but the synthetic ones, which train a warm start) holds
    its params in `model.dtype` and computes in it, as `hf.load_hf` loads them; one from the
    warm start uses `config.model`'s dtypes."""
    m = config.model
    dispatch = dict(
        attention=m.attention,
        expert_dispatch=m.expert_dispatch,
        expert_capacity_factor=m.expert_capacity_factor,
    )
    if config.init.hf_checkpoint or config.task.name not in tasks.TASKS:
        numerics = dict(dtype=m.dtype, param_dtype=m.dtype)
    else:
        numerics = dict(dtype=m.dtype, param_dtype=m.param_dtype, fp32_lm_head=m.fp32_lm_head)
    return model.get(name, **{**numerics, **dispatch, **overrides})


def sampling_config(config) -> SamplingConfig:
    """`rl.setup.sampling_config` without a tokenizer: the token ids (stop tokens, padding,
    the forced-interruption phrase) are placeholders; the compiled shapes do not depend on
    them."""
    think = config.sampling.think_budget
    return SamplingConfig(
        **saved_policy.sampling_settings(config.sampling, config.batch.samples_per_prompt),
        interrupt_ids=(1,) if think else (),
        think_end_tokens=(2,) if think else (),
        stop_tokens=(0,),
        pad_id=0,
    )


def _replicated(mesh, x):
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def _rows(mesh, x):
    """`x` as the generator places host rows: split over the batch axes (`put_batch`)."""
    x = np.asarray(x)
    s = sharding.batch_sharding(mesh, x.ndim, sharding.SAMPLE_RULES)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)


def abstract_engine_state(model_cfg, scfg, slots: int, prompt_bucket: int, layout):
    """The engine's state (`engine.init_state`: the KV cache of `slots` rows over
    prompt_bucket + max_new_tokens columns, and the per-slot state), abstract: its init is
    compiled for the state's layout, never run."""
    init = functools.partial(
        engine.init_state,
        model_cfg=model_cfg,
        cfg=scfg,
        slots=slots,
        columns=prompt_bucket + scfg.max_new_tokens,
        layout=layout,
        blocks=scfg.kv_blocks or None,  # A paged cache's pool (None: as dense rows take).
    )
    shardings = jax.jit(init).lower().compile().output_shardings
    return jax.tree.map(_abstract, jax.eval_shape(init), shardings)


def engine_programs(config, graphdef, model_cfg, params, mesh, scfg, prompt_len, progs):
    """Compiles the generator engine's programs on abstract params and state (the cache is
    never allocated): its state's init (for the state's shapes and layout), one `insert`
    of the first admission (the requests that fill the free slots, in the engine's own
    prefill rows: `engine.take_slots`, `engine.prefill_rows`) and one `decode` call.
    Returns the abstract engine state, the admission's request count and its rows R."""
    B, G = config.batch.prompts, config.batch.group_size
    slots = config.pipeline.slots
    P = scfg.bucket(prompt_len)
    layout = _Layout(mesh, sharding.SAMPLE_RULES)
    state = abstract_engine_state(model_cfg, scfg, slots, P, layout)
    static = dict(graphdef=graphdef, model_cfg=model_cfg, cfg=scfg, layout=layout)
    admitted = min(B, slots // G)
    shards = sharding.batch_divisor(mesh, sharding.SAMPLE_RULES)
    free = list(range(slots))
    owned = [engine.take_slots(free, G, slots // shards) for _ in range(admitted)]
    R = len(engine.prefill_rows(owned, slots, shards))
    keydata = jax.random.key_data(jax.random.key(0))
    insert_args = (
        np.zeros((R, P), np.int32),
        np.zeros((R, P), bool),
        np.zeros((R, G), np.int32),
        np.zeros((R, *keydata.shape), keydata.dtype),
        np.zeros((R, G), np.int32),
    )
    extra = tuple(_rows(mesh, a) for a in insert_args)
    progs.run("engine_insert", engine.insert, (params, state, *extra), static)
    steps = tuple(_replicated(mesh, np.int32(0)) for _ in range(3))  # steps, wanted, waits
    progs.run("engine_decode", engine.decode, (params, state, *steps), static)
    return state, admitted, R


def _names(path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def lora_merge(config, params, adapters, progs) -> list[bool]:
    """Compiles a LoRA run's weight swap, the merge of `adapters` into the base `params`
    (`lora.merged`, as `Setup.generator_params` runs it) as "lora_merge" in `progs`, and
    returns per leaf of `params` whether the merge makes it anew (an adapted weight: the
    generator's copy even where it needs no reshard or cast)."""
    progs.run("lora_merge", lora.merged, (params, adapters), {"scale": config.lora.scale})
    flat = jax.tree_util.tree_flatten_with_path(adapters)[0]
    adapted = {_names(path)[:-1] for path, _ in flat}  # Less the "a" / "b".
    return [_names(p) in adapted for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


# ------------------------------------------------------------------------------------------
# The plan.
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """What a run needs per device, and what it does per RL step.

    Attributes:
      per_device_bytes: `TERMS` and `total` (see the module docstring); on split roles
        (`pipeline.generator_devices`) the device group whose total is larger.
      roles: per device group ("trainer", "generator", or "shared") its own terms and total.
      host_bytes: per device, what `learner.offload_ref` keeps in pinned host memory.
      flops_per_device: FLOPs per RL step per device (update + prefills + decode steps).
      model_flops_per_device: `scaling.compute`'s FLOPs of the step per device (`flops.
        model_flops`: a mixture of experts' active parameters), "update" and "generate".
      programs: per compiled program its cost entry (`programs.cost`, per call, loop bodies
        counted once), `loop_factor`, calls per step and FLOPs per step.
      decode_bytes: per device, what each decode step reads: the generator's weights and the
        engine state (the memory traffic of `report.estimate`'s bound).
      info: the shapes planned (prompt length, completion length, rows, slots, ...), a
        mixture of experts' layout (`experts`: `experts_info`) and, as `settings`, the knob
        values `report.advice` names.
    """

    per_device_bytes: dict
    roles: dict
    host_bytes: int
    flops_per_device: float
    model_flops_per_device: dict
    programs: dict
    decode_bytes: int
    info: dict

    def largest_term(self) -> str:
        b = self.per_device_bytes
        return max(TERMS, key=lambda k: b[k])


def compile_update(config, model_cfg, mesh, prompt_bucket: int, targets: list | None = None):
    """Compiles the learner's update on `mesh` for a worst-case batch (`rollouts.full_length`)
    through `Learner.update`, with the params, train state and reference `Setup` would give
    it, abstract; for the devices `targets` where given (`Compiler`). Returns (graphdef,
    params, state, ref, the update's `Compiler` entry)."""
    B, G = config.batch.prompts, config.batch.group_size
    graphdef, params = abstract_params(model_cfg, mesh, sharding.TRAIN_RULES)
    progs = Compiler(mesh, targets)
    learn = rl_setup.make_learner(config, graphdef, params, mesh, progs)
    replicated = NamedSharding(mesh, PartitionSpec())
    value_params = {  # `Setup.initial_state`'s value head.
        "w": jax.ShapeDtypeStruct((model_cfg.d_model,), jnp.float32, sharding=replicated),
        "b": jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
    }
    trained = params
    if config.lora.enabled:  # The adapters, replicated; the base is the reference.
        adapters = jax.eval_shape(lambda: lora.init(params, config.lora, jax.random.key(0)))
        trained = jax.tree.map(lambda x: _abstract(x, replicated), adapters)
    state = abstract_train_state(learn, trained, value_params)
    ref = params if config.lora.enabled else None
    if learn.spec.ref and ref is None:  # `Learner.reference`: a copy (pinned host: offloaded).
        kind = "pinned_host" if learn.offload_ref else "device"
        ref = jax.tree.map(lambda x: _abstract(x, x.sharding.with_memory_kind(kind)), params)
    M = config.sampling.max_new_tokens  # A MoE's recorded routing too (router replay).
    rollouts = rollouts_lib.full_length(B * G, prompt_bucket, M, learn.routing_lc)
    _, metrics, _ = learn.update(state, ref, rollouts, step=1)
    entry = progs.entry("update_step")
    # Its micro-batch loops run as many times as the worst case fills micro-batches (per
    # optimizer step, on average).
    trips = float(np.mean(metrics["train/micro_ran"].sum(1)))
    entry["loop_factor"] = loop_factor(progs.jaxprs["update_step"], trips)
    return graphdef, params, state, ref, entry


def plan_run(
    config,
    model_cfg,
    train_mesh,
    gen_mesh,
    prompt_len: int,
    targets: list | None = None,
    fused_attention: bool = False,
) -> Plan:
    """Compiles a run's learner update and generator programs for `train_mesh` and
    `gen_mesh` (the same mesh when the roles share devices) from abstract arrays, and
    accounts its memory and work per device (`Plan`).

    Args:
      config: the resolved run (`rl.resolve`, `inputs.resolve`).
      model_cfg: the policy's architecture and numerics (`model_config`).
      train_mesh, gen_mesh: `sharding.role_meshes(config.mesh.shape, generator_devices)`.
      prompt_len: the longest prompt, in tokens (the prompt bucket that holds it is planned).
      targets: a TPU slice's devices (`topology.devices`), one per device of the meshes, to
        compile for instead of the meshes' own (`Compiler`).
      fused_attention: plan `model.attention`'s calls without a cache as a fused kernel's
        memory (as `attention='chunked'`, `fused.fused_config`: XLA:CPU fuses none);
        `info["fused_attention"]` then says what that holds beyond a fused kernel.
    """
    scfg = sampling_config(config)
    P = scfg.bucket(prompt_len)
    shared = sharding.same_devices(gen_mesh, train_mesh)
    planned_cfg = fused.fused_config(model_cfg, fused_attention)
    graphdef, params, state, ref, update = compile_update(
        config, planned_cfg, train_mesh, P, targets
    )

    # The generator: its params in the sampling layout and its dtype
    # (`sampling.generator_dtype`: its KV cache follows), its state, its programs.
    gen_cfg = precision.generator_model(planned_cfg, config.sampling.generator_dtype)
    gen_graphdef, gen_params = abstract_params(gen_cfg, gen_mesh, sharding.SAMPLE_RULES)
    gen_progs = Compiler(gen_mesh, targets)
    engine_state, admitted, R = engine_programs(
        config, gen_graphdef, gen_cfg, gen_params, gen_mesh, scfg, prompt_len, gen_progs
    )
    insert, decode = gen_progs.entry("engine_insert"), gen_progs.entry("engine_decode")
    gen_entries = [insert, decode]
    adapted = None
    if config.lora.enabled:  # On the trainer's devices, before the reshard to the generator.
        merge_progs = Compiler(train_mesh, targets)
        adapted = lora_merge(config, params, state.params, merge_progs)
        gen_entries.append(merge_progs.entry("lora_merge"))

    trainer = trainer_bytes(state, ref, update)
    copy = config.pipeline.mode != "sync"  # `Setup.generator_params` copies in pipeline modes.
    generator = generator_bytes(params, gen_params, engine_state, gen_entries, copy, adapted)
    if shared:
        roles = {"shared": _with_total({**trainer, **generator})}
    else:
        roles = {"trainer": _with_total(trainer), "generator": _with_total(generator)}
    entries = {"update_step": update, "engine_insert": insert, "engine_decode": decode}
    table = work_per_step(config, entries, admitted)
    useful = model_flops(config, model_cfg, P)
    return Plan(
        per_device_bytes=max(roles.values(), key=lambda r: r["total"]),
        roles=roles,
        host_bytes=device_bytes(ref, "pinned_host"),
        flops_per_device=sum(t["flops_per_step"] for t in table.values()),
        model_flops_per_device={
            "update": useful["update"] / train_mesh.devices.size,
            "generate": useful["generate"] / gen_mesh.devices.size,
        },
        programs=table,
        decode_bytes=device_bytes(gen_params) + generator["kv_cache"],
        info=_plan_info(config, model_cfg, gen_cfg, (train_mesh, gen_mesh), state, P)
        | {"prompt_len": prompt_len, "prefill_requests": admitted, "prefill_rows": R}
        | {"fused_attention": _fused_info(config, model_cfg, train_mesh, P, fused_attention)},
    )


def _plan_info(config, model_cfg, gen_cfg, meshes, state, P: int) -> dict:
    """`Plan.info`'s settings, meshes and model figures (`plan_run`'s; `meshes`: the trainer's
    and the generator's)."""
    train_mesh, gen_mesh = meshes
    B, G = config.batch.prompts, config.batch.group_size
    shared = sharding.same_devices(gen_mesh, train_mesh)
    return {
        "prompt_bucket": P,
        "max_new_tokens": config.sampling.max_new_tokens,
        "rows": B * G,
        "slots": config.pipeline.slots,
        "train_mesh": dict(train_mesh.shape),
        "generator_mesh": dict(gen_mesh.shape),
        "generator_heads": generator_heads(gen_cfg, gen_mesh),
        "shared_devices": shared,
        "param_dtype": model_cfg.param_dtype,
        "dtype": model_cfg.dtype,
        "generator_dtype": gen_cfg.dtype,
        "num_params": model_cfg.num_params(),
        "num_layers": model_cfg.num_layers,
        "experts": experts_info(model_cfg, train_mesh),
        "trained_params": sum(x.size for x in jax.tree.leaves(state.params)),
        "settings": advice_settings(config, model_cfg, train_mesh, P),
    }


def _fused_info(config, model_cfg, train_mesh, P: int, on: bool):
    """With `fused_attention`, what its stand-in holds beyond a fused kernel; else None."""
    return fused.info(model_cfg, train_mesh, *_pack_rows(config, train_mesh, P)) if on else None


def generator_heads(model_cfg, mesh) -> dict:
    """The generator mesh's tensor axis, the query and kv heads, and those per device (a
    count the axis does not divide is replicated: `sharding.logical_to_spec`)."""
    t, H, K = int(mesh.shape["tensor"]), model_cfg.num_heads, model_cfg.num_kv_heads
    per = {"heads_per_device": H // t if H % t == 0 else H}
    per["kv_heads_per_device"] = K // t if K % t == 0 else K
    return {"tensor": t, "heads": H, "kv_heads": K, **per}


def generator_settings(config, model_cfg, mesh) -> dict:
    """The generator's tensor axis and its next value for `report.advice`: twice it where that
    divides its devices (its own, or the shared ones) and the query heads (`rl.checks`),
    else 0."""
    g, t = config.pipeline.generator_devices, config.pipeline.generator_tensor
    n = g or mesh.devices.size  # Shared: the trainer's `mesh` (`sharding.role_meshes`).
    ok = n % (2 * t) == 0 and model_cfg.num_heads % (2 * t) == 0
    return {"generator_devices": g, "generator_tensor": t, "next_generator_tensor": 2 * t * ok}


def experts_info(model_cfg, mesh) -> dict | None:
    """A mixture of experts' layout on `mesh` (None for a dense model): its experts, those a
    token uses, the experts each device holds (e / the expert axis), its active parameters
    (`moe.active_params`) and the dispatch and capacity factor of its expert axis."""
    if not model_cfg.num_experts:
        return None
    n = int(dict(mesh.shape).get(moe.EXPERT_AXIS, 1))
    return {
        "num_experts": model_cfg.num_experts,
        "experts_per_token": model_cfg.experts_per_token,
        "expert_axis": n,
        "experts_per_device": model_cfg.num_experts // n,
        "active_params": moe.active_params(model_cfg),
        "dispatch": model_cfg.expert_dispatch if n > 1 else "none (no expert axis)",
        "capacity_factor": model_cfg.expert_capacity_factor,
    }


def trainer_bytes(state, ref, update: dict) -> dict:
    """The trainer's terms per device: the trained params and value head, the optimizer
    state, the reference, the update's float32 gradient accumulators (laid out as the
    params) and its other temporaries (`update`: its compiled entry)."""
    trained = (state.params, state.value_params)
    grads = sum(leaf_bytes(x) // x.dtype.itemsize * 4 for x in jax.tree.leaves(trained))
    return {
        "params": device_bytes(trained),
        "opt_state": device_bytes(state.opt_state),
        "ref_params": device_bytes(ref),
        "grads": grads,
        "temp": max(update["temp_bytes"] - grads, 0),
    }


def generator_bytes(
    params, gen_params, engine_state, entries, copy: bool, adapted: list | None = None
) -> dict:
    """The generator's terms per device: the leaves of its sampling-layout params that are a
    copy (all of them with `copy`, else those the reshard from `params` moves, the cast to
    the generator's dtype makes or, per leaf where `adapted` says so, a LoRA merge makes),
    the engine state, and the largest temporaries of its compiled `entries`."""
    adapted = adapted or [False] * len(jax.tree.leaves(params))

    def moved(x, y, new):
        same = x.dtype == y.dtype and x.sharding.is_equivalent_to(y.sharding, len(x.shape))
        return copy or new or not same

    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(gen_params), adapted)
    return {
        "generator_params": device_bytes([y for x, y, new in pairs if moved(x, y, new)]),
        "kv_cache": device_bytes(engine_state),
        "generator_temp": max(e["temp_bytes"] for e in entries),
    }


def work_per_step(config, entries: dict, admitted: int) -> dict:
    """Per compiled program its entry with `calls_per_step` and `flops_per_step` (its
    per-call count at its loops' trip counts): the update once; the batch's admissions
    (`admitted` requests each); max_new_tokens decode steps per wave of requests through the
    slots (every completion max_new_tokens long)."""
    B, G = config.batch.prompts, config.batch.group_size
    slots = config.pipeline.slots
    waves = -(-B * G // slots)
    calls = {
        "update_step": 1,
        "engine_insert": -(-B // admitted),
        "engine_decode": waves * config.sampling.max_new_tokens,
    }
    table = {}
    for name, e in entries.items():
        flops = e["flops_per_device"] * e["loop_factor"]
        table[name] = {**e, "calls_per_step": calls[name], "flops_per_step": flops * calls[name]}
    return table


def advice_settings(config, model_cfg, mesh, prompt_bucket: int) -> dict:
    """The run's values of the knobs `report.advice` names, and the next values of
    those the run's checks constrain, on the trainer `mesh`."""
    return {
        **generator_settings(config, model_cfg, mesh),
        "mesh": tuple(config.mesh.shape),
        "param_dtype": model_cfg.param_dtype,
        "pack_rows": _pack_rows(config, mesh, prompt_bucket)[1],
        "next_pack_rows": next_pack_rows(config, mesh, prompt_bucket),
        "remat": config.learner.remat,
        "logprob_chunk": config.learner.logprob_chunk,
        "slots": config.pipeline.slots,
        "max_new_tokens": config.sampling.max_new_tokens,
        "expert_dispatch": (experts_info(model_cfg, mesh) or {}).get("dispatch"),
    }


def _pack_rows(config, mesh, prompt_bucket: int) -> tuple[int, int]:
    """(T, c): the worst-case batch's tokens per forward row and forward rows per batch shard
    in a micro-batch (`batch_layout.Layout.rows`)."""
    rows = config.batch.prompts * config.batch.group_size
    divisor = sharding.batch_divisor(mesh, sharding.TRAIN_RULES)
    layout = rl_setup.learner_layout(config)
    return layout.rows(rows, prompt_bucket, config.sampling.max_new_tokens, divisor)


def next_pack_rows(config, mesh, prompt_bucket: int) -> int:
    """Half the forward rows per micro-batch (`learner.pack_rows`), down to 1 (below a group,
    a micro-batch holds part of one: `batch_layout.Layout.split_groups`), while the run's
    checks accept it (`checks.split_problems`); else 0."""
    _, rows = _pack_rows(config, mesh, prompt_bucket)
    half = rows // 2
    if half < 1:
        return 0
    halved = dataclasses.replace(config.learner, pack_rows=half)
    return 0 if checks.split_problems(dataclasses.replace(config, learner=halved)) else half


def _with_total(terms: dict) -> dict:
    out = {k: int(terms.get(k, 0)) for k in TERMS}
    resident = sum(out[k] for k in TERMS if k not in ("grads", "temp", "generator_temp"))
    out["total"] = resident + max(out["grads"] + out["temp"], out["generator_temp"])
    return out
