"""The mixture-of-experts MLP (Qwen3-MoE): top-k routing, the experts as one grouped matmul,
expert parallelism over the `expert` mesh axis (two registered dispatches: `all_gather`,
`all_to_all`), the router statistics of the auxiliary losses, and router replay (forced expert
ids). Derivations and figures: docs/model_and_sampling.md.

Dimension letters: B batch, T tokens of a call, D model width, F an expert's MLP width, X the
call's tokens flattened (B * T); lower case for the experts' own (the upper-case letters are
taken, docs/learner.md): e experts, g the experts one device holds (e / the expert axis), c
the experts a token chooses (`experts_per_token`, the k of top-k), r routed rows (X * c), l
sparse layers (`ModelConfig.moe_layers`), n devices of the expert axis, C the capacity of
one (device, expert) pair in the all-to-all dispatch, s send slots (e * C).
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from rlscale import sharding

Array = jax.Array

EXPERT_AXIS = "expert"  # The mesh axis (and the logical axis) that experts shard over.

# `cfg` below is a `ModelConfig`, which imports this module (to check `expert_dispatch`).


class Routing(NamedTuple):
    """What the routers of one forward pass chose, and the sums the auxiliary losses need,
    over the call's real tokens (`valid_BT`), stacked over the sparse layers.

    Attributes:
      expert_ids_lBTc: int32, each token's top-k experts (or the forced ones), best first.
      top_ids_lBTc: int32, each token's top-k experts by this router (the same array as
        `expert_ids_lBTc` unless forced): what replay's routing mismatch compares with.
      counts_le: float32, how many of the real tokens' c choices went to each expert.
      probs_le: float32, the real tokens' router probabilities (softmax over all e), summed.
      z_l: float32, the real tokens' squared router log-partition, logsumexp(logits)^2, summed.
      tokens_l: float32, the real tokens (the same in every layer).
      dropped_l: float32, the real tokens' choices the `all_to_all` dispatch dropped for
        capacity (their expert's output counts 0); 0 under `all_gather`, which drops none.
        None in a `Routing` built by hand.
    """

    expert_ids_lBTc: Array
    top_ids_lBTc: Array
    counts_le: Array
    probs_le: Array
    z_l: Array
    tokens_l: Array
    dropped_l: Array | None = None


def stack(layers: list[Routing]) -> Routing:
    """Layers' `Routing`s (leading dim 1, or none) stacked into [l, ...]."""
    return Routing(*(jnp.concatenate([jnp.atleast_1d(x) for x in xs]) for xs in zip(*layers)))


def load_balancing_loss(routing: Routing) -> Array:
    """e * sum_i f_i * P_i over the e experts (Switch Transformer, Fedus et al. 2021, eq.
    4-6), as Qwen3-MoE trains with it (transformers' `load_balancing_loss_func`): f_i, expert
    i's share of the token choices, and P_i, its mean router probability, each pooled over
    the real tokens of every sparse layer. f sums to c (the experts per token): uniform
    routing gives c."""
    tokens = jnp.maximum(jnp.sum(routing.tokens_l), 1.0)
    f_e = jnp.sum(routing.counts_le, axis=0) / tokens
    p_e = jnp.sum(routing.probs_le, axis=0) / tokens
    return routing.counts_le.shape[-1] * jnp.sum(f_e * p_e)


def z_loss(routing: Routing) -> Array:
    """The router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): the mean over real tokens and
    sparse layers of logsumexp(router logits)^2."""
    return jnp.sum(routing.z_l) / jnp.maximum(jnp.sum(routing.tokens_l), 1.0)


def mesh_problems(cfg, mesh_shape: dict, key: str = "mesh.shape") -> list[str]:
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
    """Qwen3-MoE's sparse MLP: a router over e gated-MLP experts, each token mixing its top c.

    Routing (transformers' `Qwen3MoeTopKRouter`): p = softmax(x W_router) over all e experts
    in float32; the token's experts are the top c of p (or the forced `expert_ids`), weighted
    by their p, renormalised to sum to 1 with `norm_topk_prob`.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, e, F, pd = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size, cfg.weight_dtype
        self.router = _param(rngs, (D, e), ("embed", None), pd, 0, 1)
        ax_in = (EXPERT_AXIS, "embed", "expert_mlp")
        self.gate = _param(rngs, (e, D, F), ax_in, pd, 1, 2, 0)
        self.up = _param(rngs, (e, D, F), ax_in, pd, 1, 2, 0)
        self.down = _param(rngs, (e, F, D), (EXPERT_AXIS, "expert_mlp", "embed"), pd, 1, 2, 0)
        self.cfg = cfg

    def __call__(self, x_BTD, valid_BT, expert_ids_BTc=None):
        """(the experts' mixture [B, T, D], this layer's `Routing`, leading dim 1)."""
        cfg, dt = self.cfg, self.cfg.compute_dtype
        B, T, D = x_BTD.shape
        x_XD = x_BTD.reshape(B * T, D)
        logits_Xe = x_XD.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        probs_Xe = jax.nn.softmax(logits_Xe, axis=-1)
        top_Xc, own_Xc = jax.lax.top_k(probs_Xe, cfg.experts_per_token)
        ids_Xc = own_Xc
        if expert_ids_BTc is not None:  # Router replay: the given experts, this router's weights.
            ids_Xc = expert_ids_BTc.reshape(B * T, -1).astype(jnp.int32)
            top_Xc = jnp.take_along_axis(probs_Xe, ids_Xc, axis=-1)
        if cfg.norm_topk_prob:
            top_Xc = top_Xc / jnp.sum(top_Xc, axis=-1, keepdims=True)
        weights = (self.gate[...], self.up[...], self.down[...])
        valid_X = valid_BT.reshape(B * T).astype(jnp.float32)
        y_XD, dropped = experts(
            x_XD.astype(dt),
            ids_Xc,
            top_Xc.astype(dt),
            valid_X,
            *(w.astype(dt) for w in weights),
            cfg,
        )
        chosen_Xe = jnp.zeros_like(probs_Xe).at[jnp.arange(B * T)[:, None], ids_Xc].add(1.0)
        lse_X = jax.nn.logsumexp(logits_Xe, axis=-1)
        routing = Routing(
            expert_ids_lBTc=ids_Xc.reshape(1, B, T, -1),
            top_ids_lBTc=own_Xc.reshape(1, B, T, -1),
            counts_le=(valid_X @ chosen_Xe)[None],
            probs_le=(valid_X @ probs_Xe)[None],
            z_l=jnp.sum(valid_X * lse_X**2)[None],
            tokens_l=jnp.sum(valid_X)[None],
            dropped_l=dropped[None],
        )
        return y_XD.reshape(B, T, D), routing


def experts(x_XD, ids_Xc, w_Xc, valid_X, gate_eDF, up_eDF, down_eFD, cfg):
    """(sum_j w_Xc[:, j] * expert_{ids_Xc[:, j]}(x_XD), the real tokens' (`valid_X`) choices
    dropped): on the current mesh's `expert` axis when it has one (`jax.set_mesh` /
    `use_abstract_mesh`), by the dispatch `cfg.expert_dispatch` names; else on one device's
    view (XLA partitions it like any other op), dropping nothing."""
    mesh = jax.sharding.get_abstract_mesh()
    weights = (gate_eDF, up_eDF, down_eFD)
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.shape[EXPERT_AXIS] == 1:
        return _grouped_mlp(x_XD, ids_Xc, w_Xc, *weights, cfg.activation), jnp.float32(0)
    n = mesh.shape[EXPERT_AXIS]
    if gate_eDF.shape[0] % n:
        raise ValueError(
            f"an expert axis of {n} devices does not divide {gate_eDF.shape[0]} experts"
        )
    with jax.named_scope(f"expert_dispatch_{cfg.expert_dispatch}"):  # `planning.hlo` reads it.
        return _DISPATCHES[cfg.expert_dispatch](mesh, x_XD, ids_Xc, w_Xc, valid_X, *weights, cfg)


# ------------------------------------------------------------------------------------------
# Expert-parallel dispatches: `model.expert_dispatch` names one.
# ------------------------------------------------------------------------------------------

Dispatch = Callable[..., tuple[Array, Array]]
_DISPATCHES: dict[str, Dispatch] = {}


def register(name: str) -> Callable[[Dispatch], Dispatch]:
    """Registers an expert-parallel dispatch: `fn(mesh, x_XD, ids_Xc, w_Xc, valid_X, gate_eDF,
    up_eDF, down_eFD, cfg) -> (y_XD, dropped)`, run inside `experts` on a mesh whose expert
    axis divides the experts."""

    def add(fn: Dispatch) -> Dispatch:
        if name in _DISPATCHES:
            raise ValueError(f"expert dispatch {name!r} is already registered")
        _DISPATCHES[name] = fn
        return fn

    return add


def dispatch_names() -> tuple[str, ...]:
    return tuple(_DISPATCHES)


def dispatch_problems(name, capacity_factor) -> list[str]:
    """`model.expert_dispatch` and `model.expert_capacity_factor`, checked (`ModelConfig`)."""
    problems = []
    if name not in _DISPATCHES:
        problems.append(f"expert_dispatch={name!r} is not one of {dispatch_names()}")
    if not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        problems.append(f"expert_capacity_factor={capacity_factor!r} must be a number > 0")
    return problems


def _token_axes(mesh, X: int) -> tuple[str, ...]:
    """The mesh axes the X tokens are split over (the batch axes that divide them)."""
    axes = sharding.logical_to_spec(("batch",), sharding.TRAIN_RULES, mesh, (X,))[0]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _activate(g, activation: str):
    return jax.nn.silu(g) if activation == "silu" else jax.nn.gelu(g, True)


def _grouped_mlp(x_XD, ids_Xc, w_Xc, gate_gDF, up_gDF, down_gFD, activation: str):
    """The experts of `ids_Xc` (in [0, g]; g, past the last expert, computes nothing) as three
    grouped matmuls (`lax.ragged_dot`) over the routed rows sorted by expert."""
    X, c = ids_Xc.shape
    g = gate_gDF.shape[0]
    flat_r = ids_Xc.reshape(X * c)
    order_r = jnp.argsort(flat_r, stable=True)
    sizes_g = jnp.zeros(g, jnp.int32).at[flat_r].add(1, mode="drop")
    x_rD = jnp.take(x_XD, order_r // c, axis=0)
    g_rF = jax.lax.ragged_dot(x_rD, gate_gDF, sizes_g)
    u_rF = jax.lax.ragged_dot(x_rD, up_gDF, sizes_g)
    h_rF = _activate(g_rF, activation) * u_rF
    y_rD = jax.lax.ragged_dot(h_rF, down_gFD, sizes_g)
    # Rows past the groups (id g) are left to the implementation: made 0 here.
    y_rD = jnp.where((jnp.arange(X * c) < jnp.sum(sizes_g))[:, None], y_rD, 0)
    unsort_r = jnp.zeros(X * c, jnp.int32).at[order_r].set(jnp.arange(X * c, dtype=jnp.int32))
    y_XcD = jnp.take(y_rD, unsort_r, axis=0).reshape(X, c, -1)
    return jnp.einsum("xcd,xc->xd", y_XcD, w_Xc)


@register("all_gather")
def _all_gather(mesh, x_XD, ids_Xc, w_Xc, valid_X, gate_eDF, up_eDF, down_eFD, cfg):
    """Each device of the expert axis computes its g = e / n experts (`shard_map`), dropping
    nothing.

    The tokens arrive sharded over the batch axes (the expert axis among them, when it
    divides them). Each device gathers its expert group's tokens (all-gather over `expert`),
    runs its own experts on the rows routed to them, and the partial mixtures are summed
    back onto each device's own tokens (reduce-scatter over `expert`). The expert weights
    enter whole on their expert axis (an FSDP-sharded `embed` is gathered, as for any layer).
    """
    g = gate_eDF.shape[0] // mesh.shape[EXPERT_AXIS]
    token_axes = _token_axes(mesh, x_XD.shape[0])
    gathered = EXPERT_AXIS in token_axes
    rows = PartitionSpec(token_axes or None)
    expert = PartitionSpec(EXPERT_AXIS)

    def local(x_XD, ids_Xc, w_Xc, gate_gDF, up_gDF, down_gFD):
        if gathered:
            x_XD, ids_Xc, w_Xc = (
                jax.lax.all_gather(a, EXPERT_AXIS, tiled=True) for a in (x_XD, ids_Xc, w_Xc)
            )
        first = jax.lax.axis_index(EXPERT_AXIS) * g
        mine_Xc = (ids_Xc >= first) & (ids_Xc < first + g)
        local_Xc = jnp.where(mine_Xc, ids_Xc - first, g)
        w_Xc = jnp.where(mine_Xc, w_Xc, 0)
        y_XD = _grouped_mlp(x_XD, local_Xc, w_Xc, gate_gDF, up_gDF, down_gFD, cfg.activation)
        if gathered:
            return jax.lax.psum_scatter(y_XD, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y_XD, EXPERT_AXIS)

    y_XD = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, expert, expert, expert),
        out_specs=rows,
    )(x_XD, ids_Xc, w_Xc, gate_eDF, up_eDF, down_eFD)
    return y_XD, jnp.float32(0)


def capacity(tokens: int, cfg) -> int:
    """C, the routed rows one device sends one expert in the all-to-all dispatch: the
    capacity factor times an even share of its `tokens` x c choices over the e experts, at
    least 1 and at most `tokens` (a token chooses an expert once: C = tokens drops nothing,
    which a factor of e / c gives)."""
    even = tokens * cfg.experts_per_token / cfg.num_experts
    return max(1, min(tokens, math.ceil(cfg.expert_capacity_factor * even)))


def _slots(ids_Xc, e: int, C: int):
    """(slot_r, kept_r): each routed row's place in a send buffer of e x C rows (expert-major;
    a row's rank among the earlier rows of its expert, in token then choice order), and
    whether it fits its expert's C; a dropped row's slot is e * C, past the buffer."""
    flat_r = ids_Xc.reshape(-1)
    r = flat_r.shape[0]
    order_r = jnp.argsort(flat_r, stable=True)
    sizes_e = jnp.zeros(e, jnp.int32).at[flat_r].add(1)
    starts_e = jnp.cumsum(sizes_e) - sizes_e
    ranked_r = jnp.arange(r, dtype=jnp.int32) - starts_e[flat_r[order_r]]
    rank_r = jnp.zeros(r, jnp.int32).at[order_r].set(ranked_r)
    kept_r = rank_r < C
    return jnp.where(kept_r, flat_r * C + rank_r, e * C), kept_r


@register("all_to_all")
def _all_to_all(mesh, x_XD, ids_Xc, w_Xc, valid_X, gate_eDF, up_eDF, down_eFD, cfg):
    """Each token's rows go to the devices that hold their experts and come back (GShard,
    Lepikhin et al. 2020): `jax.lax.all_to_all` over `expert` of fixed-size buffers.

    Each device places its own tokens' routed rows in a send buffer of C rows per expert
    (`capacity`; the rows past an expert's C are dropped: their output counts 0, and the
    real tokens' dropped choices are counted), sends each device the rows of its g experts
    (all-to-all), runs its experts as batched matmuls over the n x C rows each received
    (empty slots are zeros and give zeros), and returns the results (all-to-all) to be
    mixed on the tokens' own device. The capacity, not the routing, fixes every shape and
    the FLOPs: e x C rows per device. A batch the expert axis does not divide (a decode step:
    the tokens replicated over it) has nothing to exchange: `all_gather`'s sum (psum).
    """
    n, e, D = mesh.shape[EXPERT_AXIS], gate_eDF.shape[0], x_XD.shape[1]
    g = e // n
    token_axes = _token_axes(mesh, x_XD.shape[0])
    if EXPERT_AXIS not in token_axes:
        return _all_gather(mesh, x_XD, ids_Xc, w_Xc, valid_X, gate_eDF, up_eDF, down_eFD, cfg)
    rows = PartitionSpec(token_axes)
    expert = PartitionSpec(EXPERT_AXIS)

    def local(x_XD, ids_Xc, w_Xc, valid_X, gate_gDF, up_gDF, down_gFD):
        X, c = ids_Xc.shape
        C = capacity(X, cfg)
        slot_r, kept_r = _slots(ids_Xc, e, C)
        x_rD = jnp.repeat(x_XD, c, axis=0)
        send_sD = jnp.zeros((e * C, D), x_XD.dtype).at[slot_r].set(x_rD, mode="drop")
        # [n devices, g experts x C] out; [n sources, g x C] in.
        got = jax.lax.all_to_all(send_sD.reshape(n, g * C, D), EXPERT_AXIS, 0, 0, tiled=True)
        h_gkD = got.reshape(n, g, C, D).transpose(1, 0, 2, 3).reshape(g, n * C, D)
        u_gkF = jnp.einsum("gkd,gdf->gkf", h_gkD, up_gDF)
        a_gkF = _activate(jnp.einsum("gkd,gdf->gkf", h_gkD, gate_gDF), cfg.activation)
        y_gkD = jnp.einsum("gkf,gfd->gkd", a_gkF * u_gkF, down_gFD)
        y_sD = y_gkD.reshape(g, n, C, D).transpose(1, 0, 2, 3).reshape(n, g * C, D)
        back_sD = jax.lax.all_to_all(y_sD, EXPERT_AXIS, 0, 0, tiled=True).reshape(e * C, D)
        y_rD = jnp.take(back_sD, slot_r, axis=0, mode="fill", fill_value=0)
        y_XD = jnp.einsum("xcd,xc->xd", y_rD.reshape(X, c, D), w_Xc)
        dropped = jnp.sum(jnp.where(kept_r.reshape(X, c), 0.0, valid_X[:, None]))
        return y_XD, dropped[None]

    y_XD, dropped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, rows, expert, expert, expert),
        out_specs=(rows, rows),
    )(x_XD, ids_Xc, w_Xc, valid_X, gate_eDF, up_eDF, down_eFD)
    return y_XD, jnp.sum(dropped)


def active_params(cfg) -> int:
    """Parameters a token's forward pass reads (c of the e experts in each sparse layer)."""
    idle = cfg.num_experts - cfg.experts_per_token
    return cfg.num_params() - len(cfg.moe_layers) * idle * 3 * cfg.d_model * (
        cfg.moe_intermediate_size
    )
