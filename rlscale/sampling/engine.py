"""The generator engine's device side: continuous batching over fixed decode slots, each
owning its row of one preallocated KV cache (its own write position: a prompt at columns
[0, P), then one column per token), with weights that can change between decode calls (each
token records its version): its state and module-level jitted programs; the host `Generator`
that drives them is in `sampling.generator`. See docs/model_and_sampling.md.

A slot is live (decodes) while its sample is neither finished nor waiting: a sample waits
once its tokens of the current turn end with one of `SamplingConfig.action_stops`, until the
environment's reply is appended to it (`extend`: its KV cache, its completion as environment
tokens) or its episode ends. A completion's M columns hold its policy and environment tokens
alike, and so does its cache row: C >= P + M columns hold any sample.

Dimension letters: S slots, C cache columns, M max new tokens, V vocab, R rows of one prefill
call (prompts, or environment replies), P their padded prompt length, T their padded reply
length, G samples per request, N = R x G.
"""

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlscale import sharding
from rlscale.model import decoder, kv_pages
from rlscale.model.config import ModelConfig
from rlscale.sampling import paged
from rlscale.sampling.sampler import (
    SamplingConfig,
    _constrain,
    decode_step,
    empty_rows,
    expert_ids_dtype,
    recorded,
)


class EngineState(NamedTuple):
    """Everything on the device; rows are slots.

    `limit_S` is each slot's token budget (0 for an empty slot, so it counts as finished);
    `last_S` the last token run through the model (re-run under new weights); `waiting_S`
    which samples stopped at an action; `turn_S` the completion column where each sample's
    current turn began; `env_SM` which completion tokens the environment wrote (logprob 0,
    version -1); `version` the policy version of the current params; `experts_SClc` (a
    mixture of experts only, else None) the experts each cache column's token went to in
    each sparse layer (`sampler.recorded`), written with the column: a slot's prompt at
    [0, P), its completion's token i at P + i."""

    cache: decoder.KVCache
    logits_SV: jax.Array
    pos_S: jax.Array
    key_S: jax.Array
    limit_S: jax.Array
    last_S: jax.Array
    version_SM: jax.Array
    waiting_S: jax.Array
    turn_S: jax.Array
    env_SM: jax.Array
    rows: dict  # `sampler.empty_rows` fields, N = S.
    version: jax.Array
    experts_SClc: jax.Array | None = None


def finished(state: EngineState):
    """Each slot's sample is done: stopped, or its token budget spent (an empty slot too)."""
    return state.rows["done_N"] | (state.rows["length_N"] >= state.limit_S)


def live(state: EngineState):
    """The slots that decode: their samples neither finished nor waiting for a reply."""
    return ~finished(state) & ~state.waiting_S


def action_stopped(tokens_SM, length_S, turn_S, action_stops):
    """[S] whether each sample's tokens of its current turn (columns turn_S .. length_S - 1)
    end with one of the `action_stops` sequences: each sample's last columns, as many as the
    longest sequence has, compared with every sequence right-aligned."""
    width = max(map(len, action_stops))
    table = np.full((len(action_stops), width), -1, np.int32)  # -1: no token there.
    for a, seq in enumerate(action_stops):
        table[a, width - len(seq) :] = seq
    cols = length_S[:, None] - width + jnp.arange(width)
    last = jnp.take_along_axis(tokens_SM, jnp.clip(cols, 0, tokens_SM.shape[1] - 1), axis=1)
    hit = (last[:, None] == table) & (cols >= turn_S[:, None])[:, None]
    return jnp.any(jnp.all(hit | (table < 0), axis=-1), axis=-1)


def _cache_axes(model_cfg: ModelConfig, cache):
    if isinstance(cache, kv_pages.PagedKVCache):
        return kv_pages.logical_axes(model_cfg)
    return decoder.cache_logical_axes(model_cfg)


def _state_axes(model_cfg: ModelConfig, state: EngineState):
    batch = lambda x: ("batch",) + (None,) * (x.ndim - 1)  # noqa: E731
    axes = jax.tree.map(batch, state._replace(cache=None, version=None))
    return axes._replace(cache=_cache_axes(model_cfg, state.cache), version=())


@functools.partial(
    jax.jit, static_argnames=("model_cfg", "cfg", "slots", "columns", "layout", "blocks")
)
def init_state(*, model_cfg, cfg: SamplingConfig, slots: int, columns: int, layout, blocks=None):
    """An engine of `slots` empty slots of `columns` cache columns: a dense cache row each,
    or with `cfg.kv_block_size` a pool of `blocks` blocks (None: as many as dense rows
    take) and a block table each (`kv_pages`)."""
    S, M, bs = slots, cfg.max_new_tokens, cfg.kv_block_size
    if bs:
        blocks = S * columns // bs if blocks is None else blocks
        cache = kv_pages.init(model_cfg, S, columns, bs, blocks)
    else:
        cache = decoder.init_cache(model_cfg, S, columns)
    state = EngineState(
        cache=cache,
        logits_SV=jnp.zeros((S, model_cfg.vocab_size), jnp.float32),
        pos_S=jnp.zeros((S,), jnp.int32),
        key_S=jax.random.split(jax.random.key(0), S),
        limit_S=jnp.zeros((S,), jnp.int32),
        last_S=jnp.zeros((S,), jnp.int32),
        version_SM=jnp.zeros((S, M), jnp.int32),
        waiting_S=jnp.zeros((S,), bool),
        turn_S=jnp.zeros((S,), jnp.int32),
        env_SM=jnp.zeros((S, M), bool),
        rows=empty_rows(S, M, cfg.pad_id),
        version=jnp.zeros((), jnp.int32),
    )
    if model_cfg.num_experts:
        lc = (len(model_cfg.moe_layers), model_cfg.experts_per_token)
        ids = jnp.zeros((S, columns, *lc), expert_ids_dtype(model_cfg.num_experts))
        state = state._replace(experts_SClc=ids)
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
    h, prompt, routing = decoder.routed_hidden(
        graphdef, params, tokens_RP, positions_RP, mask_RP, cache
    )
    new = {
        "k": prompt.k,
        "v": prompt.v,
        "mask_RP": mask_RP,
        "logits_RV": decoder.logits(graphdef, params, h[:, -1:])[:, 0].astype(jnp.float32),
        "pos_R": positions_RP[:, -1] + 1,
        "last_R": tokens_RP[:, -1],
        "key_R": jax.random.wrap_key_data(keydata_R),
    }
    specs = _state_specs(model_cfg, state, layout)
    new_specs = {
        "k": specs.cache.k,
        "v": specs.cache.v,
        "mask_RP": specs.cache.valid_BS,
        "logits_RV": specs.logits_SV,
        "pos_R": specs.pos_S,
        "last_R": specs.last_S,
        "key_R": specs.key_S,
    }
    if routing is not None:
        new["experts_RPlc"], new_specs["experts_RPlc"] = recorded(routing), specs.experts_SClc
    place = functools.partial(_place, cfg=cfg)
    in_specs = (specs, new_specs, specs.version_SM, specs.version_SM)  # Rows as the slots.
    return _on_shards(place, layout, in_specs, specs)(state, new, slot_RG, limit_RG)


def _state_specs(model_cfg, state: EngineState, layout):
    """The state's `PartitionSpec`s on the layout's mesh (no layout: None for each)."""
    if layout is None:
        return jax.tree.map(lambda _: None, state)
    shardings = sharding.tree_shardings(
        state, _state_axes(model_cfg, state), layout.mesh, layout.rules
    )
    return jax.tree.map(lambda s: s.spec, shardings)


def _on_shards(fn, layout, in_specs, out_specs):
    """`fn(state, *args, first_slot)` on each shard of the slots, under `shard_map`: a shard's
    state holds slots `first_slot` ... of the engine (`in_specs[0]`: the state's specs, whose
    slots split over the mesh axes `limit_S`'s spec names, None: not split). No layout: `fn`
    on every slot.

    A paged cache's pool is one for every slot, on every device of the batch axes (which
    split nothing: `paged.problems`), and each shard writes its slots' blocks into it, so
    shard_map cannot infer that the pool comes out replicated over those axes of size 1:
    it is told not to check (`check_vma=False`)."""
    if layout is None:
        return functools.partial(fn, first_slot=0)
    batch = in_specs[0].limit_S[0]

    def local(state, *args):
        first = 0 if batch is None else jax.lax.axis_index(batch) * state.limit_S.shape[0]
        return fn(state, *args, first_slot=first)

    check = not isinstance(in_specs[0].cache, kv_pages.PagedKVCache)
    return jax.shard_map(
        local, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check
    )


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
    if isinstance(state.cache, kv_pages.PagedKVCache):  # Through their block tables.
        k, v = paged.place_prompt(state.cache, new["k"], new["v"], slot_N, G)
    else:
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
    if state.experts_SClc is not None:
        ids = state.experts_SClc.at[slot_N, :P].set(tile(new["experts_RPlc"]), mode="drop")
        state = state._replace(experts_SClc=ids)
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
        env_SM=put(state.env_SM, fresh["forced_NM"]),
        rows={name: put(x, fresh[name]) for name, x in state.rows.items()},
    )


@functools.partial(
    jax.jit, static_argnames=("graphdef", "model_cfg", "cfg", "layout"), donate_argnums=(1,)
)
def decode(params, state, steps, wanted, waits, *, graphdef, model_cfg, cfg, layout):
    """Advances every live slot by up to `steps` tokens; returns (state, steps run, tokens
    generated). Stops early when no slot is live, once `wanted` slots have finished in this
    call (a waiting request needs them; 0: never), so it starts without waiting out the
    call, or once `waits` samples have begun to wait in it (0: never), so their turns reach
    the environment without waiting out the call either. A slot whose tokens of this turn
    end with an action stop stops advancing and waits; the others go on."""
    C = state.cache.valid_BS.shape[1]
    S, M = state.limit_S.shape[0], cfg.max_new_tokens
    live0_S, waiting0_S = ~finished(state), state.waiting_S

    def cond(c):
        finished_S = finished(c[0])
        freed = (wanted > 0) & (jnp.sum(live0_S & finished_S) >= wanted)
        turns = (waits > 0) & (jnp.sum(c[0].waiting_S & ~waiting0_S) >= waits)
        return (c[1] < steps) & jnp.any(live(c[0])) & ~freed & ~turns

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
            # A waiting slot keeps the logits after its turn's last token (an empty reply
            # resumes from them).
            logits_SV=jnp.where(live_S[:, None], d["logits_NV"].astype(jnp.float32), s.logits_SV),
            pos_S=d["pos_N"],
            last_S=jnp.where(live_S, token_S, s.last_S),
            version_SM=version_SM,
            rows=rows,
        )
        if s.experts_SClc is not None:  # The token's experts, at its cache column.
            at = (jnp.arange(S), jnp.where(live_S, index_S, C))
            s = s._replace(experts_SClc=s.experts_SClc.at[at].set(d["experts_Nlc"], mode="drop"))
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
    """New weights for the unfinished slots: each one's last token is run again under `params`
    (its own cache column, index - 1, rewritten), so the next token is drawn from the new
    policy (a waiting slot's, after an empty reply; a reply's own tokens run under the
    weights of then)."""
    C = state.cache.valid_BS.shape[1]
    on_S = ~finished(state)
    index_S = state.cache.index_B
    cache = state.cache._replace(index_B=jnp.where(on_S, index_S - 1, C))
    h_S1D, cache, routing = decoder.routed_hidden(
        graphdef, params, state.last_S[:, None], (state.pos_S - 1)[:, None], on_S[:, None], cache
    )
    logits_S1V = decoder.logits(graphdef, params, h_S1D)
    if routing is not None:  # The token's experts under the new weights.
        at = (jnp.arange(on_S.shape[0]), jnp.where(on_S, index_S - 1, C))
        ids = state.experts_SClc.at[at].set(recorded(routing)[:, 0], mode="drop")
        state = state._replace(experts_SClc=ids)
    state = state._replace(
        cache=cache._replace(index_B=index_S),
        logits_SV=jnp.where(on_S[:, None], logits_S1V[:, 0].astype(jnp.float32), state.logits_SV),
        version=jnp.asarray(version, jnp.int32),
    )
    return _constrain(state, _state_axes(model_cfg, state), layout)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "model_cfg", "cfg", "layout"), donate_argnums=(1,)
)
def extend(params, state, tokens_RT, mask_RT, slot_R, end_R, *, graphdef, model_cfg, cfg, layout):
    """Appends the environment's replies to R waiting slots and clears their wait.

    Row r's tokens (`mask_RT` a prefix: right-padded to T < C) are prefilled at slot
    `slot_R[r]`'s own write position, attending to the slot's valid columns and causally
    among themselves; they join its completion as environment tokens (`env_SM`, logprob 0,
    version -1), the next token's logits come from the last one, and the slot's next turn
    starts after them; an empty row (no tokens) resumes the slot as it stood at its action
    stop. A reply longer than the slot's remaining budget is cut to fit (the
    slot is then finished, its budget spent). `end_R`: the episode ends instead (the slot
    finishes as stopped; its tokens are ignored). A slot index >= S writes nothing.

    On a mesh the rows split over the batch axes as the slots do, each in its slot's shard
    (`prefill_rows` lays them out so): each device gathers its rows' cache rows, the prefill
    runs split as the rows are, and each device writes its rows back (`_gather_rows`,
    `_put_rows`, under `shard_map`). Besides the prefill's own, its temporaries hold the
    gathered rows: R / S of the cache."""
    T, C = tokens_RT.shape[1], state.cache.valid_BS.shape[1]
    if T >= C:  # The decoder would take a call of C tokens for a prefill that fills the cache.
        raise ValueError(f"replies padded to T={T} tokens must be shorter than the C={C} columns")
    specs = _state_specs(model_cfg, state, layout)
    row = specs.limit_S  # Rows split as the slots.
    row_specs = {
        "cache": specs.cache,
        "length_R": row,
        "room_R": row,
        "pos_R": row,
        "logits_RV": specs.logits_SV,
        "last_R": row,
    }
    rows = _on_shards(_gather_rows, layout, (specs, row), row_specs)(state, slot_R)
    n_R = jnp.where(end_R, 0, jnp.minimum(jnp.sum(mask_RT, axis=1), rows["room_R"]))
    mask_RT = jnp.arange(T) < n_R[:, None]
    positions_RT = rows["pos_R"][:, None] + jnp.arange(T)
    cache = _constrain(rows["cache"], _cache_axes(model_cfg, rows["cache"]), layout)
    h, cache, routing = decoder.routed_hidden(
        graphdef, params, tokens_RT, positions_RT, mask_RT, cache
    )
    last_R = jnp.maximum(n_R - 1, 0)
    h_R1D = jnp.take_along_axis(h, last_R[:, None, None], axis=1)
    logits_RV = decoder.logits(graphdef, params, h_R1D)[:, 0].astype(jnp.float32)
    replied_R = n_R > 0  # An empty reply keeps the logits and last token of the turn's end.
    new = {
        **rows,
        "cache": cache._replace(index_B=rows["cache"].index_B + n_R),
        "logits_RV": jnp.where(replied_R[:, None], logits_RV, rows["logits_RV"]),
        "last_R": jnp.where(
            replied_R, jnp.take_along_axis(tokens_RT, last_R[:, None], axis=1)[:, 0], rows["last_R"]
        ),
        "tokens_RT": tokens_RT,
        "n_R": n_R,
        "end_R": end_R,
    }
    put = functools.partial(_put_rows, cfg=cfg)
    new_specs = {
        **row_specs,
        "tokens_RT": specs.version_SM,
        "n_R": row,
        "end_R": row,
    }
    if routing is not None:
        new["experts_RTlc"], new_specs["experts_RTlc"] = recorded(routing), specs.experts_SClc
    return _on_shards(put, layout, (specs, new_specs, row), specs)(state, new, slot_R)


def _gather_rows(state: EngineState, slot_R, *, first_slot) -> dict:
    """The cache rows, completion lengths, remaining budgets, next positions, next logits and
    last tokens of slots `slot_R` (of the engine: `state` may be one shard's, holding slots
    `first_slot` ...); a slot outside it gives slot 0's cache row and no room (it writes
    nothing)."""
    local_R = slot_R - first_slot
    ok_R = (local_R >= 0) & (local_R < state.limit_S.shape[0])
    at_R = jnp.where(ok_R, local_R, 0)
    length_R = state.rows["length_N"][at_R]
    if isinstance(state.cache, kv_pages.PagedKVCache):
        cache = paged.gather_rows(state.cache, at_R, ok_R)
    else:
        cache = jax.tree.map(lambda x: x[at_R], state.cache)
    return {
        "cache": cache,
        "length_R": length_R,
        "room_R": jnp.where(ok_R, state.limit_S[at_R] - length_R, 0),
        "pos_R": state.pos_S[at_R],
        "logits_RV": state.logits_SV[at_R],
        "last_R": state.last_S[at_R],
    }


def _put_rows(state: EngineState, new: dict, slot_R, *, cfg, first_slot) -> EngineState:
    """Writes `extend`'s rows back into slots `slot_R` (see `_gather_rows`): their cache
    rows, their replies' first n_R tokens into the completion as environment tokens, and
    their next logits; clears the wait, and finishes the rows in `end_R` as stopped."""
    S, M = state.limit_S.shape[0], cfg.max_new_tokens
    local_R = slot_R - first_slot
    w_R = jnp.where((local_R >= 0) & (local_R < S), local_R, S)
    n_R, length_R, T = new["n_R"], new["length_R"], new["tokens_RT"].shape[1]
    cols_RT = jnp.where(jnp.arange(T) < n_R[:, None], length_R[:, None] + jnp.arange(T), M)

    def put(x, update):
        return x.at[w_R].set(update, mode="drop")

    def put_cols(x_SM, update):
        return x_SM.at[w_R[:, None], cols_RT].set(update, mode="drop")

    rows = dict(state.rows)
    rows["tokens_NM"] = put_cols(rows["tokens_NM"], new["tokens_RT"])
    rows["logprobs_NM"] = put_cols(rows["logprobs_NM"], 0.0)
    rows["length_N"] = put(rows["length_N"], length_R + n_R)
    rows["forced_NM"] = put_cols(rows["forced_NM"], False)
    rows["done_N"] = put(rows["done_N"], new["end_R"])  # A waiting sample is not done.
    if state.experts_SClc is not None:  # The reply's experts, at its cache columns.
        C = state.experts_SClc.shape[1]
        start_R = new["cache"].index_B - n_R
        at_RT = jnp.where(jnp.arange(T) < n_R[:, None], start_R[:, None] + jnp.arange(T), C)
        ids = state.experts_SClc.at[w_R[:, None], at_RT].set(new["experts_RTlc"], mode="drop")
        state = state._replace(experts_SClc=ids)
    if isinstance(state.cache, kv_pages.PagedKVCache):
        cache = paged.put_rows(state.cache, new["cache"], put)
    else:
        cache = jax.tree.map(put, state.cache, new["cache"])
    return state._replace(
        cache=cache,
        logits_SV=put(state.logits_SV, new["logits_RV"]),
        pos_S=put(state.pos_S, new["pos_R"] + n_R),
        last_S=put(state.last_S, new["last_R"]),
        version_SM=put_cols(state.version_SM, -1),
        waiting_S=put(state.waiting_S, jnp.zeros_like(n_R, bool)),
        turn_S=put(state.turn_S, length_R + n_R),
        env_SM=put_cols(state.env_SM, True),
        rows=rows,
    )


@functools.partial(jax.jit, static_argnames=("model_cfg", "layout"), donate_argnums=(0,))
def move(dst, src, dst_R, src_R, *, model_cfg, layout):
    """Copies rows `src_R` of engine state `src` into rows `dst_R` of `dst` (the slots and
    the parking rows of `Generator(parked=...)`, either way): every per-slot array, the
    whole KV cache row included, so a sample moves exactly as it stood, to go on where it
    stopped. A `dst_R` >= dst's rows writes nothing (a padding row); `dst.version` stays."""
    at_R = jnp.clip(src_R, 0, src.limit_S.shape[0] - 1)

    def put(d, s):
        return d.at[dst_R].set(s[at_R], mode="drop")

    if isinstance(dst.cache, kv_pages.PagedKVCache):  # The tables move; the blocks stay.
        out = paged.move_rows(dst, src, put)
    else:
        out = jax.tree.map(put, dst._replace(version=None), src._replace(version=None))
    out = out._replace(version=dst.version)
    return _constrain(out, _state_axes(model_cfg, out), layout)


@functools.partial(jax.jit, static_argnames=("model_cfg", "layout"), donate_argnums=(0,))
def evict(state, ids_R, slot_R, *, model_cfg, layout):
    """A preempted sample's blocks `ids_R` (`paged.take_blocks`: keys and values for the
    host) and `state` with its slots `slot_R` empty (a budget of 0: finished, they decode
    nothing), once its row has moved out."""
    k, v = paged.take_blocks(state.cache, ids_R)
    out = state._replace(limit_S=state.limit_S.at[slot_R].set(0, mode="drop"))
    return k, v, _constrain(out, _state_axes(model_cfg, out), layout)


@functools.partial(jax.jit, static_argnames=("model_cfg", "layout"), donate_argnums=(0,))
def blocks_in(state, ids_R, k, v, *, model_cfg, layout):
    """`state` with `evict`'s keys and values written into blocks `ids_R`
    (`paged.put_blocks`): a preempted sample's, back into blocks of its own."""
    out = state._replace(cache=paged.put_blocks(state.cache, ids_R, k, v))
    return _constrain(out, _state_axes(model_cfg, out), layout)


def experts_of(state: EngineState, slots: list[int]) -> dict:
    """A mixture of experts' recorded routing of `slots` (slot -> [C, l, c], fetched for
    those slots only, padded to a power of two); {} for a dense model."""
    ids = state.experts_SClc
    if ids is None or not slots:
        return {}
    at = np.full(1 << (len(slots) - 1).bit_length(), slots[0], np.int32)
    at[: len(slots)] = slots
    return dict(zip(slots, sharding.fetch(jnp.take(ids, jnp.asarray(at), axis=0))))


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
