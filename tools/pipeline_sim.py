"""Predicts the speed of pipelined RL against the synchronous loop: a small simulation.

    python tools/pipeline_sim.py --gen_s G --train_s T [--host_s H] [--transfer_s X] \\
        [--devices N] [--generator_devices g] [--max_staleness k] [--updates_per_batch U] \\
        [--steps S]
    python tools/pipeline_sim.py --from_run SYNC_WORKDIR [...]   # G, T, H, X measured

The work of one batch, measured on all N devices: G device-seconds of generation (decode and
prefill), H seconds of host work after it (scoring, assembly: no device), T of training and X
of weight transfer (on the trainer's devices). With `--from_run`, these are the means over a
synchronous run's steps of `time/generator_busy_s`, `time/sample_s` minus those two,
`time/update_s` and `time/reshard_s`.

Model (an event simulation over `--steps` batches, reported in steady state):
- sync: each batch is generated, scored, trained and transferred in turn: G + H + T + X.
- pipeline / async_ppo: batch b may start generating once b - 1 - floor(k / U) batches are
  trained (the driver's admission control); generation runs batch after batch; the trainer
  takes batch b when it is scored and the previous update is done.
- Device sets: with g generator devices of N, generation runs at g / N of the all-device
  speed and training at (N - g) / N (ideal data parallelism: the assumption to check on real
  hardware). With g = 0 both share every device: when both want them at once each runs at
  half speed (processor sharing), so only host work and idle gaps can overlap.
- async_ppo differs from pipeline only in policy freshness, not in this model's timing.

Prints the predicted seconds per step of sync and the pipelined mode and their ratio.
"""

import json
import os

import numpy as np
from absl import flags

from rlscale import cli


def from_run(workdir: str) -> dict:
    """Per-batch G, H, T, X from a synchronous run's metrics (means over its RL steps)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    lines = [x for x in lines if "time/update_s" in x][1:]  # The first step compiles.
    if not lines:
        raise ValueError(f"{workdir}/metrics.jsonl has no RL steps after the first")

    def mean(key):
        return float(np.mean([x[key] for x in lines]))

    gen, sample, transfer = (
        mean("time/generator_busy_s"),
        mean("time/sample_s"),
        mean("time/reshard_s"),
    )
    return {
        "gen_s": gen,
        "host_s": max(sample - gen - transfer, 0.0),
        "train_s": mean("time/update_s"),
        "transfer_s": transfer,
        "step_s": mean("time/step_s"),
    }


def simulate(
    gen_s, train_s, host_s=0.0, transfer_s=0.0, *, devices=1, generator_devices=0,
    max_staleness=0, updates_per_batch=1, steps=40, dt=1e-3,
) -> float:  # fmt: skip
    """Steady-state seconds per step of the pipelined loop (see the module docstring)."""
    shared = generator_devices == 0
    gen_speed = 1.0 if shared else generator_devices / devices
    train_speed = 1.0 if shared else (devices - generator_devices) / devices
    ahead = max_staleness // updates_per_batch
    t = 0.0
    trained = 0  # Batches trained.
    gen = None  # Batch being generated: [index, device work left, host work left].
    next_gen = 1
    scored = []  # Batches ready to train.
    train = None  # [index, device work left].
    done_at = []
    while trained < steps:
        if gen is None and next_gen <= steps and next_gen - 1 - trained <= ahead:
            gen, next_gen = [next_gen, gen_s, host_s], next_gen + 1
        if train is None and scored and scored[0] == trained + 1:
            train = [scored.pop(0), train_s + transfer_s]
        gen_device = gen is not None and gen[1] > 0
        both = gen_device and train is not None
        share = 0.5 if (shared and both) else 1.0
        if gen is not None:
            if gen[1] > 0:
                gen[1] -= dt * gen_speed * share
            else:
                gen[2] -= dt
                if gen[2] <= 0:
                    scored.append(gen[0])
                    gen = None
        if train is not None:
            train[1] -= dt * train_speed * share
            if train[1] <= 0:
                trained, train = train[0], None
                done_at.append(t)
        t += dt
    half = len(done_at) // 2
    return (done_at[-1] - done_at[half]) / (len(done_at) - 1 - half)


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_string("from_run", "", "a synchronous run's workdir", flag_values=fv)
    for name in ("gen_s", "train_s", "host_s", "transfer_s"):
        flags.DEFINE_float(name, None, "seconds per batch (see above)", flag_values=fv)
    flags.DEFINE_integer("devices", 1, "N: devices in all", flag_values=fv)
    flags.DEFINE_integer("generator_devices", 0, "g: generation's devices", flag_values=fv)
    flags.DEFINE_integer("max_staleness", 4, "k", flag_values=fv)
    flags.DEFINE_integer("updates_per_batch", 1, "U", flag_values=fv)
    flags.DEFINE_integer("steps", 40, "batches simulated", flag_values=fv)


def main(fv: flags.FlagValues) -> dict:
    measured = from_run(fv.from_run) if fv.from_run else {}
    times = {}
    for key in ("gen_s", "train_s", "host_s", "transfer_s"):
        value = fv[key].value
        times[key] = value if value is not None else measured.get(key, 0.0)
    if not times["gen_s"] or not times["train_s"]:
        raise ValueError("give --gen_s and --train_s, or --from_run")
    if not 0 <= fv.generator_devices < fv.devices and fv.generator_devices:
        raise ValueError(f"--generator_devices={fv.generator_devices} must leave trainer devices")
    sync = sum(times.values())
    piped = simulate(
        **times,
        devices=fv.devices,
        generator_devices=fv.generator_devices,
        max_staleness=fv.max_staleness,
        updates_per_batch=fv.updates_per_batch,
        steps=fv.steps,
    )
    split = f"{fv.generator_devices} generator + {fv.devices - fv.generator_devices} trainer"
    split = split if fv.generator_devices else f"{fv.devices} shared"
    g, h, t, x = (times[k] for k in ("gen_s", "host_s", "train_s", "transfer_s"))
    print(f"per batch: generate {g:.3f} s, host {h:.3f} s, train {t:.3f} s, transfer {x:.3f} s")
    if "step_s" in measured:
        print(f"measured sync step: {measured['step_s']:.3f} s (model: {sync:.3f} s)")
    print(f"devices: {split}; k = {fv.max_staleness}, {fv.updates_per_batch} update(s) per batch")
    print(f"predicted s/step: sync {sync:.3f}, pipelined {piped:.3f}, speedup {sync / piped:.2f}x")
    return {"sync_s": sync, "pipelined_s": piped, "speedup": sync / piped}


if __name__ == "__main__":
    cli.run_command(define_flags, main)
