"""Benchmarks: sampler and train-step throughput against this machine's measured roofline.

    python tools/bench.py --model small [--batch 128] [--only decode,train,generator,episodes]
        [--out bench.json]

In one run it measures the peak matmul FLOP/s (large square matmuls in the model's compute
dtype) and the memory bandwidth (a large reduction: reads only, which is what decode does),
then times:
  * decode: `generate` at --batch prompts of --prompt_len tokens and --new_tokens new tokens,
    prefill timed separately and subtracted. Its roofline bound per step is
    max(FLOPs / peak, bytes / bandwidth), with FLOPs = 2 x (matmul params) x batch + attention
    over the live context, and bytes = every weight read once + the live KV cache read + the new
    K/V written. Achieved fraction = sum of bounds / measured decode time.
  * train: forward + backward of the next-token loss + AdamW, FLOPs = 6 x (matmul params) x
    tokens + 12 x layers x heads x head_dim x T per token (attention), fraction of peak.
  * generator: continuous batching (`generator.Generator`, --slots slots, `step(--steps_per_call)`)
    against static batching (`Sampler` on batches of --slots requests in the same order) on
    --requests requests whose completion lengths are long-tailed (see `completion_lengths`;
    no stop tokens, so each request's budget is its length; --gen_samples samples each, and
    with --kv_block_size a paged engine too: KV bytes per live token, prefill rows per group;
    with --kv_blocks a pool that size, and a preempting paged engine on it: utilization).
    A static batch decodes until its longest row is done (max_new_tokens = that row's
    length), so both sides produce the same
    useful tokens. Utilization = useful tokens / slot-steps; tokens/s over wall time, prefill
    included, compilation excluded (every program is compiled by an untimed first pass). The
    bound is the utilization of an ideal engine (a slot refilled the step it frees, no host
    time) on the same workload: what the drain at the end of a finite workload leaves.
  * episodes: multi-turn episodes (`envs.episodes.Episodes` over a Generator of --ep_slots
    slots and --parked parking rows, `step(--steps_per_call)`) on --ep_requests random
    prompts, against a synthetic tool (`SleepyTool`) that sleeps --latency_ms on its worker
    thread and replies --reply_tokens tokens. A turn ends at a stop: the tokens the random
    policy samples most, together about 1 in --turn_tokens of its tokens (`frequent_stops`);
    an episode ends after --turns turns, or at --ep_tokens tokens. The same workload (the
    same keys: the same tokens, checked) runs with no latency, with the latency, and with
    the latency and no parking rows. Utilization = policy tokens / slot-steps, both
    `EngineStats` counters (a reply's tokens are appended by a prefill, not decoded: they
    count in neither); tokens/s = policy tokens / wall time, compilation excluded.
Prints a table; `--out` writes the same numbers as JSON. Each section is a module of the
package `bench/` beside this file (named as `--only` names it; `common` holds the timing and
the measured roofline); this file holds the flags and runs them in turn on the same params.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

# The sections' package beside this file (a path of its own when a test loads this file).
TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
if TOOLS_DIR not in sys.path:
    sys.path.insert(0, TOOLS_DIR)

from bench import common, decode, episodes, generator, train  # noqa: E402

from rlscale import cli, model  # noqa: E402

PARTS = ("decode", "train", "generator", "episodes")


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_enum("model", "small", list(model.config.NAMES), "the model", flag_values=fv)
    flags.DEFINE_integer("batch", 128, "decode batch", flag_values=fv)
    flags.DEFINE_integer("prompt_len", 64, "decode: prompt tokens", flag_values=fv)
    flags.DEFINE_integer("new_tokens", 192, "decode: new tokens", flag_values=fv)
    flags.DEFINE_integer("decode_phases", 8, "SamplingConfig.decode_phases", flag_values=fv)
    flags.DEFINE_integer("train_batch", 8, "train: batch", flag_values=fv)
    flags.DEFINE_integer("seq_len", 512, "train: sequence length", flag_values=fv)
    flags.DEFINE_string("dtype", None, "override the model's compute/param dtype", flag_values=fv)
    # 16 requests per slot: with fewer, the drain at the end (slots idle while the longest
    # requests finish) caps any FIFO engine's utilization below 0.9 (`ideal_utilization`).
    flags.DEFINE_integer("slots", 4, "generator: engine slots = static batch", flag_values=fv)
    flags.DEFINE_integer("requests", 64, "generator: a multiple of --slots", flag_values=fv)
    flags.DEFINE_integer("gen_tokens", 192, "generator: longest completion", flag_values=fv)
    flags.DEFINE_integer("steps_per_call", 4, "generator: Generator.step(k)", flag_values=fv)
    flags.DEFINE_integer("gen_prompt_len", 16, "generator: longest prompt", flag_values=fv)
    flags.DEFINE_integer("gen_samples", 1, "generator: samples per request", flag_values=fv)
    flags.DEFINE_integer(
        "kv_block_size",
        0,
        "generator: also a paged engine (sampling.kv_block_size)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "kv_blocks",
        0,
        "generator: the paged engine's pool (0: as dense rows take); smaller: a preempting "
        "paged engine too (sampling.kv_preempt)",
        flag_values=fv,
    )
    flags.DEFINE_integer("ep_slots", 8, "episodes: engine slots", flag_values=fv)
    # 16 requests per slot: with fewer, the drain at the end (the last episodes' turns and
    # tool calls, with fewer samples ready than slots) weighs more than the run.
    flags.DEFINE_integer("ep_requests", 128, "episodes: requests (episodes)", flag_values=fv)
    flags.DEFINE_integer("ep_tokens", 192, "episodes: max_new_tokens", flag_values=fv)
    flags.DEFINE_integer("turn_tokens", 24, "episodes: ~policy tokens a turn", flag_values=fv)
    flags.DEFINE_integer("turns", 4, "episodes: env.max_turns", flag_values=fv)
    flags.DEFINE_integer("reply_tokens", 4, "episodes: tokens of each reply", flag_values=fv)
    flags.DEFINE_float("latency_ms", 50.0, "episodes: each env call's latency", flag_values=fv)
    flags.DEFINE_integer("parked", 56, "episodes: Generator(parked=...)", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed repeats (the best counts)", flag_values=fv)
    flags.DEFINE_list("only", list(PARTS), "comma list of parts to run", flag_values=fv)
    flags.DEFINE_list("skip", [], "comma list of parts to skip", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON here", flag_values=fv)


def model_config(args):
    """The `--model` preset with `--dtype`, its `max_seq_len` raised to hold every section's
    longest sequence."""
    overrides = {}
    if args.dtype:
        overrides = dict(dtype=args.dtype, param_dtype=args.dtype)
    cfg = model.get(args.model, **overrides)
    longest = max(
        cfg.max_seq_len,
        args.prompt_len + args.new_tokens,
        args.gen_prompt_len + args.gen_tokens,
        args.seq_len,
    )
    return model.get(args.model, **overrides, max_seq_len=longest)


def run_sections(args, parts, cfg, params, graphdef, results):
    """Runs each section of `parts` in turn on the same params, into `results`."""
    peak = results.get("peak_matmul_flops_per_s")
    bw = results.get("memory_bandwidth_bytes_per_s")
    sections = {
        "decode": lambda: decode.bench_decode(
            cfg, params, graphdef, args.batch, args.prompt_len, args.new_tokens,
            args.decode_phases, peak, bw, args.repeats,
        ),
        "train": lambda: train.bench_train(
            cfg, params, graphdef, args.train_batch, args.seq_len, peak, args.repeats
        ),
        "generator": lambda: generator.bench_generator(
            cfg, params, graphdef, args.slots, args.requests, args.gen_prompt_len,
            args.gen_tokens, args.steps_per_call, args.repeats,
            samples=args.gen_samples, kv_block_size=args.kv_block_size,
            kv_blocks=args.kv_blocks,
        ),
        "episodes": lambda: episodes.bench_episodes(
            cfg, params, graphdef, args.ep_slots, args.ep_requests, args.gen_prompt_len,
            args.ep_tokens, args.turn_tokens, args.turns, args.reply_tokens,
            args.latency_ms / 1000, args.parked, args.steps_per_call, args.repeats,
        ),
    }  # fmt: skip
    for part in PARTS:
        if part in parts:
            t = time.perf_counter()
            results[part] = sections[part]()
            results[part]["section_s"] = time.perf_counter() - t


def print_results(results, parts, cfg):
    print(
        f"device {results['device']} x{results['num_devices']}  model {results['model']} "
        f"({cfg.num_params() / 1e6:.1f}M params, {cfg.dtype})"
    )
    if parts & {"decode", "train"}:
        peak = results["peak_matmul_flops_per_s"]
        bw = results["memory_bandwidth_bytes_per_s"]
        print(f"peak matmul {peak / 1e9:8.1f} GFLOP/s   memory bandwidth {bw / 1e9:6.1f} GB/s")
        print(f"{'part':<8}{'shape':<22}{'tokens/s':>12}{'GFLOP/s':>10}{'roofline':>10}")
    if "decode" in results:
        decode.print_decode(results["decode"])
    if "train" in results:
        train.print_train(results["train"])
    if "generator" in results:
        generator.print_generator(results["generator"])
    if "episodes" in results:
        episodes.print_episodes(results["episodes"])


def main(fv: flags.FlagValues) -> None:
    args = fv  # The flags, read below as `args`.
    parts = set(filter(None, args.only)) - set(filter(None, args.skip))
    unknown = parts - set(PARTS)
    if unknown:
        raise ValueError(f"unknown part(s) {sorted(unknown)}; known: {', '.join(PARTS)}")
    cfg = model_config(args)
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    results = {
        "device": str(jax.devices()[0].device_kind),
        "num_devices": jax.device_count(),
        "model": args.model,
        "params": cfg.num_params(),
        "dtype": cfg.dtype,
    }
    if parts & {"decode", "train"}:  # Their rooflines; the generator section needs neither.
        results["peak_matmul_flops_per_s"] = common.peak_matmul_flops(jnp.dtype(cfg.dtype))
        results["memory_bandwidth_bytes_per_s"] = common.memory_bandwidth()
    run_sections(args, parts, cfg, params, graphdef, results)
    print_results(results, parts, cfg)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    cli.run_command(define_flags, main)
