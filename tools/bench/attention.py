"""The model's forward and backward pass alone (the gradient of the next-token loss, no
optimizer), timed: what an attention implementation changes, side by side
(`tools/gpu_check.py`'s `attention_names()`).

Model FLOPs of a pass over B x T tokens (the LM head over every token; causal attention
attends to t + 1 positions at position t), forward and backward:

    3 x (2 x (matmul params) x B x T + 4 x layers x heads x head_dim x B x T (T + 1) / 2)
"""

import functools
import statistics
import time

import jax
import numpy as np

from rlscale import model, next_token, sharding
from rlscale.scaling.compute import matmul_params


@functools.partial(jax.jit, static_argnums=0)
def loss_grad(graphdef, params, tokens_BT, mask_BT):
    """The next-token loss sum and its gradient with respect to `params`."""
    return jax.value_and_grad(lambda p: next_token.loss(graphdef, p, tokens_BT, mask_BT)[0])(params)


def attention_flops(cfg: model.ModelConfig, batch: int, seq_len: int) -> float:
    """Causal attention's FLOPs in one forward pass over `batch` x `seq_len` tokens."""
    heads = cfg.num_layers * cfg.num_heads * cfg.head_dim
    return 4 * heads * batch * seq_len * (seq_len + 1) / 2


def bench_forward_backward(cfg, batch, seq_len, peak_flops, deadline, runs=(2, 5), params=None):
    """`loss_grad` on `batch` x `seq_len` random tokens: after a call that compiles, at
    least `runs[0]` and at most `runs[1]` timed calls, stopping at `deadline`
    (`time.perf_counter()`) once the least are done; the median counts. Returns the step
    time, tokens/s, model FLOP/s, the share of attention in the FLOPs and the fraction of
    `peak_flops`. `params`: the model's on one device (the attention implementation leaves
    them as they are), else random ones."""
    if params is None:
        mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
        params = model.init_sharded(cfg, jax.random.key(0), mesh)[1]
    graphdef = model.abstract_model(cfg)[0]
    rng = np.random.default_rng(0)
    tokens = jax.device_put(rng.integers(4, cfg.vocab_size, (batch, seq_len)).astype(np.int32))
    mask = jax.device_put(np.ones((batch, seq_len), bool))
    t = time.perf_counter()
    jax.block_until_ready(loss_grad(graphdef, params, tokens, mask))
    first_s = time.perf_counter() - t
    times = []
    while len(times) < runs[1] and (len(times) < runs[0] or time.perf_counter() < deadline):
        t = time.perf_counter()
        jax.block_until_ready(loss_grad(graphdef, params, tokens, mask))
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    attention = attention_flops(cfg, batch, seq_len)
    flops = 3 * (2 * matmul_params(cfg) * batch * seq_len + attention)
    return {
        "batch": batch,
        "seq_len": seq_len,
        "first_call_s": first_s,
        "step_times_s": times,
        "step_s": step_s,
        "tokens_per_s": batch * seq_len / step_s,
        "model_flops_per_step": flops,
        "attention_flops_share": 3 * attention / flops,
        "model_flops_per_s": flops / step_s,
        "peak_flops_per_s": peak_flops,
        "mfu": flops / step_s / peak_flops,
    }
