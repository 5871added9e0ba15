"""Compiled FLOPs of the learner's update with and without `learner.shared_prefix`
(docs/learner.md#shared-prefix).

    python tools/bench_shared_prefix.py [--config configs/quickstart.py:smoke] \\
        [--prompt_len 512 --completion 64 --group 8 --prompts 8 --pack_length 1152] [--out f.json]

For each layout it compiles (never runs) the update a run with `--config` and these settings
compiles, through the planner's path (`planning.planner.compile_update`: `Learner.update` on
a worst-case batch of full-length rows, every group's samples with one prompt), and reads
the compiled program's cost: `flops_per_device` as `programs.json` records it, times the
planner's `loop_factor` (the micro-batch loop counted at the trips the batch fills, where
XLA's cost analysis counts a loop body once), times the devices: FLOPs per update, and per
trained (completion) token. The two layouts share `pack_length` and the derived `pack_rows`
(a group's rows), so each packs the batch as a run would.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_flags(fv, argv) -> None:
    from absl import flags

    from rlscale import cli

    default = os.path.join(ROOT, "configs", "quickstart.py") + ":smoke"
    cli.define_config(fv, argv, default=default)
    flags.DEFINE_integer(
        "prompt_len", 512, "Prompt tokens (the batch's prompt bucket).", flag_values=fv
    )
    flags.DEFINE_integer("completion", 64, "Completion tokens (max_new_tokens).", flag_values=fv)
    flags.DEFINE_integer("group", 8, "Samples per prompt (batch.group_size).", flag_values=fv)
    flags.DEFINE_integer("prompts", 8, "Prompts per batch (batch.prompts).", flag_values=fv)
    flags.DEFINE_integer("pack_length", 1152, "learner.pack_length.", flag_values=fv)
    flags.DEFINE_string("out", None, "Write the results as JSON here.", flag_values=fv)


def measure(config, shared: bool, prompt_len: int) -> dict:
    """The compiled update's cost for `config` (a ConfigDict) with `learner.shared_prefix`
    set to `shared`, on this host's first device."""
    import jax

    from rlscale import sharding
    from rlscale.planning import planner
    from rlscale.rl import run_config

    config.learner.shared_prefix = shared
    run = run_config.resolve(config)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    *_, entry = planner.compile_update(run, run.model, mesh, prompt_len)
    flops = entry["flops_per_device"] * entry["loop_factor"] * entry["devices"]
    trained = run.batch.prompts * run.batch.group_size * run.sampling.max_new_tokens
    return {
        "shared_prefix": shared,
        "flops_per_device": entry["flops_per_device"],
        "loop_factor": entry["loop_factor"],
        "devices": entry["devices"],
        "flops_per_update": flops,
        "trained_tokens": trained,
        "flops_per_trained_token": flops / trained,
        "temp_bytes": entry["temp_bytes"],
    }


def main(fv) -> None:
    c = fv.config
    c.batch.prompts, c.batch.group_size = fv.prompts, fv.group
    c.sampling.max_new_tokens = fv.completion
    c.learner.pack_length, c.learner.pack_rows, c.learner.length_buckets = fv.pack_length, 0, 1
    c.model.max_seq_len = max(c.model.max_seq_len, fv.prompt_len + fv.completion)
    c.mesh.shape = (1, 1, 1)
    rows = [measure(c, shared, fv.prompt_len) for shared in (False, True)]
    ratio = rows[0]["flops_per_update"] / rows[1]["flops_per_update"]
    print(
        f"{fv.prompts} prompts x {fv.group} samples, {fv.prompt_len}-token prompts, "
        f"{fv.completion}-token completions, rows of {fv.pack_length} tokens"
    )
    print(f"{'shared_prefix':<14}{'FLOPs/update':>14}{'FLOPs/token':>13}{'loop x':>8}")
    for r in rows:
        print(
            f"{r['shared_prefix']!s:<14}{r['flops_per_update']:>14.4g}"
            f"{r['flops_per_trained_token']:>13.4g}{r['loop_factor']:>8.2f}"
        )
    print(f"plain / shared: {ratio:.2f}x")
    if fv.out:
        with open(fv.out, "w") as f:
            json.dump({"layouts": rows, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from rlscale import cli

    cli.run_command(define_flags, main)
