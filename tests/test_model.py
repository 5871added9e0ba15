"""Decoder tests: cached decode == full forward, padding invariance, variants, parameter counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlscale import model
from rlscale.model import config as model_config
from rlscale.model import decoder

# One jitted forward for every test: an eager forward compiles each of its operations for
# each new shape (1.4 CPU-s), the jitted one compiles once (0.3 CPU-s).
_forward = jax.jit(model.forward, static_argnums=0)

VARIANTS = {
    "llama": {},
    "qwen2": dict(attn_bias=True, tie_embeddings=True, rope_theta=1e6),
    "qwen3": dict(qk_norm=True),
    "gemma": dict(
        norm_plus_one=True,
        activation="gelu_tanh",
        embed_scale=True,
        tie_embeddings=True,
        num_kv_heads=1,
    ),
    "llama3_rope": dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=32),
    "yarn": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=32),
}


def _model(**overrides):
    cfg = model.get("tiny", **overrides)
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    if cfg.attn_bias:  # Zero-initialized biases would not test anything.
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.1 if "bias" in jax.tree_util.keystr(p) else x, params
        )
    return cfg, graphdef, params


def _ragged_batch(cfg, lengths, T, seed=1):
    """Left-padded token rows of the given real lengths."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), T), np.int32)
    mask = np.zeros((len(lengths), T), bool)
    for i, n in enumerate(lengths):
        tokens[i, T - n :] = rng.integers(4, cfg.vocab_size, n)
        mask[i, T - n :] = True
    return jnp.asarray(tokens), jnp.asarray(mask)


def test_rows_write_at_their_own_cache_positions():
    """Right-padded rows of different lengths, each continued at its own write position (just
    after its real tokens, over the padding the prefill left there): every decoded token's
    logits equal the full forward over its row."""
    cfg, graphdef, params = _model()
    lengths, T, steps = [9, 4, 6], 9, 5
    rng = np.random.default_rng(2)
    seq = rng.integers(4, cfg.vocab_size, (3, T + steps)).astype(np.int32)
    mask = np.arange(T + steps)[None, :] < np.asarray(lengths)[:, None] + steps
    full, _ = _forward(graphdef, params, seq, model.positions_from_mask(mask), mask)
    step = _forward
    head = mask[:, :T] & (np.arange(T)[None, :] < np.asarray(lengths)[:, None])
    cache = model.init_cache(cfg, 3, T + steps)
    _, cache = step(graphdef, params, seq[:, :T], model.positions_from_mask(head), head, cache)
    assert cache.index_B.tolist() == [T] * 3
    cache = cache._replace(index_B=jnp.asarray(lengths, jnp.int32))
    rows = np.arange(3)
    for i in range(steps):
        at = np.asarray(lengths) + i
        logits, cache = step(
            graphdef, params, seq[rows, at][:, None], at[:, None], np.ones((3, 1), bool), cache
        )
        np.testing.assert_allclose(logits[:, 0], full[rows, at], atol=1e-5, rtol=0)
    assert cache.index_B.tolist() == [n + steps for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decode_equals_full_forward(variant):
    cfg, graphdef, params = _model(**VARIANTS[variant])
    T, P = 20, 12
    tokens, mask = _ragged_batch(cfg, [20, 15, 9], T)
    positions = model.positions_from_mask(mask)
    full, _ = _forward(graphdef, params, tokens, positions, mask)

    cache = model.init_cache(cfg, 3, 24)
    step = _forward
    logits, cache = step(graphdef, params, tokens[:, :P], positions[:, :P], mask[:, :P], cache)
    pieces = [logits]
    for t in range(P, T):
        logits, cache = step(
            graphdef,
            params,
            tokens[:, t : t + 1],
            positions[:, t : t + 1],
            mask[:, t : t + 1],
            cache,
        )
        pieces.append(logits)
    cached = jnp.concatenate(pieces, axis=1)
    np.testing.assert_allclose(
        np.where(mask[..., None], cached, 0), np.where(mask[..., None], full, 0), atol=1e-5, rtol=0
    )
    assert cache.index_B.tolist() == [T] * 3


@pytest.mark.slow
def test_left_padding_does_not_change_logits():
    cfg, graphdef, params = _model()
    tokens, mask = _ragged_batch(cfg, [7], 7)
    padded = jnp.pad(tokens, ((0, 0), (5, 0)))
    padded_mask = jnp.pad(mask, ((0, 0), (5, 0)))
    a, _ = _forward(graphdef, params, tokens, model.positions_from_mask(mask), mask)
    b, _ = _forward(graphdef, params, padded, model.positions_from_mask(padded_mask), padded_mask)
    np.testing.assert_allclose(a, b[:, 5:], atol=1e-5)


def test_attention_matches_numpy():
    rng = np.random.default_rng(0)
    B, T, S, H, K, E = 2, 3, 5, 4, 2, 8
    q = rng.normal(size=(B, T, H, E)).astype(np.float32)
    k = rng.normal(size=(B, S, K, E)).astype(np.float32)
    v = rng.normal(size=(B, S, K, E)).astype(np.float32)
    mask = rng.random((B, T, S)) < 0.7
    mask[..., 0] = True
    out = decoder.attention(
        jnp.asarray(q),
        jnp.asarray(k.transpose(0, 2, 3, 1)),
        jnp.asarray(v.transpose(0, 2, 1, 3)),
        jnp.asarray(mask),
        0.3,
    )
    expected = np.zeros((B, T, H, E), np.float32)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                kv = h // (H // K)
                s = 0.3 * k[b, :, kv] @ q[b, t, h]
                s = np.where(mask[b, t], s, -np.inf)
                w = np.exp(s - s.max())
                expected[b, t, h] = (w / w.sum()) @ v[b, :, kv]
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_rms_norm_and_plus_one():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6)).astype(np.float32))
    for plus_one in (False, True):
        cfg = model.get("tiny", norm_plus_one=plus_one, norm_eps=1e-5)
        norm = decoder.RMSNorm(6, cfg, rngs=None)
        norm.scale[...] = jnp.arange(6.0)
        scale = np.arange(6.0) + (1.0 if plus_one else 0.0)
        expected = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-5) * scale
        np.testing.assert_allclose(norm(x), expected, rtol=1e-5)


def test_rope_scalings_against_hand_values():
    base = model.get("tiny", head_dim=16, rope_theta=10_000.0)
    inv, factor = decoder.rope_inv_freq(base)
    np.testing.assert_allclose(inv, 10_000.0 ** (-np.arange(0, 16, 2) / 16))
    assert factor == 1.0
    linear, _ = decoder.rope_inv_freq(
        model.get("tiny", head_dim=16, rope_scaling="linear", rope_factor=4.0)
    )
    np.testing.assert_allclose(linear, inv / 4)
    # Llama 3.1: wavelengths shorter than orig/high_ff keep their frequency, longer than
    # orig/low_ff are divided by the factor.
    cfg = model.get(
        "tiny",
        head_dim=16,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_original_max_len=64,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
    )
    l3, _ = decoder.rope_inv_freq(cfg)
    wavelen = 2 * np.pi / inv
    high = wavelen < 64 / 4
    low = wavelen > 64 / 1
    assert high.any() and low.any()
    np.testing.assert_allclose(l3[high], inv[high])
    np.testing.assert_allclose(l3[low], inv[low] / 8)
    mid = ~high & ~low
    assert np.all((l3[mid] < inv[mid]) & (l3[mid] > inv[mid] / 8))
    _, yarn_factor = decoder.rope_inv_freq(model.get("tiny", rope_scaling="yarn", rope_factor=4.0))
    assert math.isclose(yarn_factor, 0.1 * math.log(4.0) + 1.0)


@pytest.mark.slow
def test_bf16_compute_with_fp32_head():
    cfg32, graphdef32, params = _model()
    cfg16 = model.get("tiny", dtype="bfloat16")
    graphdef16, _ = model.abstract_model(cfg16)
    tokens, mask = _ragged_batch(cfg32, [10, 6], 10)
    pos = model.positions_from_mask(mask)
    l32, _ = _forward(graphdef32, params, tokens, pos, mask)
    l16, _ = _forward(graphdef16, params, tokens, pos, mask)
    assert l16.dtype == jnp.float32  # The FP32 head.
    cfg_no = model.get("tiny", dtype="bfloat16", fp32_lm_head=False)
    lno, _ = _forward(model.abstract_model(cfg_no)[0], params, tokens, pos, mask)
    assert lno.dtype == jnp.bfloat16
    err = float(jnp.max(jnp.abs(jnp.where(mask[..., None], l16 - l32, 0))))
    assert 0 < err < 0.1  # bf16 activations: close, but not bit-equal.


@pytest.mark.parametrize("name", model_config.NAMES)
def test_named_configs_parameter_counts(name):
    cfg = model.get(name)
    _, abstract = model.abstract_model(cfg)
    assert sum(x.size for x in jax.tree.leaves(abstract)) == cfg.num_params()
    axes = jax.tree.leaves(
        jax.tree.map(
            lambda v: v.get_metadata()["axes"],
            abstract,
            is_leaf=lambda x: hasattr(x, "get_metadata"),
        ),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    shapes = jax.tree.leaves(abstract)
    assert len(axes) == len(shapes)
    assert all(len(a) == len(s.shape) for a, s in zip(axes, shapes))


def test_published_sizes():
    assert abs(model.get("llama3_8b").num_params() / 1e9 - 8.03) < 0.01
    assert abs(model.get("qwen2.5_0.5b").num_params() / 1e9 - 0.494) < 0.001


def test_bad_model_config_names_the_field():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        model.get("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_scaling='ntk'"):
        model.get("tiny", rope_scaling="ntk")
    with pytest.raises(ValueError, match="Unknown model 'tinny'"):
        model.get("tinny")
    with pytest.raises(ValueError, match="hidden_size"):
        model.get("tiny", hidden_size=3)


@pytest.mark.slow
def test_causal_block_skipping_equals_full_attention():
    rng = np.random.default_rng(0)
    B, T, H, K, E = 2, 300, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, T, H, E)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, K, E, T)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, K, T, E)), jnp.float32)
    valid = np.arange(T)[None] >= np.array([[0], [37]])
    mask = jnp.asarray(np.tril(np.ones((T, T), bool))[None] & valid[:, None, :])
    full = jax.jit(decoder.attention, static_argnums=4)(q, k, v, mask, 0.35)
    chunked = jax.jit(decoder.causal_attention, static_argnums=(4, 5))(q, k, v, mask, 0.35, 64)
    # Padding queries attend to nothing; their (unused) outputs may differ.
    np.testing.assert_allclose(np.asarray(chunked)[valid], np.asarray(full)[valid], atol=1e-5)


def test_dense_custom_vjp_equals_plain_matmul_gradient():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 5, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 3, 4)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32)
    ours = jax.grad(lambda x, w: jnp.sum(decoder.project(x, w) * c), argnums=(0, 1))(x, w)
    plain = jax.grad(lambda x, w: jnp.sum(jnp.einsum("btd,dhe->bthe", x, w) * c), argnums=(0, 1))(
        x, w
    )
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    o = jnp.asarray(rng.normal(size=(3, 4, 6)), jnp.float32)  # Two contracted dims ("hed").
    y = jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32)
    g1 = jax.grad(lambda o: jnp.sum(decoder.project(y, o, n_in=2) ** 2))(o)
    g2 = jax.grad(lambda o: jnp.sum(jnp.einsum("bthe,hed->btd", y, o) ** 2))(o)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-4)
