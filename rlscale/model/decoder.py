"""The decoder: a Llama/Qwen/Gemma-style transformer as Flax NNX modules, and its pure functions.

The module tree is split once (`nnx.split`) into a static `GraphDef` and a params pytree; every
jitted function takes the params pytree explicitly (`forward(graphdef, params, ...)`).

Dimension letters: B batch, T tokens of this call, S KV-cache slots, D model width, H query
heads, K kv heads, Q query heads per kv head (H = K * Q), E head dim, F MLP width, V vocab.

Attention (`model.attention`, its masks and implementations) is `rlscale.model.attention`'s.

Padding and positions: each call gets `mask_BT` (which tokens are real) and `positions_BT`
(their RoPE positions). With a KV cache, each row has its own write position: row b's T new
tokens are written at cache slots `cache.index_B[b] ... cache.index_B[b] + T - 1` (a slot
past the end writes nothing), and a token attends to the slots of its row up to its own that
hold real tokens. A call of as many tokens as the cache has slots fills it from slot 0 (a
prefill into a cache of its own size). The static sampler's rows share one position (prompts
left-padded); the generator engine's slots each advance their own.
"""

import contextlib
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlscale import sharding
from rlscale.model import attention as attention_lib
from rlscale.model import kv_pages
from rlscale.model import moe as moe_lib
from rlscale.model.attention import attention, causal_attention  # noqa: F401 (re-exported)
from rlscale.model.config import ModelConfig

Array = jax.Array


def _param(rngs, init, shape, axes, dtype):
    # Logical axis names travel with the variable as `axes` metadata; `rlscale.sharding` maps
    # them to mesh axes.
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


def _kernel_init(in_axis, out_axis):
    return nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )


@jax.custom_vjp
def dense(x_TD, w_DF):
    """x @ w for 2-D operands, with a backward pass that feeds XLA standard-layout matmuls.

    The rows of x are the T tokens of a call, flattened over its batch. The weight gradient
    x^T @ g contracts over the T tokens. Left to itself, XLA:CPU picks a transposed layout for
    g and writes it with a strided copy fused into the activation's gradient (14% of a train
    step for `small`); transposing the smaller x explicitly instead keeps every matmul in the
    layout the CPU kernels run at full speed. The barrier stops XLA from folding the transpose
    back into the matmul. GPU and TPU matmuls take transposed operands natively, so there the
    gradient is the plain x^T @ g.
    """
    return x_TD @ w_DF


def _dense_fwd(x_TD, w_DF):
    return x_TD @ w_DF, (x_TD, w_DF)


def _dense_bwd(res, g_TF):
    x_TD, w_DF = res
    x_DT = x_TD.T
    if jax.default_backend() == "cpu":
        x_DT = jax.lax.optimization_barrier(x_DT)
    return g_TF @ w_DF.T, (x_DT @ g_TF).astype(w_DF.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def project(x, w, n_in: int = 1):
    """Contracts the last `n_in` dims of w's leading dims with x's trailing dims via `dense`."""
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    lead = x.shape[: x.ndim - n_in]
    d_in, d_out = math.prod(in_shape), math.prod(out_shape)
    y = dense(x.reshape(-1, d_in), w.reshape(d_in, d_out))
    return y.reshape(*lead, *out_shape)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, cfg: ModelConfig, *, rngs: nnx.Rngs):
        del rngs
        init = jnp.zeros if cfg.norm_plus_one else jnp.ones
        self.scale = nnx.Param(init((dim,), cfg.weight_dtype), axes=("norm",))
        self.eps = cfg.norm_eps
        self.plus_one = cfg.norm_plus_one

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns RoPE inverse frequencies [E/2] and the attention factor, for `cfg.rope_scaling`.

    "linear": position interpolation (Chen et al. 2023). "llama3": Llama 3.1 keeps high
    frequencies, divides low ones by `rope_factor` and interpolates between the bands. "yarn":
    YaRN (Peng et al. 2023), as used by Qwen2.5 for long context, with its attention factor
    0.1 ln(factor) + 1 applied to cos and sin.
    """
    E, theta, factor = cfg.head_dim, cfg.rope_theta, cfg.rope_factor
    inv_freq = 1.0 / theta ** (np.arange(0, E, 2, dtype=np.float64) / E)
    if cfg.rope_scaling == "linear":
        return inv_freq / factor, 1.0
    if cfg.rope_scaling == "llama3":
        old = cfg.rope_original_max_len
        low_wavelen = old / cfg.rope_low_freq_factor
        high_wavelen = old / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return np.where(is_mid, mid, out), 1.0
    if cfg.rope_scaling == "yarn":
        old = cfg.rope_original_max_len

        def correction_dim(rotations):
            return E * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(cfg.rope_yarn_beta_fast)), 0)
        high = min(math.ceil(correction_dim(cfg.rope_yarn_beta_slow)), E - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(E // 2) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        return inv, 0.1 * math.log(factor) + 1.0
    return inv_freq, 1.0


def apply_rope(x_BTHE, positions_BT, inv_freq, attention_factor):
    """Rotates the two halves of each head (the Hugging Face `rotate_half` layout); the heads
    are query (H) or kv (K) heads."""
    angles = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    cos = (jnp.cos(angles) * attention_factor)[:, :, None, :]
    sin = (jnp.sin(angles) * attention_factor)[:, :, None, :]
    x = x_BTHE.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHE.dtype)


class KVCache(NamedTuple):
    """Preallocated keys and values of every layer, updated in place.

    Keys are stored transposed, [B, K, E, S], and values as [B, K, S, E]: with these layouts
    both attention contractions at decode time run as long contiguous reductions, which on CPU
    is 1.6x faster than the [B, S, K, E] layout (tools/bench.py).

    Attributes:
      k: per layer [B, K, E, S].
      v: per layer [B, K, S, E].
      valid_BS: which slots hold real (non-padding) tokens.
      index_B: each row's next slot to write.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    valid_BS: Array
    index_B: Array


def init_cache(cfg: ModelConfig, batch: int, size: int) -> KVCache:
    if size > cfg.max_seq_len:
        raise ValueError(f"KV cache of {size} slots exceeds max_seq_len={cfg.max_seq_len}")
    K, E, L, dt = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, cfg.compute_dtype
    return KVCache(
        k=tuple(jnp.zeros((batch, K, E, size), dt) for _ in range(L)),
        v=tuple(jnp.zeros((batch, K, size, E), dt) for _ in range(L)),
        valid_BS=jnp.zeros((batch, size), bool),
        index_B=jnp.zeros((batch,), jnp.int32),
    )


def cache_logical_axes(cfg: ModelConfig) -> KVCache:
    return KVCache(
        k=(("batch", "kv_heads", "head_dim", "cache_seq"),) * cfg.num_layers,
        v=(("batch", "kv_heads", "cache_seq", "head_dim"),) * cfg.num_layers,
        valid_BS=("batch", "cache_seq"),
        index_B=("batch",),
    )


def _write_rows(buf, update, slots_BT, axis: int):
    """`buf` with row b's T entries of `update` written at its slots `slots_BT[b]` along
    `axis` (a slot past the end writes nothing). One scatter whose rows are a batching
    dimension (`vmap`), so on a mesh each device writes its own rows."""

    def row(buf, update, slots_T):
        at = (slice(None),) * (axis - 1) + (slots_T,)
        return buf.at[at].set(update.astype(buf.dtype), mode="drop")

    return jax.vmap(row)(buf, update, slots_BT)


class Attention(nnx.Module):
    """Grouped-query attention (Ainslie et al. 2023) with RoPE, optional q/k/v bias and QK-norm."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H, K, E, pd = (
            cfg.d_model,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.weight_dtype,
        )
        self.q = _param(
            rngs, _kernel_init(0, (1, 2)), (D, H, E), ("embed", "heads", "head_dim"), pd
        )
        kv_axes = ("embed", "kv_heads", "head_dim")
        self.k = _param(rngs, _kernel_init(0, (1, 2)), (D, K, E), kv_axes, pd)
        self.v = _param(rngs, _kernel_init(0, (1, 2)), (D, K, E), kv_axes, pd)
        self.o = _param(
            rngs, _kernel_init((0, 1), 2), (H, E, D), ("heads", "head_dim", "embed"), pd
        )
        if cfg.attn_bias:
            self.q_bias = nnx.Param(jnp.zeros((H, E), pd), axes=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((K, E), pd), axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((K, E), pd), axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(E, cfg, rngs=rngs)
            self.k_norm = RMSNorm(E, cfg, rngs=rngs)
        self.cfg = cfg

    def __call__(self, x_BTD, positions_BT, mask, kv=None, slots_BT=None):
        """`mask`: the call's `attention.Mask`; `kv`: the layer's cache, (k, v) or a paged
        cache's (k pool, v pool, table) (`kv_pages`)."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        q = project(x_BTD, self.q[...].astype(dt))
        k = project(x_BTD, self.k[...].astype(dt))
        v = project(x_BTD, self.v[...].astype(dt))
        if cfg.attn_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, attention_factor = rope_inv_freq(cfg)  # NumPy constants, folded at trace time.
        q = apply_rope(q, positions_BT, inv_freq, attention_factor)
        k = apply_rope(k, positions_BT, inv_freq, attention_factor)
        k_BKET = jnp.transpose(k, (0, 2, 3, 1))
        v_BKTE = jnp.transpose(v, (0, 2, 1, 3))
        if kv is not None and slots_BT is None:  # The call fills the cache.
            kv = (k_BKET.astype(kv[0].dtype), v_BKTE.astype(kv[1].dtype))
            k_BKET, v_BKTE = kv
        elif kv is not None and len(kv) == 3:  # A paged cache: (k pool, v pool, table).
            kv = kv_pages.write(kv, k_BKET, v_BKTE, slots_BT)
            k_BKET, v_BKTE = kv_pages.view(kv)
        elif kv is not None:
            # Each row's T tokens at its own slots `slots_BT`: inside the sampler's while_loop
            # XLA aliases the buffers, so the write is in place.
            kv = (_write_rows(kv[0], k_BKET, slots_BT, 3), _write_rows(kv[1], v_BKTE, slots_BT, 2))
            k_BKET, v_BKTE = kv
        scale = 1.0 / math.sqrt(cfg.head_dim)
        if kv is None:  # Training / scoring: the configured implementation.
            out = attention_lib.apply(
                cfg.attention,
                q,
                k_BKET,
                v_BKTE,
                mask,
                scale=scale,
                window=cfg.sliding_window,
                softcap=cfg.attn_softcap,
            )
        else:  # With the cache: the reference (`cache_mask` holds the window).
            out = attention(q, k_BKET, v_BKTE, mask.mask_BTS, scale, cfg.attn_softcap)
        return project(out, self.o[...].astype(dt), n_in=2), kv


class MLP(nnx.Module):
    """Gated MLP: down(act(gate x) * up x); SwiGLU or GeGLU (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F, pd = cfg.d_model, cfg.mlp_dim, cfg.weight_dtype
        self.gate = _param(rngs, _kernel_init(0, 1), (D, F), ("embed", "mlp"), pd)
        self.up = _param(rngs, _kernel_init(0, 1), (D, F), ("embed", "mlp"), pd)
        self.down = _param(rngs, _kernel_init(0, 1), (F, D), ("mlp", "embed"), pd)
        self.cfg = cfg

    def __call__(self, x_BTD):
        dt = self.cfg.compute_dtype
        g = project(x_BTD, self.gate[...].astype(dt))
        u = project(x_BTD, self.up[...].astype(dt))
        if self.cfg.activation == "silu":
            h = jax.nn.silu(g)
        else:
            h = jax.nn.gelu(g, approximate=True)
        return project(h * u, self.down[...].astype(dt))


class Block(nnx.Module):
    """Pre-norm attention and MLP; the MLP of a sparse layer (`ModelConfig.is_moe_layer`) is
    the mixture of experts (`moe.MoE`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.attn_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
        self.sparse = cfg.is_moe_layer(layer)
        if self.sparse:
            self.moe = moe_lib.MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)

    def __call__(
        self, x_BTD, positions_BT, mask, kv=None, slots_BT=None, valid_BT=None, expert_ids_BTc=None
    ):
        """(x, kv, routing): `routing` is a sparse layer's `moe.Routing` (None when dense)."""
        h, kv = self.attn(self.attn_norm(x_BTD), positions_BT, mask, kv, slots_BT)
        x_BTD = x_BTD + h
        if not self.sparse:
            return x_BTD + self.mlp(self.mlp_norm(x_BTD)), kv, None
        y_BTD, routing = self.moe(self.mlp_norm(x_BTD), valid_BT, expert_ids_BTc)
        return x_BTD + y_BTD, kv, routing


# What a block's backward pass keeps from its forward pass (`jax.checkpoint` policies):
#   none  everything (no rematerialization: the fastest, the most activation memory);
#   dots  the outputs of the matmuls without batch dimensions (the projections and the MLP);
#         the rest (norms, activations, attention scores) is recomputed;
#   full  only the block's input: the whole block is recomputed (the least memory, about one
#         more forward pass of compute).
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def _remat_layers(layers, x_BTD, positions_BT, mask, remat: str, valid_BT, expert_ids_lBTc):
    """The blocks as `lax.scan`s over their stacked params (one per run of consecutive
    blocks of one kind, dense or sparse), each step under `jax.checkpoint` with the `remat`
    policy. Inside a loop the backward pass recomputes one block at a time; an unrolled chain
    of checkpointed blocks leaves that order to XLA's scheduler, and XLA:CPU's keeps every
    block's activations anyway (measured: an 8-block gradient's temporaries fall by 1%
    unrolled, by 6x scanned). Stacking copies the blocks' params once per call (sharded as
    they are). Returns (x, the sparse blocks' routings)."""
    policy = REMAT_POLICIES[remat]
    routings, start, sparse_seen = [], 0, 0
    while start < len(layers):
        end = start
        while end < len(layers) and layers[end].sparse == layers[start].sparse:
            end += 1
        run = layers[start:end]
        graphdef, _ = nnx.split(run[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(layer) for layer in run))
        ids = None
        if run[0].sparse and expert_ids_lBTc is not None:
            ids = expert_ids_lBTc[sparse_seen : sparse_seen + len(run)]

        def block(x_BTD, xs, graphdef=graphdef):
            state, ids_BTc = xs
            x_BTD, _, routing = nnx.merge(graphdef, state)(
                x_BTD, positions_BT, mask, valid_BT=valid_BT, expert_ids_BTc=ids_BTc
            )
            return x_BTD, routing

        step = jax.checkpoint(block, policy=policy, prevent_cse=False)
        x_BTD, routing = jax.lax.scan(step, x_BTD, (stacked, ids))
        if run[0].sparse:  # Each step's [1, ...] fields, stacked: [n, 1, ...].
            routings.append(moe_lib.Routing(*(r.reshape(-1, *r.shape[2:]) for r in routing)))
            sparse_seen += len(run)
        start = end
    return x_BTD, routings


class Decoder(nnx.Module):
    """Token embedding, `num_layers` pre-norm blocks, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        V, D, pd = cfg.vocab_size, cfg.d_model, cfg.weight_dtype
        embed_init = nnx.initializers.normal(1.0 / math.sqrt(D))
        self.embedding = _param(rngs, embed_init, (V, D), ("vocab", "embed"), pd)
        self.layers = nnx.List([Block(cfg, rngs=rngs, layer=i) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(D, cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, _kernel_init(0, 1), (D, V), ("embed", "vocab"), pd)
        self.cfg = cfg

    def hidden(
        self,
        tokens_BT,
        positions_BT,
        mask_BT,
        cache: KVCache | None = None,
        segments_BT=None,
        remat: str = "none",
        prefixes_BT=None,
    ):
        """Final-norm hidden states [B, T, D], and the updated cache when one is given.

        `segments_BT` (no cache): packed rows, where a token attends only to the earlier
        tokens of its own segment (ids > 0; 0 is padding) and `mask_BT` is ignored.
        `prefixes_BT` (with `segments_BT`): shared prefixes, where a token also attends to the
        earlier tokens of the segment its prefix id names (`attention.training_mask`).
        `remat` (no cache): what each block's backward pass keeps (`REMAT_POLICIES`)."""
        h, cache, _ = self.routed(
            tokens_BT, positions_BT, mask_BT, cache, segments_BT, remat, prefixes_BT=prefixes_BT
        )
        return h, cache

    def routed(
        self,
        tokens_BT,
        positions_BT,
        mask_BT,
        cache: KVCache | None = None,
        segments_BT=None,
        remat: str = "none",
        expert_ids_lBTc=None,
        prefixes_BT=None,
    ):
        """`hidden`, and the routers' `moe.Routing` over the sparse layers (None for a dense
        model). `expert_ids_lBTc` (int32 [l, B, T, c]: l sparse layers, c experts per token):
        router replay, each token's experts as given (weighted by the current router's
        probabilities). `prefixes_BT`: as in `hidden`."""
        cfg = self.cfg
        x = jnp.take(self.embedding[...], tokens_BT, axis=0).astype(cfg.compute_dtype)
        if cfg.embed_scale:
            x = x * jnp.asarray(math.sqrt(cfg.d_model), cfg.compute_dtype)
        T = tokens_BT.shape[1]
        slots_BT = None
        fills = cache is not None and cache.valid_BS.shape[1] == T
        if cache is None or fills:
            mask = attention_lib.training_mask(
                mask_BT, segments_BT, cfg.sliding_window, prefixes_BT
            )
            if fills:  # A prefill into a cache of its own size: written whole, no scatter.
                valid_BS, index_B = mask_BT, jnp.full_like(cache.index_B, T)
        else:
            slots_BT = cache.index_B[:, None] + jnp.arange(T)
            valid_BS = _write_rows(cache.valid_BS, mask_BT, slots_BT, 1)
            mask = attention_lib.cache_mask(valid_BS, slots_BT, cfg.sliding_window)
            index_B = cache.index_B + T
        valid_BT = None  # The real tokens, which the routers' statistics count.
        if cfg.num_experts:
            valid_BT = segments_BT > 0 if segments_BT is not None else mask_BT
            valid_BT = jnp.ones(tokens_BT.shape, bool) if valid_BT is None else valid_BT
        if cache is None and remat != "none":
            x, routings = _remat_layers(
                self.layers, x, positions_BT, mask, remat, valid_BT, expert_ids_lBTc
            )
            return self.final_norm(x), None, moe_lib.stack(routings) if routings else None
        new_k, new_v, routings = [], [], []
        paged = (cache.table_BN,) if isinstance(cache, kv_pages.PagedKVCache) else ()
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i], *paged)
            ids = None
            if layer.sparse and expert_ids_lBTc is not None:
                ids = expert_ids_lBTc[len(routings)]
            x, kv, routing = layer(x, positions_BT, mask, kv, slots_BT, valid_BT, ids)
            if routing is not None:
                routings.append(routing)
            if cache is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        h = self.final_norm(x)
        if cache is not None:
            cache = cache._replace(
                k=tuple(new_k), v=tuple(new_v), valid_BS=valid_BS, index_B=index_B
            )
        return h, cache, moe_lib.stack(routings) if routings else None

    def logits(self, h_BTD):
        """LM head; in float32 when `fp32_lm_head` (ScaleRL), else in the compute dtype."""
        cfg = self.cfg
        dt = jnp.float32 if cfg.fp32_lm_head else cfg.compute_dtype
        if cfg.tie_embeddings:
            return jnp.einsum("btd,vd->btv", h_BTD.astype(dt), self.embedding[...].astype(dt))
        return project(h_BTD.astype(dt), self.lm_head[...].astype(dt))

    def __call__(self, tokens_BT, positions_BT, mask_BT, cache: KVCache | None = None):
        h, cache = self.hidden(tokens_BT, positions_BT, mask_BT, cache)
        return self.logits(h), cache


# ------------------------------------------------------------------------------------------
# Pure functions over (graphdef, params): what jitted code calls.
# ------------------------------------------------------------------------------------------


class ForwardSpec(NamedTuple):
    """What a forward pass of the decoder is compiled for (hashable: a jit static argument):
    by the policy, its reference and a distillation teacher over sampled rows
    (`rl.forward`), and by the reward-model and PRM scorers (`reward_models.scalar_head`),
    which read the graph and `remat` only."""

    graphdef: Any
    remat: str = "none"  # The blocks' rematerialization policy (`REMAT_POLICIES`).
    mesh: Any = None
    logits_cfg: Any = None  # The sampler's logits transform (`SamplingConfig`): what was sampled.
    pack_length: int = 0  # Tokens per forward row (`batch_layout.Plan.T`).
    pack_rows: int = 0  # Forward rows per batch shard in a micro-batch.
    chunk: int = 0  # Tokens per batch shard in each chunk of the vocabulary-sized terms.
    router_replay: bool = False  # A MoE's forward uses the batch's recorded expert ids.
    # Rows hold a group's prompt once, then its completions (`batch_layout`, `shared_prefix`).
    shared_prefix: bool = False


class _ShapeKeys:  # abstract_model's rngs: a traced nnx.Rngs walks the whole trace per key
    params = staticmethod(lambda: jax.random.key(0))  # (qwen3_30b_a3b: 6.5 CPU-s -> 0.8).


def abstract_model(cfg: ModelConfig):
    """(graphdef, abstract params) without allocating anything."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=_ShapeKeys())))


def init_params(cfg: ModelConfig, rng: Array):
    """Initializes params on the default device (see `init_sharded`)."""
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(params=rng)))[1]


def init_sharded(cfg: ModelConfig, rng: Array, mesh, rules=sharding.TRAIN_RULES):
    """(graphdef, params) with every parameter created directly on its shards.

    The shapes come from `nnx.eval_shape` and the init is jitted with `out_shardings`, so a
    large model is never materialized on one device.
    """
    problems = moe_lib.mesh_problems(cfg, dict(mesh.shape))
    if problems:
        raise ValueError("; ".join(problems))
    graphdef, abstract = abstract_model(cfg)
    shardings = sharding.param_shardings(abstract, mesh, rules)
    params = jax.jit(lambda r: init_params(cfg, r), out_shardings=shardings)(rng)
    return graphdef, params


def forward(graphdef, params, tokens_BT, positions_BT, mask_BT, cache=None):
    """Logits [B, T, V] (float32 with `fp32_lm_head`) and the updated cache."""
    return nnx.merge(graphdef, params)(tokens_BT, positions_BT, mask_BT, cache)


def hidden(
    graphdef, params, tokens_BT, positions_BT, mask_BT, cache=None, segments_BT=None, remat="none"
):
    return nnx.merge(graphdef, params).hidden(
        tokens_BT, positions_BT, mask_BT, cache, segments_BT, remat
    )


def routed_hidden(
    graphdef,
    params,
    tokens_BT,
    positions_BT,
    mask_BT,
    cache=None,
    segments_BT=None,
    remat="none",
    expert_ids_lBTc=None,
    mesh=None,
    prefixes_BT=None,
):
    """(hidden [B, T, D], cache, `moe.Routing` or None): `hidden` with what the routers chose
    (`Decoder.routed`). `mesh` (or the caller's `jax.set_mesh`): its `expert` axis runs the
    experts expert-parallel. `prefixes_BT`: shared prefixes (`Decoder.hidden`)."""
    decoder = nnx.merge(graphdef, params)
    context = contextlib.nullcontext()
    pallas = attention_lib.get(decoder.cfg.attention).pallas  # `splash`: in a shard_map.
    if mesh is not None and (decoder.cfg.num_experts or pallas):  # Read at trace time.
        context = jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
    with context:
        return decoder.routed(
            tokens_BT,
            positions_BT,
            mask_BT,
            cache,
            segments_BT,
            remat,
            expert_ids_lBTc,
            prefixes_BT=prefixes_BT,
        )


def logits(graphdef, params, h_BTD):
    return nnx.merge(graphdef, params).logits(h_BTD)


def positions_from_mask(mask_BT):
    """RoPE positions for left- or right-padded rows: 0, 1, ... over the real tokens."""
    return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=1) - 1, 0)
