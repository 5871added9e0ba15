"""The generator engine against independent references: the static sampler (same keys, same
tokens), a full forward pass, a hand-built cache for a weight change mid-generation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import completed_arrays

from rlscale import model, programs, sharding
from rlscale.sampling import Sampler, SamplingConfig, transform_logits
from rlscale.sampling.generator import Generator, Request

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20], [21, 22]]
SCFG = SamplingConfig(
    max_new_tokens=12,
    num_samples=2,
    temperature=1.3,
    top_k=40,
    stop_tokens=(3,),
    buckets=(8, 16),
    think_budget=6,
    interrupt_ids=(40, 41),
    think_end_tokens=(30,),
)
NO_STOP = SamplingConfig(max_new_tokens=10, num_samples=2, buckets=(8, 16))  # Fixed lengths.
# The references' forward, jitted: an eager forward compiles each of its operations for each
# new shape (1.4 CPU-s), a jitted one compiles once (0.3 CPU-s).
_forward = jax.jit(model.forward, static_argnums=0)


@pytest.fixture(scope="module")
def policy():
    cfg = model.get("tiny")
    graphdef, _ = model.abstract_model(cfg)
    return cfg, graphdef, model.init_params(cfg, jax.random.key(0))


def _run(gen, requests, chunk, swap=None):
    """Every request to completion, `chunk` decode steps per call; `swap` = (after how many
    calls, params, version)."""
    gen.submit(requests)
    done, calls = [], 0
    while gen.busy:
        if swap is not None and calls == swap[0]:
            gen.set_params(swap[1], swap[2])
        done += gen.step(chunk).completed
        calls += 1
    return sorted(done, key=lambda c: c.request.id)


def _requests(rng, prompts=PROMPTS):
    return [Request(i, p, jax.random.fold_in(rng, i)) for i, p in enumerate(prompts)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, slots", [pytest.param((4, 1, 1), 4, marks=pytest.mark.isa_sensitive), ((1, 2, 2), 8)]
)
def test_engine_samples_what_the_static_sampler_samples(policy, shape, slots):
    """With fewer slots than rows (so finished samples hand their slot to queued requests),
    on a 4-device generator mesh: the same tokens, forced phrases and lengths as the static
    sampler given the same keys, logprobs equal to a full forward pass, every token version 0,
    and every slot-step accounted for. One slot per batch shard (a request's samples span
    shards, each prefills it), or four (two requests per shard, padding rows, kv heads split
    over `tensor`)."""
    cfg, graphdef, params = policy
    rng = jax.random.key(3)
    ref = Sampler(graphdef, cfg)(params, PROMPTS, rng, SCFG)
    mesh = sharding.make_mesh(shape)
    gen = Generator(graphdef, cfg, SCFG, slots=slots, max_prompt_len=16, mesh=mesh)
    shardings = sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES)
    gen.set_params(sharding.reshard(params, shardings), 0)
    done = _run(gen, _requests(rng), chunk=3)
    assert [c.request.id for c in done] == list(range(len(PROMPTS)))
    cat = completed_arrays(done)
    np.testing.assert_array_equal(cat["tokens_GM"], np.asarray(ref.tokens))
    np.testing.assert_array_equal(cat["forced_GM"], np.asarray(ref.forced))
    np.testing.assert_array_equal(cat["lengths_G"], np.asarray(ref.lengths))
    np.testing.assert_array_equal(cat["truncated_G"], np.asarray(ref.truncated))
    assert cat["forced_GM"].any() and not cat["truncated_G"].all()  # Both paths exercised.
    np.testing.assert_allclose(cat["logprobs_GM"], np.asarray(ref.logprobs), atol=1e-5)
    # An independent reference: one forward pass over prompt + completion.
    full = _full_logprobs(graphdef, params, PROMPTS, ref.prompt_index, cat["tokens_GM"])
    sampled = cat["mask_GM"] & ~cat["forced_GM"]
    np.testing.assert_allclose(cat["logprobs_GM"][sampled], full[sampled], atol=1e-5)
    assert not cat["versions_GM"].any()
    assert gen.stats.tokens == cat["lengths_G"].sum()
    assert gen.stats.slot_steps == gen.stats.steps * slots and gen.stats.utilization <= 1.0


def _full_logprobs(graphdef, params, prompts, prompt_index, tokens_NM, cfg=SCFG):
    """Each completion token's logprob from one forward pass over left-padded prompt +
    completion (the tokens after a completion's end do not reach earlier positions)."""
    P = max(map(len, prompts))
    rows = [[0] * (P - len(prompts[b])) + list(prompts[b]) for b in prompt_index]
    seq = jnp.concatenate([jnp.asarray(rows, jnp.int32), jnp.asarray(tokens_NM)], axis=1)
    mask = seq > -1
    mask = mask.at[:, :P].set(jnp.asarray([[t > 0 for t in r] for r in rows]))
    logits, _ = _forward(graphdef, params, seq, model.positions_from_mask(mask), mask)
    logp = jax.nn.log_softmax(transform_logits(logits[:, P - 1 : -1], cfg), axis=-1)
    return np.asarray(jnp.take_along_axis(logp, seq[:, P:, None], axis=-1)[..., 0])


@pytest.mark.slow
def test_weight_swap_keeps_the_cache(policy):
    """New weights between decode calls: the live rows keep the cache the old weights built,
    the last token is re-run under the new weights, and each later token's logprob is the new
    policy's given that cache; tokens record the version that drew them."""
    cfg, graphdef, old = policy
    new = model.init_params(cfg, jax.random.key(7))
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    gen = Generator(graphdef, cfg, NO_STOP, slots=4, max_prompt_len=16)
    gen.set_params(old, 4)
    j = 4  # Decode steps under the old weights.
    forward = _forward
    done = _run(gen, _requests(jax.random.key(1), prompts), chunk=j, swap=(1, new, 5))
    rows = [(c, g, prompt) for c, prompt in zip(done, prompts) for g in range(2)]
    C = max(map(len, prompts)) + 10  # One cache size: one decode program for every row.
    for c, g, prompt in rows:
        tokens = c.tokens_GM[g]
        assert c.lengths_G[g] == 10
        assert c.versions_GM[g].tolist() == [4] * j + [5] * (10 - j)
        # Reference: a fresh cache filled by the old weights with the prompt and the tokens
        # before the swap's re-run one, then the new weights teacher-forced from there.
        seq = list(prompt) + list(tokens)
        P = len(prompt)
        cache = model.init_cache(cfg, 1, C)
        head = jnp.asarray([seq[: P + j - 1]], jnp.int32)
        mask = jnp.ones_like(head, bool)
        _, cache = forward(graphdef, old, head, model.positions_from_mask(mask), mask, cache)
        expect = []
        for t in range(P + j - 1, P + 9):
            tok = jnp.asarray([[seq[t]]], jnp.int32)
            logits, cache = forward(
                graphdef, new, tok, jnp.asarray([[t]]), jnp.ones((1, 1), bool), cache
            )
            logp = jax.nn.log_softmax(logits[0, 0].astype(jnp.float32))
            expect.append(float(logp[seq[t + 1]]))
        np.testing.assert_allclose(c.logprobs_GM[g, j:], expect, atol=1e-5)
        # A flushed cache (everything re-run under the new weights) gives other logprobs.
        flushed = _full_logprobs(graphdef, new, [prompt], [0], tokens[None], NO_STOP)[0, j:]
        assert np.abs(flushed - np.asarray(expect)).max() > 1e-3


def test_no_recompile_for_new_work_and_weights(policy, count_compiles):
    """Other prompts of the same buckets, other keys, new weights: no new program. (No stop
    tokens, so the admissions, and with them the prefill sizes, repeat.)"""
    cfg, graphdef, params = policy
    other = jax.tree.map(lambda x: x * 1.01, params)
    gen = Generator(graphdef, cfg, NO_STOP, slots=4, max_prompt_len=16)
    gen.set_params(params, 0)
    _run(gen, _requests(jax.random.key(0)), chunk=3, swap=(2, other, 1))
    prompts = [[p + 1 for p in prompt] for prompt in PROMPTS]
    with count_compiles() as counter:
        gen.set_params(params, 2)
        _run(gen, _requests(jax.random.key(1), prompts), chunk=3, swap=(2, other, 3))
    assert counter.count == 0, counter.count


@pytest.mark.slow
def test_prefill_work_and_memory_divide_over_the_batch_axes(policy):
    """A first admission that fills every slot, on 1 device and on 8 (slots and prefill rows
    split 8 ways), read from the compiled `insert` the generator runs: per device an eighth
    of the prefill FLOPs and of the temporaries. (Before, every device prefilled every
    request and built each layer's new rows whole: 2.7 MB of temporaries on 8 devices as on
    one.)"""
    cfg, graphdef, params = policy
    cfg = dataclasses.replace(cfg, max_seq_len=512)
    scfg = SamplingConfig(max_new_tokens=96, num_samples=4, buckets=(32,))
    prompts = [list(range(5 + i, 37 + i)) for i in range(8)]  # 8 x 4 samples: 32 slots.
    insert = {}
    for shape in [(1, 1, 1), (1, 8, 1)]:
        mesh = sharding.make_mesh(shape)
        progs = programs.Programs(mesh)
        gen = Generator(graphdef, cfg, scfg, slots=32, max_prompt_len=32, mesh=mesh, programs=progs)
        gen.set_params(
            sharding.reshard(params, sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES)),
            0,
        )
        gen.submit(_requests(jax.random.key(0), prompts))
        gen.step(1)
        (insert[shape],) = [e for e in progs.entries if e["name"] == "engine_insert"]
    one, eight = insert[(1, 1, 1)], insert[(1, 8, 1)]
    assert eight["flops_per_device"] == pytest.approx(one["flops_per_device"] / 8, rel=0.01)
    assert eight["temp_bytes"] < 1.05 * one["temp_bytes"] / 8, (one, eight)


def test_bad_generator_input_names_the_problem(policy):
    cfg, graphdef, params = policy
    with pytest.raises(ValueError, match=r"slots=3 must be a positive multiple of num_samples=2"):
        Generator(graphdef, cfg, SCFG, slots=3, max_prompt_len=16)
    with pytest.raises(ValueError, match=r"slots=2 does not divide the mesh's batch axes"):
        Generator(graphdef, cfg, SCFG, slots=2, max_prompt_len=16, mesh=sharding.make_mesh())
    with pytest.raises(ValueError, match="max_prompt_len=17 is longer than the largest bucket"):
        Generator(graphdef, cfg, SCFG, slots=4, max_prompt_len=17)
    gen = Generator(graphdef, cfg, SCFG, slots=4, max_prompt_len=8)
    with pytest.raises(ValueError, match=r"request 'x': prompt of 9 tokens > max_prompt_len=8"):
        gen.submit([Request("x", list(range(5, 14)), jax.random.key(0))])
    with pytest.raises(ValueError, match=r"request 2: max_new_tokens=13 not in \[0, 12\]"):
        gen.submit([Request(2, [5], jax.random.key(0), max_new_tokens=13)])
    with pytest.raises(ValueError, match="before set_params"):
        gen.step(1)


@pytest.mark.slow
def test_decode_compiles_ahead_from_abstract_weights(policy):
    """`Generator.precompile` with only the weights' shapes and shardings compiles the decode
    program the first step runs (a program compiled ahead leaves the pending ones when a
    call with its signature takes it; a mismatch would leave it there)."""
    cfg, graphdef, params = policy
    mesh = sharding.make_mesh((1, 2, 1))
    progs = programs.Programs(mesh)
    gen = Generator(graphdef, cfg, SCFG, slots=4, max_prompt_len=8, mesh=mesh, programs=progs)
    shardings = sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES)
    gen.precompile(
        jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
        )
    )
    for future in progs._pending.values():
        future.result()
    gen.set_params(sharding.reshard(params, shardings), 0)
    gen.submit(_requests(jax.random.key(0), [[5, 6, 7]]))
    assert len(progs._pending) == 1
    gen.step(2)
    assert not progs._pending
    assert [e["name"] for e in progs.entries] == ["engine_insert", "engine_decode"]
