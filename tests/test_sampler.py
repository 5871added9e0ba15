"""Sampler tests: logprobs, transforms, stopping, buckets and recompiles, bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlscale import model, sharding
from rlscale.sampling import Sampler, SamplingConfig, demo, sampler, transform_logits

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]

# The references jitted: an eager forward compiles each of its operations for each new shape
# (1.4 CPU-s), a jitted one compiles once (0.3 CPU-s).
_forward = jax.jit(model.forward, static_argnums=0)
_recompute_logprobs = jax.jit(demo.recompute_logprobs, static_argnums=(0, 5))


@pytest.fixture(scope="module")
def setup():
    cfg = model.get("tiny")
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    return cfg, graphdef, params, Sampler(graphdef, cfg)


def _full_logits(graphdef, params, smp, prompts, out, cfg):
    """Logits at each completion position from one forward over prompt + completion."""
    p_tok, p_mask = smp.prepare(prompts, cfg)
    rep = out.prompt_index
    tokens = jnp.concatenate([p_tok[rep], out.tokens], 1)
    mask = jnp.concatenate([p_mask[rep], out.mask], 1)
    logits, _ = _forward(graphdef, params, tokens, model.positions_from_mask(mask), mask)
    return logits[:, p_tok.shape[1] - 1 : -1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.3, top_p=0.8),
        pytest.param(dict(temperature=0.9, top_k=30, top_p=0.9), marks=pytest.mark.isa_sensitive),
    ],
)
def test_logprobs_equal_forward_under_same_transform(setup, kw):
    cfg, graphdef, params, smp = setup
    scfg = SamplingConfig(max_new_tokens=12, num_samples=3, stop_tokens=(3, 4), **kw)
    out = smp(params, PROMPTS, jax.random.key(7), scfg)
    p_tok, p_mask = smp.prepare(PROMPTS, scfg)
    ref = _recompute_logprobs(
        graphdef, params, p_tok[out.prompt_index], p_mask[out.prompt_index], out, scfg
    )
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-5)
    assert np.all(np.asarray(out.logprobs)[np.asarray(out.mask)] < 0)


@pytest.mark.slow
def test_top_k_and_top_p_stay_in_allowed_set(setup):
    cfg, graphdef, params, smp = setup
    for kw in (dict(top_k=3), dict(top_p=0.3), dict(top_k=10, top_p=0.5)):
        scfg = SamplingConfig(max_new_tokens=16, num_samples=4, temperature=1.0, **kw)
        out = smp(params, PROMPTS, jax.random.key(3), scfg)
        logits = np.asarray(_full_logits(graphdef, params, smp, PROMPTS, out, scfg), np.float64)
        tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
        for n, t in zip(*np.nonzero(mask)):
            row = logits[n, t]
            order = np.argsort(-row)
            allowed = order[: kw.get("top_k", len(row))]
            if "top_p" in kw:  # NumPy nucleus over the top-k survivors.
                p = np.exp(row[allowed] - row[allowed].max())
                p /= p.sum()
                before = np.cumsum(p) - p
                allowed = allowed[before < kw["top_p"]]
            assert tokens[n, t] in allowed, (kw, n, t)


def test_transform_logits_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    cfg = SamplingConfig(temperature=0.5, top_k=10, top_p=0.6)
    got = np.asarray(jax.nn.log_softmax(transform_logits(jnp.asarray(logits), cfg)))
    for row, g in zip(logits / 0.5, got):
        keep = np.argsort(-row)[:10]
        p = np.exp(row[keep] - row[keep].max())
        p /= p.sum()
        keep = keep[(np.cumsum(p) - p) < 0.6]
        expected = np.full(50, -np.inf)
        expected[keep] = row[keep] - np.log(np.sum(np.exp(row[keep])))
        assert set(np.nonzero(g > -1e30)[0]) == set(keep)
        np.testing.assert_allclose(g[keep], expected[keep], atol=1e-5)


def test_categorical_matches_probabilities_and_never_draws_zero():
    probs = np.array([0.0, 0.1, 0.0, 0.25, 0.05, 0.0, 0.6, 0.0, 0.0], np.float32)
    n = 40_000
    draws = np.asarray(
        jax.jit(
            lambda k: sampler.categorical(jax.random.uniform(k, (n,)), jnp.tile(probs, (n, 1)), 4)
        )(jax.random.key(0))
    )
    counts = np.bincount(draws, minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    expected = probs * n
    nz = probs > 0
    chi2 = np.sum((counts[nz] - expected[nz]) ** 2 / expected[nz])
    assert chi2 < 16.3  # 3 dof, p = 0.001.


@pytest.mark.slow
def test_temperature_differs_from_greedy_and_greedy_is_argmax(setup):
    cfg, graphdef, params, smp = setup
    greedy = SamplingConfig(max_new_tokens=10, temperature=0.0, num_samples=2)
    g = smp(params, PROMPTS, jax.random.key(0), greedy)
    g2 = smp(params, PROMPTS, jax.random.key(99), greedy)
    np.testing.assert_array_equal(g.tokens, g2.tokens)
    np.testing.assert_array_equal(g.tokens[0::2], g.tokens[1::2])  # Samples of one prompt.
    assert np.all(np.asarray(g.logprobs) == 0)
    logits = _full_logits(graphdef, params, smp, PROMPTS, g, greedy)
    np.testing.assert_array_equal(np.argmax(logits, -1), g.tokens)
    t = smp(params, PROMPTS, jax.random.key(0), SamplingConfig(max_new_tokens=10, num_samples=2))
    assert not np.array_equal(t.tokens, g.tokens)
    assert not np.array_equal(t.tokens[0::2], t.tokens[1::2])


@pytest.mark.slow
def test_stop_tokens_mask_lengths_and_truncation(setup):
    cfg, graphdef, params, smp = setup
    # Stop on a common token so some rows stop and some do not.
    base = smp(params, PROMPTS, jax.random.key(5), SamplingConfig(max_new_tokens=12, num_samples=4))
    stop = int(np.bincount(np.asarray(base.tokens).ravel()).argmax())
    scfg = SamplingConfig(max_new_tokens=12, num_samples=4, stop_tokens=(stop,))
    out = smp(params, PROMPTS, jax.random.key(6), scfg)
    tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
    lengths, truncated = np.asarray(out.lengths), np.asarray(out.truncated)
    assert truncated.any() and not truncated.all()
    for row in range(tokens.shape[0]):
        n = lengths[row]
        assert mask[row].tolist() == [True] * n + [False] * (12 - n)
        assert np.all(tokens[row, n:] == scfg.pad_id)
        hits = np.nonzero(tokens[row, :n] == stop)[0]
        if truncated[row]:
            assert n == 12 and hits.size == 0
        else:
            assert hits.tolist() == [n - 1]  # Stops at, and includes, the first stop token.


@pytest.mark.slow
def test_no_recompile_within_bucket(setup, count_compiles):
    cfg, graphdef, params, smp = setup
    scfg = SamplingConfig(max_new_tokens=6, num_samples=2, buckets=(8, 16))
    jax.block_until_ready(smp(params, [[5, 6, 7], [8, 9]], jax.random.key(0), scfg))
    with count_compiles() as c:
        jax.block_until_ready(smp(params, [[5, 6, 7, 8, 9, 10], [11]], jax.random.key(1), scfg))
    assert c.count == 0
    with count_compiles() as c:  # A longer bucket is a new program, compiled once.
        jax.block_until_ready(smp(params, [[5] * 12, [6] * 9], jax.random.key(1), scfg))
    assert c.count > 0


def test_bad_input_fails_before_compiling(setup, count_compiles):
    cfg, graphdef, params, smp = setup
    scfg = SamplingConfig(max_new_tokens=8, buckets=(8, 16))
    mesh = sharding.make_mesh((4, 2, 1))
    cases = [
        (smp, [[5] * 17], scfg, "17 tokens, longer than the largest bucket 16"),
        (smp, [[5, 6], []], scfg, "prompt 1 is empty"),
        (
            smp,
            [[5, 6]],
            SamplingConfig(max_new_tokens=250, buckets=(8, 16)),
            "max_new_tokens=250 does not fit the KV cache",
        ),
        (smp, [[5, 300]], scfg, r"prompt 0 has token id\(s\) \[300\]"),
        (Sampler(graphdef, cfg, mesh), [[5]] * 6, scfg, "batch of 6 prompts does not divide"),
    ]
    with count_compiles() as c:
        for smp_, prompts, sc, msg in cases:
            with pytest.raises(ValueError, match=msg):
                smp_(params, prompts, jax.random.key(0), sc)
    assert c.count == 0
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingConfig(top_p=1.5)


@pytest.mark.slow
def test_sampler_on_mesh_matches_single_device(setup):
    cfg, graphdef, params, smp = setup
    mesh = sharding.make_mesh((2, 2, 2))
    sharded = sharding.reshard(
        params, sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES)
    )
    smp_mesh = Sampler(graphdef, cfg, mesh)
    prompts = PROMPTS + [[21, 22], [23], [24, 25, 26], [27]]
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0, num_samples=2)
    a = smp(params, prompts, jax.random.key(0), greedy)
    b = smp_mesh(sharded, prompts, jax.random.key(0), greedy)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert len(b.tokens.sharding.device_set) == 8
    scfg = SamplingConfig(max_new_tokens=8, num_samples=2, top_k=40)
    out = smp_mesh(sharded, prompts, jax.random.key(1), scfg)
    p_tok, p_mask = smp.prepare(prompts, scfg)
    ref = _recompute_logprobs(
        graphdef, params, p_tok[out.prompt_index], p_mask[out.prompt_index], out, scfg
    )
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-5)


def test_decode_updates_cache_in_place(setup):
    """The compiled sampler never copies a whole KV-cache buffer: each step writes one slot
    per row (a scatter at the rows' own write positions). The one copy allowed is of the
    empty cache's zeros: XLA builds every layer's buffer from one broadcast, and the copy
    materializes a layer's own (the work a second broadcast would do)."""
    cfg, graphdef, params, _ = setup
    scfg = SamplingConfig(max_new_tokens=40, buckets=(24,))
    tokens, mask = np.ones((4, 24), np.int32), np.ones((4, 24), bool)
    hlo = (
        sampler.generate.lower(
            params, tokens, mask, jax.random.key(0), graphdef=graphdef, model_cfg=cfg, cfg=scfg
        )
        .compile()
        .as_text()
    )
    S = 24 + 40
    k_shape = f"f32[4,{cfg.num_kv_heads},{cfg.head_dim},{S}]"
    v_shape = f"f32[4,{cfg.num_kv_heads},{S},{cfg.head_dim}]"
    lines = hlo.splitlines()
    defined = {ln.split()[0]: ln for ln in map(str.strip, lines) if ln.startswith("%")}
    for shape in (k_shape, v_shape):
        updates = [ln for ln in lines if f"= {shape}" in ln and "scatter" in ln]
        copies = [ln for ln in lines if f"= {shape}" in ln and " copy(" in ln]
        assert updates, shape
        of_zeros = [
            ln for ln in copies if "broadcast" in defined[re.search(r" copy\((%\S+?)[,)]", ln)[1]]
        ]
        assert copies == of_zeros, copies[:2]


@pytest.mark.slow
def test_decode_phases_give_the_same_samples(setup):
    cfg, graphdef, params, smp = setup
    one = SamplingConfig(max_new_tokens=13, num_samples=2, top_k=50, stop_tokens=(3,))
    three = SamplingConfig(
        max_new_tokens=13, num_samples=2, top_k=50, stop_tokens=(3,), decode_phases=3
    )
    a = smp(params, PROMPTS, jax.random.key(4), one)
    b = smp(params, PROMPTS, jax.random.key(4), three)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.mask, b.mask)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.slow
def test_forced_interruption(setup):
    """Rows still thinking at the budget get the phrase written in (not sampled: flagged,
    logprob 0, stop tokens inside it ignored), then sampling resumes; rows that closed their
    thinking first are left alone; every sampled token's logprob still equals the full
    forward pass over the whole sequence, phrase included."""
    cfg, graphdef, params, smp = setup
    budget, phrase, think_end = 5, (3, 40, 41), 30
    scfg = SamplingConfig(
        max_new_tokens=14,
        num_samples=16,
        temperature=1.5,
        stop_tokens=(3,),
        think_budget=budget,
        interrupt_ids=phrase,
        think_end_tokens=(think_end,),
    )
    base = SamplingConfig(max_new_tokens=14, num_samples=16, temperature=1.5, stop_tokens=(3,))
    out = smp(params, PROMPTS, jax.random.key(6), scfg)
    tokens, mask, forced = map(np.asarray, (out.tokens, out.mask, out.forced))
    logprobs, interrupted = np.asarray(out.logprobs), np.asarray(out.interrupted)
    closed = [think_end in tokens[n, :budget] for n in range(len(tokens))]
    assert interrupted.any() and any(closed)  # Both cases occur in this draw.
    for n in range(tokens.shape[0]):
        head = tokens[n, :budget][mask[n, :budget]]
        expect = mask[n, budget - 1] and tokens[n, budget - 1] != 3 and think_end not in head
        assert interrupted[n] == expect, n
        if expect:
            assert list(tokens[n, budget : budget + 3]) == list(phrase)
            assert forced[n].tolist() == [budget <= t < budget + 3 for t in range(14)]
            assert np.all(logprobs[n, budget : budget + 3] == 0)
            assert mask[n, budget + 3]  # The stop token in the phrase did not end the row.
        else:
            assert not forced[n].any()
    # Sampled tokens' logprobs are those of the full sequence; forced ones are excluded.
    p_tok, p_mask = smp.prepare(PROMPTS, scfg)
    ref = _recompute_logprobs(
        graphdef, params, p_tok[out.prompt_index], p_mask[out.prompt_index], out, base
    )
    sampled = mask & ~forced
    np.testing.assert_allclose(logprobs[sampled], np.asarray(ref)[sampled], atol=1e-5)
    with pytest.raises(ValueError, match="no room to answer"):
        SamplingConfig(
            max_new_tokens=8, think_budget=5, interrupt_ids=phrase, think_end_tokens=(1,)
        )
    with pytest.raises(ValueError, match="needs interrupt_ids"):
        SamplingConfig(max_new_tokens=8, think_budget=2)
