"""What a plan is asked for, checked before anything compiles: the target (mesh, devices,
accelerator, memory per device, prompt length, TPU slice) from the plan command's flag
values, the run's own start-up checks at the planned mesh, the shapes the model must hold
(every problem at once, each naming its flag or config key), and the devices the programs
compile on.
"""

import dataclasses
import difflib
import math

import jax
import ml_collections

from rlscale import model as model_lib
from rlscale import rl, sections, sharding, warm_start
from rlscale.model.config import NAMES
from rlscale.planning import planner, report, topology
from rlscale.rl import checks
from rlscale.rl import run_config as resolve_lib

# The config's model fields a plan keeps whatever `--model` it plans (`planner.model_config`).
_COMPUTE = (*warm_start.COMPUTE_ONLY, "param_dtype")


@dataclasses.dataclass(frozen=True)
class Target:
    """What a plan is for, from the flags' values (None where a value is bad).

    Attributes:
      mesh: data, fsdp and tensor sizes, and expert's where given.
      devices: the devices planned for (the mesh's product).
      accelerator: a key of `report.ACCELERATORS`.
      hbm_bytes: memory per device.
      prompt_len: the longest prompt, in tokens.
      tpu: with `--platform tpu`, the slice the programs compile for.
    """

    mesh: tuple[int, ...] | None
    devices: int | None
    accelerator: str
    hbm_bytes: float | None
    prompt_len: int
    tpu: topology.Slice | None = None


def check_target(
    *,
    model: str,
    mesh: str | None,
    devices: int | None,
    platform: str,
    accelerator: str | None,
    hbm_gib: float | None,
    prompt_len: int | None,
    config_mesh: tuple,
    buckets: tuple,
    topology_name: str | None = None,
    generator_devices: int = 0,
) -> tuple[list[str], Target]:
    """Every problem with the plan command's flag values at once, each naming its flag; and
    the target they give. `mesh` (the trainer's) defaults to `config_mesh`, `devices` to the
    mesh's product plus the generator's own devices (`generator_devices`, the config's
    `pipeline.generator_devices`),
    `accelerator` to the TPU slice's (`tpu_slice`) or else the platform's usual one, `hbm_gib`
    to its HBM and `prompt_len` to the largest of the config's prompt `buckets`."""
    problems = []
    mesh_text = mesh or ",".join(str(s) for s in config_mesh)
    try:
        sizes = tuple(int(s) for s in mesh_text.split(","))
        if len(sizes) not in (3, 4) or min(sizes) < 1:
            raise ValueError
    except ValueError:
        problems.append(
            f"--mesh={mesh_text}: expected three positive sizes data,fsdp,tensor (or four: "
            "data,fsdp,tensor,expert)"
        )
        sizes = None
    if sizes is not None:
        product = math.prod(sizes) + generator_devices
        devices = product if devices is None else devices
        axes = " x ".join(sharding.EXPERT_MESH_AXES[: len(sizes)])
        if generator_devices:
            axes += f", plus pipeline.generator_devices={generator_devices}"
        if devices != product:
            problems.append(
                f"--mesh={mesh_text} has {product} devices ({axes}) but "
                f"--devices={devices}; they must be equal"
            )
    if model not in NAMES:
        near = difflib.get_close_matches(model, NAMES, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        problems.append(f"--model={model}: no such model; {hint}known: {', '.join(NAMES)}")
    tpu = None
    if topology_name is not None and platform != "tpu":
        problems.append(f"--topology={topology_name} names a TPU slice: it needs --platform=tpu")
    elif platform == "tpu":
        tpu, slice_problems = tpu_slice(
            topology_name, accelerator, devices, mesh_text, generator_devices
        )
        problems += slice_problems
    accelerator = accelerator or (tpu.accelerator if tpu else "h100")
    hbm = None
    if accelerator not in report.ACCELERATORS:
        known = ", ".join(report.ACCELERATORS)
        problems.append(f"--accelerator={accelerator}: not one of {known}")
    else:
        acc = report.ACCELERATORS[accelerator]
        hbm = (hbm_gib * report.GIB) if hbm_gib is not None else acc.hbm_bytes
        if hbm_gib is not None and hbm_gib <= 0:
            problems.append(f"--hbm_gib={hbm_gib}: must be > 0")
    longest = prompt_len or (max(buckets) if buckets else 0)
    if prompt_len is not None and prompt_len < 1:
        problems.append(f"--prompt_len={prompt_len}: must be >= 1")
    elif buckets and longest > max(buckets):
        problems.append(
            f"--prompt_len={longest} is longer than the largest prompt bucket "
            f"(sampling.buckets={buckets})"
        )
    return problems, Target(sizes, devices, accelerator, hbm, longest, tpu)


def tpu_slice(
    name: str | None,
    accelerator: str | None,
    devices: int | None,
    mesh_text: str,
    generator_devices: int = 0,
) -> tuple[topology.Slice | None, list[str]]:
    """(the TPU slice `--topology` names, or else the `accelerator`'s (default `tpu_v5p`)
    slice of `devices` chips, `generator_devices` of them the generator's; the problems with
    them, each naming its flag)."""
    if name is not None:
        try:
            tpu = topology.parse(name)
        except ValueError as e:
            return None, [f"--topology={name}: {e}"]
    elif devices is None or (accelerator or "tpu_v5p") not in report.ACCELERATORS:
        return None, []  # The mesh's or the accelerator's problem says why.
    else:
        accelerator = accelerator or "tpu_v5p"
        tpu = topology.of(accelerator, devices)
        if tpu is None:
            return None, [
                f"--platform=tpu: --accelerator={accelerator} has no TPU slice of {devices} "
                "chips; name one with --topology (v5p-64, v5e-16, v6e-32, or libtpu's "
                "v5p:2x4x4)"
            ]
    problems = []
    flag = f"--topology={name}" if name is not None else f"the default slice {tpu.name}"
    if accelerator is not None and accelerator != tpu.accelerator:
        problems.append(f"--accelerator={accelerator} but {flag} is a {tpu.accelerator} slice")
    if devices is not None and devices != tpu.chips:
        problems.append(
            f"--mesh={mesh_text} plans {devices} devices but {flag} has {tpu.chips} chips "
            f"(a device each); they must be equal, e.g. --mesh=1,{tpu.chips - generator_devices},1"
            + (
                f" beside pipeline.generator_devices={generator_devices}"
                if generator_devices
                else ""
            )
        )
    return tpu, problems


def missing_libtpu(platform: str) -> list[str]:
    """Why this machine cannot compile for `platform` (libtpu absent for `tpu`), or []."""
    if platform != "tpu" or topology.libtpu_version() is not None:
        return []
    return [
        "--platform=tpu compiles with libtpu, which is not installed: pip install -e '.[tpu]' "
        "(jax[tpu]==0.10.2 pins libtpu 0.0.42.1; it compiles for a TPU slice with no TPU "
        "attached)"
    ]


def resolve_shapes(config) -> tuple[list[str], "rl.RunConfig | None"]:
    """(problems, run): the run's own start-up checks (`rl.resolve`), less those about its
    data, checkpoint and reward function, for the planner needs only shapes; `run` (None
    with problems) keeps the config's task, `init` and `reward` as they are."""
    shapes = config.copy_and_resolve_references()
    with shapes.unlocked():
        shapes.task.name = "arithmetic"
        shapes.init.hf_checkpoint = ""
        shapes.reward.fn = ""
    try:
        run = rl.resolve(shapes)
    except sections.InvalidConfigError as e:
        return e.problems, None
    with sections.deferred():  # The keys set aside above, unchecked as they were.
        kept = {k: resolve_lib.SECTIONS[k](**dict(config[k])) for k in ("init", "reward")}
    return [], dataclasses.replace(
        run,
        task=ml_collections.FrozenConfigDict(config.task),
        raw=ml_collections.FrozenConfigDict(config),
        **kept,
    )


def shape_problems(config, model_cfg, prompt_len: int) -> list[str]:
    """What the run's parts would refuse at these shapes, found before compiling: the cache
    the model cannot hold, packing that cannot hold a sequence or a group."""
    problems = []
    M = config.sampling.max_new_tokens
    try:
        P = planner.sampling_config(config).bucket(prompt_len)
    except ValueError as e:
        return [f"prompt length {prompt_len}: {e}"]
    if P + M > model_cfg.max_seq_len:
        problems.append(
            f"prompt bucket {P} + sampling.max_new_tokens={M} = {P + M} tokens exceeds the "
            f"model's max_seq_len={model_cfg.max_seq_len}"
        )
    return problems + checks.pack_problems(config.learner, config.batch, config.sampling, P)


def resolve(config, model: str, num_layers: int | None = None, **flag_values):
    """The config at the planned mesh, the target and the architecture `model` with the
    run's numerics (`planner.model_config`), from the plan command's flag values
    (`check_target`'s keywords, less the config's); or every problem at once. `num_layers`
    (`--num_layers`) plans the architecture with that many layers, each of its shapes.

    Returns:
      (problems, run, target, model_cfg): `run` the resolved config (`rl.RunConfig`; None
      with problems) at the target's mesh (1,1,1 when a flag is bad, so that its own checks
      still run), `model_cfg` None when `model` is unknown or the prompt length bad.
    """
    g = config.pipeline.get("generator_devices", 0)
    problems, target = check_target(
        model=model,
        config_mesh=tuple(config.mesh.shape),
        buckets=tuple(config.sampling.buckets),
        generator_devices=g if isinstance(g, int) and g > 0 else 0,  # Else the config's problem.
        **flag_values,
    )
    problems += missing_libtpu(flag_values["platform"])
    layers = {} if num_layers is None else {"num_layers": num_layers}
    architecture = {}
    if model in NAMES:
        try:
            architecture = model_lib.as_dict(model_lib.get(model, **layers))
        except ValueError as e:
            problems.append(f"--num_layers={num_layers}: {e}")
    config = config.copy_and_resolve_references()
    with config.unlocked():  # The checks below see the planned mesh when it is a valid one,
        config.mesh.shape = target.mesh if not problems else (1, 1, 1)
        # and the planned architecture (its expert axis, its auxiliary losses), with the
        # config's numerics and compute settings.
        config.model.update({k: v for k, v in architecture.items() if k not in _COMPUTE})
    config_problems, run = resolve_shapes(config)
    problems += config_problems
    model_cfg = None
    if run is not None and architecture and not any(x.startswith("--prompt_len") for x in problems):
        model_cfg = planner.model_config(run, model, **layers)
        problems += [
            f"--model={model}: {e}" for e in shape_problems(run, model_cfg, target.prompt_len)
        ]
    return problems, run, target, model_cfg


def missing_devices(platform: str, n: int) -> str | None:
    """Why this machine cannot compile for `n` attached `platform` (gpu) devices, or None
    when it can. (A TPU slice needs none attached: `topology`.)"""
    have = [d for d in jax.devices() if d.platform == platform]
    if len(have) >= n:
        return None
    return f"this machine has {len(have)} {platform.upper()} devices, not {n}"


def devices_used(
    platform: str, n: int, fallback: str | None = None, tpu: topology.Slice | None = None
) -> str:
    """Where the programs are compiled, in words after "compiled": for the TPU slice `tpu`
    by libtpu; on `n` fake CPU devices, standing in for `platform` when `fallback` (why its
    devices are missing); or on `n` attached devices."""
    if tpu is not None:
        return (
            f"for {tpu.describe()} by libtpu {topology.libtpu_version()}, no TPU attached "
            f"(the parts built on {n} fake CPU devices)"
        )
    if fallback:
        return f"on {n} fake CPU devices (XLA:CPU), standing in for {platform}: {fallback}"
    if platform == "cpu":
        return f"on {n} fake CPU devices (XLA:CPU)"
    have = [d for d in jax.devices() if d.platform == platform]
    return f"on {n} attached {platform.upper()} devices ({have[0].device_kind})"
