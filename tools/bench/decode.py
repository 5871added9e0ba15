"""The decode section: `generate` at a batch of prompts, prefill timed separately and
subtracted, against this machine's roofline (`common`)."""

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from rlscale import model
from rlscale.sampling import sampler as sampling
from rlscale.scaling.compute import matmul_params


def bench_decode(cfg, params, graphdef, batch, prompt_len, new_tokens, phases, peak, bw, repeats):
    """`generate` at `batch` prompts of `prompt_len` tokens and `new_tokens` new tokens in
    `phases` decode phases, the best of `repeats` runs, prefill subtracted. Its roofline bound
    per step is max(FLOPs / `peak`, bytes / `bw`), with FLOPs = 2 x (matmul params) x batch +
    attention over the live context, and bytes = every weight read once + the live KV cache
    read + the new K/V written; achieved fraction = sum of bounds / measured decode time."""
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

    total = common.best_time(run, repeats)
    pre = common.best_time(lambda: jax.block_until_ready(prefill(params, tokens, mask)), repeats)
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


def print_decode(d):
    """One row of the roofline table (`tools/bench.py` prints its header)."""
    shape = f"B={d['batch']} P={d['prompt_len']} M={d['new_tokens']}/{d['decode_phases']}ph"
    print(
        f"{'decode':<8}{shape:<22}"
        f"{d['decode_tokens_per_s']:>12.0f}{d['decode_flops_per_s'] / 1e9:>10.1f}"
        f"{d['decode_roofline_fraction']:>10.1%}"
    )
