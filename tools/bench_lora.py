"""Benchmarks the two ways a LoRA policy's forward can use its adapters (docs/learner.md, "LoRA").

    python tools/bench_lora.py [--model quickstart] [--rank 8] [--rows 32] [--length 96]

  * merge: W' = W + (alpha / r) A @ B for every adapted weight, then the unchanged decoder
    (`lora.merge`, what rlscale does: the learner merges inside its loss, the generator once
    per weight swap);
  * on the fly: y = x W + (alpha / r) (x A) B inside each projection, the base never changed.

For each it times, on --rows rows of --length tokens, the learner's work (the next-token
loss's value and gradient with respect to the adapters) and a generator decode step
(--rows rows of one token against the base's weights, no cache: the per-token matmuls), with
full fine-tuning's gradient as the baseline; and the merge alone (a weight swap). The
on-the-fly forward exists only here: it swaps `decoder.project` for one that adds each
projection's adapter, in the order the decoder calls them (q, k, v, o, gate, up, down per
block, then the LM head), while tracing. Times are the best of --repeats runs after one that
compiles.
"""

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

# The benchmarks' package beside this file (a path of its own when a test loads this file).
TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
if TOOLS_DIR not in sys.path:
    sys.path.insert(0, TOOLS_DIR)

from bench.common import best_time  # noqa: E402

from rlscale import cli, config_lib, model  # noqa: E402
from rlscale.model import decoder  # noqa: E402
from rlscale.model import lora as lora_lib  # noqa: E402

_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_string(
        "model",
        "quickstart",
        "a preset (`rlscale.model`) or the quickstart's policy",
        flag_values=fv,
    )
    flags.DEFINE_integer("rank", 8, "the adapters' rank", flag_values=fv)
    flags.DEFINE_integer("rows", 32, "rows per call", flag_values=fv)
    flags.DEFINE_integer("length", 96, "tokens per row (the learner)", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "timed runs of each (the best is kept)", flag_values=fv)


def _model_cfg(name: str):
    if name == "quickstart":
        return model.from_dict(config_lib.rl_config().model)
    return model.get(name)


def _on_the_fly_project(adapter_list, scale):
    """`decoder.project` with the next adapter of `adapter_list` (None: none) added."""
    calls = iter(adapter_list)
    plain = decoder.project

    def project(x, w, n_in: int = 1):
        y = plain(x, w, n_in)
        node = next(calls)
        if node is None:
            return y
        a, b = node["a"].astype(x.dtype), node["b"].astype(x.dtype)
        lead = x.shape[: x.ndim - n_in]
        x2 = x.reshape(-1, math.prod(x.shape[x.ndim - n_in :]))
        return y + (scale * (x2 @ a) @ b).reshape(*lead, *w.shape[n_in:])

    return project


def _in_call_order(adapters, cfg) -> list:
    out = []
    for i in range(cfg.num_layers):
        for t in _ORDER:
            path = lora_lib.TARGETS[t].path
            out.append(adapters["layers"][str(i)][path[0]][path[1]])
    return out + [None]  # The LM head (untied).


def _loss(graphdef, params, tokens_BT):
    mask = jnp.ones(tokens_BT.shape, bool)
    logits, _ = decoder.forward(
        graphdef, params, tokens_BT, decoder.positions_from_mask(mask), mask
    )
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens_BT[:, 1:, None], -1).mean()


def _timed(fn, args, repeats):
    return best_time(lambda: jax.block_until_ready(fn(*args)), repeats)


def measure(cfg, rank: int, rows: int, length: int, repeats: int) -> dict:
    """Seconds of each variant's learner step, decode step and merge; and how far apart
    the two variants' losses are."""
    graphdef, _ = decoder.abstract_model(cfg)
    params = decoder.init_params(cfg, jax.random.key(0))
    lcfg = lora_lib.LoraConfig(rank=rank, alpha=32.0)
    adapters = lora_lib.init(params, lcfg, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B != 0: real work.
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, length)), jnp.int32)
    token = tokens[:, :2]  # A decode step's matmuls: one new token a row (and its neighbour).

    def merged_loss(ad, base, t):
        return _loss(graphdef, lora_lib.merge(base, ad, lcfg.scale), t)

    def fly_loss(ad, base, t):
        saved = decoder.project
        decoder.project = _on_the_fly_project(_in_call_order(ad, cfg), lcfg.scale)
        try:
            return _loss(graphdef, base, t)
        finally:
            decoder.project = saved

    # The two are one function: their losses agree to float32 rounding.
    gap = abs(
        float(
            jax.jit(merged_loss)(adapters, params, tokens)
            - jax.jit(fly_loss)(adapters, params, tokens)
        )
    )
    full = jax.jit(jax.grad(lambda p, t: _loss(graphdef, p, t)))
    out = {
        "learner/full_fine_tuning": _timed(full, (params, tokens), repeats),
        "learner/merge": _timed(
            jax.jit(jax.grad(merged_loss)), (adapters, params, tokens), repeats
        ),
        "learner/on_the_fly": _timed(
            jax.jit(jax.grad(fly_loss)), (adapters, params, tokens), repeats
        ),
        "decode/merged": _timed(
            jax.jit(lambda p, t: _loss(graphdef, p, t)), (params, token), repeats
        ),
        "decode/on_the_fly": _timed(jax.jit(fly_loss), (adapters, params, token), repeats),
        "swap/merge": _timed(lora_lib.merged, (params, adapters, lcfg.scale), repeats),
    }
    return out, gap


def main(fv: flags.FlagValues, args) -> None:
    del args
    cfg = _model_cfg(fv.model)
    times, gap = measure(cfg, fv.rank, fv.rows, fv.length, fv.repeats)
    print(
        f"{fv.model}: {cfg.num_params() / 1e6:.2f}M params, rank {fv.rank}, "
        f"{fv.rows} x {fv.length} tokens ({jax.devices()[0].platform}); "
        f"|loss(merge) - loss(on the fly)| = {gap:.1e}"
    )
    for name, seconds in times.items():
        print(f"  {name:28s} {seconds * 1e3:9.2f} ms")


if __name__ == "__main__":
    cli.run_command(define_flags, main)
