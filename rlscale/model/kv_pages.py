"""A paged KV cache: a pool of fixed-size blocks shared by every row, and a block table per
row naming which block holds each run of `block_size` of its columns.

A row's column c lives in block `table_BN[b, c // block_size]` at offset c % block_size;
rows may name the same block (a prompt's blocks shared by its samples), and a table entry of
`blocks` (past the pool) names no block: a write there is dropped, a read is clamped to some
block whose values the mask removes (attention gives a column that is not valid a weight of
exactly 0, and every pool value is finite). Which blocks a row holds is the host's business
(`sampling.paged`); this module writes and reads through the table.

Layout follows `decoder.KVCache`: one buffer per layer, keys transposed ([NB, K, E, bs]) and
values [NB, K, bs, E], so a row's gathered view is the dense cache's [B, K, E, C] and
[B, K, C, E] and decode attention runs unchanged (`view`, the CPU reference). A paged
attention kernel (TPU: `jax.experimental.pallas.ops.tpu.paged_attention`, which reads
[K, NB, bs, E] pages through the same table) would replace `view` + `attention.attention` in
`decoder.Attention`; see docs/model_and_sampling.md#a-paged-kv-cache for what it needs.

Dimension letters: B rows, T tokens of this call, NB blocks of the pool, bs block size, N
table entries of a row (C / bs), C a row's columns, K kv heads, E head dim.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlscale.model.config import ModelConfig

Array = jax.Array


class PagedKVCache(NamedTuple):
    """`decoder.KVCache` with its keys and values in a block pool.

    Attributes:
      k: per layer [NB, K, E, bs].
      v: per layer [NB, K, bs, E].
      table_BN: each row's block ids, one per `bs` columns (NB: no block).
      valid_BS: which of each row's C columns hold real tokens.
      index_B: each row's next column to write.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    table_BN: Array
    valid_BS: Array
    index_B: Array


def init(cfg: ModelConfig, batch: int, columns: int, block_size: int, blocks: int):
    """An empty pool of `blocks` blocks and `batch` rows of `columns` columns naming none."""
    if columns % block_size:
        raise ValueError(f"block size {block_size} does not divide the {columns} columns")
    K, E, dt = cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype
    return PagedKVCache(
        k=tuple(jnp.zeros((blocks, K, E, block_size), dt) for _ in range(cfg.num_layers)),
        v=tuple(jnp.zeros((blocks, K, block_size, E), dt) for _ in range(cfg.num_layers)),
        table_BN=jnp.full((batch, columns // block_size), blocks, jnp.int32),
        valid_BS=jnp.zeros((batch, columns), bool),
        index_B=jnp.zeros((batch,), jnp.int32),
    )


def logical_axes(cfg: ModelConfig) -> PagedKVCache:
    """The pool splits over kv heads only; the rows' table, validity and index as the rows."""
    return PagedKVCache(
        k=((None, "kv_heads", "head_dim", None),) * cfg.num_layers,
        v=((None, "kv_heads", None, "head_dim"),) * cfg.num_layers,
        table_BN=("batch", None),
        valid_BS=("batch", "cache_seq"),
        index_B=("batch",),
    )


def locate(table_BN, columns_BT, blocks: int, block_size: int):
    """(block, offset) [B, T] of each row's columns; a column past the row's end, or in no
    block, gives block `blocks` (a write there is dropped)."""
    N = table_BN.shape[1]
    n_BT = columns_BT // block_size
    block_BT = jnp.take_along_axis(table_BN, jnp.clip(n_BT, 0, N - 1), axis=1)
    block_BT = jnp.where((n_BT >= 0) & (n_BT < N), block_BT, blocks)
    return block_BT, columns_BT % block_size


def write(kv, k_BKET, v_BKTE, columns_BT):
    """The layer's (k pool, v pool, table) with row b's T new keys and values at its columns
    `columns_BT[b]`: one scatter per pool."""
    k_pool, v_pool, table_BN = kv
    NB, bs = k_pool.shape[0], k_pool.shape[3]
    block_BT, at_BT = locate(table_BN, columns_BT, NB, bs)
    # Index arrays on dims 0 and 3 (k) or 0 and 2 (v): the update's [B, T] dims come first.
    k_BTKE = jnp.transpose(k_BKET, (0, 3, 1, 2)).astype(k_pool.dtype)
    v_BTKE = jnp.transpose(v_BKTE, (0, 2, 1, 3)).astype(v_pool.dtype)
    k_pool = k_pool.at[block_BT, :, :, at_BT].set(k_BTKE, mode="drop")
    v_pool = v_pool.at[block_BT, :, at_BT].set(v_BTKE, mode="drop")
    return k_pool, v_pool, table_BN


def view(kv):
    """The CPU reference read: each row's blocks gathered through its table into the dense
    cache's layout, keys [B, K, E, C] and values [B, K, C, E]."""
    k_pool, v_pool, table_BN = kv
    B, N = table_BN.shape
    NB, K, E, bs = k_pool.shape
    k_BNKEb = jnp.take(k_pool, table_BN, axis=0, mode="clip")
    v_BNKbE = jnp.take(v_pool, table_BN, axis=0, mode="clip")
    k_BKES = jnp.transpose(k_BNKEb, (0, 2, 3, 1, 4)).reshape(B, K, E, N * bs)
    v_BKSE = jnp.transpose(v_BNKbE, (0, 2, 1, 3, 4)).reshape(B, K, N * bs, E)
    return k_BKES, v_BKSE


def copy_blocks(cache: PagedKVCache, src_R, dst_R) -> PagedKVCache:
    """Blocks `src_R` copied into blocks `dst_R` in every layer (a `dst_R` of NB: nothing)."""
    NB = cache.k[0].shape[0]
    src_R = jnp.clip(src_R, 0, NB - 1)
    return cache._replace(
        k=tuple(k.at[dst_R].set(k[src_R], mode="drop") for k in cache.k),
        v=tuple(v.at[dst_R].set(v[src_R], mode="drop") for v in cache.v),
    )
