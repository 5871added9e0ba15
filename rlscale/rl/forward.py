"""The per-token terms of a forward pass over sampled rows, as the learner, the reference and
a distillation teacher compute them: `logp` of each completion token under the sampler's
logits transform, `entropy` and `value`, from packed forward rows built on the device
(`packed_micro`, from `batch_layout.plan`), the vocabulary-sized terms in chunks
(`vocab_token_terms`); `no_grad_terms` runs such passes over a batch's micro-batches.
`decoder.ForwardSpec` is what such a pass is compiled for.

Dimension letters: N rows, L tokens of a batch row, P prompt tokens of a batch row (L - M), M
completion length, O optimizer steps, R forward rows and T tokens per forward row, d batch
shards, X tokens per batch shard, Y chunks of them and k tokens per chunk
(`vocab_token_terms`), V vocab, D model width.
"""

import jax
import jax.numpy as jnp

from rlscale import sharding
from rlscale.model import decoder, moe
from rlscale.model.decoder import ForwardSpec
from rlscale.sampling import transform_logits


def token_terms(spec: ForwardSpec, params, value_params, fwd, terms):
    """Per completion token, under the sampler's logits transform: `logp` of the taken token,
    `entropy`, and `value` (of the state before the token), [N, M] each. Computes only
    `terms`. A mixture-of-experts policy adds its routers' auxiliary losses over the forward
    rows' real tokens, `moe_lb` and `moe_z` (scalars; `objectives.moe_aux` reads them).

    `fwd` is a micro-batch's forward rows (`packed_micro`), with `targets` at every position:
    the terms are computed at every position of the rows, then each completion token's is
    gathered into its batch row (0s and garbage for rows outside the micro-batch).

    Router replay: with the generator's recorded routing (`fwd["experts"]`, [l, R, T, c]) a
    mixture of experts routes each token to the recorded experts where
    `spec.router_replay`, and adds `routing_mismatch`, [N, M]: at the position predicting
    each completion token, the share of its l x c (layer, choice) slots whose recorded expert
    is not among this router's own top c (the routing that computed its logprob).
    """
    recorded_lRTc = fwd.get("experts")
    h_RTD, _, routing = decoder.routed_hidden(
        spec.graphdef,
        params,
        fwd["tokens"],
        fwd["positions"],
        None,
        segments_BT=fwd["segments"],
        remat=spec.remat,
        expert_ids_lBTc=recorded_lRTc if spec.router_replay else None,
        mesh=spec.mesh,
        prefixes_BT=fwd.get("prefixes"),
    )
    R, T, _ = h_RTD.shape
    d = sharding.batch_divisor(spec.mesh, sharding.TRAIN_RULES)
    out = {}
    vocab_terms = tuple(t for t in ("logp", "entropy") if t in terms)
    if vocab_terms:
        out.update(
            vocab_token_terms(
                spec.graphdef,
                params,
                h_RTD,
                fwd["targets"],
                spec.logits_cfg,
                vocab_terms,
                spec.chunk,
                shards=d,
                mesh=spec.mesh,
            )
        )
    if "value" in terms:
        out["value"] = h_RTD.astype(jnp.float32) @ value_params["w"] + value_params["b"]
    if routing is not None and recorded_lRTc is not None:
        out["routing_mismatch"] = routing_mismatch(recorded_lRTc, routing.top_ids_lBTc)
    # From the forward rows' positions to the batch rows' tokens.
    N, M = fwd["gather"].shape
    index_dX = rows_sharded(fwd["gather"].reshape(d, N // d * M), spec.mesh)
    take = jax.vmap(jnp.take)
    out = {
        k: take(rows_sharded(v.reshape(d, R // d * T), spec.mesh), index_dX).reshape(N, M)
        for k, v in out.items()
    }
    if routing is not None:  # A mixture of experts: its auxiliary losses over the rows' tokens.
        out.update(moe_lb=moe.load_balancing_loss(routing), moe_z=moe.z_loss(routing))
    return out


def routing_mismatch(recorded_lBTc, own_lBTc):
    """[B, T] float32: the share of each token's l x c recorded experts that are not among
    its own top c (a set: the order of the choices does not matter)."""
    slots = recorded_lBTc.shape[0] * recorded_lBTc.shape[-1]
    hit = recorded_lBTc.astype(jnp.int32)[..., :, None] == own_lBTc[..., None, :]
    missed_lBTc = ~jnp.any(hit, axis=-1)
    return jnp.sum(missed_lBTc, axis=(0, 3)).astype(jnp.float32) / slots


def no_grad_terms(spec: ForwardSpec, params, value_params, batch, place, count, terms):
    """`terms` ([N, M] each, 0 for rows never placed) with `params`, no gradient, over the
    micro-batches of O optimizer steps (`place`: [O, N] arrays of `batch_layout.pack`;
    `count`: [O], the micro-batches of each), a `fori_loop` over each step's. A row placed in
    several steps gets the terms of the last."""
    N, M = batch["mask"].shape
    init = {t: rows_sharded(jnp.zeros((N, M), jnp.float32), spec.mesh) for t in terms}

    def step(acc, x):
        step_place, step_count = x

        def micro(u, acc):
            fwd, in_N = packed_micro(spec, batch, step_place, u)
            out = token_terms(spec, params, value_params, fwd, terms)
            return {k: merge(acc[k], out[k], in_N, spec.mesh) for k in acc}

        return jax.lax.fori_loop(0, step_count, micro, acc), None

    return jax.lax.scan(step, init, (place, count))[0]


def merge(acc_NM, terms_NM, in_N, mesh):
    """`acc_NM` with the rows `in_N` of a micro-batch's terms written in."""
    return rows_sharded(jnp.where(in_N[:, None], terms_NM, acc_NM), mesh)


def packed_micro(spec: ForwardSpec, batch, place, u):
    """Micro-batch `u` of an optimizer step, packed on the device from the batch's rows
    (`batch["tokens"]`, `batch["attn"]`: [N, L], completions in the last M) by the step's
    `place` (`batch_layout.pack`, [N] each): each batch shard writes its rows' sequences into
    its own `pack_rows` rows (a scatter, no communication).

    Returns (fwd, in_N): the forward rows `tokens`, `positions`, `segments` (0 on padding,
    else the sequence's row within its shard plus 1) and `targets` (the next token where it
    is a completion token), [d * pack_rows, pack_length] each; `gather` [N, M], the flat
    index within row r's shard of the packed rows of the position predicting its completion
    token m; and `in_N`, the rows in the micro-batch. With the batch's recorded routing
    (`batch["experts"]`, [N, L, l, c]), `experts`: [l, d * pack_rows, pack_length, c], each
    token's where the token goes. With `spec.shared_prefix` (`place` from `pack` with
    `prefix_N`), also `prefixes`: the prefix id each token sees besides its segment
    (`_shared_rows`).
    """
    tokens_NL, attn_NL = batch["tokens"], batch["attn"]
    N, L = tokens_NL.shape
    M = batch["mask"].shape[1]
    P = L - M
    d = sharding.batch_divisor(spec.mesh, sharding.TRAIN_RULES)
    T, c = spec.pack_length, spec.pack_rows
    in_N = place["micro"] == u
    start_N = place["row"] * T + place["offset"]
    pos_NL = jnp.maximum(jnp.cumsum(attn_NL, axis=1) - 1, 0)
    prompt_N = jnp.sum(attn_NL[:, :P], axis=1)
    segment_N = jnp.arange(N) % (N // d) + 1
    if spec.shared_prefix:
        dest_NL, segments_NL, prefixes_NL = _shared_rows(place, pos_NL, segment_N, N // d, T, c * T)
        start_N = start_N - place["shared"]  # Where its prompt's first token would be.
    else:
        dest_NL = start_N[:, None] + pos_NL
        segments_NL = jnp.broadcast_to(segment_N[:, None], (N, L))
    dest_NL = jnp.where(attn_NL & in_N[:, None], dest_NL, c * T)
    gather_NM = jnp.minimum(start_N[:, None] + prompt_N[:, None] - 1 + jnp.arange(M), c * T - 1)
    into_NM = jnp.where(attn_NL[:, P:] & in_N[:, None], gather_NM, c * T)

    def scatter(dest, values):  # Per batch shard: [N / d, L, ...] values -> [c * T, ...].
        rest = values.shape[2:]
        dest = rows_sharded(dest.reshape(d, -1), spec.mesh)
        values = rows_sharded(values.reshape(d, -1, *rest), spec.mesh)
        rows = jax.vmap(lambda i, v: jnp.zeros((c * T, *rest), jnp.int32).at[i].set(v, mode="drop"))
        out = rows_sharded(rows(dest, values.astype(jnp.int32)), spec.mesh)
        return out.reshape(d * c, T, *rest)

    fwd = {
        "tokens": scatter(dest_NL, tokens_NL),
        "positions": scatter(dest_NL, pos_NL),
        "segments": scatter(dest_NL, segments_NL),
        "targets": scatter(into_NM, tokens_NL[:, P:]),  # At the position predicting each.
        "gather": gather_NM,
    }
    if spec.shared_prefix:
        fwd["prefixes"] = scatter(dest_NL, prefixes_NL)
    if "experts" in batch:  # A mixture of experts' recorded routing: [l, rows, T, c].
        fwd["experts"] = jnp.moveaxis(scatter(dest_NL, batch["experts"]), 2, 0)
    return fwd, in_N


def _shared_rows(place, pos_NL, segment_N, rows: int, T: int, drop: int):
    """Where the tokens of shared-prefix rows go (`packed_micro` with `spec.shared_prefix`),
    before the micro-batch's and the padding's are dropped: (dest_NL, segments_NL,
    prefixes_NL); `rows` per batch shard, T tokens per packed row, `drop` a destination the
    scatter drops.

    A row's first `place["shared"]` real tokens (its prompt but the last) are its group's
    prefix: its lead (`place["lead"]`) writes them at `place["prefix"]`, the others nowhere;
    its own tokens go from `place["offset"]` on, positions continuing the prompt's. The own
    tokens are segment `segment_N` (the row within its shard, plus 1) and see prefix id
    lead's row + `rows` + 1, the segment of the prefix tokens (which see only themselves):
    a completion sees its prompt and its own earlier tokens, never another completion's.
    Where nothing is shared the prefix id is the row's own segment (the plain mask).
    """
    N = segment_N.shape[0]
    shared_N, lead_N = place["shared"][:, None], place["lead"]
    own_NL = pos_NL >= shared_N
    lead_NL = (lead_N == jnp.arange(N))[:, None]
    head_N = place["row"] * T + place["prefix"]
    start_N = place["row"] * T + place["offset"]
    dest_NL = jnp.where(
        own_NL,
        start_N[:, None] + pos_NL - shared_N,
        jnp.where(lead_NL, head_N[:, None] + pos_NL, drop),
    )
    prefix_N = lead_N % rows + rows + 1
    segments_NL = jnp.where(own_NL, segment_N[:, None], prefix_N[:, None])
    prefixes_NL = jnp.where(shared_N > 0, prefix_N[:, None], segment_N[:, None])
    return dest_NL, segments_NL, jnp.broadcast_to(prefixes_NL, pos_NL.shape)


def vocab_token_terms(
    graphdef, params, h_nMD, targets_nM, logits_cfg, terms, chunk: int = 0, shards: int = 1,
    mesh=None,
):  # fmt: skip
    """`logp` of each target token and the policy's `entropy`, from the final hidden states
    under the sampler's logits transform, `chunk` tokens per batch shard at a time.

    Unchunked (`chunk=0`) the [n, M, V] float32 log-probabilities exist at once, and the
    backward pass keeps its own copy: at a real vocabulary (152k for Qwen2.5) and long
    completions that is most of a device's memory. Chunked, each of the `shards` batch shards
    flattens its tokens, and a `lax.map` runs the LM head over `chunk` of them (per shard) at
    a time; `jax.checkpoint` makes the backward pass recompute each chunk's logits instead of
    saving them, so the vocabulary-sized temporaries per device are [chunk, V]. Values and
    gradients are the unchunked ones (the tokens are padded to whole chunks and the padding
    cut off). On `mesh` the chunks keep their shard axis on the batch's mesh axes: left to
    XLA's propagation through the reshapes, an fsdp mesh computed every shard's chunk on
    each device (the update's temporaries grew 10.4 MiB per chunk token at qwen2.5_0.5b's
    152k vocabulary on 8 devices, against 2.0 on one).
    """

    def terms_of(h_XD, t_X):
        logits = transform_logits(decoder.logits(graphdef, params, h_XD), logits_cfg)
        logp_all = jax.nn.log_softmax(logits)
        out = {}
        if "logp" in terms:
            out["logp"] = jnp.take_along_axis(logp_all, t_X[..., None], axis=-1)[..., 0]
        if "entropy" in terms:
            out["entropy"] = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return out

    n, M, D = h_nMD.shape
    X = n // shards * M  # Tokens per batch shard.
    if not chunk or chunk >= X:
        return terms_of(h_nMD, targets_nM)
    Y = -(-X // chunk)
    pad = Y * chunk - X
    h_dXD = jnp.pad(h_nMD.reshape(shards, X, D), ((0, 0), (0, pad), (0, 0)))
    t_dX = jnp.pad(targets_nM.reshape(shards, X), ((0, 0), (0, pad)))
    h_YdkD = _shard_axis(h_dXD.reshape(shards, Y, chunk, D).swapaxes(0, 1), mesh)
    t_Ydk = _shard_axis(t_dX.reshape(shards, Y, chunk).swapaxes(0, 1), mesh)

    def one(xs):
        h_dkD, t_dk = (_shard_axis(x, mesh, 0) for x in xs)
        return jax.checkpoint(terms_of)(h_dkD, t_dk)

    out_Ydk = jax.lax.map(one, (h_YdkD, t_Ydk))
    return {
        k: v.swapaxes(0, 1).reshape(shards, Y * chunk)[:, :X].reshape(n, M)
        for k, v in out_Ydk.items()
    }


def _shard_axis(x, mesh, axis: int = 1):
    """`x` with dimension `axis` on the batch's mesh axes (`TRAIN_RULES`), the rest
    replicated; as it is without a mesh."""
    if mesh is None:
        return x
    axes = [None] * x.ndim
    axes[axis] = "batch"
    spec = sharding.logical_to_spec(axes, sharding.TRAIN_RULES, mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def rows_sharded(x, mesh):
    return jax.lax.with_sharding_constraint(
        x, sharding.batch_sharding(mesh, x.ndim, sharding.TRAIN_RULES)
    )
