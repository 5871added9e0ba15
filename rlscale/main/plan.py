"""Plans a run before launching it: per-device memory and FLOPs per step of a config on a
target mesh, from its programs compiled ahead of time on this machine.

    python -m rlscale.main.plan --config configs/math.py --model llama3_8b --mesh 1,8,1 \\
        [--devices 8] [--platform cpu|gpu|tpu] [--accelerator h100] [--hbm_gib 80] \\
        [--prompt_len 512] [--out plan.json] [--config.learner.micro_batches=4 ...]

The architecture is `--model`'s (any of `rlscale.NAMES`); everything else (batch,
sampling lengths, learner knobs, objective, pipeline mode) is the config's, overridable with
`--config.x=y`. Nothing is read from the config's data or checkpoint: prompts are taken to
fill `--prompt_len` tokens (default: the largest of `sampling.buckets`) and every
completion to run to `sampling.max_new_tokens` (the worst case).

The programs are compiled for `--devices` devices (default: the mesh's product): `N` fake
CPU devices (`--xla_force_host_platform_device_count`, set here before JAX starts), or, with
`--platform gpu|tpu` on a machine that has at least that many such devices, those devices.
For a TPU slice that is not attached, `jax.experimental.topologies` needs the TPU runtime
(`pip install -e .[tpu]`, libtpu); without it (as on this project's machines) the planner
compiles on fake CPU devices and says so. XLA:CPU partitions the programs as XLA:GPU/TPU do
(the per-device parameter, optimizer and cache bytes are exact); its temporaries and FLOP
counts come from another compiler's fusion choices, so they are estimates for an accelerator.

`rlscale.planner` defines the terms. It prints them per device against `--hbm_gib` (default:
the accelerator's HBM), the FLOPs per RL step and a roofline bound on the step time from
`--accelerator`'s published peaks, then whether the config fits. If it does not, one
`error: DOES NOT FIT: ...` line on stderr names the largest term and the knobs that shrink
it (with the run's values), and the exit status is 1 (bad input: an `error:` line, status 2).
`--out` writes the plan as JSON (`per_device_bytes.{params,opt_state,grads,temp,kv_cache,
total,...}`, `flops_per_device`, ...).
"""

import difflib
import logging
import os
import sys

PLATFORMS = ("cpu", "gpu", "tpu")


def _flag(argv, name):
    """The value of `--name=v` or `--name v` in argv (None if absent), before absl parses."""
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _device_count(argv) -> int | None:
    """How many devices to plan for: `--devices`, else the product of `--mesh`."""
    try:
        if _flag(argv, "devices") is not None:
            return int(_flag(argv, "devices"))
        sizes = [int(s) for s in (_flag(argv, "mesh") or "").split(",")]
        return int(__import__("math").prod(sizes)) if len(sizes) == 3 else None
    except ValueError:
        return None  # Reported with the other flag problems, once absl has parsed them.


def _set_up_devices(argv):
    """Before JAX starts: fake CPU devices for the plan (and, for --platform gpu|tpu, a look
    for the real ones first: the planner re-runs itself on CPU when they are missing)."""
    n = _device_count(argv)
    if n and n > 0:
        kept = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        os.environ["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={n}"])
    # Compiling a real-size update on XLA:CPU takes minutes by design: no "slow compile"
    # alarms between the table and its verdict.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    platform = _flag(argv, "platform") or "cpu"
    if platform == "cpu" or os.environ.get("RLSCALE_PLAN_FALLBACK"):
        os.environ["JAX_PLATFORMS"] = "cpu"


_set_up_devices(sys.argv)

import jax  # noqa: E402  (after XLA_FLAGS)
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from rlscale import planner, sharding  # noqa: E402
from rlscale.model.config import NAMES  # noqa: E402

# JAX logs each backend it cannot start (INFO); `devices_used` says what is missing instead.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally with a :variant suffix.", lock_config=True
)
_MODEL = flags.DEFINE_string("model", None, f"Architecture: one of {', '.join(NAMES)}.")
_MESH = flags.DEFINE_string("mesh", None, "data,fsdp,tensor sizes (default: the config's).")
_DEVICES = flags.DEFINE_integer("devices", None, "Devices to plan for (default: the mesh's).")
_PLATFORM = flags.DEFINE_enum("platform", "cpu", PLATFORMS, "Where to compile (see above).")
_ACCELERATOR = flags.DEFINE_string(
    "accelerator",
    None,
    f"Peaks for the step-time bound: one of {', '.join(planner.ACCELERATORS)} "
    "(default: h100, or tpu_v5p with --platform tpu).",
)
_HBM = flags.DEFINE_float("hbm_gib", None, "Memory per device, GiB (default: the accelerator's).")
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", None, "Longest prompt in tokens (default: the largest sampling bucket)."
)
_OUT = flags.DEFINE_string("out", None, "Write the plan as JSON here.")
flags.mark_flags_as_required(["config", "model"])


def check_flags(config) -> tuple[list[str], dict]:
    """Every problem with the flags at once, each naming its flag; and the parsed values."""
    problems, out = [], {}
    mesh_text = _MESH.value or ",".join(str(s) for s in config.mesh.shape)
    try:
        mesh = tuple(int(s) for s in mesh_text.split(","))
        if len(mesh) != 3 or min(mesh) < 1:
            raise ValueError
        out["mesh"] = mesh
    except ValueError:
        problems.append(f"--mesh={mesh_text}: expected three positive sizes data,fsdp,tensor")
        mesh = None
    devices = _DEVICES.value
    if mesh is not None:
        product = mesh[0] * mesh[1] * mesh[2]
        devices = product if devices is None else devices
        if devices != product:
            problems.append(
                f"--mesh={mesh_text} has {product} devices (data x fsdp x tensor) but "
                f"--devices={devices}; they must be equal"
            )
    out["devices"] = devices
    if _MODEL.value not in NAMES:
        near = difflib.get_close_matches(_MODEL.value, NAMES, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        problems.append(f"--model={_MODEL.value}: no such model; {hint}known: {', '.join(NAMES)}")
    default_acc = "tpu_v5p" if _PLATFORM.value == "tpu" else "h100"
    out["accelerator"] = _ACCELERATOR.value or default_acc
    if out["accelerator"] not in planner.ACCELERATORS:
        problems.append(
            f"--accelerator={out['accelerator']}: not one of {', '.join(planner.ACCELERATORS)}"
        )
    else:
        acc = planner.ACCELERATORS[out["accelerator"]]
        out["hbm"] = (_HBM.value * planner.GIB) if _HBM.value is not None else acc.hbm_bytes
        if _HBM.value is not None and _HBM.value <= 0:
            problems.append(f"--hbm_gib={_HBM.value}: must be > 0")
    buckets = tuple(config.sampling.buckets)
    out["prompt_len"] = _PROMPT_LEN.value or (max(buckets) if buckets else 0)
    if _PROMPT_LEN.value is not None and _PROMPT_LEN.value < 1:
        problems.append(f"--prompt_len={_PROMPT_LEN.value}: must be >= 1")
    elif buckets and out["prompt_len"] > max(buckets):
        problems.append(
            f"--prompt_len={out['prompt_len']} is longer than the largest prompt bucket "
            f"(sampling.buckets={buckets})"
        )
    return problems, out


def config_problems(config) -> list[str]:
    """The run's own start-up checks (`rl.checks.validate`), less those about its data,
    checkpoint and reward function: the planner needs only shapes."""
    from rlscale.rl import checks

    shapes = config.copy_and_resolve_references()
    with shapes.unlocked():
        shapes.task.name = "arithmetic"
        shapes.init.hf_checkpoint = ""
        shapes.reward.fn = ""
    try:
        checks.validate(shapes)
    except ValueError as e:  # "Invalid config:\n  a\n  b": one problem a line.
        return [line.strip() for line in str(e).splitlines()[1:]]
    return []


def devices_used(platform: str, n: int) -> str:
    """Where the programs are compiled, in words; re-runs the planner on fake CPU devices
    when `platform` has fewer than `n` attached devices."""
    fallback = os.environ.get("RLSCALE_PLAN_FALLBACK")
    if fallback:
        return f"{n} fake CPU devices (XLA:CPU), standing in for {platform}: {fallback}"
    if platform == "cpu":
        return f"{n} fake CPU devices (XLA:CPU)"
    have = [d for d in jax.devices() if d.platform == platform]
    if len(have) >= n:
        return f"{n} attached {platform.upper()} devices ({have[0].device_kind})"
    why = f"this machine has {len(have)} {platform.upper()} devices, not {n}"
    if platform == "tpu":
        try:
            from jax.experimental import topologies

            topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
            why += "; jax.experimental.topologies is available but the learner places a batch"
            why += " on its devices, which needs them attached"
        except Exception as e:  # noqa: BLE001  (the TPU runtime is absent: say why)
            why += f"; jax.experimental.topologies is unavailable ({str(e).split('. ')[0]})"
    env = {**os.environ, "RLSCALE_PLAN_FALLBACK": why}
    os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], env)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def report(p, acc, hbm: float, where: str, model_name: str, config) -> str:
    """The plan as a table: bytes per device (a column per device group), then the work."""
    size, info = planner.size, p.info
    lines = [
        f"plan: {model_name} ({_count(info['num_params'])} params, {info['param_dtype']} "
        f"params, {info['dtype']} compute), config {config.recipe}",
        f"  compiled on {where}",
        f"  trainer mesh {info['train_mesh']}, generator mesh {info['generator_mesh']}"
        + ("" if info["shared_devices"] else " (its own devices)"),
        f"  {info['rows']} rows, prompt bucket {info['prompt_bucket']} (prompts up to "
        f"{info['prompt_len']} tokens), completions of {info['max_new_tokens']} tokens, "
        f"{info['slots']} decode slots",
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
    s = p.step_seconds
    lines += [
        f"  {'total':<14} {p.flops_per_device:10.3e} FLOPs",
        f"  step >= {s['step']:.3g} s: update {s['update']:.3g} s, prefill {s['prefill']:.3g} s, "
        f"decode {s['decode']:.3g} s at 100% of peak FLOP/s and HBM bandwidth",
    ]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    problems, v = check_flags(config)
    with config.unlocked():  # The checks below see the planned mesh when it is a valid one.
        config.mesh.shape = v["mesh"] if not problems else (1, 1, 1)
    problems += config_problems(config)
    if _MODEL.value in NAMES and not any(x.startswith("--prompt_len") for x in problems):
        model_cfg = planner.model_config(config, _MODEL.value)
        problems += [
            f"--model={_MODEL.value}: {e}"
            for e in planner.shape_problems(config, model_cfg, v["prompt_len"])
        ]
    if problems:
        print("error: " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(2)
    where = devices_used(_PLATFORM.value, v["devices"])
    acc = planner.ACCELERATORS[v["accelerator"]]
    train_mesh, gen_mesh = sharding.role_meshes(v["mesh"], config.pipeline.generator_devices)
    p = planner.plan_run(config, model_cfg, train_mesh, gen_mesh, v["prompt_len"], acc)
    fits, line = planner.verdict(p, v["hbm"])
    print(report(p, acc, v["hbm"], where, _MODEL.value, config), flush=True)
    if fits:
        print("\n" + line)
    else:  # One line on stderr, as for bad input, after the table that explains it.
        print(f"error: {line}", file=sys.stderr)
    if _OUT.value:
        planner.write(
            _OUT.value,
            p,
            model=_MODEL.value,
            accelerator=v["accelerator"],
            hbm_bytes=v["hbm"],
            fits=fits,
            compiled_on=where,
        )
    sys.exit(0 if fits else 1)


def parse_flags(argv):
    """absl flag parsing with a bad flag or config key reported in one line (as
    `rlscale.main.parse_flags` does), exit status 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
    except (AttributeError, KeyError) as e:  # A key the locked config lacks.
        bad = " ".join(a for a in argv[1:] if a.startswith("--config."))
        print(f"error: {bad}: no such config key ({e})", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
