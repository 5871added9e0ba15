"""Attention implementations (`rlscale.model.attention`): values and gradients of each
against the `xla` reference, and `xla` against a float64 NumPy re-derivation, for causal,
packed, sliding-window and soft-capped attention with grouped query heads; a decoder under
`dot_product` equals it under `xla`; cached decode equals the full forward with a window and
a soft-cap; bad settings fail naming the key.

`splash` runs in Pallas interpret mode (`attention.pallas_interpret()`) on the CPU; `cudnn`
needs a GPU, so here only its refusal is tested.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, U, load_config, rounding
from jax.sharding import NamedSharding, PartitionSpec

from rlscale import model, sections, sharding
from rlscale.model import attention, hf
from rlscale.rl import run_config

B, T, H, K, E = 2, 24, 4, 2, 8  # Grouped queries: Q = 2 query heads per kv head.
SCALE = E**-0.5
CASES = {  # name -> (packed, window, softcap)
    "causal": (False, 0, 0.0),
    "packed": (True, 0, 0.0),
    "window": (True, 5, 0.0),
    "softcap": (True, 0, 1.5),
}


def _inputs(packed: bool, window: int, seed=0):
    """q [B, T, H, E], k [B, K, E, T], v [B, K, T, E], the `attention.Mask`, which queries are
    real, which keys each sees (re-derived in NumPy) and the cotangent of the output (0 on
    padding queries, whose outputs are never read)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, E)).astype(np.float32)
    k = rng.normal(size=(B, K, E, T)).astype(np.float32)
    v = rng.normal(size=(B, K, T, E)).astype(np.float32)
    i = np.arange(T)
    visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - (window or T))
    if packed:  # Row 0: three sequences and trailing padding; row 1: one after padding.
        segments = np.zeros((B, T), np.int32)
        segments[0, :7], segments[0, 7:16], segments[0, 16:21] = 1, 2, 3
        segments[1, 4:] = 1
        mask = attention.training_mask(None, jnp.asarray(segments), window)
        real = segments > 0
        visible = visible & (segments[:, :, None] == segments[:, None, :])
    else:  # Left-padded rows.
        real = i[None] >= np.array([[0], [9]])
        mask = attention.training_mask(jnp.asarray(real), None, window)
    visible = visible & real[:, None, :]
    do = rng.normal(size=(B, T, H, E)).astype(np.float32) * real[:, :, None, None]
    return q, k, v, mask, real, visible, do


def _numpy(q, k, v, visible_BTS, real_BT, cap, do):
    """Float64 re-derivation: output, gradients (q, k, v in their layouts) and, for each,
    the magnitude its float32 rounding scales with (see `_bounds`)."""
    q, do = q.astype(np.float64), do.astype(np.float64)
    kh = np.repeat(k.transpose(0, 3, 1, 2).astype(np.float64), H // K, axis=2)  # [B, S, H, E]
    vh = np.repeat(v.transpose(0, 2, 1, 3).astype(np.float64), H // K, axis=2)
    s = SCALE * np.einsum("bthe,bshe->bhts", q, kh)
    z, dz_ds = s, np.ones_like(s)
    if cap:
        z, dz_ds = cap * np.tanh(s / cap), 1 - np.tanh(s / cap) ** 2
    seen = visible_BTS[:, None] & real_BT[:, None, :, None]  # Padding queries: no weight.
    e = np.where(seen, np.exp(z - np.where(seen, z, -np.inf).max(-1, keepdims=True)), 0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    o = np.einsum("bhts,bshe->bthe", p, vh)
    dP = np.einsum("bthe,bshe->bhts", do, vh)
    D = (p * dP).sum(-1, keepdims=True)
    ds = p * (dP - D) * dz_ds
    dq = SCALE * np.einsum("bhts,bshe->bthe", ds, kh)
    dk = SCALE * np.einsum("bhts,bthe->bshe", ds, q)
    dv = np.einsum("bhts,bthe->bshe", p, do)
    # Magnitudes: the same sums over absolute values, |dP| bounded by its terms' magnitudes.
    mag_dP = np.einsum("bthe,bshe->bhts", np.abs(do), np.abs(vh))
    mag_ds = p * (mag_dP + (p * mag_dP).sum(-1, keepdims=True))
    mags = {
        "o": np.einsum("bhts,bshe->bthe", p, np.abs(vh)),
        "dq": SCALE * np.einsum("bhts,bshe->bthe", mag_ds, np.abs(kh)),
        "dk": SCALE * np.einsum("bhts,bthe->bshe", mag_ds, np.abs(q)),
        "dv": np.einsum("bhts,bthe->bshe", p, np.abs(do)),
    }
    score = SCALE * np.einsum("bthe,bshe->bhts", np.abs(q), np.abs(kh))
    score_err = (score * rounding(E) + 4 * U * (cap or 0)).max()  # tanh: a few ulps of cap.

    def kv_layout(x_BSHE, transpose_k):  # Sum the query heads of each kv head.
        x_BSKE = x_BSHE.reshape(B, T, K, H // K, E).sum(3)
        return x_BSKE.transpose(0, 2, 3, 1) if transpose_k else x_BSKE.transpose(0, 2, 1, 3)

    values = {"o": o, "dq": dq, "dk": kv_layout(dk, True), "dv": kv_layout(dv, False)}
    mags["dk"], mags["dv"] = kv_layout(mags["dk"], True), kv_layout(mags["dv"], False)
    return values, mags, score_err


def _bounds(mags, score_err):
    """How far a float32 computation may be from the exact values, elementwise.

    A score s = scale q.k sums E products: it is off by at most `score_err` (rounding(E) of
    its terms' magnitudes, and a few ulps of the cap for tanh). softmax then moves each weight
    p by a relative 2 * score_err (s and the row's log-normalizer), and its normalizer sums S
    terms: rounding(S). Every output and gradient is a sum over at most S keys (and E for
    dP, 2 S for the D = sum(p dP) correction) of terms each carrying those relative errors,
    so each is within (2 score_err + rounding(E + 3 S)) of the sum of its terms' magnitudes
    (`_numpy`'s `mags`). dk and dv also sum the Q query heads of a kv head: S * Q terms."""
    rel = 2 * score_err + rounding(E + 3 * T * H // K)
    return {name: rel * m + 1e-30 for name, m in mags.items()}


def _run(name, q, k, v, mask, window, cap, do):
    def f(q, k, v):
        return attention.apply(name, q, k, v, mask, scale=SCALE, window=window, softcap=cap)

    @jax.jit
    def values_and_grads(q, k, v, do):
        o, vjp = jax.vjp(f, q, k, v)
        return o, *vjp(do)

    with attention.pallas_interpret():
        o, dq, dk, dv = values_and_grads(q, k, v, do)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv}


def _check(got, want, bound, real, what):
    for name in ("o", "dq", "dk", "dv"):
        g, w = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        if name == "o":  # Padding queries' outputs are never read.
            g, w = g[real], w[real]
        b = bound[name][real] if name == "o" else bound[name]
        excess = np.abs(g - w) / b
        assert excess.max() <= 1, f"{what} {name}: {excess.max():.2f} x the bound"


@pytest.mark.parametrize("case", sorted(CASES))
def test_xla_matches_float64_numpy(case):
    packed, window, cap = CASES[case]
    q, k, v, mask, real, visible, do = _inputs(packed, window)
    # Real queries see exactly the keys NumPy says (padding queries' rows are never read).
    np.testing.assert_array_equal(np.asarray(mask.mask_BTS)[real], visible[real])
    want, mags, score_err = _numpy(q, k, v, visible, real, cap, do)
    got = _run("xla", q, k, v, mask, window, cap, do)
    _check(got, want, _bounds(mags, score_err), real, f"xla/{case}")


IMPLEMENTATIONS = [
    (name, case)
    for name in ("dot_product", "chunked", "splash")
    for case in sorted(CASES)
    if not (CASES[case][2] and not attention.get(name).softcap)
]


@functools.cache
def _xla_reference(case):
    """`xla`'s values and gradients on `case`'s inputs (seed 1), once for every implementation
    compared with it."""
    packed, window, cap = CASES[case]
    q, k, v, mask, _, _, do = _inputs(packed, window, seed=1)
    return _run("xla", q, k, v, mask, window, cap, do)


@pytest.mark.parametrize("name,case", IMPLEMENTATIONS)
def test_implementation_matches_xla(name, case):
    """Values and gradients within twice the float32 bound of the exact ones (each of the two
    is within the bound: `_bounds`)."""
    packed, window, cap = CASES[case]
    q, k, v, mask, real, visible, do = _inputs(packed, window, seed=1)
    _, mags, score_err = _numpy(q, k, v, visible, real, cap, do)
    bound = {n: 2 * b for n, b in _bounds(mags, score_err).items()}
    want = _xla_reference(case)
    got = _run(name, q, k, v, mask, window, cap, do)
    _check(got, want, bound, real, f"{name}/{case}")


def test_splash_runs_per_device_on_a_mesh():
    """A Mosaic kernel is not partitioned by XLA, so on a mesh (the caller's abstract mesh,
    as `decoder.routed_hidden` sets it) `splash` runs under a shard_map: each of 4 devices
    its row (fsdp 2) and its query and kv heads (tensor 2). Values and gradients as on one
    device: within twice the float32 bound of the exact ones, like the unsharded kernel."""
    packed, window, cap = CASES["packed"]
    q, k, v, mask, real, visible, do = _inputs(packed, window, seed=1)
    _, mags, score_err = _numpy(q, k, v, visible, real, cap, do)
    bound = {n: 2 * b for n, b in _bounds(mags, score_err).items()}
    mesh = sharding.make_mesh((1, 2, 2), devices=jax.devices()[:4])

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))

    heads = ("fsdp", None, "tensor", None)
    kv = ("fsdp", "tensor", None, None)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        got = _run("splash", put(q, *heads), put(k, *kv), put(v, *kv), mask, window, cap,
                   put(do, *heads))  # fmt: skip
    want = _run("xla", q, k, v, mask, window, cap, do)
    _check(got, want, bound, real, "splash on a (1, 2, 2) mesh")
    assert got["o"].sharding.spec == PartitionSpec(*heads)
    # Under a shard_map (libtpu refuses to partition a Mosaic kernel itself).
    f = jax.jit(lambda q, k, v: attention.apply("splash", q, k, v, mask, scale=SCALE))
    with attention.pallas_interpret(), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        text = f.lower(put(q, *heads), put(k, *kv), put(v, *kv)).as_text()
    assert "manual_computation" in text


# ------------------------------------------------------------------------------------------
# In the decoder.
# ------------------------------------------------------------------------------------------


def _decoder(**overrides):
    cfg = model.get("tiny", **overrides)
    return cfg, model.abstract_model(cfg)[0]


_hidden = jax.jit(model.hidden, static_argnums=0)


def _logit_bound(cfg, graphdef, params, tokens, positions, mask, segments=None):
    """How far two float32 forwards that add in different orders may differ, per logit:
    rounding(N) of the magnitude of the LM head's terms (|h| @ |W|), N the sums on the path
    from the tokens to a logit (per layer: a score's E products, a softmax's and the
    attention-weighted sum's T keys with the D = sum(p dP)-style correction (3 T), the q/k/v
    and output projections (D, H E), the MLP's D and F; then the head's D). The norms
    keep a relative error relative; the differences sit on both sides: twice that."""
    h, _ = _hidden(graphdef, params, tokens, positions, mask, segments_BT=segments)
    T, D = tokens.shape[1], cfg.d_model
    layer = cfg.head_dim + 3 * T + 2 * D + cfg.num_heads * cfg.head_dim + cfg.mlp_dim
    n = cfg.num_layers * layer + D
    w_DV = params["lm_head"][...] if "lm_head" in params else params["embedding"][...].T
    return 2 * rounding(n) * (jnp.abs(h) @ jnp.abs(w_DV))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dot_product", "splash"])
def test_decoder_forward_equals_xla(name):
    """Unpacked (left-padded) and packed rows: every real token's logits under `name`, with
    a sliding window where it has one, are the `xla` ones."""
    window = 6
    cfg, graphdef = _decoder(sliding_window=window)
    params = model.init_params(cfg, jax.random.key(0))
    _, other = _decoder(sliding_window=window, attention=name)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (2, 20)), jnp.int32)
    mask = jnp.asarray(np.arange(20)[None] >= np.array([[0], [7]]))
    segments = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], 5, axis=1), jnp.int32)
    for segs, real in ((None, mask), (segments, segments > 0)):
        pos = (
            model.positions_from_mask(real)
            if segs is None
            else jnp.asarray(np.tile(np.arange(5), (2, 4)), jnp.int32)
        )
        args = (tokens, pos, mask if segs is None else None)
        with attention.pallas_interpret():
            h_ref, _ = _hidden(graphdef, params, *args, segments_BT=segs)
            h, _ = _hidden(other, params, *args, segments_BT=segs)
        ref, got = model.logits(graphdef, params, h_ref), model.logits(graphdef, params, h)
        bound = _logit_bound(cfg, graphdef, params, *args, segs)
        excess = jnp.where(real[..., None], jnp.abs(got - ref) / bound, 0)
        assert float(excess.max()) <= 1, (name, segs is not None, float(excess.max()))


@pytest.mark.slow
def test_cached_decode_equals_full_forward_with_window_and_softcap():
    """Prefill then one token at a time into a larger cache (so every step writes at its own
    slots and reads the window from `cache_mask`): the logits of every real token are the
    full forward's, and the window and the cap do change them."""
    cfg, graphdef = _decoder(sliding_window=4, attn_softcap=0.5)
    params = model.init_params(cfg, jax.random.key(0))
    _, plain = _decoder()
    rng = np.random.default_rng(4)
    T, P = 14, 8
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (3, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [3], [6]]))
    positions = model.positions_from_mask(mask)
    step = jax.jit(model.forward, static_argnums=0)
    full, _ = step(graphdef, params, tokens, positions, mask)
    cache = model.init_cache(cfg, 3, 18)
    logits, cache = step(graphdef, params, tokens[:, :P], positions[:, :P], mask[:, :P], cache)
    pieces = [logits]
    for t in range(P, T):
        sl = slice(t, t + 1)
        logits, cache = step(graphdef, params, tokens[:, sl], positions[:, sl], mask[:, sl], cache)
        pieces.append(logits)
    cached = jnp.concatenate(pieces, axis=1)
    bound = _logit_bound(cfg, graphdef, params, tokens, positions, mask)
    excess = jnp.where(mask[..., None], jnp.abs(cached - full) / bound, 0)
    assert float(excess.max()) <= 1, float(excess.max())
    plain_logits, _ = step(plain, params, tokens, positions, mask)
    moved = jnp.where(mask[..., None], jnp.abs(plain_logits - full) / bound, 0)
    assert float(moved.max()) > 100  # The window and the cap are not no-ops here.


# ------------------------------------------------------------------------------------------
# Bad settings fail at start-up, naming the key.
# ------------------------------------------------------------------------------------------


def test_bad_attention_settings_name_the_key():
    with pytest.raises(
        ValueError, match=r"attention='splsh' is not a registered .* did you mean 'splash'\?"
    ):
        model.get("tiny", attention="splsh")
    with pytest.raises(ValueError, match=r"sliding_window=-3 must be > 0 \(or 0: off\)"):
        model.get("tiny", sliding_window=-3)
    with pytest.raises(ValueError, match=r"attn_softcap=-1.0 must be a number > 0"):
        model.get("tiny", attn_softcap=-1.0)
    with pytest.raises(ValueError, match=r"attention='dot_product' has no logit soft-cap"):
        model.get("tiny", attention="dot_product", attn_softcap=30.0)
    with pytest.raises(ValueError, match=r"attention='cudnn' takes dtype bfloat16, not 'float32'"):
        model.get("tiny", attention="cudnn")
    assert attention.platform_problems("splash", "tpu") == []
    assert attention.platform_problems("dot_product", "cpu") == []
    assert attention.platform_problems("cudnn", "gpu") == []
    (problem,) = attention.platform_problems("cudnn", "cpu")
    assert problem.startswith("attention='cudnn' runs on gpu, not on this host's cpu")
    (problem,) = attention.platform_problems("splash", "cpu")
    assert problem.startswith("attention='splash' runs on tpu, not on this host's cpu")
    with attention.pallas_interpret():  # Pallas kernels run interpreted anywhere.
        assert attention.platform_problems("splash", "cpu") == []
        assert attention.platform_problems("cudnn", "cpu")
    with attention.target_platform("tpu"):  # The planner compiling for a TPU slice.
        assert attention.platform_problems("splash") == []
        assert attention.platform_problems("cudnn")[0].endswith(
            "not on the planned tpu (use attention='xla' or 'dot_product' here)"
        )
    assert attention.platform_problems("splash")  # This host's own platform again.


def test_hugging_face_export_refuses_what_its_configs_lack():
    with pytest.raises(ValueError, match="sliding_window=4, attn_softcap=0.0: the llama family"):
        hf.config_to_hf(model.get("tiny", sliding_window=4))
    assert hf.config_to_hf(model.get("tiny", attention="dot_product"))["model_type"] == "llama"


def test_the_forward_refuses_an_implementation_this_platform_lacks():
    graphdef, params = model.abstract_model(model.get("tiny", attention="splash"))
    ones = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="attention='splash' runs on tpu, not on this host's cpu"):
        jax.eval_shape(lambda p: model.forward(graphdef, p, ones, ones, ones > 0), params)


def test_config_override_reaches_the_model_and_start_up_checks_the_platform():
    c = load_config("quickstart")
    c.model.attention = "dot_product"  # As --config.model.attention=dot_product sets it.
    c.model.sliding_window = 64
    run = run_config.resolve(c)
    assert (run.model.attention, run.model.sliding_window) == ("dot_product", 64)
    c.model.attention = "splash"
    with pytest.raises(sections.InvalidConfigError) as e:
        run_config.resolve(c)
    assert any(p.startswith("model.attention='splash' runs on tpu") for p in e.value.problems)
    c.model.attention = "dot_prodct"
    with pytest.raises(sections.InvalidConfigError, match="did you mean 'dot_product'"):
        run_config.resolve(c)


def test_docs_table_is_the_registry():
    with open(f"{ROOT}/docs/model_and_sampling.md", encoding="utf-8") as f:
        assert attention.table() in f.read()
