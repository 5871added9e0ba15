"""The generator engine's host side: `Generator` takes `Request`s in and gives `Completed`
ones out (and, for multi-turn episodes, the `Turn`s that wait for an environment's reply),
keeping the request queue, the free slots, weight changes between decode calls and the
harvest of finished samples; it drives the device programs of `sampling.engine`, whose
docstring states the engine's invariants.

Dimension letters: S slots, M max new tokens, V vocab, R rows of one prefill call (prompts,
or environment replies), P their padded prompt length, T their padded reply length, G
samples per request.
"""

import itertools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlscale import sharding
from rlscale.model.config import ModelConfig
from rlscale.sampling import engine, paged
from rlscale.sampling.records import (  # The engine's interface, imported from here too.
    Completed,
    EngineStats,
    Request,
    Stepped,
    Turn,
)
from rlscale.sampling.sampler import SamplingConfig, _Layout


class Generator:
    """Requests in, completed requests out, over `slots` decode slots.

    Host side of the engine: a queue of requests, the free slots, weight changes between
    decode calls, and harvesting finished samples and the turns that wait. In multi-turn
    episodes (`cfg.action_stops`) `step` also returns the samples that wait for the
    environment, and `reply` answers them. Every bad input fails in `submit`, `reply` or at
    construction, before anything is compiled.

    A waiting sample holds its slot (its KV cache row) until its reply, so while the
    environment takes its time the slot decodes nothing. With `parked` rows, a step that
    has queued requests (or parked samples whose replies came) and no free slot for them
    moves waiting samples out of their slots into parking rows (`engine.move`: the whole
    row, cache included) and brings a parked sample back into a free slot once its reply
    is queued, before the queued requests; a sample goes on exactly where it stopped,
    whichever slot it comes back to. The latest waits are parked first (the earlier ones'
    replies are due sooner); with the parking rows full, samples wait in their slots.

    Args:
      graphdef, model_cfg: the policy.
      cfg: sampling settings; `num_samples` is G, `buckets` the prompt and reply lengths.
      slots: S, a multiple of G and of the mesh's batch split.
      max_prompt_len: the longest prompt to accept; the cache has bucket(it) + M columns.
      mesh, rules: the generator's device set and its layout (params must be in it).
      programs: a `programs.Programs` recording the compiled engine programs.
      parked: parking rows for waiting samples (each a cache row: `parked` / `slots` more
        cache memory), a multiple of the mesh's batch split; 0: samples wait in their slots.
        With a paged cache (`cfg.kv_block_size`) a parked sample keeps its blocks.
    With `cfg.kv_preempt` (a paged cache, single-turn) admission takes a request's prompt
    blocks and one more per sample, and a decode call that would run out of blocks first
    preempts the latest samples (`_make_room`; `sampling.paged` has the rules).
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
        parked: int = 0,
    ):
        G = cfg.num_samples
        problems = []
        if slots < G or slots % G:
            problems.append(f"slots={slots} must be a positive multiple of num_samples={G}")
        div = 1 if mesh is None else sharding.batch_divisor(mesh, rules)
        if mesh is not None and slots % div:
            problems.append(
                f"slots={slots} does not divide the mesh's batch axes ({dict(mesh.shape)}: "
                f"batch split {div} ways); use a multiple of {div}"
            )
        if parked < 0 or parked % div:
            problems.append(f"parked={parked} must be a multiple of the batch split {div}, >= 0")
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
        V = model_cfg.vocab_size
        bad = sorted({t for seq in cfg.action_stops for t in seq if t >= V})
        if bad:
            problems.append(f"action_stops has token id(s) {bad[:5]} outside [0, {V})")
        C = bucket + cfg.max_new_tokens if bucket else 0
        blocks = cfg.kv_blocks or (slots * C // cfg.kv_block_size if cfg.kv_block_size else 0)
        if cfg.kv_block_size and bucket and not problems:
            problems += paged.problems(
                cfg.kv_block_size, cfg.kv_blocks, C, slots, G, bucket, cfg.max_new_tokens, div
            )
        if problems:
            raise ValueError("Invalid generator: " + "; ".join(problems))
        self.cfg, self.slots, self.max_prompt_len = cfg, slots, max_prompt_len
        self.shards = div  # The slots' split over the mesh's batch axes.
        self.model_cfg = model_cfg
        self.layout = None if mesh is None else _Layout(mesh, rules)
        self.static = dict(graphdef=graphdef, model_cfg=model_cfg, cfg=cfg, layout=self.layout)
        self._static = dict(model_cfg=model_cfg, layout=self.layout)  # Row moves' and blocks'.
        self.programs = programs
        rows = dict(model_cfg=model_cfg, cfg=cfg, columns=C)
        self.state = engine.init_state(slots=slots, layout=self.layout, blocks=blocks, **rows)
        rows_parked = parked + slots * cfg.kv_preempt  # A row for each preempted sample.
        self.pool = None  # The parking rows: an engine state of `rows_parked` rows.
        if rows_parked:  # A paged cache's parking rows name the slots' pool's blocks.
            self.pool = engine.init_state(slots=rows_parked, layout=self.layout, blocks=0, **rows)
        # The paged cache's block manager (rows: the slots, then the parking rows).
        pages = (slots + rows_parked, C, cfg.kv_block_size, blocks, not cfg.kv_preempt)
        self.pages = paged.Pages(*pages) if blocks else None
        self.params, self.version, self._stale = None, 0, False
        self.queue: list[tuple[Request, np.ndarray]] = []  # With each request's key data.
        self.free = list(range(slots))
        self.running: dict[int, tuple[Request, int]] = {}  # Slot -> (request, sample g).
        self.partial: dict[int, dict] = {}  # id(request) -> harvested rows so far.
        self.park_free = list(range(rows_parked))
        self.parked: dict[int, tuple[Request, int, int]] = {}  # Row -> (request, g, version).
        self.swapped: dict[int, tuple] = {}  # Preempted: row -> (r, g, version, n, k, v).
        self.admitted: dict[int, int] = {}  # Slot -> when its sample came in (a count).
        self._arrivals = itertools.count()
        self.waiting: dict[int, Turn] = {}  # Handle -> its turn, reported by `step`.
        self.replies: dict[int, np.ndarray | None] = {}  # Handle -> reply (None: end), queued.
        self.where: dict[int, int] = {}  # Handle -> its slot, or `slots` + its parking row.
        self._handles = itertools.count()
        # Replies go in pieces of the largest bucket below the cache's columns (`extend`).
        self.reply_chunk = max(b for b in cfg.buckets if b < bucket + cfg.max_new_tokens)
        self.stats = EngineStats(parking_rows=parked)

    # -- host API --------------------------------------------------------------------------

    def precompile(self, params) -> None:
        """Starts compiling the decode program in the background (`Programs.prefetch`): its
        shapes are the slots' and the weights' (`params`: in the generator's layout, arrays or
        their `jax.ShapeDtypeStruct`s), so a run's first decode does not wait for it. (The
        prefill's depend on the requests admitted together.)"""
        if self.programs is not None:
            args = (params, self.state, *self._replicated(*np.zeros(3, np.int32)))
            self.programs.prefetch("engine_decode", engine.decode, args, self.static)

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

    def reply(self, handle: int, tokens: Sequence[int] | None = None, end: bool = False) -> None:
        """Queues the environment's reply to the turn `handle` (a `Turn` that `step`
        returned); the next `step` appends it before it decodes, in a call of its own (a
        parked sample's once it is back in a slot), and the sample's next turn starts after
        it. The reply's tokens join the completion as environment tokens (`Completed.env_GM`)
        and count against its budget: a reply longer than the turn's `room` is cut to fit,
        and the sample finishes (truncated). An empty reply (no tokens) resumes the sample
        with nothing appended. `tokens=None` or `end=True` ends the episode instead: the
        sample finishes as stopped."""
        turn = self.waiting.get(handle)
        if turn is None:
            queued = " (a reply to it is queued)" if handle in self.replies else ""
            raise ValueError(f"turn {handle} is not waiting for a reply{queued}")
        if end or tokens is None:
            self.replies[handle] = None
        else:
            where = f"reply to turn {handle} (request {turn.request.id!r}, sample {turn.sample})"
            V = self.model_cfg.vocab_size
            bad = [t for t in tokens if not 0 <= int(t) < V]
            if bad:
                raise ValueError(f"{where}: token id(s) {bad[:5]} outside [0, {V})")
            self.replies[handle] = np.asarray(tokens, np.int32)[: turn.room]
        del self.waiting[handle]

    @property
    def busy(self) -> bool:
        """Requests queued or decoding (a sample waiting for a reply counts, parked too)."""
        return bool(self.queue or self.running or self.parked or self.swapped)

    @property
    def live_slots(self) -> int:
        return self.slots - len(self.free)

    @property
    def stalled(self) -> bool:
        """A step would do nothing: every sample in a slot waits for a reply not yet given,
        and no parked sample or queued request can take a slot."""
        idle = {self.where[h] for h in self.waiting} & self.running.keys()
        return len(self.running) == len(idle) and self._plan() == ([], [], 0)

    def step(self, max_steps: int) -> Stepped:
        """Admits queued requests into free slots (parking waiting samples to make room),
        decodes up to `max_steps` tokens per live slot and returns the requests whose
        samples are all done and the samples that stopped at an action (each reported
        once)."""
        if self.params is None:
            raise ValueError("Generator.step before set_params: no weights to sample with")
        self._refresh()
        self._move()
        self._resume()
        self._refresh()  # A sample parked (or preempted) under older weights came back.
        self._apply_replies()
        self._admit()
        if not self.running:
            return Stepped([], [])
        t = time.perf_counter()
        # Waiting requests: stop once they can start, but admit at least an eighth of the
        # slots at a time (each admission is a prefill program that reads every weight).
        G = self.cfg.num_samples
        wanted = max(G, self.slots // 8 // G * G) - len(self.free) if self.queue else 0
        # Turns: stop once an eighth of the slots wait, so their environments start.
        waits = max(1, self.slots // 8) if self.cfg.action_stops else 0
        args = self._replicated(np.int32(max_steps), np.int32(wanted), np.int32(waits))
        idle = set(self.where.values())  # Samples that wait decode nothing.
        self._grow(self._make_room({s: max_steps for s in self.running if s not in idle}))
        self.state, steps, tokens = self._run("engine_decode", engine.decode, args)
        steps, tokens = map(int, sharding.fetch((steps, tokens)))
        self.stats.decode_s += time.perf_counter() - t
        self.stats.steps += steps
        self.stats.slot_steps += steps * self.slots
        self.stats.tokens += tokens
        return self._harvest(steps)

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

    def _limit(self, slot: int) -> int:
        return self.running[slot][0].max_new_tokens or self.cfg.max_new_tokens

    def _columns(self, extra: dict) -> dict:
        """Slot s -> the cache columns its next `extra[s]` tokens reach (within its budget);
        {} without a paged cache (nothing fetched)."""
        if self.pages is None or not extra:
            return {}
        lengths = sharding.fetch(self.state.rows["length_N"])
        return {
            s: self.cfg.bucket(len(self.running[s][0].prompt))
            + min(int(lengths[s]) + n, self._limit(s))
            for s, n in extra.items()
        }

    def _grow(self, columns: dict) -> None:
        """A paged cache: slot s's blocks cover its first `columns[s]` columns (`_columns`),
        and the device's block tables are the host's."""
        if self.pages is None:
            return
        for s, n in columns.items():
            self.pages.grow(s, n)
        if self.pages.dirty:
            old = self.state.cache.table_BN
            table = jax.device_put(self.pages.table[: self.slots], old.sharding)
            self.state = self.state._replace(cache=self.state.cache._replace(table_BN=table))
            self.pages.dirty = False

    def _make_room(self, extra: dict) -> dict:
        """The columns slot s's next `extra[s]` tokens reach; with `cfg.kv_preempt`, after
        preempting the latest samples until the pool holds them (one sample fits: the pool
        holds a whole request)."""
        wants = self._columns(extra)
        while (
            self.pages is not None
            and not self.pages.reserving
            and len(wants) > 1
            and self.pages.short(wants)
        ):
            s = max(wants, key=self.admitted.__getitem__)
            del wants[s]
            self._preempt(s)
        return wants

    def _preempt(self, s: int) -> None:
        """Slot s's sample to a parking row, its blocks' keys and values to the host and
        its blocks back to the pool; the slot left empty."""
        t, p, n = time.perf_counter(), self.park_free.pop(0), self.pages.held(s)
        self.pool = self._moved(self.pool, self.state, [p], [s])
        ids = paged.padded(self.pages.table[s, :n], 1 << (n - 1).bit_length(), self.pages.blocks)
        ids_slot = self._replicated(ids, np.int32([s]))
        k, v, self.state = engine.evict(self.state, *ids_slot, **self._static)
        k, v = sharding.fetch((k, v))
        (r, g), _ = self.running.pop(s), self.admitted.pop(s)
        self.pages.release(s)
        self.free = sorted(self.free + [s])
        self.swapped[p] = (r, g, self.version, n, k, v)
        self.stats.preempted += 1
        self.stats.preempt_s += time.perf_counter() - t

    def _resume(self) -> None:
        """Preempted samples back, the earliest first, each into fresh blocks and a free
        slot, while the pool holds its blocks and one more for each live slot (an empty pool
        takes one back whatever it holds)."""
        S, t = self.slots, time.perf_counter()
        for p in list(self.swapped):
            r, g, version, n, k, v = self.swapped[p]
            room = min(n + len(self.running) + 1, self.pages.blocks)
            if not self.free or len(self.pages.free) < room:
                break
            del self.swapped[p]
            ids = paged.padded(self.pages.own(S + p, n), len(k[0]), self.pages.blocks)
            self.state = engine.blocks_in(self.state, *self._replicated(ids), k, v, **self._static)
            s = engine.take_slots(self.free, 1, S // self.shards)[0]
            self.pages.move(s, S + p)
            self.state = self._moved(self.state, self.pool, [s], [p])
            self.park_free = sorted(self.park_free + [p])
            self.running[s], self.admitted[s] = (r, g), next(self._arrivals)
            self._stale |= version != self.version
            self.stats.resumed += 1
            self._grow({})  # The tables, before a program reads the cache through them.
        self.stats.preempt_s += time.perf_counter() - t

    def _refresh(self):
        if not self._stale:
            return
        if self.running:
            t = time.perf_counter()
            self.state = self._run(
                "engine_refresh", engine.refresh, self._replicated(np.int32(self.version))
            )
            jax.block_until_ready(self.state)
            self.stats.swap_s += time.perf_counter() - t
        else:  # Nothing live: the new version takes effect at the next prefill.
            self.state = self.state._replace(version=self._replicated(np.int32(self.version))[0])
        self._stale = False

    def _plan(self) -> tuple[list[int], list[int], int]:
        """(The handles of the waiting samples to park, of the parked samples to bring back,
        the queued requests to admit): replied parked samples first, then requests, each
        into a free slot or one a waiting sample leaves, as many as the parking rows
        allow."""
        S, G = self.slots, self.cfg.num_samples
        back = [h for h in self.replies if self.where[h] >= S]
        idle = sorted(h for h in self.waiting if self.where[h] < S)  # The latest last.
        room = len(self.free) + min(len(idle), len(self.park_free))
        back = back[:room]
        admit = min(len(self.queue), (room - len(back)) // G)
        park = max(0, len(back) + admit * G - len(self.free))
        return idle[len(idle) - park :], back, admit

    def _move(self):
        """Parks waiting samples and brings parked ones back, as `_plan` says: one
        `engine.move` call each way."""
        if self.pool is None:
            return
        park, back, _ = self._plan()
        if not park and not back:
            return
        t, S = time.perf_counter(), self.slots
        if park:
            slots, rows = [self.where[h] for h in park], self.park_free[: len(park)]
            del self.park_free[: len(park)]
            for h, s, p in zip(park, slots, rows):
                r, g = self.running.pop(s)
                self.parked[p], self.where[h] = (r, g, self.version), S + p
                if self.pages is not None:
                    self.pages.move(S + p, s)
            self.free = sorted(self.free + slots)
            self.pool = self._moved(self.pool, self.state, rows, slots)
            self.stats.parked += len(park)
        if back:
            rows = [self.where[h] - S for h in back]
            slots = [engine.take_slots(self.free, 1, S // self.shards)[0] for _ in back]
            for h, s, p in zip(back, slots, rows):
                r, g, version = self.parked.pop(p)
                self.running[s], self.where[h] = (r, g), s
                if self.pages is not None:
                    self.pages.move(s, S + p)
                self._stale |= version != self.version
            self.park_free = sorted(self.park_free + rows)
            self.state = self._moved(self.state, self.pool, slots, rows)
            self.stats.unparked += len(back)
        jax.block_until_ready((self.state, self.pool))
        self.stats.move_s += time.perf_counter() - t

    def _moved(self, dst, src, dst_rows, src_rows):
        """`engine.move` of `src_rows` into `dst_rows`, padded to a power of two rows."""
        R = 1 << (len(dst_rows) - 1).bit_length()
        size = dst.limit_S.shape[0]
        dst_R = np.full((R,), size, np.int32)  # Padding rows write nothing.
        src_R = np.zeros((R,), np.int32)
        dst_R[: len(dst_rows)], src_R[: len(src_rows)] = dst_rows, src_rows
        args = (dst, src, *self._replicated(dst_R, src_R))
        if self.programs is not None:
            return self.programs.run("engine_move", engine.move, args, self._static)
        return engine.move(*args, **self._static)

    def _admit(self):
        G = self.cfg.num_samples
        fits = min(len(self.free) // G, len(self.queue))
        if self.swapped:  # Preempted samples come back first.
            return
        if self.pages is not None:  # As many as the pool can hold (`_blocks`).
            need = [self._blocks(r) for r, _ in self.queue[:fits]]
            fits = int(np.searchsorted(np.cumsum(need), self.pages.available, side="right"))
        if not fits:
            return
        taken, self.queue = self.queue[:fits], self.queue[fits:]
        by_bucket: dict[int, list] = {}
        for r, keydata in taken:
            by_bucket.setdefault(self.cfg.bucket(len(r.prompt)), []).append((r, keydata))
        for P, reqs in sorted(by_bucket.items()):
            owned = [engine.take_slots(self.free, G, self.slots // self.shards) for _ in reqs]
            for (r, _), own in zip(reqs, owned):
                for g, s in enumerate(own):
                    self.running[s], self.admitted[s] = (r, g), next(self._arrivals)
                if self.pages is not None:
                    self.pages.admit(own, P, [self._limit(own[0])] * G)
            self._grow({})
            rows = engine.prefill_rows(owned, self.slots, self.shards)
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
            self.state = self._run("engine_insert", engine.insert, args)
            jax.block_until_ready(self.state)
            self.stats.prefill_s += time.perf_counter() - t
            self.stats.prefills += 1
            self.stats.prefill_rows += sum(row is not None for row in rows)

    def _blocks(self, r: Request) -> int:
        """The blocks admitting request `r` takes (a paged cache): the most it can hold, or
        with `kv_preempt` its prompt's and one more per sample."""
        P, M = self.cfg.bucket(len(r.prompt)), r.max_new_tokens or self.cfg.max_new_tokens
        G, bs = self.cfg.num_samples, self.cfg.kv_block_size
        if self.cfg.kv_preempt:
            return paged.request_blocks(P, 0, G, bs) + G
        return paged.request_blocks(P, M, G, bs)

    def _apply_replies(self):
        """The queued replies to samples in slots, each appended by its own `engine.extend`
        calls (in pieces of `reply_chunk` tokens), and the episodes ended (in one call); a
        parked sample's reply stays queued until it is back. One reply a call: a prefill's
        rounding depends on the rows it runs with, so a reply batched with whichever others
        came back at the same time would move its sample's numbers with the environment's
        timing; alone, a sample is the same whenever its environment answers (a sync run and
        its resume are equal bit for bit), at the price of a call per reply."""
        pending = {}
        for h in [h for h in self.replies if self.where[h] < self.slots]:
            pending[self.where.pop(h)] = self.replies.pop(h)
        if not pending:
            return
        t = time.perf_counter()
        ended = {s: None for s, x in pending.items() if x is None}
        if ended:
            self._extend(ended)
        for s in sorted(set(pending) - set(ended)):
            x = pending[s]
            self._extend({s: x[: self.reply_chunk]})  # An empty reply too: it resumes the slot.
            for at in range(self.reply_chunk, len(x), self.reply_chunk):
                self._extend({s: x[at : at + self.reply_chunk]})
        jax.block_until_ready(self.state)
        self.stats.reply_s += time.perf_counter() - t

    def _extend(self, pieces: dict):
        """One `engine.extend` call: slot -> the tokens to append (at most `reply_chunk`), or
        None to end its episode."""
        slots = sorted(pieces)
        rows = engine.prefill_rows([[s] for s in slots], self.slots, self.shards)
        T = self.cfg.bucket(max([1] + [len(x) for x in pieces.values() if x is not None]))
        R = len(rows)
        tokens = np.full((R, T), self.cfg.pad_id, np.int32)
        mask = np.zeros((R, T), bool)
        slot_R = np.full((R,), self.slots, np.int32)  # Padding rows write nothing.
        end_R = np.zeros((R,), bool)
        for i, row in enumerate(rows):
            if row is not None:
                slot_R[i] = s = slots[row[0]]
                end_R[i] = pieces[s] is None
                if pieces[s] is not None:
                    tokens[i, : len(pieces[s])] = pieces[s]
                    mask[i, : len(pieces[s])] = True
                    self.stats.env_tokens += len(pieces[s])
        self._grow(self._columns({s: len(x) for s, x in pieces.items() if x is not None}))
        args = self._rows(tokens, mask, slot_R, end_R)
        self.state = self._run("engine_extend", engine.extend, args)

    def _harvest(self, steps: int) -> Stepped:
        finished_S, waiting_S, length_S = sharding.fetch(
            (engine.finished(self.state), self.state.waiting_S, self.state.rows["length_N"])
        )
        done = [s for s in self.running if finished_S[s]]
        self._count_kv(steps, done, length_S)
        held = set(self.where.values())  # Waits reported already.
        waits = sorted(s for s in self.running if waiting_S[s] and s not in held)
        if not done and not waits:
            return Stepped([], [])
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
                "turns": self.state.turn_S,
                "limits": self.state.limit_S,
                "env": self.state.env_SM,
            }
        )
        turns = []
        for s in waits:
            (r, g), n, h = self.running[s], host["lengths"][s], next(self._handles)
            tokens = np.asarray(host["tokens"][s, host["turns"][s] : n])
            self.waiting[h] = Turn(h, r, g, tokens, int(host["limits"][s] - n))
            self.where[h] = s
            turns.append(self.waiting[h])
        completed, G = [], self.cfg.num_samples
        experts = engine.experts_of(self.state, sorted(done))
        for s in sorted(done):
            r, g = self.running.pop(s)
            self.admitted.pop(s, None)
            self.free.append(s)
            if self.pages is not None:
                self.pages.release(s)
            got = self.partial.setdefault(id(r), {})
            got[g] = {k: np.asarray(v[s]) for k, v in host.items()}
            if experts:
                got[g]["experts"] = experts[s]
            if len(got) == G:
                del self.partial[id(r)]
                P = self.cfg.bucket(len(r.prompt))
                completed.append(Completed.of_rows(r, [got[g] for g in range(G)], P))
        self.free.sort()
        return Stepped(completed, turns)

    def _count_kv(self, steps: int, done: list[int], length_S) -> None:
        """`stats`' KV cache use after a decode call of `steps` steps (`EngineStats`)."""
        live = [s for s in self.running if s not in set(done)]
        self.stats.live_tokens += steps * sum(
            len(self.running[s][0].prompt) + int(length_S[s]) for s in live
        )
        if self.pages is None:
            self.stats.kv_columns += steps * self.state.cache.valid_BS.size
            return
        held = set(np.unique(self.pages.table[live]).tolist()) - {self.pages.blocks}
        self.stats.kv_columns += steps * len(held) * self.pages.bs
        self.stats.kv_blocks_peak = max(self.stats.kv_blocks_peak, self.pages.taken_peak)
