"""What a plan (`planner.Plan`) says against an accelerator: the table of bytes and work per
device, whether it fits a memory budget (`verdict`), which knobs shrink the term that does not
(`advice`), a roofline bound on the step time (`estimate`) and the plan as JSON.

The bound uses a small table of published peaks (`ACCELERATORS`): the update and prefill at
the accelerator's dense bfloat16 peak, each decode step at max(FLOPs / peak, bytes / HBM
bandwidth) with bytes the weights and the KV cache it reads (`Plan.decode_bytes`).
"""

import dataclasses
import json
import os

from rlscale.planning import planner

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Published per-chip figures: dense bfloat16 peak FLOP/s, HBM bandwidth (bytes/s) and
    HBM capacity (bytes)."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: float


# Vendor datasheets; dense (not 2:4-sparse) bfloat16 peaks, per chip.
ACCELERATORS = {
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): BF16 Tensor Core 1,979
    # TFLOP/s with sparsity, so 989 dense; HBM3 3.35 TB/s; 80 GB.
    "h100": Accelerator("NVIDIA H100 SXM", 989e12, 3.35e12, 80e9),
    # NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): the H100's compute
    # (1,979 TFLOP/s sparse BF16), HBM3e 4.8 TB/s, 141 GB.
    "h200": Accelerator("NVIDIA H200 SXM", 989e12, 4.8e12, 141e9),
    # Google Cloud TPU docs (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s BF16, 819 GB/s, 16 GB.
    "tpu_v5e": Accelerator("TPU v5e", 197e12, 819e9, 16e9),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s BF16, 2,765 GB/s, 95 GB.
    "tpu_v5p": Accelerator("TPU v5p", 459e12, 2765e9, 95e9),
    # cloud.google.com/tpu/docs/v6e (Trillium): 918 TFLOP/s BF16, 1,640 GB/s, 32 GB.
    "tpu_v6e": Accelerator("TPU v6e", 918e12, 1640e9, 32e9),
}


def size(nbytes: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    if nbytes < GIB:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def estimate(p: planner.Plan, acc: Accelerator) -> dict:
    """Seconds per RL step, a roofline bound: the update and the prefills at the dense peak,
    each decode step at max(FLOPs / peak, `p.decode_bytes` / bandwidth) (the weights and the
    KV cache it reads). Sequential when the roles share devices, overlapped when split."""
    table = p.programs
    update = table["update_step"]["flops_per_step"] / acc.peak_flops
    prefill = table["engine_insert"]["flops_per_step"] / acc.peak_flops
    d = table["engine_decode"]
    per_step = max(
        d["flops_per_step"] / max(d["calls_per_step"], 1) / acc.peak_flops,
        p.decode_bytes / acc.hbm_bandwidth,
    )
    decode = per_step * d["calls_per_step"]
    generate = prefill + decode
    total = update + generate if p.info["shared_devices"] else max(update, generate)
    return {"update": update, "prefill": prefill, "decode": decode, "step": total}


def table(p: planner.Plan, acc: Accelerator, hbm: float, where: str, model: str, recipe: str):
    """The plan as a table: bytes per device (a column per device group) against `hbm`, then
    the work per RL step and its bound on `acc`. `where`: where it was compiled
    (`inputs.devices_used`);
    `model`, `recipe`: the names of the architecture and the config."""
    info = p.info
    lines = [
        f"plan: {model} ({info['num_layers']} layers, {_count(info['num_params'])} params, "
        f"{info['param_dtype']} "
        f"params, {info['dtype']} compute), config {recipe}",
        f"  compiled {where}",
        f"  trainer mesh {info['train_mesh']}, generator mesh {info['generator_mesh']}"
        + ("" if info["shared_devices"] else " (its own devices)"),
        *_generator_lines(p),
        f"  {info['rows']} rows, prompt bucket {info['prompt_bucket']} (prompts up to "
        f"{info['prompt_len']} tokens), completions of {info['max_new_tokens']} tokens, "
        f"{info['slots']} decode slots",
        *_model_lines(info),
        *_fused_lines(info),
        "",
        "per device" + "".join(f"{role:>18}" for role in p.roles),
    ]
    for k in (*planner.TERMS, "total"):
        lines.append(f"  {k:<18}" + "".join(f"{size(r[k]):>18}" for r in p.roles.values()))
    lines.append(f"  {'memory':<18}{size(hbm):>18}")
    if p.host_bytes:
        lines.append(f"  (and {size(p.host_bytes)} per device in pinned host memory)")
    lines += ["", f"work per RL step, per device (bound: {acc.name} peaks)"]
    unit = {"update_step": "call", "engine_insert": "call", "engine_decode": "decode step"}
    for name, e in p.programs.items():
        each = e["flops_per_device"] * e["loop_factor"]
        n = e["calls_per_step"]
        lines.append(
            f"  {name:<14} {e['flops_per_step']:10.3e} FLOPs = {n} {unit[name]}"
            f"{'s' if n != 1 else ''} x {each:.3e}   temp {size(e['temp_bytes'])}"
        )
    s = estimate(p, acc)
    useful = p.model_flops_per_device
    lines += [
        f"  {'total':<14} {p.flops_per_device:10.3e} FLOPs",
        f"  {'model FLOPs':<14} {sum(useful.values()):10.3e} FLOPs (scaling.compute, active "
        f"params): update {useful['update']:.3e}, generate {useful['generate']:.3e}",
        f"  step >= {s['step']:.3g} s: update {s['update']:.3g} s, prefill {s['prefill']:.3g} s, "
        f"decode {s['decode']:.3g} s at 100% of peak FLOP/s and HBM bandwidth",
    ]
    return "\n".join(lines + _collective_lines(p))


def _fused_lines(info: dict) -> list[str]:
    """With `--fused_attention`: which attention is planned as fused, and the stand-in's
    excess over a fused kernel (counted in the update's temp)."""
    f = info.get("fused_attention")
    if not f:
        return []
    return [
        f"  attention {f['attention']!r} planned as a fused kernel (planning.fused: its "
        f"stand-in holds {size(f['excess_bytes'])} more, in temp)"
    ]


def _generator_lines(p: planner.Plan) -> list[str]:
    """The generator's split over its tensor axis and its params + KV cache per device."""
    heads = p.info.get("generator_heads")
    if heads is None:
        return []
    role = p.roles.get("generator", p.roles.get("shared"))
    whole = heads["tensor"] > 1 and heads["kv_heads_per_device"] == heads["kv_heads"]
    kv = ", replicated" if whole else ""
    return [
        f"  generator tensor axis {heads['tensor']}: {heads['heads_per_device']} of "
        f"{heads['heads']} query heads and {heads['kv_heads_per_device']} of "
        f"{heads['kv_heads']} kv heads per device{kv}; params "
        f"{size(role['generator_params'])} + KV cache {size(role['kv_cache'])} per device"
    ]


def _model_lines(info: dict) -> list[str]:
    """What a plan of fewer layers, a LoRA run or a mixture of experts adds to the header."""
    lines = []
    if info.get("trained_params", info["num_params"]) < info["num_params"]:
        lines.append(f"  trained: {_count(info['trained_params'])} params (the LoRA adapters)")
    x = info.get("experts")
    if x:
        lines.append(
            f"  experts: {x['num_experts']}, {x['experts_per_token']} per token, "
            f"{x['experts_per_device']} per device (expert axis {x['expert_axis']}), "
            f"{_count(x['active_params'])} active params; dispatch {x['dispatch']}"
            + (f", capacity factor {x['capacity_factor']}" if x["dispatch"] == "all_to_all" else "")
        )
    return lines


def _collective_lines(p: planner.Plan) -> list[str]:
    """Per program its collectives (`hlo.collectives`), those of the experts' dispatch apart."""
    lines = ["", "collectives per call, per device (loop bodies once): count x, bytes sent"]
    for name, e in p.programs.items():
        found = e.get("collectives", {})
        for where in ("all", "expert_dispatch"):
            kinds = found.get(where) or {}
            if kinds:
                text = ", ".join(
                    f"{k} {v['count']}x {size(v['bytes'])}" for k, v in sorted(kinds.items())
                )
                label = name if where == "all" else "  of which MoE"
                lines.append(f"  {label:<16} {text}")
    return lines


def verdict(p: planner.Plan, hbm_bytes: float) -> tuple[bool, str]:
    """(fits, the sentence that says so): a plan that does not fit names its largest term
    and the knobs that shrink it."""
    total = p.per_device_bytes["total"]
    if total <= hbm_bytes:
        return True, f"FITS: {size(total)} of {size(hbm_bytes)} per device"
    big = p.largest_term()
    return False, (
        f"DOES NOT FIT: {size(total)} per device > {size(hbm_bytes)}; the largest term is "
        f"{big} ({size(p.per_device_bytes[big])}): try {advice(big, p.info['settings'])}"
    )


def advice(term: str, s: dict) -> str:
    """The knobs that shrink `term`, in the order to try, with the run's values
    (`Plan.info["settings"]`): config keys, and the mesh as `--mesh` (data,fsdp,tensor)."""
    mesh = ",".join(str(n) for n in s["mesh"])
    fsdp = f"a larger fsdp axis (--mesh={mesh}: the params are split fsdp x tensor ways)"
    if term in ("params", "grads"):
        return f"{fsdp} or tensor parallelism"
    if term == "opt_state":
        laid = f"{fsdp} or tensor parallelism (the optimizer state is laid out as the params)"
        if s["param_dtype"] == "float32":
            return laid
        # Low-precision params: float32 masters are a third of the state (with AdamW's moments).
        return f"{laid}; with float32 params (model.param_dtype) it holds no master copy"
    if term == "ref_params":
        return "learner.offload_ref=True (the reference waits in host memory), or " + fsdp
    if term == "generator_params":
        if s.get("next_generator_tensor"):  # The generator's tensor axis.
            return (
                f"pipeline.generator_tensor={s['next_generator_tensor']} (now "
                f"{s['generator_tensor']}: the sampling layout splits matrices only over the "
                "generator's tensor axis)"
            )
        return (
            f"tensor parallelism (--mesh={mesh}: the sampling layout keeps whole matrices on "
            "each data x fsdp replica and splits them only over tensor)"
        )
    if term == "kv_cache":
        more = ""
        if s.get("next_generator_tensor"):
            t = s["next_generator_tensor"]
            more = f", pipeline.generator_tensor={t} (its kv heads, where {t} divides them)"
        return (
            f"fewer decode slots (pipeline.slots={s['slots']}), shorter completions "
            f"(sampling.max_new_tokens={s['max_new_tokens']}), or more data x fsdp devices "
            f"(--mesh={mesh}: they split the slots){more}"
        )
    if term == "temp":
        return ", ".join([*_temp_knobs(s), f"more data x fsdp devices (--mesh={mesh})"])
    return (  # generator_temp
        f"fewer decode slots (pipeline.slots={s['slots']}: fewer requests prefilled at once), "
        f"a shorter prompt bucket (sampling.buckets), or more data x fsdp devices "
        f"(--mesh={mesh}: each prefills the requests of its own slots)"
    )


def _temp_knobs(s: dict) -> list[str]:
    """The learner's knobs that shrink the update's temporaries and have room left."""
    knobs = []
    if s.get("expert_dispatch") == "all_gather":  # Only with an expert axis.
        knobs.append("model.expert_dispatch=all_to_all (now all_gather; it drops past capacity)")
    if s.get("next_pack_rows"):
        knobs.append(f"learner.pack_rows={s['next_pack_rows']} (now {s['pack_rows']})")
    if s["remat"] != "full":
        knobs.append(
            f"learner.remat={'dots' if s['remat'] == 'none' else 'full'} (now {s['remat']})"
        )
    if s["logprob_chunk"] > 1:
        knobs.append(
            f"learner.logprob_chunk={max(s['logprob_chunk'] // 4, 1)} (now {s['logprob_chunk']})"
        )
    return knobs


def to_json(p: planner.Plan, acc: Accelerator, **extra) -> dict:
    """The plan as a JSON-ready dict: `extra` fields (the model, accelerator, ...), the
    plan's, and its bound on `acc` as `step_seconds`."""
    return {**extra, **dataclasses.asdict(p), "step_seconds": estimate(p, acc)}


def write(path: str, p: planner.Plan, acc: Accelerator, **extra) -> None:
    """Writes `to_json(p, acc, **extra)` to `path`, making its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_json(p, acc, **extra), f, indent=2)
