"""A fused attention kernel's memory, for plans compiled where no such kernel exists.

XLA:CPU, on which the planner compiles by default, fuses no attention: `xla` and
`dot_product` materialize a layer's [T, T] scores and keep them for the backward pass, where
cuDNN's flash attention on a GPU (`dot_product` in bfloat16, `cudnn`) and Pallas splash on a
TPU hold none: they tile the scores on chip and save only the output and a log-sum-exp per
query row. At 16k-token sequences the scores are the whole plan. With `--fused_attention` the
planner compiles `model.attention`'s calls as `attention='chunked'` instead (`fused_config`),
the same values a query block at a time, forward and backward. What that holds beyond a fused
kernel is one block's scores, probabilities and their cotangents, [rows, H, b, T] float32
each, per layer in flight (`standin_excess_bytes`, reported beside the plan); like the kernels
it reads the [rows, T, T] boolean mask the learner builds.
"""

import dataclasses

from rlscale.model import attention

# Live [B, H, b, S] float32 arrays of a block's backward pass: scores, probabilities and
# their cotangents.
STANDIN_COPIES = 4


def fused_config(model_cfg, on: bool = True):
    """`model_cfg` planned as a fused kernel's memory (`attention='chunked'`), with `on`."""
    return dataclasses.replace(model_cfg, attention="chunked") if on else model_cfg


def standin_excess_bytes(rows: int, heads: int, T: int) -> int:
    """What `chunked` holds beyond a fused kernel, per device in the update: one query block's
    float32 scores, probabilities and their cotangents in a layer's backward pass, for `rows`
    forward rows of T tokens and `heads` query heads on the device."""
    return STANDIN_COPIES * rows * heads * attention.chunk_queries(T) * T * 4


def info(model_cfg, mesh, T: int, rows: int) -> dict:
    """What a plan with `--fused_attention` reports: the implementation planned as fused and
    its stand-in's excess over a fused kernel per device (`standin_excess_bytes`) for `rows`
    forward rows of T tokens per batch shard in a micro-batch, the query heads on a device
    (split over `tensor` where it divides them)."""
    t, H = int(mesh.shape["tensor"]), model_cfg.num_heads
    heads = H // t if H % t == 0 else H
    return {"attention": model_cfg.attention, "excess_bytes": standin_excess_bytes(rows, heads, T)}
