"""Benchmarks: sampler and train-step throughput against this machine's measured roofline.

    python tools/bench.py --model small [--batch 128] [--out bench.json]

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
Prints a table; `--out` writes the same numbers as JSON.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlscale import model, next_token
from rlscale.sampling import sampler as sampling
from rlscale.scaling.compute import matmul_params


def _time(fn, repeats):
    fn()  # Compile and warm up.
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def peak_matmul_flops(dtype, sizes=(1024, 2048, 3072)):
    best = 0.0
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), dtype)
        f = jax.jit(lambda a, b: a @ b)
        best = max(best, 2 * n**3 / _time(lambda f=f, a=a, b=b: f(a, b).block_until_ready(), 5))
    return best


def memory_bandwidth(nbytes=512 << 20):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    return nbytes / _time(lambda: f(x).block_until_ready(), 5)


def bench_decode(cfg, params, graphdef, batch, prompt_len, new_tokens, phases, peak, bw, repeats):
    itemsize = jnp.dtype(cfg.dtype).itemsize
    scfg = sampling.SamplingConfig(
        max_new_tokens=new_tokens, temperature=1.0, buckets=(prompt_len,), decode_phases=phases
    )
    tokens = np.asarray(
        jax.random.randint(jax.random.key(1), (batch, prompt_len), 4, cfg.vocab_size), np.int32
    )
    mask = np.ones_like(tokens, bool)
    rng = jax.random.key(2)

    def run():
        out = sampling.generate(
            params, tokens, mask, rng, graphdef=graphdef, model_cfg=cfg, cfg=scfg
        )
        jax.block_until_ready(out)
        return out

    @jax.jit
    def prefill(params, tokens, mask):
        cache = model.init_cache(cfg, batch, prompt_len + -(-new_tokens // phases))
        h, cache = model.hidden(
            graphdef, params, tokens, model.positions_from_mask(mask), mask, cache
        )
        return model.logits(graphdef, params, h[:, -1:]), cache

    total = _time(run, repeats)
    pre = _time(lambda: jax.block_until_ready(prefill(params, tokens, mask)), repeats)
    steps = int(run()[3].max())  # The loop exits early only if every row stops.
    decode = total - pre
    n_mm = matmul_params(cfg)
    weight_bytes = cfg.num_params() * jnp.dtype(cfg.param_dtype).itemsize
    kv_per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    bound = flops = nbytes = 0.0
    for i in range(steps):
        ctx = prompt_len + i + 1
        f = 2 * n_mm * batch + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx * batch
        b = weight_bytes + kv_per_slot * batch * (ctx + 1)
        flops, nbytes, bound = flops + f, nbytes + b, bound + max(f / peak, b / bw)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": steps,
        "decode_phases": phases,
        "prefill_s": pre,
        "decode_s": decode,
        "decode_tokens_per_s": batch * steps / decode,
        "decode_flops_per_s": flops / decode,
        "decode_bytes_per_s": nbytes / decode,
        "decode_arith_intensity": flops / nbytes,
        "decode_roofline_fraction": bound / decode,
    }


def bench_train(cfg, params, graphdef, batch, seq_len, peak, repeats):
    optimizer = optax.adamw(1e-4)
    step = next_token.make_train_step(graphdef, optimizer)
    state = next_token.init_state(params, optimizer)
    tokens = jax.random.randint(jax.random.key(3), (batch, seq_len), 4, cfg.vocab_size)
    mask = jnp.ones((batch, seq_len), bool)
    holder = [state]

    def run():
        holder[0], metrics = step(holder[0], tokens, mask)
        jax.block_until_ready(metrics)

    dt = _time(run, repeats)
    n_tok = batch * seq_len
    flops = 6 * matmul_params(cfg) * n_tok + (
        12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len * n_tok
    )
    return {
        "batch": batch,
        "seq_len": seq_len,
        "step_s": dt,
        "tokens_per_s": n_tok / dt,
        "flops_per_s": flops / dt,
        "peak_fraction": flops / dt / peak,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=model.config.NAMES)
    p.add_argument("--batch", type=int, default=128, help="decode batch")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=192)
    p.add_argument("--decode_phases", type=int, default=8, help="SamplingConfig.decode_phases")
    p.add_argument("--train_batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--dtype", default=None, help="override the model's compute/param dtype")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", default="", help="comma list of parts to skip: decode,train")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    overrides = {}
    if args.dtype:
        overrides = dict(dtype=args.dtype, param_dtype=args.dtype)
    cfg = model.get(args.model, **overrides)
    cfg = model.get(
        args.model,
        **overrides,
        max_seq_len=max(cfg.max_seq_len, args.prompt_len + args.new_tokens, args.seq_len),
    )
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    peak = peak_matmul_flops(jnp.dtype(cfg.dtype))
    bw = memory_bandwidth()
    results = {
        "device": str(jax.devices()[0].device_kind),
        "num_devices": jax.device_count(),
        "model": args.model,
        "params": cfg.num_params(),
        "dtype": cfg.dtype,
        "peak_matmul_flops_per_s": peak,
        "memory_bandwidth_bytes_per_s": bw,
    }
    skip = set(filter(None, args.skip.split(",")))
    if "decode" not in skip:
        results["decode"] = bench_decode(
            cfg,
            params,
            graphdef,
            args.batch,
            args.prompt_len,
            args.new_tokens,
            args.decode_phases,
            peak,
            bw,
            args.repeats,
        )
    if "train" not in skip:
        results["train"] = bench_train(
            cfg, params, graphdef, args.train_batch, args.seq_len, peak, args.repeats
        )

    print(
        f"device {results['device']} x{results['num_devices']}  model {args.model} "
        f"({cfg.num_params() / 1e6:.1f}M params, {cfg.dtype})"
    )
    print(f"peak matmul {peak / 1e9:8.1f} GFLOP/s   memory bandwidth {bw / 1e9:6.1f} GB/s")
    print(f"{'part':<8}{'shape':<22}{'tokens/s':>12}{'GFLOP/s':>10}{'roofline':>10}")
    if "decode" in results:
        d = results["decode"]
        shape = f"B={d['batch']} P={d['prompt_len']} M={d['new_tokens']}/{d['decode_phases']}ph"
        print(
            f"{'decode':<8}{shape:<22}"
            f"{d['decode_tokens_per_s']:>12.0f}{d['decode_flops_per_s'] / 1e9:>10.1f}"
            f"{d['decode_roofline_fraction']:>10.1%}"
        )
    if "train" in results:
        t = results["train"]
        shape = f"B={t['batch']} T={t['seq_len']}"
        print(
            f"{'train':<8}{shape:<22}{t['tokens_per_s']:>12.0f}"
            f"{t['flops_per_s'] / 1e9:>10.1f}{t['peak_fraction']:>10.1%}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
