"""Attention: the reference computation, the masks, and the implementations a config names.

`model.attention` names one registered implementation (`register`); every one computes

    o = softmax(where(visible, cap * tanh(s / cap), -inf)) v,   s = scale * q k^T

with grouped query heads (a kv head serves H / K query heads), the soft-cap only when
`attn_softcap` = cap > 0 (Gemma 2), and `visible` the `Mask`: causal within the row, only within
a query's own segment (packed rows; id 0 is padding) or only to real keys (unpacked rows), and
with `sliding_window` = W > 0 only to the last W keys (key index j with i - W < j <= i). With
prefix ids (the learner's `shared_prefix` rows: a prompt once, then its completions) a query
also sees the keys of the prefix segment its id names: its segment's own earlier keys and
its shared prompt's, never another completion's. Rows
keep a sequence's real tokens contiguous (the sampler left-pads prompts, the engine writes one
cache column per token, the learner packs sequences end to end), so a window in indices is a
window in positions.

The registry is for a call without a KV cache (training and scoring). Decoding with the cache
always runs `attention`, the `xla` reference: no other implementation reads the cache's
layout (keys [B, K, E, S]; `dot_product` would transpose the whole cache each step, and
splash is a prefill kernel; TPU decode kernels are ragged/paged attention). The window and
the soft-cap apply there too (`cache_mask`, `attention`), so cached decode equals the full
forward under any implementation, up to rounding.

A padding query's output is never read (its token is masked everywhere downstream), and the
implementations differ there: a row with no visible key is uniform over all keys in `xla`,
and attends to itself in `dot_product` and `splash`.

Dimension letters: B batch, T queries of this call, S keys (cache slots; S = T without a
cache), H query heads, K kv heads, Q = H / K query heads per kv head, E head dim, X = T * Q a
kv head's queries, flattened.
"""

import contextlib
import contextvars
import difflib
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib

Array = jax.Array

PLATFORMS = ("cpu", "gpu", "tpu")


class Mask(NamedTuple):
    """Which keys each query sees, in the forms the implementations read.

    Attributes:
      mask_BTS: every rule at once (causal, padding or segments, sliding window), what `xla`
        and `dot_product` read.
      segments_BT: without a cache, each token's segment id (packed rows; 0 on padding; for
        unpacked rows 1 on real tokens): what `splash` reads with its static causal or local
        mask. None with a cache.
      prefixes_BT: with shared prefixes, each token's prefix id: the segment whose keys it
        sees besides its own (a prefix's tokens carry their own id). None otherwise: an
        implementation that reads only segment ids (`Implementation.prefix` False) cannot
        express such a mask.
    """

    mask_BTS: Array
    segments_BT: Array | None = None
    prefixes_BT: Array | None = None


def _causal(T: int, window: int) -> Array:
    causal_TT = jnp.tril(jnp.ones((T, T), bool))
    if window:
        i = jnp.arange(T)
        causal_TT &= i[None, :] > i[:, None] - window
    return causal_TT


def training_mask(mask_BT, segments_BT=None, window: int = 0, prefixes_BT=None) -> Mask:
    """The mask of a call without a cache (queries are the keys): causal, and with
    `segments_BT` only within a query's segment and to keys with ids > 0 (`mask_BT` is then
    ignored), else only to real keys (`mask_BT`); with `window` > 0 only the last `window`.

    With `prefixes_BT` (and `segments_BT`) a query i also sees key j of segment
    `prefixes_BT[i]`: visible(i, j) = j <= i and seg[j] > 0 and (seg[j] == seg[i] or
    seg[j] == prefix[i]). A window counts indices, which a shared prefix's completions do not
    keep contiguous: the two together are refused.
    """
    if segments_BT is None:
        causal_TT = _causal(mask_BT.shape[1], window)
        return Mask(causal_TT[None] & mask_BT[:, None, :], mask_BT.astype(jnp.int32))
    causal_TT = _causal(segments_BT.shape[1], window)
    same_BTT = segments_BT[:, :, None] == segments_BT[:, None, :]
    if prefixes_BT is not None:
        if window:
            raise ValueError(
                f"model.sliding_window={window} counts row indices, which "
                "learner.shared_prefix rows do not keep contiguous per sequence"
            )
        same_BTT |= prefixes_BT[:, :, None] == segments_BT[:, None, :]
    visible_BTT = causal_TT[None] & same_BTT & (segments_BT > 0)[:, None, :]
    return Mask(visible_BTT, segments_BT, prefixes_BT)


def cache_mask(valid_BS, slots_BT, window: int = 0) -> Mask:
    """The mask of T new tokens at cache slots `slots_BT`: a token sees the valid slots of its
    row up to its own, and with `window` > 0 only the last `window` of them."""
    key_S = jnp.arange(valid_BS.shape[1])
    visible_BTS = key_S <= slots_BT[:, :, None]
    if window:
        visible_BTS &= key_S > slots_BT[:, :, None] - window
    return Mask(visible_BTS & valid_BS[:, None, :])


def attention(q_BTHE, k_BKES, v_BKSE, mask_BTS, scale: float, softcap: float = 0.0):
    """Softmax attention with grouped query heads; scores and softmax in float32: the
    reference every implementation is tested against, and decoding with the KV cache.

    Both contractions are written as 4-D batched matmuls over (B, K) with the T x Q queries of
    a kv head folded into one dimension (X = T * Q): XLA:CPU runs the equivalent 5-D einsums
    5x slower.
    """
    B, T, H, E = q_BTHE.shape
    K = k_BKES.shape[1]
    Q = H // K
    q_BKXE = q_BTHE.reshape(B, T, K, Q, E).transpose(0, 2, 1, 3, 4).reshape(B, K, T * Q, E)
    s = jnp.einsum("bkxe,bkes->bkxs", q_BKXE, k_BKES, preferred_element_type=jnp.float32)
    logits = s.reshape(B, K, T, Q, -1) * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    s = jnp.where(mask_BTS[:, None, :, None], logits, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v_BKSE.dtype).reshape(B, K, T * Q, -1)
    o_BKXE = jnp.einsum("bkxs,bkse->bkxe", p, v_BKSE)
    return o_BKXE.reshape(B, K, T, Q, E).transpose(0, 2, 1, 3, 4).reshape(B, T, H, E)


def causal_attention(
    q_BTHE,
    k_BKET,
    v_BKTE,
    mask_BTT,
    scale: float,
    chunk: int = 128,
    window: int = 0,
    softcap: float = 0.0,
):
    """`attention` without a cache, skipping the key blocks the mask removes.

    Query block i only attends to keys [0, (i + 1) * chunk), and with a `window` W (which
    `mask_BTT` applies) from i * chunk - W + 1 on: about half the score FLOPs of the full
    T x T product for long sequences (1.7x faster forward + backward at T=512 on CPU), and
    O(T (chunk + W)) with a window.
    """
    T = q_BTHE.shape[1]
    if T <= chunk:
        return attention(q_BTHE, k_BKET, v_BKTE, mask_BTT, scale, softcap)
    outs = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        lo = max(0, start - window + 1) if window else 0
        outs.append(
            attention(
                q_BTHE[:, start:end],
                k_BKET[..., lo:end],
                v_BKTE[:, :, lo:end],
                mask_BTT[:, start:end, lo:end],
                scale,
                softcap,
            )
        )
    return jnp.concatenate(outs, axis=1)


# ------------------------------------------------------------------------------------------
# The registry.
# ------------------------------------------------------------------------------------------


class Implementation(NamedTuple):
    """A registered attention implementation for calls without a cache.

    `fn(q_BTHE, k_BKET, v_BKTE, mask, *, scale, window, softcap) -> o_BTHE`; `platforms`
    where it compiles; `pallas`: a Pallas kernel, which also runs on any platform in
    `pallas_interpret()`; `softcap` whether it applies `attn_softcap`; `dtypes` the compute
    dtypes it takes; `summary` its table row; `prefix` whether it reads a whole mask and so
    can express shared prefixes (`Mask.prefixes_BT`: `learner.shared_prefix`).
    """

    name: str
    fn: Callable[..., Array]
    platforms: tuple[str, ...]
    pallas: bool
    softcap: bool
    dtypes: tuple[str, ...]
    summary: str
    prefix: bool = True


_REGISTRY: dict[str, Implementation] = {}


def register(
    name: str,
    *,
    platforms: tuple[str, ...] = PLATFORMS,
    pallas: bool = False,
    softcap: bool = True,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    summary: str,
    prefix: bool = True,
):
    """Registers an implementation under `name` (a decorator; returns the function)."""
    unknown = sorted(set(platforms) - set(PLATFORMS))
    if unknown:
        raise ValueError(f"register({name!r}): platforms {unknown} are not among {PLATFORMS}")

    def decorate(fn):
        old = _REGISTRY.get(name)
        if old is not None and old.fn.__qualname__ != fn.__qualname__:
            raise ValueError(f"attention {name!r} is already registered ({old.fn})")
        _REGISTRY[name] = Implementation(
            name, fn, tuple(platforms), pallas, softcap, tuple(dtypes), summary, prefix
        )
        return fn

    return decorate


def names() -> tuple[str, ...]:
    """Registered implementation names, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> Implementation:
    """The implementation registered as `name` (KeyError if none: `problems` names it)."""
    return _REGISTRY[name]


def problems(name, sliding_window, attn_softcap, dtype: str) -> list[str]:
    """What is wrong with a model's attention settings on any platform (`ModelConfig` lists
    them with its other problems): an unknown name (with a "did you mean"), a negative or
    non-integer window, a negative soft-cap, a soft-cap or dtype the implementation lacks."""
    out = []
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        out.append(f"sliding_window={sliding_window!r} must be an int (0: off)")
    elif sliding_window < 0:
        out.append(f"sliding_window={sliding_window} must be > 0 (or 0: off)")
    cap_ok = isinstance(attn_softcap, (int, float)) and not isinstance(attn_softcap, bool)
    if not cap_ok or not math.isfinite(attn_softcap) or attn_softcap < 0:
        out.append(f"attn_softcap={attn_softcap!r} must be a number > 0 (or 0: off)")
    impl = _REGISTRY.get(name) if isinstance(name, str) else None
    if impl is None:
        near = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        out.append(
            f"attention={name!r} is not a registered attention implementation "
            f"({', '.join(_REGISTRY)}){hint}"
        )
        return out
    if cap_ok and attn_softcap and not impl.softcap:
        with_cap = ", ".join(n for n, i in _REGISTRY.items() if i.softcap)
        out.append(
            f"attention={name!r} has no logit soft-cap (attn_softcap={attn_softcap}); "
            f"use one that has: {with_cap}"
        )
    if dtype not in impl.dtypes:
        out.append(f"attention={name!r} takes dtype {' or '.join(impl.dtypes)}, not {dtype!r}")
    return out


def prefix_problems(name: str, sliding_window: int = 0) -> list[str]:
    """Why `learner.shared_prefix` cannot run with `model.attention=name` (an implementation
    that reads only segment ids) or a sliding window (which counts indices), if so."""
    out = []
    impl = _REGISTRY.get(name)
    if impl is not None and not impl.prefix:
        able = ", ".join(n for n, i in _REGISTRY.items() if i.prefix)
        out.append(
            f"learner.shared_prefix=True needs an attention that reads a whole mask; "
            f"model.attention={name!r} reads segment ids only (use one of: {able})"
        )
    if sliding_window:
        out.append(
            f"learner.shared_prefix=True with model.sliding_window={sliding_window}: a window "
            "counts row indices, and a shared prefix's completions are not contiguous with it"
        )
    return out


_INTERPRET = contextvars.ContextVar("rlscale_pallas_interpret", default=False)


@contextlib.contextmanager
def pallas_interpret():
    """Pallas kernels (`splash`) traced in this context run in interpret mode, on any
    platform: for tests on CPU. A function traced here keeps its interpreted kernel when
    jit's cache serves it again outside."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


_TARGET = contextvars.ContextVar("rlscale_attention_target", default="")


@contextlib.contextmanager
def target_platform(platform: str):
    """Programs traced in this context are compiled for `platform` (the planner's TPU slice,
    from a CPU host): implementations are checked against it, not JAX's backend here."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def platform_problems(name: str, platform: str | None = None) -> list[str]:
    """Why `attention=name` cannot run on `platform` (default: the `target_platform`, else
    JAX's backend here), if so."""
    impl = _REGISTRY.get(name)
    target = not platform and _TARGET.get()
    platform = platform or target or jax.default_backend()
    if impl is None or platform in impl.platforms:
        return []
    if impl.pallas and _INTERPRET.get():
        return []
    where = "the planned" if target else "this host's"
    return [
        f"attention={name!r} runs on {' or '.join(impl.platforms)}, not on {where} "
        f"{platform} (use attention='xla' or 'dot_product' here)"
    ]


def apply(name: str, q_BTHE, k_BKET, v_BKTE, mask: Mask, *, scale, window=0, softcap=0.0):
    """Attention over a call without a cache with implementation `name`, which must be able
    to run here (`ModelConfig` checked the rest).

    Raises:
      ValueError: naming `attention` when this platform cannot run it.
    """
    trouble = platform_problems(name)
    if trouble:
        raise ValueError("; ".join(trouble))
    return _REGISTRY[name].fn(
        q_BTHE, k_BKET, v_BKTE, mask, scale=scale, window=window, softcap=softcap
    )


def table() -> str:
    """The registry as a Markdown table (docs/model_and_sampling.md's): every implementation
    applies causal masks, packed rows' segments and a sliding window."""
    rows = [
        "| `model.attention` | platforms | causal, packed, window | soft-cap | dtypes | computes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i in _REGISTRY.values():
        where = ", ".join(i.platforms) + (" (any in `pallas_interpret()`)" if i.pallas else "")
        rows.append(
            f"| `{i.name}` | {where} | yes | {'yes' if i.softcap else 'no'} | "
            f"{', '.join(i.dtypes)} | {i.summary} |"
        )
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------
# The implementations. Each applies causal, segments or padding, window and soft-cap.
# ------------------------------------------------------------------------------------------


@register(
    "xla",
    dtypes=("float32", "bfloat16", "float16"),
    summary="`causal_attention`: float32 scores 128 queries at a time, the key blocks "
    "outside the causal window skipped",
)
def _xla(q_BTHE, k_BKET, v_BKTE, mask: Mask, *, scale, window, softcap):
    return causal_attention(
        q_BTHE, k_BKET, v_BKTE, mask.mask_BTS, scale, window=window, softcap=softcap
    )


def _dot_product_call(q_BTHE, k_BKET, v_BKTE, mask: Mask, scale, window, implementation):
    # A padding query also sees itself, so that no row is empty whatever the backend does
    # with one; a real query always sees itself already.
    T = q_BTHE.shape[1]
    mask_B1TT = (mask.mask_BTS | jnp.eye(T, dtype=bool))[:, None]
    return jax.nn.dot_product_attention(
        q_BTHE,
        jnp.transpose(k_BKET, (0, 3, 1, 2)),
        jnp.transpose(v_BKTE, (0, 2, 1, 3)),
        mask=mask_B1TT,
        scale=scale,
        is_causal=True,
        local_window_size=(window - 1, 0) if window else None,
        implementation=implementation,
    )


@register(
    "dot_product",
    softcap=False,
    summary="`jax.nn.dot_product_attention`: cuDNN flash attention on GPU in bfloat16, "
    "XLA otherwise; packed rows as a [B, 1, T, T] mask",
)
def _dot_product(q_BTHE, k_BKET, v_BKTE, mask: Mask, *, scale, window, softcap):
    del softcap  # `problems` rejects one: the function has no soft-cap.
    on_gpu = jax.default_backend() == "gpu"
    implementation = "cudnn" if on_gpu and q_BTHE.dtype == jnp.bfloat16 else "xla"
    return _dot_product_call(q_BTHE, k_BKET, v_BKTE, mask, scale, window, implementation)


@register(
    "cudnn",
    platforms=("gpu",),
    softcap=False,
    dtypes=("bfloat16",),
    summary="`dot_product` with cuDNN required (`implementation='cudnn'`)",
)
def _cudnn(q_BTHE, k_BKET, v_BKTE, mask: Mask, *, scale, window, softcap):
    del softcap
    return _dot_product_call(q_BTHE, k_BKET, v_BKTE, mask, scale, window, "cudnn")


CHUNK_QUERIES = 128  # `chunked`'s query block: the largest divisor of T that divides this.


def chunk_queries(T: int) -> int:
    """`chunked`'s query block for T queries."""
    return math.gcd(T, CHUNK_QUERIES)


def _split_queries(x_BT, b: int):
    """[B, T, ...] -> [n, B, b, ...]: n blocks of b queries."""
    B, T = x_BT.shape[:2]
    return jnp.moveaxis(x_BT.reshape(B, T // b, b, *x_BT.shape[2:]), 1, 0)


def _join_queries(x_nB):
    """[n, B, b, ...] -> [B, T, ...]."""
    x = jnp.moveaxis(x_nB, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked_attention(q_BTHE, k_BKES, v_BKSE, mask_BTS, scale, softcap):
    b = chunk_queries(q_BTHE.shape[1])

    def one(args):
        q, m = args
        return attention(q, k_BKES, v_BKSE, m, scale, softcap)

    return _join_queries(jax.lax.map(one, (_split_queries(q_BTHE, b), _split_queries(mask_BTS, b))))


def _chunked_fwd(q_BTHE, k_BKES, v_BKSE, mask_BTS, scale, softcap):
    out = _chunked_attention(q_BTHE, k_BKES, v_BKSE, mask_BTS, scale, softcap)
    return out, (q_BTHE, k_BKES, v_BKSE, mask_BTS)


def _chunked_bwd(scale, softcap, res, do_BTHE):
    """The gradients a query block at a time, recomputing its scores (nothing of the forward
    pass is saved but its inputs); dk and dv summed over the blocks."""
    q_BTHE, k_BKES, v_BKSE, mask_BTS = res
    b = chunk_queries(q_BTHE.shape[1])

    def step(carry, args):
        dk, dv = carry
        q, m, do = args
        _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, m, scale, softcap), q, k_BKES, v_BKSE)
        dq, dk_b, dv_b = vjp(do)
        return (dk + dk_b, dv + dv_b), dq

    zeros = (jnp.zeros_like(k_BKES), jnp.zeros_like(v_BKSE))
    blocks = tuple(_split_queries(x, b) for x in (q_BTHE, mask_BTS, do_BTHE))
    (dk, dv), dq = jax.lax.scan(step, zeros, blocks)
    return _join_queries(dq), dk, dv, None


_chunked_attention.defvjp(_chunked_fwd, _chunked_bwd)


@register(
    "chunked",
    dtypes=("float32", "bfloat16", "float16"),
    summary="`attention` a block of up to 128 queries at a time, forward and backward (a "
    "custom VJP that recomputes a block's scores): a layer holds one block's [H, b, T] "
    "scores, not [H, T, T], on any platform",
)
def _chunked(q_BTHE, k_BKET, v_BKTE, mask: Mask, *, scale, window, softcap):
    del window  # In `mask.mask_BTS` already.
    return _chunked_attention(q_BTHE, k_BKET, v_BKTE, mask.mask_BTS, scale, softcap)


SPLASH_BLOCKS = (512, 256, 128)  # Block sizes tried, largest first; the lane width is 128.


def _splash_kernel(T: int, H: int, window: int, softcap: float, interpret: bool):
    """The splash kernel for T (a multiple of 128) tokens and H heads: a static causal or
    local (window) mask, the block size the largest of `SPLASH_BLOCKS` dividing T."""
    if window:
        static = splash_lib.LocalMask((T, T), (window - 1, 0), offset=0)
    else:
        static = splash_lib.CausalMask((T, T))
    b = next(b for b in SPLASH_BLOCKS if T % b == 0)
    blocks = splash_lib.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    return splash_lib.make_splash_mha(
        splash_lib.MultiHeadMask([static] * H),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=softcap or None,
        interpret=interpret,
    )


@register(
    "splash",
    platforms=("tpu",),
    pallas=True,
    prefix=False,  # Segment ids only: `SegmentIds` cannot say "also this other segment".
    summary="Pallas splash attention: block-sparse causal or local mask, segment ids, "
    "soft-cap in the kernel; rows padded to a multiple of 128",
)
def _splash(q_BTHE, k_BKET, v_BKTE, mask: Mask, *, scale, window, softcap):
    # A Mosaic kernel is not partitioned by XLA: on a mesh (the caller's abstract mesh:
    # `decoder.routed_hidden` sets it) each device runs it on its own rows and heads.
    if mask.prefixes_BT is not None:  # `prefix_problems` refuses it at start-up.
        raise ValueError(prefix_problems("splash")[0])
    local = functools.partial(_splash_local, scale=scale, window=window, softcap=softcap)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(q_BTHE, k_BKET, v_BKTE, mask.segments_BT)
    B, H, K = q_BTHE.shape[0], q_BTHE.shape[2], k_BKET.shape[1]
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rows = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
    if B % math.prod(sizes[a] for a in rows):
        rows = ()
    t = sizes.get("tensor", 1)
    heads = "tensor" if t > 1 and H % t == 0 and K % t == 0 else None
    rows = rows or None
    spec_BTHE = jax.sharding.PartitionSpec(rows, None, heads, None)
    spec_BK = jax.sharding.PartitionSpec(rows, heads, None, None)
    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec_BTHE, spec_BK, spec_BK, jax.sharding.PartitionSpec(rows, None)),
        out_specs=spec_BTHE,
        check_vma=False,
    )
    return run(q_BTHE, k_BKET, v_BKTE, mask.segments_BT)


def _splash_local(q_BTHE, k_BKET, v_BKTE, segments_BT, *, scale, window, softcap):
    """The splash kernel over the rows and heads it is given (one device's, on a mesh)."""
    # The kernel does not scale: the queries are scaled first (as MaxText does). Rows are
    # padded to whole 128-lane blocks with segment id -1, which no real or padding token has:
    # the padding sees only itself and earlier padding, so no row is empty.
    B, T, H, E = q_BTHE.shape
    pad = -T % 128
    q_BHTE = jnp.transpose(q_BTHE * jnp.asarray(scale, q_BTHE.dtype), (0, 2, 1, 3))
    k_BKTE = jnp.transpose(k_BKET, (0, 1, 3, 2))
    rows = ((0, 0), (0, 0), (0, pad), (0, 0))
    q_BHTE, k_BKTE, v_BKTE = (jnp.pad(x, rows) for x in (q_BHTE, k_BKTE, v_BKTE))
    segments_BT = jnp.pad(segments_BT.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    kernel = _splash_kernel(T + pad, H, window, softcap, _INTERPRET.get())
    segment_ids = splash_lib.SegmentIds(q=segments_BT, kv=segments_BT)
    o_BHTE = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s))(
        q_BHTE, k_BKTE, v_BKTE, segment_ids
    )
    return jnp.transpose(o_BHTE[:, :, :T], (0, 2, 1, 3))
