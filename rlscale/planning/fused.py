"""A fused attention kernel's memory, for plans compiled where no such kernel exists.

XLA:CPU, on which the planner compiles by default, fuses no attention: every implementation
it can run materializes a layer's [T, T] scores (`dot_product` the whole square, `xla` the
causal half) and keeps them for the backward pass, where cuDNN's flash attention on a GPU
(`dot_product` in bfloat16, `cudnn`) and Pallas splash on a TPU hold none: they tile the
scores on chip and save only the output and a log-sum-exp per query row. At 16k-token
sequences the scores are the whole plan. `as_fused(name)` plans `model.attention=name`'s
calls as `chunked_attention` instead: the same values (the reference `attention.attention`),
computed `QUERY_BLOCK` queries at a time under a custom VJP whose backward pass recomputes
one block's scores at a time. What it holds beyond a fused kernel is one block's scores,
probabilities and their cotangents, [rows, H, QUERY_BLOCK, T] float32 each, per layer in
flight (`standin_excess_bytes`, reported beside the plan), and like the kernels it reads
the [rows, T, T] boolean mask the learner builds.

Dimension letters: B rows, T queries, S keys (S = T), H query heads, K kv heads, E head dim,
n query blocks, b queries per block.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from rlscale.model import attention

QUERY_BLOCK = 128
# Live [B, H, b, S] float32 arrays of a block's backward pass: scores, probabilities and
# their cotangents.
STANDIN_COPIES = 4


def _block(T: int) -> int:
    return math.gcd(T, QUERY_BLOCK)


def _split(x_BT, b: int):
    """[B, T, ...] -> [n, B, b, ...]."""
    B, T = x_BT.shape[:2]
    return jnp.moveaxis(x_BT.reshape(B, T // b, b, *x_BT.shape[2:]), 1, 0)


def _join(x_nB):
    """[n, B, b, ...] -> [B, T, ...]."""
    x = jnp.moveaxis(x_nB, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked(q_BTHE, k_BKES, v_BKSE, mask_BTS, scale, softcap):
    b = _block(q_BTHE.shape[1])

    def one(args):
        q, m = args
        return attention.attention(q, k_BKES, v_BKSE, m, scale, softcap)

    return _join(jax.lax.map(one, (_split(q_BTHE, b), _split(mask_BTS, b))))


def _chunked_fwd(q_BTHE, k_BKES, v_BKSE, mask_BTS, scale, softcap):
    out = _chunked(q_BTHE, k_BKES, v_BKSE, mask_BTS, scale, softcap)
    return out, (q_BTHE, k_BKES, v_BKSE, mask_BTS)


def _chunked_bwd(scale, softcap, res, do_BTHE):
    q_BTHE, k_BKES, v_BKSE, mask_BTS = res
    b = _block(q_BTHE.shape[1])

    def step(carry, args):
        dk, dv = carry
        q, m, do = args
        _, vjp = jax.vjp(
            lambda q, k, v: attention.attention(q, k, v, m, scale, softcap), q, k_BKES, v_BKSE
        )
        dq, dk_b, dv_b = vjp(do)
        return (dk + dk_b, dv + dv_b), dq

    zeros = (jnp.zeros_like(k_BKES), jnp.zeros_like(v_BKSE))
    blocks = (_split(q_BTHE, b), _split(mask_BTS, b), _split(do_BTHE, b))
    (dk, dv), dq = jax.lax.scan(step, zeros, blocks)
    return _join(dq), dk, dv, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q_BTHE, k_BKET, v_BKTE, mask: attention.Mask, *, scale, window, softcap):
    """The registry's signature (`attention.Implementation.fn`): the reference attention
    over `mask.mask_BTS` (which holds the window), `QUERY_BLOCK` queries at a time, forward
    and backward."""
    del window  # In `mask.mask_BTS` already.
    return _chunked(q_BTHE, k_BKET, v_BKTE, mask.mask_BTS, scale, softcap)


@contextlib.contextmanager
def as_fused(name: str, on: bool = True):
    """Within it, calls of attention implementation `name` without a cache run
    `chunked_attention` (the programs traced inside it plan a fused kernel's memory); with
    `on` False, as they are."""
    if not on:
        yield
        return
    impl = attention.get(name)
    attention._REGISTRY[name] = impl._replace(fn=chunked_attention)  # Restored on exit.
    try:
        yield
    finally:
        attention._REGISTRY[name] = impl


def standin_excess_bytes(rows: int, heads: int, T: int) -> int:
    """What `chunked_attention` holds beyond a fused kernel, per device in the update: one
    query block's float32 scores, probabilities and their cotangents in a layer's backward
    pass, for `rows` forward rows of T tokens and `heads` query heads on the device."""
    return STANDIN_COPIES * rows * heads * _block(T) * T * 4


def info(model_cfg, mesh, T: int, rows: int) -> dict:
    """What a plan with `as_fused` reports: the implementation planned as fused and its
    stand-in's excess over a fused kernel per device (`standin_excess_bytes`) for `rows`
    forward rows of T tokens per batch shard in a micro-batch, the query heads on a device
    (split over `tensor` where it divides them)."""
    t, H = int(mesh.shape["tensor"]), model_cfg.num_heads
    heads = H // t if H % t == 0 else H
    return {"attention": model_cfg.attention, "excess_bytes": standin_excess_bytes(rows, heads, T)}
