"""The generator engine's paged KV cache (`sampling.kv_block_size`): the host's block manager
by hand, the paged write and read against the dense cache's, and the engine with a paged
cache against the same engine with dense rows (the same tokens), through slot and
block reuse, a pool that makes requests wait, a weight swap and a mixture of experts'
recorded routing. Multi-turn replies and parking with a paged cache: tests/test_turns.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, rounding

from rlscale import model, rl, sharding
from rlscale.model import decoder, kv_pages
from rlscale.sampling import SamplingConfig, paged
from rlscale.sampling.generator import Generator, Request

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [15], [16, 17, 18, 19, 20]]
SCFG = SamplingConfig(
    max_new_tokens=12,
    num_samples=2,
    temperature=1.3,
    top_k=40,
    stop_tokens=(3,),
    buckets=(8, 16),
)
BS = 4  # Columns 16 + 12 = 28: bucket 8 shares 1 block, bucket 16 shares 3.


def test_pages_share_prompt_blocks_and_free_them_with_their_last_sample():
    pages = paged.Pages(rows=3, columns=12, block_size=4, blocks=8)
    assert paged.request_blocks(8, 4, 2, 4) == 1 + 2 * 2  # Block 0 shared, 1 and 2 own.
    pages.admit([0, 2], P=8, budgets=[4, 4])
    assert pages.table[0, :2].tolist() == [0, 1] and pages.table[2, :2].tolist() == [0, 2]
    assert pages.refs[:3].tolist() == [2, 1, 1] and pages.available == 8 - 3 - 2
    pages.grow(0, 9)  # Column 8 is in block 2 of the table: one block more.
    pages.grow(0, 12)  # Within the same block.
    assert pages.table[0].tolist() == [0, 1, 3] and pages.reserve[0] == 0
    pages.grow(0, 99)  # Past the reservation: nothing more.
    assert pages.taken == 4
    pages.move(1, 2)  # Parked: its blocks go with it.
    assert pages.table[1, :2].tolist() == [0, 2] and (pages.table[2] == 8).all()
    pages.release(0)
    assert pages.refs[0] == 1 and sorted(pages.free) == [1, 3, 4, 5, 6, 7]
    pages.release(1)
    assert pages.taken == 0 and pages.available == 8 and not pages.refs.any()


def test_pages_without_reservations_count_what_rows_are_short_of():
    """`kv_preempt`'s block manager: admission reserves nothing, `short` counts the blocks
    rows lack for the columns they want, a preempted row's blocks come back (a shared one
    stays with its other sample), and a resumed row takes fresh blocks of its own."""
    pages = paged.Pages(rows=4, columns=12, block_size=4, blocks=4, reserving=False)
    pages.admit([0, 1], P=8, budgets=[4, 4])  # Block 0 shared, 1 and 2 own.
    assert pages.reserve.sum() == 0 and pages.available == 1
    assert pages.short({0: 12, 1: 12}) == 1  # Each wants its third block: one is free.
    pages.grow(0, 12)
    assert pages.table[0].tolist() == [0, 1, 3] and pages.short({1: 12}) == 1
    pages.release(1)  # Preempted: its own block back, the shared one kept by row 0.
    assert pages.refs.tolist() == [1, 1, 0, 1] and pages.free == [2]
    assert pages.own(3, 1).tolist() == [2] and pages.table[3].tolist() == [2, 4, 4]
    assert pages.held(3) == 1 and pages.refs[2] == 1 and not pages.free


def test_paged_writes_and_reads_equal_the_dense_cache():
    """Random keys and values written at random columns of rows whose tables name blocks in
    any order (one shared): the gathered view equals the dense cache on every column a row
    wrote, and a column in no block is dropped."""
    cfg = model.get("tiny")
    B, C, bs, NB = 2, 8, 2, 9
    K, E = cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(0)
    table = np.array([[6, 2, 0, 9], [6, 4, 1, 7]], np.int32)  # Block 6 shared; 9: none.
    cache = kv_pages.init(cfg, B, C, bs, NB)._replace(table_BN=jnp.asarray(table))
    dense = decoder.init_cache(cfg, B, C)
    kv = (cache.k[0], cache.v[0], cache.table_BN)
    dense_kv = (dense.k[0], dense.v[0])
    for cols in ([[0, 1], [2, 3]], [[2, 3], [4, 5]], [[4, 6], [6, 7]]):
        cols = np.array(cols, np.int32)
        k = jnp.asarray(rng.normal(size=(B, K, E, 2)), cfg.compute_dtype)
        v = jnp.asarray(rng.normal(size=(B, K, 2, E)), cfg.compute_dtype)
        if cols[0, 0] == 0:  # Row 1 writes nothing into the shared block.
            k, v = k.at[1].set(0), v.at[1].set(0)
        kv = kv_pages.write(kv, k, v, jnp.asarray(cols))
        dense_kv = (
            decoder._write_rows(dense_kv[0], k, jnp.asarray(cols), 3),
            decoder._write_rows(dense_kv[1], v, jnp.asarray(cols), 2),
        )
    k_view, v_view = kv_pages.view(kv)
    wrote = [list(range(0, 6)), [2, 3, 4, 5]]  # Row 0's columns 6, 7: no block.
    for b, cols in enumerate(wrote):
        np.testing.assert_array_equal(k_view[b][..., cols], dense_kv[0][b][..., cols])
        np.testing.assert_array_equal(v_view[b][:, cols], dense_kv[1][b][:, cols])
    assert not np.asarray(kv[0][NB - 1]).any()  # Block 8 is named by no table.


def _run(policy, scfg, swap_params=None, mesh=None):
    """Every request (fewer slots than samples), 3 steps a call; new weights (version 1)
    after the second call when `swap_params`; on `mesh` when given. `gen.most_live`: the
    most samples in slots after a call."""
    cfg, graphdef, params = policy
    gen = Generator(graphdef, cfg, scfg, slots=4, max_prompt_len=16, mesh=mesh)
    if mesh is not None:  # The generator's layout.
        shardings = sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES)
        params = sharding.reshard(params, shardings)
        swap_params = swap_params and sharding.reshard(swap_params, shardings)
    gen.set_params(params, 0)
    gen.submit(
        [Request(i, p, jax.random.fold_in(jax.random.key(3), i)) for i, p in enumerate(PROMPTS)]
    )
    done, calls, gen.most_live = [], 0, 0
    while gen.busy:
        if calls == 2 and swap_params is not None:
            gen.set_params(swap_params, 1)
        done += gen.step(3).completed
        calls += 1
        gen.most_live = max(gen.most_live, len(gen.running))
    return sorted(done, key=lambda c: c.request.id), gen


# The float32 reductions a logprob of the tiny models comes through, each of at most 256
# terms (tests/test_router_replay.py: a mixture of experts' router adds to the dense 23).
REDUCTIONS, TERMS = 33, 256


def _equal(got, want):
    """Every field of every request equal, the logprobs to float32 rounding: the attention
    over a gathered view is the dense cache's computation, but XLA:CPU may sum its products
    in another order for another operand layout (as tests/test_determinism.py argues for
    other shapes)."""
    assert [c.request.id for c in got] == [c.request.id for c in want]
    for a, b in zip(got, want):
        for field in a._fields[1:]:
            x, y = getattr(a, field), getattr(b, field)
            if field == "logprobs_GM":
                tol = REDUCTIONS * rounding(TERMS) * (1.0 + np.abs(y))
                assert np.all(np.abs(x - y) <= tol), np.abs(x - y).max()
            elif y is None:
                assert x is None, field
            else:
                np.testing.assert_array_equal(x, y, err_msg=field)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny_moe"])
def test_paged_engine_equals_the_dense_engine(name):
    """Every completion field, the mixture of experts' recorded routing included, equals the
    dense engine's (the logprobs to float32 rounding), with a weight swap mid-way (a pool of
    two requests of the longest bucket: the dense engine's schedule) and, without one, with
    the smallest pool the checks allow (one such request at a time: requests wait for
    blocks). Every block comes back, and fewer columns are held than the dense rows hold."""
    cfg = model.get(name)
    policy = (cfg, model.abstract_model(cfg)[0], model.init_params(cfg, jax.random.key(0)))
    new = jax.tree.map(lambda x: x * 1.05, policy[2])
    least = paged.request_blocks(16, 12, 2, BS)
    paging = dict(kv_block_size=BS, kv_blocks=2 * least)
    got, gen = _run(policy, dataclasses.replace(SCFG, **paging), new)
    _equal(got, _run(policy, SCFG, new)[0])
    assert (got[0].experts_GLlc is not None) == (name == "tiny_moe")
    versions = np.concatenate([c.versions_GM[c.mask_GM] for c in got])
    assert set(versions.tolist()) == {0, 1}
    assert gen.stats.kv_columns < 4 * 28 * gen.stats.steps  # Dense: 4 rows of 28 columns.
    if name == "tiny":
        paging["kv_blocks"] = least
        got, gen = _run(policy, dataclasses.replace(SCFG, **paging))
        _equal(got, _run(policy, SCFG)[0])
        assert gen.stats.kv_blocks_peak <= least
    pages = gen.pages
    assert pages.taken == 0 and not pages.refs.any() and pages.reserve.sum() == 0


@pytest.mark.slow
def test_preempting_engine_equals_the_dense_engine():
    """`kv_preempt` with the smallest pool the checks allow: requests are admitted on their
    prompts' blocks, decode calls that would run out preempt the latest samples (their keys
    and values to the host and back into fresh blocks), and every completion field still
    equals the dense engine's (the logprobs to float32 rounding). More samples decode at
    once than when admission reserves each request's worst case, and every block comes
    back. With a weight swap the schedule decides which tokens each version samples (the
    dense engine's differs), so there the check is that preempted samples come back and
    sample under the new weights after the old, never before."""
    cfg = model.get("tiny")
    policy = (cfg, model.abstract_model(cfg)[0], model.init_params(cfg, jax.random.key(0)))
    new = jax.tree.map(lambda x: x * 1.05, policy[2])
    least = paged.request_blocks(16, 12, 2, BS)
    paging = dict(kv_block_size=BS, kv_blocks=least)
    reserving = _run(policy, dataclasses.replace(SCFG, **paging))[1]
    for swap in (new, None):
        got, gen = _run(policy, dataclasses.replace(SCFG, kv_preempt=True, **paging), swap)
        if swap is None:
            _equal(got, _run(policy, SCFG)[0])
        else:
            versions = [v[m] for c in got for v, m in zip(c.versions_GM, c.mask_GM)]
            assert all((np.diff(v) >= 0).all() for v in versions)
            assert set(np.concatenate(versions).tolist()) == {0, 1}
        assert gen.stats.preempted > 0 and gen.stats.resumed == gen.stats.preempted
        # A preempted sample's slot decodes nothing once it is out: every token is one kept.
        assert gen.stats.tokens == sum(int(c.lengths_G.sum()) for c in got)
        assert not gen.swapped and sorted(gen.park_free) == list(range(gen.slots))
        pages = gen.pages
        assert pages.taken == 0 and not pages.refs.any() and pages.reserve.sum() == 0
    # The reserving pool holds one request (2 of the 4 slots) at a time.
    assert reserving.most_live == 2 and gen.most_live > 2
    # On a generator mesh (kv heads over `tensor`; the prefill writes the pool under
    # shard_map, which an RL run's generator always has), against dense rows on that mesh.
    mesh = sharding.make_mesh((1, 1, 2))
    got, gen = _run(policy, dataclasses.replace(SCFG, kv_preempt=True, **paging), mesh=mesh)
    _equal(got, _run(policy, SCFG, mesh=mesh)[0])
    assert gen.stats.preempted > 0


def test_bad_paged_settings_name_the_key():
    config = load_config("quickstart")
    config.sampling.kv_block_size, config.sampling.kv_blocks = -1, -2
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert "sampling.kv_block_size=-1 must be an integer >= 0" in str(e.value)
    assert "sampling.kv_blocks=-2 must be an integer >= 0" in str(e.value)
    config.sampling.kv_block_size, config.sampling.kv_blocks = 0, 0
    config.sampling.kv_preempt = True
    with pytest.raises(ValueError, match=r"sampling.kv_preempt=True needs sampling.kv_block_s"):
        rl.resolve(config)
    config.sampling.kv_block_size = 8
    assert rl.resolve(config).sampling.kv_preempt
    cfg = model.get("tiny")
    graphdef = model.abstract_model(cfg)[0]
    with pytest.raises(ValueError, match=r"kv_block_size=-1 must be an integer >= 0"):
        dataclasses.replace(SCFG, kv_block_size=-1)
    with pytest.raises(ValueError, match=r"kv_blocks=-2 must be an integer >= 0"):
        dataclasses.replace(SCFG, kv_blocks=-2)
    with pytest.raises(ValueError, match=r"kv_preempt=True needs a paged cache"):
        dataclasses.replace(SCFG, kv_preempt=True)

    def make(mesh=None, **paging):
        scfg = dataclasses.replace(SCFG, **paging)
        return Generator(graphdef, cfg, scfg, slots=4, max_prompt_len=16, mesh=mesh)

    with pytest.raises(
        ValueError, match=r"sampling.kv_block_size=5 does not divide the cache's 28 columns"
    ):
        make(kv_block_size=5)
    with pytest.raises(ValueError, match=r"sampling.kv_blocks=10 is too small.*at least 11"):
        make(kv_block_size=4, kv_blocks=10)
    with pytest.raises(ValueError, match=r"kv_block_size=4: the paged cache's pool is not split"):
        make(sharding.make_mesh((2, 1, 1)), kv_block_size=4)
    with pytest.raises(ValueError, match=r"kv_preempt=True with multi-turn episodes"):
        dataclasses.replace(SCFG, kv_block_size=4, kv_preempt=True, action_stops=((5,),))


@pytest.mark.slow
def test_tpu_paged_attention_kernel_reads_the_pool_in_interpret_mode():
    """Where a TPU kernel would plug in: `jax.experimental.pallas.ops.tpu.paged_attention`
    run in Pallas interpret mode on the CPU, on this pool (transposed to its [K, NB, bs, E]
    pages) and table, equals `kv_pages.view` + `attention.attention` over each row's first
    `length` columns. The kernel reads keys and values in bfloat16, so the reference rounds
    them so too; what is left is float32 rounding over the C columns and E dims."""
    import jax.experimental.pallas.tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    from rlscale.model import attention

    B, H, K, E, bs, NB, N = 2, 4, 2, 128, 16, 8, 4
    rng = np.random.default_rng(0)
    k_pool = jnp.asarray(rng.normal(size=(NB, K, E, bs)), jnp.float32)
    v_pool = jnp.asarray(rng.normal(size=(NB, K, bs, E)), jnp.float32)
    q_BHE = jnp.asarray(rng.normal(size=(B, H, E)) / E**0.5, jnp.float32)
    table_BN = jnp.asarray([[3, 1, 6, 0], [2, 5, 7, 4]], jnp.int32)
    length_B = jnp.asarray([37, 50], jnp.int32)
    with pltpu.force_tpu_interpret_mode():
        out = paged_attention(
            q_BHE,
            jnp.transpose(k_pool, (1, 0, 3, 2)),
            jnp.transpose(v_pool, (1, 0, 2, 3)),
            length_B,
            table_BN,
            pages_per_compute_block=2,
        )
    bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    k_BKES, v_BKSE = kv_pages.view((bf16(k_pool), bf16(v_pool), table_BN))
    mask_BTS = (jnp.arange(N * bs)[None, :] < length_B[:, None])[:, None, :]
    ref = attention.attention(q_BHE[:, None], k_BKES, v_BKSE, mask_BTS, 1.0)[:, 0]
    tol = 4 * rounding(N * bs) * float(jnp.abs(v_pool).max()) + rounding(E)
    assert float(jnp.abs(out - ref).max()) <= tol
