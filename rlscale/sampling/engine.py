"""The generator engine: continuous batching over fixed decode slots sharing one ring KV cache, with
weights that can change between decode calls (each token records its version).

Dimension letters: S slots, C cache columns, M max new tokens, V vocab, R rows of one prefill call,
P their padded prompt length, G samples per request, N = R x G.
"""

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from rlscale import sharding
from rlscale.model import decoder
from rlscale.model.config import ModelConfig
from rlscale.sampling.sampler import (
    SamplingConfig,
    _constrain,
    _Layout,
    decode_step,
    empty_rows,
)


class EngineState(NamedTuple):
    """Everything on the device; rows are slots.

    `limit_S` is each slot's token budget (0 for an empty slot, so it counts as finished);
    `last_S` the last token run through the model (re-run under new weights); `version` the
    policy version of the current params."""

    cache: decoder.KVCache
    logits_SV: jax.Array
    pos_S: jax.Array
    key_S: jax.Array
    limit_S: jax.Array
    last_S: jax.Array
    version_SM: jax.Array
    rows: dict  # `sampler.empty_rows` fields, N = S.
    version: jax.Array


def _finished(state: EngineState):
    return state.rows["done_N"] | (state.rows["length_N"] >= state.limit_S)


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
    places), behind the ring's write index. `keydata_R` holds the rows' request keys as
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

    A new slot gets the prompt's KV columns (just behind the write index) and a validity row
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
    cols_P = (state.cache.index - P + jnp.arange(P)) % C

    def put(x, update):
        return x.at[slot_N].set(update, mode="drop")

    # The prompt's columns of the new slots: [N, P, ...] updates at (slot, column).
    k = tuple(
        ring.at[slot_N[:, None], :, :, cols_P].set(
            tile(part).transpose(0, 3, 1, 2).astype(ring.dtype), mode="drop"
        )
        for ring, part in zip(state.cache.k, new["k"])
    )
    v = tuple(
        ring.at[slot_N[:, None], :, cols_P].set(
            tile(part).transpose(0, 2, 1, 3).astype(ring.dtype), mode="drop"
        )
        for ring, part in zip(state.cache.v, new["v"])
    )
    valid_NC = jnp.zeros((R * G, C), bool).at[:, cols_P].set(tile(new["mask_RP"]))
    keys_N = jax.vmap(jax.random.fold_in)(tile(new["key_R"]), jnp.tile(jnp.arange(G), R))
    fresh = empty_rows(R * G, cfg.max_new_tokens, cfg.pad_id)
    return state._replace(
        cache=state.cache._replace(k=k, v=v, valid_BS=put(state.cache.valid_BS, valid_NC)),
        logits_SV=put(state.logits_SV, tile(new["logits_RV"])),
        pos_S=put(state.pos_S, tile(new["pos_R"])),
        key_S=put(state.key_S, keys_N),
        limit_S=put(state.limit_S, limit_RG.reshape(-1)),
        last_S=put(state.last_S, tile(new["last_R"])),
        version_SM=put(state.version_SM, jnp.zeros_like(fresh["tokens_NM"])),
        rows={name: put(x, fresh[name]) for name, x in state.rows.items()},
    )


@functools.partial(
    jax.jit, static_argnames=("graphdef", "model_cfg", "cfg", "layout"), donate_argnums=(1,)
)
def decode(params, state, steps, wanted, *, graphdef, model_cfg, cfg, layout):
    """Advances every live slot by up to `steps` tokens; returns (state, steps run, tokens
    generated). Stops early when every slot is done, or once `wanted` slots have finished in
    this call (a waiting request needs them; 0: never), so it starts without waiting out the
    call."""
    C = state.cache.valid_BS.shape[1]
    S = state.limit_S.shape[0]
    live0_S = ~_finished(state)

    def cond(c):
        finished_S = _finished(c[0])
        freed = (wanted > 0) & (jnp.sum(live0_S & finished_S) >= wanted)
        return (c[1] < steps) & ~jnp.all(finished_S) & ~freed

    def body(c):
        s, j, n = c
        live_S = ~_finished(s)
        cache = s.cache._replace(index=s.cache.index % C)
        carry = {"logits_NV": s.logits_SV, "cache": cache, "pos_N": s.pos_S, **s.rows}
        d = decode_step(graphdef, params, carry, s.key_S, live_S, cfg)
        i_S = s.rows["length_N"]
        col_S = jnp.where(live_S, i_S, cfg.max_new_tokens)
        version_SM = s.version_SM.at[jnp.arange(S), col_S].set(s.version, mode="drop")
        rows = {k: d[k] for k in s.rows}
        token_S = d["tokens_NM"][jnp.arange(S), jnp.minimum(i_S, cfg.max_new_tokens - 1)]
        s = s._replace(
            cache=d["cache"]._replace(index=d["cache"].index % C),
            logits_SV=d["logits_NV"].astype(jnp.float32),
            pos_S=d["pos_N"],
            last_S=jnp.where(live_S, token_S, s.last_S),
            version_SM=version_SM,
            rows=rows,
        )
        return _constrain(s, _state_axes(model_cfg, s), layout), j + 1, n + jnp.sum(live_S)

    zero = jnp.zeros((), jnp.int32)
    return jax.lax.while_loop(cond, body, (state, zero, zero))


@functools.partial(
    jax.jit, static_argnames=("graphdef", "model_cfg", "cfg", "layout"), donate_argnums=(1,)
)
def refresh(params, state, version, *, graphdef, model_cfg, cfg, layout):
    """New weights for the live slots: each one's last token is run again under `params` (its
    own cache column rewritten), so the next token is drawn from the new policy."""
    C = state.cache.valid_BS.shape[1]
    live_S = ~_finished(state)
    cache = state.cache._replace(index=(state.cache.index - 1) % C)
    logits_S1V, cache = decoder.forward(
        graphdef, params, state.last_S[:, None], (state.pos_S - 1)[:, None], live_S[:, None], cache
    )
    state = state._replace(
        cache=cache._replace(index=cache.index % C),
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


@dataclasses.dataclass
class Request:
    """A prompt to sample `SamplingConfig.num_samples` completions of.

    Attributes:
      id: the caller's handle, returned with the completions.
      prompt: token ids.
      key: a PRNG key; sample g draws with fold_in(key, g).
      max_new_tokens: this request's budget (0: the config's).
    """

    id: Any
    prompt: Sequence[int]
    key: jax.Array
    max_new_tokens: int = 0


class Completed(NamedTuple):
    """A request's G completions (host arrays, [G, M]); see `sampler.SampleOutput` for the
    fields they share. `versions_GM` is the policy version that sampled each token."""

    request: Request
    tokens_GM: np.ndarray
    mask_GM: np.ndarray
    logprobs_GM: np.ndarray
    versions_GM: np.ndarray
    forced_GM: np.ndarray
    lengths_G: np.ndarray
    truncated_G: np.ndarray
    interrupted_G: np.ndarray


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine started: decode steps run, slot-steps (steps x slots),
    tokens generated (the useful slot-steps), seconds decoding, prefilling and swapping
    weights (device busy time: each call is waited on)."""

    steps: int = 0
    slot_steps: int = 0
    tokens: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    swap_s: float = 0.0

    @property
    def utilization(self) -> float:
        return self.tokens / max(self.slot_steps, 1)


class Generator:
    """Requests in, completed requests out, over `slots` decode slots.

    Host side of the engine: a queue of requests, the free slots, weight changes between
    decode calls, and harvesting finished samples. Every bad input fails in `submit` or at
    construction, before anything is compiled.

    Args:
      graphdef, model_cfg: the policy.
      cfg: sampling settings; `num_samples` is G, `buckets` the prompt lengths.
      slots: S, a multiple of G and of the mesh's batch split.
      max_prompt_len: the longest prompt to accept; the cache has bucket(it) + M columns.
      mesh, rules: the generator's device set and its layout (params must be in it).
      programs: a `programs.Programs` recording the compiled engine programs.
    """

    def __init__(
        self,
        graphdef,
        model_cfg: ModelConfig,
        cfg: SamplingConfig,
        slots: int,
        max_prompt_len: int,
        mesh: Mesh | None = None,
        rules: sharding.Rules = sharding.SAMPLE_RULES,
        programs=None,
    ):
        G = cfg.num_samples
        problems = []
        if slots < G or slots % G:
            problems.append(f"slots={slots} must be a positive multiple of num_samples={G}")
        div = 1 if mesh is None else sharding.batch_divisor(mesh, rules)
        if mesh is not None:
            if slots % div:
                problems.append(
                    f"slots={slots} does not divide the mesh's batch axes ({dict(mesh.shape)}: "
                    f"batch split {div} ways); use a multiple of {div}"
                )
        bucket = cfg.bucket(max_prompt_len) if max_prompt_len <= cfg.buckets[-1] else None
        if bucket is None:
            problems.append(
                f"max_prompt_len={max_prompt_len} is longer than the largest bucket "
                f"{cfg.buckets[-1]}"
            )
        elif bucket + cfg.max_new_tokens > model_cfg.max_seq_len:
            problems.append(
                f"prompt bucket {bucket} + max_new_tokens={cfg.max_new_tokens} exceeds the "
                f"model's max_seq_len={model_cfg.max_seq_len}"
            )
        if problems:
            raise ValueError("Invalid generator: " + "; ".join(problems))
        self.cfg, self.slots, self.max_prompt_len = cfg, slots, max_prompt_len
        self.shards = div  # The slots' split over the mesh's batch axes.
        self.model_cfg = model_cfg
        self.layout = None if mesh is None else _Layout(mesh, rules)
        self.static = dict(graphdef=graphdef, model_cfg=model_cfg, cfg=cfg, layout=self.layout)
        self.programs = programs
        self.state = init_state(
            model_cfg=model_cfg,
            cfg=cfg,
            slots=slots,
            columns=bucket + cfg.max_new_tokens,
            layout=self.layout,
        )
        self.params, self.version, self._stale = None, 0, False
        self.queue: list[tuple[Request, np.ndarray]] = []  # With each request's key data.
        self.free = list(range(slots))
        self.running: dict[int, tuple[Request, list[int]]] = {}  # Slot -> (request, its slots).
        self.partial: dict[int, dict] = {}  # id(request) -> harvested rows so far.
        self.stats = EngineStats()

    # -- host API --------------------------------------------------------------------------

    def precompile(self, params) -> None:
        """Starts compiling the decode program in the background (`Programs.prefetch`): its
        shapes are the slots' and the weights' (`params`: in the generator's layout, arrays or
        their `jax.ShapeDtypeStruct`s), so a run's first decode does not wait for it. (The
        prefill's depend on the requests admitted together.)"""
        if self.programs is not None:
            args = (params, self.state, *self._replicated(np.int32(0), np.int32(0)))
            self.programs.prefetch("engine_decode", decode, args, self.static)

    def set_params(self, params, version: int) -> None:
        """Weights for the next decode steps (in the generator's layout), and their version."""
        self.params, self.version, self._stale = params, int(version), True

    def submit(self, requests: Sequence[Request]) -> None:
        V = self.model_cfg.vocab_size
        for r in requests:
            where = f"request {r.id!r}"
            if len(r.prompt) == 0:
                raise ValueError(f"{where}: the prompt is empty")
            if len(r.prompt) > self.max_prompt_len:
                raise ValueError(
                    f"{where}: prompt of {len(r.prompt)} tokens > max_prompt_len="
                    f"{self.max_prompt_len}"
                )
            bad = [t for t in r.prompt if not 0 <= int(t) < V]
            if bad:
                raise ValueError(f"{where}: token id(s) {bad[:5]} outside [0, {V})")
            if not 0 <= r.max_new_tokens <= self.cfg.max_new_tokens:
                raise ValueError(
                    f"{where}: max_new_tokens={r.max_new_tokens} not in [0, "
                    f"{self.cfg.max_new_tokens}]"
                )
        # Keys as host data: they may live on other devices (the trainer's) than the engine.
        self.queue.extend((r, sharding.fetch(jax.random.key_data(r.key))) for r in requests)

    @property
    def busy(self) -> bool:
        """Requests queued or decoding."""
        return bool(self.queue or self.running)

    @property
    def live_slots(self) -> int:
        return self.slots - len(self.free)

    def step(self, max_steps: int) -> list[Completed]:
        """Admits queued requests into free slots, decodes up to `max_steps` tokens per slot
        and returns the requests whose samples are all done."""
        if self.params is None:
            raise ValueError("Generator.step before set_params: no weights to sample with")
        if self._stale:
            if self.running:
                t = time.perf_counter()
                self.state = self._run("engine_refresh", refresh, self._replicated(self.version))
                jax.block_until_ready(self.state)
                self.stats.swap_s += time.perf_counter() - t
            else:  # Nothing live: the new version takes effect at the next prefill.
                self.state = self.state._replace(version=self._replicated(self.version)[0])
            self._stale = False
        self._admit()
        if not self.running:
            return []
        t = time.perf_counter()
        # Waiting requests: stop once they can start, but admit at least an eighth of the
        # slots at a time (each admission is a prefill program that reads every weight).
        G = self.cfg.num_samples
        wanted = max(G, self.slots // 8 // G * G) - len(self.free) if self.queue else 0
        args = self._replicated(np.int32(max_steps), np.int32(wanted))
        self.state, steps, tokens = self._run("engine_decode", decode, args)
        steps, tokens = map(int, sharding.fetch((steps, tokens)))
        self.stats.decode_s += time.perf_counter() - t
        self.stats.steps += steps
        self.stats.slot_steps += steps * self.slots
        self.stats.tokens += tokens
        return self._harvest()

    # -- internals -------------------------------------------------------------------------

    def _replicated(self, *xs) -> tuple:
        """Host values -> copies on every device of the generator's mesh."""
        xs = tuple(jnp.asarray(x) for x in xs)
        return xs if self.layout is None else tuple(sharding.replicate(xs, self.layout.mesh))

    def _rows(self, *xs) -> tuple:
        """Host rows -> arrays split over the mesh's batch axes, as the slots are."""
        if self.layout is None:
            return xs
        return tuple(sharding.put_batch(xs, self.layout.mesh, self.layout.rules))

    def _run(self, name, fn, extra):
        args = (self.params, self.state, *extra)
        if self.programs is not None:
            return self.programs.run(name, fn, args, self.static)
        return fn(*args, **self.static)

    def _admit(self):
        G = self.cfg.num_samples
        fits = min(len(self.free) // G, len(self.queue))
        if not fits:
            return
        if not self.running:  # Idle: restart the ring, so the same work computes the same
            # bits whatever ran before (a resumed run samples as the uninterrupted one did).
            cache = self.state.cache._replace(index=self._replicated(np.int32(0))[0])
            self.state = self.state._replace(cache=cache)
        taken, self.queue = self.queue[:fits], self.queue[fits:]
        by_bucket: dict[int, list] = {}
        for r, keydata in taken:
            by_bucket.setdefault(self.cfg.bucket(len(r.prompt)), []).append((r, keydata))
        for P, reqs in sorted(by_bucket.items()):
            owned = [take_slots(self.free, G, self.slots // self.shards) for _ in reqs]
            for (r, _), own in zip(reqs, owned):
                for s in own:
                    self.running[s] = (r, own)
            rows = prefill_rows(owned, self.slots, self.shards)
            R = len(rows)
            tokens = np.full((R, P), self.cfg.pad_id, np.int32)
            mask = np.zeros((R, P), bool)
            slots = np.full((R, G), self.slots, np.int32)  # Padding rows write nothing.
            limits = np.zeros((R, G), np.int32)
            keys = np.zeros((R, 2), np.uint32)
            for i, row in enumerate(rows):
                if row is None:
                    continue
                r, keydata = reqs[row[0]]
                tokens[i, P - len(r.prompt) :] = r.prompt
                mask[i, P - len(r.prompt) :] = True
                slots[i] = row[1]
                limits[i] = r.max_new_tokens or self.cfg.max_new_tokens
                keys[i] = keydata
            t = time.perf_counter()
            args = self._rows(tokens, mask, slots, keys, limits)
            self.state = self._run("engine_insert", insert, args)
            jax.block_until_ready(self.state)
            self.stats.prefill_s += time.perf_counter() - t

    def _harvest(self) -> list[Completed]:
        finished_S = sharding.fetch(_finished(self.state))
        done = [s for s in self.running if finished_S[s]]
        if not done:
            return []
        rows = self.state.rows
        host = sharding.fetch(
            {
                "tokens": rows["tokens_NM"],
                "logprobs": rows["logprobs_NM"],
                "forced": rows["forced_NM"],
                "versions": self.state.version_SM,
                "lengths": rows["length_N"],
                "stopped": rows["done_N"],
                "interrupted": rows["interrupted_N"],
            }
        )
        completed = []
        for s in sorted(done):
            r, own = self.running.pop(s)
            self.free.append(s)
            got = self.partial.setdefault(id(r), {})
            got[own.index(s)] = {k: np.asarray(v[s]) for k, v in host.items()}
            if len(got) == len(own):
                del self.partial[id(r)]
                completed.append(self._completed(r, [got[g] for g in range(len(own))]))
        self.free.sort()
        return completed

    def _completed(self, r: Request, rows: list[dict]) -> Completed:
        def stack(k):
            return np.stack([row[k] for row in rows])

        lengths = stack("lengths")
        M = self.cfg.max_new_tokens
        return Completed(
            request=r,
            tokens_GM=stack("tokens"),
            mask_GM=np.arange(M)[None, :] < lengths[:, None],
            logprobs_GM=stack("logprobs"),
            versions_GM=stack("versions"),
            forced_GM=stack("forced"),
            lengths_G=lengths,
            truncated_G=~stack("stopped"),
            interrupted_G=stack("interrupted"),
        )
