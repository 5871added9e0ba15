"""Plans a run before launching it: per-device memory and FLOPs per step of a config on a
target mesh, from its programs compiled ahead of time on this machine.

    python -m rlscale.main.plan --config configs/math.py --model llama3_8b --mesh 1,8,1 \\
        [--devices 8] [--platform cpu|gpu|tpu] [--topology v5p-64] [--accelerator h100] \\
        [--num_layers 4] [--hbm_gib 80] [--prompt_len 512] [--out plan.json] \\
        [--config.learner.pack_rows=4 ...]

The architecture is `--model`'s; everything else is the config's. The programs compile for
`--devices` fake CPU devices (set here, before JAX starts); with `--platform gpu` on that
many attached GPUs (else on fake CPU devices, saying why); with `--platform tpu` for the TPU
slice `--topology` names, by libtpu with no TPU attached (`rlscale.planning.topology`).
It prints the table (`rlscale.planning.report`), then FITS, or one `error: DOES NOT FIT:
...` line naming the largest term and its knobs with exit status 1; bad input gives `error:`
lines and status 2. `--out` writes the plan as JSON. See docs/pods_and_planning.md.
"""

import math
import os
import sys

# Imports JAX, which reads XLA_FLAGS and JAX_PLATFORMS only when its backends start.
from rlscale.planning import topology

_FALLBACK = "RLSCALE_PLAN_FALLBACK"  # Why this is a re-run on CPU (`_compiled_on`).


def _flag(argv, name):
    """The value of `--name=v` or `--name v` in argv (None if absent), before absl parses."""
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _device_count(argv) -> int:
    """How many devices to plan for: `--devices`, else the product of `--mesh` plus
    `--config.pipeline.generator_devices`, else the chips of `--topology` (0 when none is a
    number: reported with the other flag problems, once absl has parsed them). A config that
    sets `pipeline.generator_devices` itself needs `--devices`."""
    try:
        if _flag(argv, "devices") is not None:
            return int(_flag(argv, "devices"))
        if _flag(argv, "mesh") is None and _flag(argv, "topology") is not None:
            return topology.parse(_flag(argv, "topology")).chips
        sizes = [int(s) for s in (_flag(argv, "mesh") or "").split(",")]
        generator = int(_flag(argv, "config.pipeline.generator_devices") or 0)
    except ValueError:
        return 0
    return math.prod(sizes) + generator if len(sizes) in (3, 4) else 0


def _set_up_devices(argv):
    """Before JAX starts: that many fake CPU devices, and the CPU platform unless
    `--platform gpu` asks for real devices (`_compiled_on` falls back when they are
    missing). A TPU slice is compiled for from the CPU platform: the parts are built on fake
    CPU devices and compiled for the slice's (`topology.retarget`)."""
    n = _device_count(argv)
    if n > 0:
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
    if platform in ("cpu", "tpu") or os.environ.get(_FALLBACK):
        os.environ["JAX_PLATFORMS"] = "cpu"
    if platform == "tpu":  # Off a TPU VM, libtpu warns that it cannot find these.
        try:
            name = topology.parse(_flag(argv, "topology") or "").name
        except ValueError:
            name = "v5p-8"  # Any: the slice compiled for is the one `--topology` names.
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", name)
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


if __name__ == "__main__":
    _set_up_devices(sys.argv)

from absl import flags  # noqa: E402  (JAX starts after XLA_FLAGS, from here on)

from rlscale import cli, sharding  # noqa: E402
from rlscale.model import attention  # noqa: E402
from rlscale.model.config import NAMES  # noqa: E402
from rlscale.planning import inputs, planner, report  # noqa: E402


def define_flags(fv: flags.FlagValues, argv) -> None:
    cli.define_config(fv, argv)
    flags.DEFINE_string("model", None, f"Architecture: one of {', '.join(NAMES)}.", flag_values=fv)
    flags.DEFINE_string(
        "mesh",
        None,
        "data,fsdp,tensor sizes, or data,fsdp,tensor,expert (default: the config's).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "num_layers",
        None,
        "Plan the architecture with this many layers, each of its shapes (a quicker compile; "
        "default: its own).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "devices",
        None,
        "Devices to plan for (default: the mesh's, plus pipeline.generator_devices).",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "platform", "cpu", ("cpu", "gpu", "tpu"), "Where to compile (see above).", flag_values=fv
    )
    flags.DEFINE_string(
        "topology",
        None,
        "With --platform tpu, the TPU slice to compile for: v5p-64, v5e-16, v6e-32 or libtpu's "
        "v5p:2x4x4 (default: the accelerator's slice of --devices chips).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "accelerator",
        None,
        f"Peaks for the step-time bound: one of {', '.join(report.ACCELERATORS)} "
        "(default: h100, or tpu_v5p with --platform tpu).",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "hbm_gib", None, "Memory per device, GiB (default: the accelerator's).", flag_values=fv
    )
    flags.DEFINE_integer(
        "prompt_len",
        None,
        "Longest prompt in tokens (default: the largest sampling bucket).",
        flag_values=fv,
    )
    flags.DEFINE_bool(
        "fused_attention",
        False,
        "Plan model.attention's calls as a fused kernel's memory (rlscale.planning.fused): "
        "XLA:CPU fuses no attention.",
        flag_values=fv,
    )
    flags.DEFINE_string("out", None, "Write the plan as JSON here.", flag_values=fv)
    flags.mark_flag_as_required("model", flag_values=fv)


def _compiled_on(platform: str, n: int) -> str:
    """Where the programs compile, in words. When `platform` (gpu) lacks the `n` devices,
    first runs this command again on fake CPU devices (JAX picks its platform once, at
    start)."""
    fallback = os.environ.get(_FALLBACK)
    why = None if fallback or platform != "gpu" else inputs.missing_devices(platform, n)
    if why:
        argv = [sys.executable, "-m", __spec__.name, *sys.argv[1:]]
        os.execve(sys.executable, argv, {**os.environ, _FALLBACK: why})
    return inputs.devices_used(platform, n, fallback)


def main(fv: flags.FlagValues) -> None:
    # A TPU slice's programs are checked and traced for the TPU (its attention kernels).
    with attention.target_platform("tpu" if fv.platform == "tpu" else ""):
        _plan(fv)


def _plan(fv: flags.FlagValues) -> None:
    problems, config, target, model_cfg = inputs.resolve(
        fv.config,
        fv.model,
        num_layers=fv.num_layers,
        mesh=fv.mesh,
        devices=fv.devices,
        platform=fv.platform,
        accelerator=fv.accelerator,
        hbm_gib=fv.hbm_gib,
        prompt_len=fv.prompt_len,
        topology_name=fv.topology,
    )
    if problems:
        cli.fail("\n  ".join(problems), status=2)
    targets = None
    if target.tpu is not None:
        try:
            targets = topology.devices(target.tpu)
        except Exception as e:  # noqa: BLE001  (libtpu's own reason, on one line)
            cli.fail(f"libtpu cannot describe {target.tpu.describe()}: {e}".replace("\n", " "))
        where = inputs.devices_used(fv.platform, target.devices, tpu=target.tpu)
    else:
        where = _compiled_on(fv.platform, target.devices)
    acc = report.ACCELERATORS[target.accelerator]
    pipe = config.pipeline
    train_mesh, gen_mesh = sharding.role_meshes(
        target.mesh, pipe.generator_devices, pipe.generator_tensor
    )
    p = planner.plan_run(
        config, model_cfg, train_mesh, gen_mesh, target.prompt_len, targets, fv.fused_attention
    )
    fits, line = report.verdict(p, target.hbm_bytes)
    print(report.table(p, acc, target.hbm_bytes, where, fv.model, config.recipe), flush=True)
    if fits:
        print("\n" + line)
    else:  # One line on stderr, as for bad input, after the table that explains it.
        print(f"error: {line}", file=sys.stderr)
    if fv.out:
        report.write(
            fv.out,
            p,
            acc,
            model=fv.model,
            accelerator=target.accelerator,
            hbm_bytes=target.hbm_bytes,
            fits=fits,
            compiled_on=where,
            topology=target.tpu.topology_name if target.tpu else None,
        )
    sys.exit(0 if fits else 1)


if __name__ == "__main__":
    cli.run_command(define_flags, main, status=2)
