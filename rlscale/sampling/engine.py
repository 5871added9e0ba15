"""The generator engine's device side: continuous batching over fixed decode slots, each
owning its row of one preallocated KV cache (its own write position: a prompt at columns
[0, P), then one column per token), with weights that can change between decode calls (each
token records its version): its state and module-level jitted programs; the host `Generator`
that drives them is in `sampling.generator`. See docs/model_and_sampling.md.

A slot is live (decodes) while its sample is neither finished nor waiting: a sample waits
once its tokens of the current turn end with one of `SamplingConfig.action_stops`, until the
environment's reply arrives.

Dimension letters: S slots, C cache columns, M max new tokens, V vocab, R rows of one prefill call,
P their padded prompt length, G samples per request, N = R x G.
"""

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from rlscale import sharding
from rlscale.model import decoder
from rlscale.model.config import ModelConfig
from rlscale.sampling.sampler import (
    SamplingConfig,
    _constrain,
    decode_step,
    empty_rows,
)


class EngineState(NamedTuple):
    """Everything on the device; rows are slots.

    `limit_S` is each slot's token budget (0 for an empty slot, so it counts as finished);
    `last_S` the last token run through the model (re-run under new weights); `waiting_S`
    which samples stopped at an action; `turn_S` the completion column where each sample's
    current turn began; `version` the policy version of the current params."""

    cache: decoder.KVCache
    logits_SV: jax.Array
    pos_S: jax.Array
    key_S: jax.Array
    limit_S: jax.Array
    last_S: jax.Array
    version_SM: jax.Array
    waiting_S: jax.Array
    turn_S: jax.Array
    rows: dict  # `sampler.empty_rows` fields, N = S.
    version: jax.Array


def finished(state: EngineState):
    """Each slot's sample is done: stopped, or its token budget spent (an empty slot too)."""
    return state.rows["done_N"] | (state.rows["length_N"] >= state.limit_S)


def live(state: EngineState):
    """The slots that decode: their samples neither finished nor waiting for a reply."""
    return ~finished(state) & ~state.waiting_S


def action_stopped(tokens_SM, length_S, turn_S, action_stops):
    """[S] whether each sample's tokens of its current turn (columns turn_S .. length_S - 1)
    end with one of the `action_stops` sequences: the last W = the longest's length columns
    compared with every sequence, right-aligned."""
    W = max(map(len, action_stops))
    stops_AW = np.full((len(action_stops), W), -1, np.int32)
    for a, seq in enumerate(action_stops):
        stops_AW[a, W - len(seq) :] = seq
    cols_SW = length_S[:, None] - W + jnp.arange(W)
    tokens_SW = jnp.take_along_axis(tokens_SM, jnp.clip(cols_SW, 0, tokens_SM.shape[1] - 1), 1)
    hit_SAW = (tokens_SW[:, None] == stops_AW) & (cols_SW >= turn_S[:, None])[:, None]
    return jnp.any(jnp.all(hit_SAW | (stops_AW < 0), axis=-1), axis=-1)


def _state_axes(model_cfg: ModelConfig, state: EngineState):
    batch = lambda x: ("batch",) + (None,) * (x.ndim - 1)  # noqa: E731
    axes = jax.tree.map(batch, state._replace(cache=None, version=None))
    return axes._replace(cache=decoder.cache_logical_axes(model_cfg), version=())


@functools.partial(jax.jit, static_argnames=("model_cfg", "cfg", "slots", "columns", "layout"))
def init_state(*, model_cfg, cfg: SamplingConfig, slots: int, columns: int, layout):
    S, M = slots, cfg.max_new_tokens
    state = EngineState(
        cache=decoder.init_cache(model_cfg, S, columns),
        logits_SV=jnp.zeros((S, model_cfg.vocab_size), jnp.float32),
        pos_S=jnp.zeros((S,), jnp.int32),
        key_S=jax.random.split(jax.random.key(0), S),
        limit_S=jnp.zeros((S,), jnp.int32),
        last_S=jnp.zeros((S,), jnp.int32),
        version_SM=jnp.zeros((S, M), jnp.int32),
        waiting_S=jnp.zeros((S,), bool),
        turn_S=jnp.zeros((S,), jnp.int32),
        rows=empty_rows(S, M, cfg.pad_id),
        version=jnp.zeros((), jnp.int32),
    )
    return _constrain(state, _state_axes(model_cfg, state), layout)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "model_cfg", "cfg", "layout"), donate_argnums=(1,)
)
def insert(
    params,
    state,
    tokens_RP,
    mask_RP,
    slot_RG,
    keydata_R,
    limit_RG,
    *,
    graphdef,
    model_cfg,
    cfg,
    layout,
):
    """Prefills R left-padded prompts once and writes sample g of row r into slot
    `slot_RG[r, g]` (an index >= S writes nothing: a padding row, or a sample another row
    places), its prompt at the slot's columns [0, P). `keydata_R` holds the rows' request keys as
    `jax.random.key_data`; sample g draws with fold_in(key, g).

    On a mesh the rows split over the batch axes as the slots do, and every slot of a row
    lies in its own shard (`prefill_rows` lays them out so): each device prefills its rows
    only and writes them into its own slots (`_place`, under `shard_map`)."""
    R, P = tokens_RP.shape
    positions_RP = decoder.positions_from_mask(mask_RP)
    cache_axes = decoder.cache_logical_axes(model_cfg)
    cache = _constrain(decoder.init_cache(model_cfg, R, P), cache_axes, layout)
    h, prompt = decoder.hidden(graphdef, params, tokens_RP, positions_RP, mask_RP, cache)
    new = {
        "k": prompt.k,
        "v": prompt.v,
        "mask_RP": mask_RP,
        "logits_RV": decoder.logits(graphdef, params, h[:, -1:])[:, 0].astype(jnp.float32),
        "pos_R": positions_RP[:, -1] + 1,
        "last_R": tokens_RP[:, -1],
        "key_R": jax.random.wrap_key_data(keydata_R),
    }
    place = functools.partial(_place, cfg=cfg)
    if layout is None:
        return place(state, new, slot_RG, limit_RG, first_slot=0)
    specs = jax.tree.map(
        lambda s: s.spec,
        sharding.tree_shardings(state, _state_axes(model_cfg, state), layout.mesh, layout.rules),
    )
    batch = specs.limit_S[0]  # The mesh axes the slots split over (None: not split).
    new_specs = {
        "k": specs.cache.k,
        "v": specs.cache.v,
        "mask_RP": specs.cache.valid_BS,
        "logits_RV": specs.logits_SV,
        "pos_R": specs.pos_S,
        "last_R": specs.last_S,
        "key_R": specs.key_S,
    }

    def local(state, new, slot_RG, limit_RG):
        S = state.limit_S.shape[0]
        first = 0 if batch is None else jax.lax.axis_index(batch) * S
        return place(state, new, slot_RG, limit_RG, first_slot=first)

    rows = PartitionSpec(batch, None)
    return jax.shard_map(
        local, mesh=layout.mesh, in_specs=(specs, new_specs, rows, rows), out_specs=specs
    )(state, new, slot_RG, limit_RG)


def _place(state: EngineState, new: dict, slot_RG, limit_RG, *, cfg, first_slot) -> EngineState:
    """Writes R prefilled rows (`insert`'s `new`) into the slots of `state`, which may be one
    shard's: its slot i is slot `first_slot` + i of the engine; a slot outside it writes
    nothing.

    A new slot gets the prompt's KV at columns [0, P), its write index P, and a validity row
    that is False everywhere else. Its other KV columns keep what an earlier sequence wrote
    there: attention gives a column that is not valid a weight of exactly 0 (its score is
    the float32 minimum), so those finite values add exactly 0, and no full-width row is
    built per layer."""
    S = state.limit_S.shape[0]
    C = state.cache.valid_BS.shape[1]
    R, G = slot_RG.shape
    P = new["mask_RP"].shape[1]
    local_N = slot_RG.reshape(-1) - first_slot
    slot_N = jnp.where((local_N >= 0) & (local_N < S), local_N, S)
    tile = functools.partial(jnp.repeat, repeats=G, axis=0)

    def put(x, update):
        return x.at[slot_N].set(update, mode="drop")

    # The prompt's columns [0, P) of the new slots.
    k = tuple(
        buf.at[slot_N, :, :, :P].set(tile(part).astype(buf.dtype), mode="drop")
        for buf, part in zip(state.cache.k, new["k"])
    )
    v = tuple(
        buf.at[slot_N, :, :P].set(tile(part).astype(buf.dtype), mode="drop")
        for buf, part in zip(state.cache.v, new["v"])
    )
    valid_NC = jnp.zeros((R * G, C), bool).at[:, :P].set(tile(new["mask_RP"]))
    keys_N = jax.vmap(jax.random.fold_in)(tile(new["key_R"]), jnp.tile(jnp.arange(G), R))
    fresh = empty_rows(R * G, cfg.max_new_tokens, cfg.pad_id)
    return state._replace(
        cache=state.cache._replace(
            k=k,
            v=v,
            valid_BS=put(state.cache.valid_BS, valid_NC),
            index_B=put(state.cache.index_B, jnp.full((R * G,), P, jnp.int32)),
        ),
        logits_SV=put(state.logits_SV, tile(new["logits_RV"])),
        pos_S=put(state.pos_S, tile(new["pos_R"])),
        key_S=put(state.key_S, keys_N),
        limit_S=put(state.limit_S, limit_RG.reshape(-1)),
        last_S=put(state.last_S, tile(new["last_R"])),
        version_SM=put(state.version_SM, jnp.zeros_like(fresh["tokens_NM"])),
        waiting_S=put(state.waiting_S, jnp.zeros((R * G,), bool)),
        turn_S=put(state.turn_S, jnp.zeros((R * G,), jnp.int32)),
        rows={name: put(x, fresh[name]) for name, x in state.rows.items()},
    )


@functools.partial(
    jax.jit, static_argnames=("graphdef", "model_cfg", "cfg", "layout"), donate_argnums=(1,)
)
def decode(params, state, steps, wanted, *, graphdef, model_cfg, cfg, layout):
    """Advances every live slot by up to `steps` tokens; returns (state, steps run, tokens
    generated). Stops early when no slot is live, or once `wanted` slots have finished in
    this call (a waiting request needs them; 0: never), so it starts without waiting out the
    call. A slot whose tokens of this turn end with an action stop stops advancing and waits;
    the others go on."""
    C = state.cache.valid_BS.shape[1]
    S, M = state.limit_S.shape[0], cfg.max_new_tokens
    live0_S = ~finished(state)

    def cond(c):
        finished_S = finished(c[0])
        freed = (wanted > 0) & (jnp.sum(live0_S & finished_S) >= wanted)
        return (c[1] < steps) & jnp.any(live(c[0])) & ~freed

    def body(c):
        s, j, n = c
        live_S = live(s)
        index_S = s.cache.index_B
        cache = s.cache._replace(index_B=jnp.where(live_S, index_S, C))  # C: writes nothing.
        carry = {"logits_NV": s.logits_SV, "cache": cache, "pos_N": s.pos_S, **s.rows}
        d = decode_step(graphdef, params, carry, s.key_S, live_S, cfg)
        i_S = s.rows["length_N"]
        col_S = jnp.where(live_S, i_S, M)
        version_SM = s.version_SM.at[jnp.arange(S), col_S].set(s.version, mode="drop")
        rows = {k: d[k] for k in s.rows}
        at_S = jnp.minimum(i_S, M - 1)
        token_S = d["tokens_NM"][jnp.arange(S), at_S]
        s = s._replace(
            cache=d["cache"]._replace(index_B=index_S + live_S),
            logits_SV=d["logits_NV"].astype(jnp.float32),
            pos_S=d["pos_N"],
            last_S=jnp.where(live_S, token_S, s.last_S),
            version_SM=version_SM,
            rows=rows,
        )
        if cfg.action_stops:  # A forced token never ends a turn (as it never ends a sample).
            sampled_S = live_S & ~d["forced_NM"][jnp.arange(S), at_S] & ~finished(s)
            stops = cfg.action_stops
            acted_S = action_stopped(rows["tokens_NM"], rows["length_N"], s.turn_S, stops)
            s = s._replace(waiting_S=s.waiting_S | (sampled_S & acted_S))
        return _constrain(s, _state_axes(model_cfg, s), layout), j + 1, n + jnp.sum(live_S)

    zero = jnp.zeros((), jnp.int32)
    return jax.lax.while_loop(cond, body, (state, zero, zero))


@functools.partial(
    jax.jit, static_argnames=("graphdef", "model_cfg", "cfg", "layout"), donate_argnums=(1,)
)
def refresh(params, state, version, *, graphdef, model_cfg, cfg, layout):
    """New weights for the live slots: each one's last token is run again under `params` (its
    own cache column, index - 1, rewritten), so the next token is drawn from the new policy.
    (A waiting slot's next logits come from its reply, run under the weights of then.)"""
    C = state.cache.valid_BS.shape[1]
    live_S = live(state)
    index_S = state.cache.index_B
    cache = state.cache._replace(index_B=jnp.where(live_S, index_S - 1, C))
    logits_S1V, cache = decoder.forward(
        graphdef, params, state.last_S[:, None], (state.pos_S - 1)[:, None], live_S[:, None], cache
    )
    state = state._replace(
        cache=cache._replace(index_B=index_S),
        logits_SV=jnp.where(live_S[:, None], logits_S1V[:, 0].astype(jnp.float32), state.logits_SV),
        version=jnp.asarray(version, jnp.int32),
    )
    return _constrain(state, _state_axes(model_cfg, state), layout)


def take_slots(free: list[int], n: int, shard_slots: int) -> list[int]:
    """Takes `n` slots out of `free` (ascending) for one request's samples: from the shards
    (runs of `shard_slots` slots) with the most free slots first, so the request reaches as
    few shards as it can (each shard it reaches prefills it) and the shards fill evenly. With
    one shard: the lowest free slots."""
    by_shard: dict[int, list[int]] = {}
    for s in free:
        by_shard.setdefault(s // shard_slots, []).append(s)
    fullest = sorted(by_shard.values(), key=len, reverse=True)  # Stable: lower shards first.
    own = [s for group in fullest for s in group][:n]
    taken = set(own)
    free[:] = [s for s in free if s not in taken]
    return own


def prefill_rows(owned: Sequence[Sequence[int]], slots: int, shards: int) -> list:
    """`insert`'s rows for requests holding the slots `owned` (request i's sample g in slot
    owned[i][g]), the slots split into `shards` equal runs: one row per request and shard it
    has slots on, that row's slots in its own shard. Each shard's rows are padded to the
    same power of two (few prefill programs), shard after shard.

    Returns R entries, (request index, slot of each sample: `slots` for one the row does not
    place) or None for a padding row."""
    shard_slots = slots // shards
    rows: list[list] = [[] for _ in range(shards)]
    for i, own in enumerate(owned):
        for d in sorted({s // shard_slots for s in own}):
            rows[d].append((i, [s if s // shard_slots == d else slots for s in own]))
    per = 1 << (max(map(len, rows)) - 1).bit_length()
    return [d[j] if j < len(d) else None for d in rows for j in range(per)]
