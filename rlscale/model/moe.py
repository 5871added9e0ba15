"""The mixture-of-experts MLP (Qwen3-MoE): top-k routing, the experts as one grouped matmul,
expert parallelism over the `expert` mesh axis, the router statistics of the auxiliary losses,
and router replay (forced expert ids). Derivations and figures: docs/model_and_sampling.md.

Dimension letters: B batch, T tokens of a call, D model width, E experts, G experts held by
one device (E / the expert axis), F expert MLP width, k experts per token, M tokens of a call
flattened (B * T), R routed rows (M * k), L sparse layers (`ModelConfig.moe_layers`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from rlscale import sharding
from rlscale.model.config import ModelConfig

Array = jax.Array

EXPERT_AXIS = "expert"  # The mesh axis (and the logical axis) that experts shard over.


class Routing(NamedTuple):
    """What the routers of one forward pass chose, and the sums the auxiliary losses need,
    over the call's real tokens (`valid_BT`), stacked over the sparse layers.

    Attributes:
      expert_ids_LBTk: int32, each token's top-k experts (or the forced ones), best first.
      counts_LE: float32, how many of the real tokens' k choices went to each expert.
      probs_LE: float32, the real tokens' router probabilities (softmax over all E), summed.
      z_L: float32, the real tokens' squared router log-partition, logsumexp(logits)^2, summed.
      tokens_L: float32, the real tokens (the same in every layer).
    """

    expert_ids_LBTk: Array
    counts_LE: Array
    probs_LE: Array
    z_L: Array
    tokens_L: Array


def stack(layers: list[Routing]) -> Routing:
    """One layer's `Routing`s (leading dim 1, or none) stacked into [L, ...]."""
    return Routing(*(jnp.concatenate([jnp.atleast_1d(x) for x in xs]) for xs in zip(*layers)))


def load_balancing_loss(routing: Routing) -> Array:
    """E * sum_e f_e * P_e (Switch Transformer, Fedus et al. 2021, eq. 4-6), as Qwen3-MoE
    trains with it (transformers' `load_balancing_loss_func`): f_e, the expert's share of the
    token choices, and P_e, its mean router probability, each pooled over the real tokens of
    every sparse layer. f sums to k, so perfectly uniform routing gives k."""
    tokens = jnp.maximum(jnp.sum(routing.tokens_L), 1.0)
    f_E = jnp.sum(routing.counts_LE, axis=0) / tokens
    p_E = jnp.sum(routing.probs_LE, axis=0) / tokens
    return routing.counts_LE.shape[-1] * jnp.sum(f_E * p_E)


def z_loss(routing: Routing) -> Array:
    """The router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): the mean over real tokens and
    sparse layers of logsumexp(router logits)^2."""
    return jnp.sum(routing.z_L) / jnp.maximum(jnp.sum(routing.tokens_L), 1.0)


def mesh_problems(cfg: ModelConfig, mesh_shape: dict, key: str = "mesh.shape") -> list[str]:
    """The expert axis of a mesh (axis name -> size) against the model's experts."""
    n = int(mesh_shape.get(EXPERT_AXIS, 1))
    if n == 1:
        return []
    shape = tuple(mesh_shape.values())
    if not cfg.num_experts:
        return [f"{key}={shape} has an expert axis of {n} but the model has no experts"]
    if cfg.num_experts % n:
        return [
            f"{key}={shape}: the expert axis ({n} devices) does not divide "
            f"model.num_experts={cfg.num_experts}"
        ]
    return []


def _param(rngs, shape, axes, dtype, in_axis, out_axis, batch_axis=()):
    init = nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
    )
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


class MoE(nnx.Module):
    """Qwen3-MoE's sparse MLP: a router over E gated-MLP experts, each token mixing its top k.

    Routing (transformers' `Qwen3MoeTopKRouter`): p = softmax(x W_router) over all E experts
    in float32; the token's experts are the top k of p (or the forced `expert_ids`), weighted
    by their p, renormalised to sum to 1 with `norm_topk_prob`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, E, F, pd = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size, cfg.weight_dtype
        self.router = _param(rngs, (D, E), ("embed", None), pd, 0, 1)
        ax_in = (EXPERT_AXIS, "embed", "expert_mlp")
        self.gate = _param(rngs, (E, D, F), ax_in, pd, 1, 2, 0)
        self.up = _param(rngs, (E, D, F), ax_in, pd, 1, 2, 0)
        self.down = _param(rngs, (E, F, D), (EXPERT_AXIS, "expert_mlp", "embed"), pd, 1, 2, 0)
        self.cfg = cfg

    def __call__(self, x_BTD, valid_BT, expert_ids_BTk=None):
        """(the experts' mixture [B, T, D], this layer's `Routing`, leading dim 1)."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        B, T, D = x_BTD.shape
        x_MD = x_BTD.reshape(B * T, D)
        logits_ME = x_MD.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        probs_ME = jax.nn.softmax(logits_ME, axis=-1)
        if expert_ids_BTk is None:
            top_Mk, ids_Mk = jax.lax.top_k(probs_ME, cfg.experts_per_token)
        else:  # Router replay: the given experts, weighted by this router's probabilities.
            ids_Mk = expert_ids_BTk.reshape(B * T, -1).astype(jnp.int32)
            top_Mk = jnp.take_along_axis(probs_ME, ids_Mk, axis=-1)
        if cfg.norm_topk_prob:
            top_Mk = top_Mk / jnp.sum(top_Mk, axis=-1, keepdims=True)
        weights = (self.gate[...], self.up[...], self.down[...])
        y_MD = experts(
            x_MD.astype(dt), ids_Mk, top_Mk.astype(dt), *(w.astype(dt) for w in weights), cfg
        )
        valid_M = valid_BT.reshape(B * T).astype(jnp.float32)
        chosen_ME = jnp.zeros_like(probs_ME).at[jnp.arange(B * T)[:, None], ids_Mk].add(1.0)
        lse_M = jax.nn.logsumexp(logits_ME, axis=-1)
        routing = Routing(
            expert_ids_LBTk=ids_Mk.reshape(1, B, T, -1),
            counts_LE=(valid_M @ chosen_ME)[None],
            probs_LE=(valid_M @ probs_ME)[None],
            z_L=jnp.sum(valid_M * lse_M**2)[None],
            tokens_L=jnp.sum(valid_M)[None],
        )
        return y_MD.reshape(B, T, D), routing


def experts(x_MD, ids_Mk, w_Mk, gate_EDF, up_EDF, down_EFD, cfg: ModelConfig):
    """sum_j w_Mk[:, j] * expert_{ids_Mk[:, j]}(x_MD): on the current mesh's `expert` axis
    when it has one (`jax.set_mesh` / `use_abstract_mesh`), else on one device's view (XLA
    partitions it like any other op)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.shape[EXPERT_AXIS] == 1:
        return _grouped_mlp(x_MD, ids_Mk, w_Mk, gate_EDF, up_EDF, down_EFD, cfg.activation)
    return _expert_parallel(mesh, x_MD, ids_Mk, w_Mk, gate_EDF, up_EDF, down_EFD, cfg.activation)


def _grouped_mlp(x_MD, ids_Mk, w_Mk, gate_GDF, up_GDF, down_GFD, activation: str):
    """The experts of `ids_Mk` (in [0, G]; G, past the last expert, computes nothing) as three
    grouped matmuls (`lax.ragged_dot`) over the routed rows sorted by expert."""
    M, k = ids_Mk.shape
    G = gate_GDF.shape[0]
    flat_R = ids_Mk.reshape(M * k)
    order_R = jnp.argsort(flat_R, stable=True)
    sizes_G = jnp.zeros(G, jnp.int32).at[flat_R].add(1, mode="drop")
    x_RD = jnp.take(x_MD, order_R // k, axis=0)
    g_RF = jax.lax.ragged_dot(x_RD, gate_GDF, sizes_G)
    u_RF = jax.lax.ragged_dot(x_RD, up_GDF, sizes_G)
    h_RF = (jax.nn.silu(g_RF) if activation == "silu" else jax.nn.gelu(g_RF, True)) * u_RF
    y_RD = jax.lax.ragged_dot(h_RF, down_GFD, sizes_G)
    # Rows past the groups (id G) are left to the implementation: made 0 here.
    y_RD = jnp.where((jnp.arange(M * k) < jnp.sum(sizes_G))[:, None], y_RD, 0)
    unsort_R = jnp.zeros(M * k, jnp.int32).at[order_R].set(jnp.arange(M * k, dtype=jnp.int32))
    y_MkD = jnp.take(y_RD, unsort_R, axis=0).reshape(M, k, -1)
    return jnp.einsum("mkd,mk->md", y_MkD, w_Mk)


def _expert_parallel(mesh, x_MD, ids_Mk, w_Mk, gate_EDF, up_EDF, down_EFD, activation: str):
    """Each device of the expert axis computes its G = E / n experts (`shard_map`).

    The tokens arrive sharded over the batch axes (the expert axis among them, when it
    divides them). Each device gathers its expert group's tokens (all-gather over `expert`),
    runs its own experts on the rows routed to them, and the partial mixtures are summed
    back onto each device's own tokens (reduce-scatter over `expert`). The expert weights
    enter whole on their expert axis (an FSDP-sharded `embed` is gathered, as for any layer).
    """
    n = mesh.shape[EXPERT_AXIS]
    if gate_EDF.shape[0] % n:
        raise ValueError(
            f"an expert axis of {n} devices does not divide {gate_EDF.shape[0]} experts"
        )
    G = gate_EDF.shape[0] // n
    token_axes = sharding.logical_to_spec(("batch",), sharding.TRAIN_RULES, mesh, x_MD.shape)[0]
    token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes or ())
    gathered = EXPERT_AXIS in token_axes
    rows = PartitionSpec(token_axes or None)
    expert = PartitionSpec(EXPERT_AXIS)

    def local(x_MD, ids_Mk, w_Mk, gate_GDF, up_GDF, down_GFD):
        if gathered:
            x_MD, ids_Mk, w_Mk = (
                jax.lax.all_gather(a, EXPERT_AXIS, tiled=True) for a in (x_MD, ids_Mk, w_Mk)
            )
        first = jax.lax.axis_index(EXPERT_AXIS) * G
        mine_Mk = (ids_Mk >= first) & (ids_Mk < first + G)
        local_Mk = jnp.where(mine_Mk, ids_Mk - first, G)
        w_Mk = jnp.where(mine_Mk, w_Mk, 0)
        y_MD = _grouped_mlp(x_MD, local_Mk, w_Mk, gate_GDF, up_GDF, down_GFD, activation)
        if gathered:
            return jax.lax.psum_scatter(y_MD, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y_MD, EXPERT_AXIS)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, expert, expert, expert),
        out_specs=rows,
    )(x_MD, ids_Mk, w_Mk, gate_EDF, up_EDF, down_EFD)


def active_params(cfg: ModelConfig) -> int:
    """Parameters a token's forward pass reads (k of the E experts in each sparse layer)."""
    idle = cfg.num_experts - cfg.experts_per_token
    return cfg.num_params() - len(cfg.moe_layers) * idle * 3 * cfg.d_model * (
        cfg.moe_intermediate_size
    )
