"""The generator engine's paged KV cache (`SamplingConfig.kv_block_size` > 0): the host's
block manager (`Pages`: the pool's free list and reference counts, each row's block table,
the blocks each request may still take), the start-up checks, and the device-side pieces the
engine's programs call for a `kv_pages.PagedKVCache` (placing a prefilled prompt into its
blocks, a slot's rows for `extend`, moving rows without their blocks).

A request's samples share its prompt's blocks: the prompt (left-padded to its bucket P) is
prefilled once and written once into F = (P - 1) // bs shared blocks (reference count G),
and each sample gets its own copy of block F, which holds the prompt's last token and the
first completion columns: no sample ever writes into a shared block (a decode step writes at
column >= P, a weight swap re-runs column P - 1 at the latest). A slot takes blocks as it
grows (the host gives each live slot the blocks the next decode call can reach) and a
finished sample returns them; a shared block returns when its last sample finishes.

Admission reserves a request's worst case (its shared blocks and every sample's own blocks
up to its token budget), so a decode call never runs out of blocks and nothing is
preempted; the blocks taken follow the live tokens. With `SamplingConfig.kv_preempt`
(`Pages(reserving=False)`) nothing is reserved: the generator admits a request on its
prompt's blocks and, before a decode call that would run out, swaps the latest-admitted
samples' blocks out to the host (`take_blocks`), and later into fresh blocks of their own
(`put_blocks`: a resumed sample's prompt is its own copy). See docs/model_and_sampling.md.

Dimension letters: S slots, C cache columns, N table entries (C / bs), NB blocks of the pool,
R prefill rows, G samples per request, P padded prompt length.
"""

import heapq

import jax
import jax.numpy as jnp
import numpy as np

from rlscale.model import kv_pages


def own_from(P: int, block_size: int) -> int:
    """The first table entry a sample owns: the block holding its prompt's last column."""
    return (P - 1) // block_size


def request_blocks(P: int, budget: int, G: int, block_size: int) -> int:
    """The most blocks a request of bucket P and `budget` tokens per sample can hold."""
    F = own_from(P, block_size)
    return F + G * (-(-(P + budget) // block_size) - F)


def problems(block_size, blocks, columns, slots, G, bucket, M, batch_split) -> list[str]:
    """What is wrong with a paged cache of `blocks` blocks of `block_size` columns for
    `slots` slots of `columns` columns (longest prompt bucket `bucket`, budget M)."""
    key = "sampling.kv_block_size"
    if columns % block_size:
        return [
            f"{key}={block_size} does not divide the cache's {columns} columns (the longest "
            f"prompt bucket {bucket} + max_new_tokens={M})"
        ]
    out = []
    if batch_split > 1:
        out.append(
            f"{key}={block_size}: the paged cache's pool is not split over the mesh's batch "
            f"axes ({batch_split} ways); use a mesh without a batch split, or {key}=0"
        )
    groups = slots // G
    prompts = groups * request_blocks(bucket, 0, G, block_size)
    least = max(prompts, request_blocks(bucket, M, G, block_size))
    if blocks and blocks < least:
        out.append(
            f"sampling.kv_blocks={blocks} is too small: the {slots} slots' prompts (bucket "
            f"{bucket}, {groups} requests of {G}) take {prompts} blocks of {block_size}, and "
            f"one request at max_new_tokens={M} {request_blocks(bucket, M, G, block_size)}; "
            f"use at least {least}"
        )
    return out


class Pages:
    """The host's view of the pool: which blocks each row's table names (rows: the slots,
    then the parking rows), their reference counts, the free blocks (the lowest first), and
    each row's reservation (blocks it may still take; a shared block counts once)."""

    def __init__(self, rows: int, columns: int, block_size: int, blocks: int, reserving=True):
        self.bs, self.blocks, self.reserving = block_size, blocks, reserving
        self.table = np.full((rows, columns // block_size), blocks, np.int32)
        self.refs = np.zeros(blocks, np.int32)
        self.free = list(range(blocks))  # A heap.
        self.reserve = np.zeros(rows, np.int64)
        self.dirty = True  # The device's tables are behind.
        self.taken_peak = 0

    @property
    def taken(self) -> int:
        return self.blocks - len(self.free)

    @property
    def available(self) -> int:
        """Free blocks that no reservation holds."""
        return len(self.free) - int(self.reserve.sum())

    def _take(self) -> int:
        block = heapq.heappop(self.free)
        self.taken_peak = max(self.taken_peak, self.taken)
        return block

    def admit(self, rows, P: int, budgets) -> None:
        """A request's samples into `rows` (sample g's budget `budgets[g]`): its shared
        prompt blocks (one per F table entries, referenced by every sample) and each
        sample's block F taken now, the rest of each sample's worst case reserved."""
        F, bs = own_from(P, self.bs), self.bs
        shared = [self._take() for _ in range(F)]
        self.refs[shared] = len(rows)
        for row, budget in zip(rows, budgets):
            self.table[row, :F] = shared
            self.table[row, F] = block = self._take()
            self.refs[block] = 1
            self.reserve[row] = -(-(P + budget) // bs) - F - 1 if self.reserving else 0
        self.dirty = True

    def grow(self, row: int, columns: int) -> None:
        """Row `row`'s table covers its first `columns` columns (within its reservation, when
        reserving; else the caller made room: `short`)."""
        have = self.held(row)
        need = -(-columns // self.bs)
        if self.reserving:
            need = min(need, have + int(self.reserve[row]))
        for n in range(have, need):
            self.table[row, n] = block = self._take()
            self.refs[block] = 1
            self.reserve[row] -= int(self.reserving)
            self.dirty = True

    def held(self, row: int) -> int:
        """The table entries row `row` holds (its first ones)."""
        return int(np.sum(self.table[row] < self.blocks))

    def short(self, wants: dict) -> int:
        """Blocks missing for rows to cover `wants[row]` columns each (not reserving)."""
        need = sum(max(0, -(-c // self.bs) - self.held(row)) for row, c in wants.items())
        return max(0, need - len(self.free))

    def own(self, row: int, n: int) -> np.ndarray:
        """Row `row` (holding none) takes `n` fresh blocks of its own, for its first entries;
        their ids."""
        ids = np.array([self._take() for _ in range(n)], np.int32)
        self.table[row, :n], self.refs[ids] = ids, 1
        self.dirty = True
        return ids

    def release(self, row: int) -> None:
        """A finished sample's blocks back (a shared one once its last sample is done)."""
        for block in self.table[row][self.table[row] < self.blocks]:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                heapq.heappush(self.free, int(block))
        self.table[row] = self.blocks
        self.reserve[row] = 0
        self.dirty = True

    def move(self, dst: int, src: int) -> None:
        """Row `src`'s blocks and reservation to row `dst` (parking, and back)."""
        self.table[dst], self.table[src] = self.table[src], self.blocks
        self.reserve[dst], self.reserve[src] = self.reserve[src], 0
        self.dirty = True


def padded(ids, rows: int, fill: int) -> np.ndarray:
    """Block ids `ids` followed by `fill` (past the pool: no block) to `rows` entries."""
    return np.concatenate([ids, np.full(rows - len(ids), fill)]).astype(np.int32)


# -- device side: called inside the engine's jitted programs -------------------------------


def place_prompt(cache, new_k, new_v, slot_N, G: int):
    """The pools with R prefilled prompts (`new_k`, `new_v`: per layer [R, K, E, P] and
    [R, K, P, E]) written through the tables of their samples' slots `slot_N` (N = R x G; a
    slot >= S writes nothing): the shared blocks once per row, block F once per sample."""
    S, N = cache.table_BN.shape
    NB, bs = cache.k[0].shape[0], cache.k[0].shape[3]
    R, P = new_k[0].shape[0], new_k[0].shape[3]
    F = own_from(P, bs)
    table_NN = jnp.where((slot_N < S)[:, None], cache.table_BN[jnp.minimum(slot_N, S - 1)], NB)
    n = jnp.arange(N)
    shared_RN = jnp.where(n < F, table_NN.reshape(R, G, N)[:, 0], NB)
    own_NN = jnp.where(n == F, table_NN, NB)
    cols_RP = jnp.broadcast_to(jnp.arange(P), (R, P))
    cols_NT = jnp.broadcast_to(jnp.arange(F * bs, P), (R * G, P - F * bs))
    tile = lambda x: jnp.repeat(x, G, axis=0)  # noqa: E731
    k, v = [], []
    for k_pool, v_pool, k_RKEP, v_RKPE in zip(cache.k, cache.v, new_k, new_v):
        if F:
            k_pool, v_pool, _ = kv_pages.write((k_pool, v_pool, shared_RN), k_RKEP, v_RKPE, cols_RP)
        own_k, own_v = tile(k_RKEP[..., F * bs :]), tile(v_RKPE[:, :, F * bs :])
        k_pool, v_pool, _ = kv_pages.write((k_pool, v_pool, own_NN), own_k, own_v, cols_NT)
        k.append(k_pool)
        v.append(v_pool)
    return tuple(k), tuple(v)


def take_blocks(cache, ids_R):
    """The keys and values of blocks `ids_R` (per layer [R, K, E, bs] and [R, K, bs, E]; an
    id past the pool reads the last block): a preempted sample's, for the host."""
    take = lambda pool: jnp.take(pool, ids_R, axis=0, mode="clip")  # noqa: E731
    return tuple(map(take, cache.k)), tuple(map(take, cache.v))


def put_blocks(cache, ids_R, k, v):
    """The pools with `take_blocks`' keys and values `k`, `v` written into blocks `ids_R`
    (an id past the pool writes nothing): a preempted sample back, into blocks of its own."""
    put = lambda pool, x: pool.at[ids_R].set(x.astype(pool.dtype), mode="drop")  # noqa: E731
    return cache._replace(k=tuple(map(put, cache.k, k)), v=tuple(map(put, cache.v, v)))


def gather_rows(cache, at_R, ok_R):
    """`extend`'s cache rows of slots `at_R`: their tables (none where not `ok_R`: a padding
    row writes nothing), validity and write positions, over the whole pool."""
    NB = cache.k[0].shape[0]
    return cache._replace(
        table_BN=jnp.where(ok_R[:, None], cache.table_BN[at_R], NB),
        valid_BS=cache.valid_BS[at_R],
        index_B=cache.index_B[at_R],
    )


def put_rows(cache, rows, put):
    """`extend`'s rows back: the pool written through their tables, their validity and write
    positions `put` into their slots."""
    return cache._replace(
        k=rows.k,
        v=rows.v,
        valid_BS=put(cache.valid_BS, rows.valid_BS),
        index_B=put(cache.index_B, rows.index_B),
    )


def move_rows(dst, src, put):
    """`engine.move` of a paged state: every per-row array `put` (the tables name the same
    pool's blocks), each pool left where it is."""
    hollow = lambda s: s._replace(cache=s.cache._replace(k=(), v=()), version=None)  # noqa: E731
    out = jax.tree.map(put, hollow(dst), hollow(src))
    return out._replace(cache=out.cache._replace(k=dst.cache.k, v=dst.cache.v))
