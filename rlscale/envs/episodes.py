"""Episodes: the generator engine driven through environments. `Episodes` wraps a
`Generator` with the interface the drivers use (`submit`, `step`, `busy`, `set_params`,
`stats`) and plays each sample's episode: every turn the engine stops at goes, as text, to
the sample's own environment on a worker thread; the replies that come back are appended
at the next step; the limits of `EnvConfig` end what runs too long. A single-turn
environment (no stops) passes the engine's completions through untouched.

Each finished request comes back as an `Episode`: the engine's completion and, per sample,
how its episode went (`Episode.stats`), which scoring and the step's metrics read.

Dimension letters: G samples per request.
"""

import concurrent.futures
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from rlscale.envs.protocol import Reply
from rlscale.envs.registry import EnvConfig, EnvFactory
from rlscale.sampling.generator import Completed, Generator, Request, Stepped

# How an episode ended (`Episode.stats["end"]`): the policy ended its sample (end of
# sequence); the environment ended it (`Reply.done`); the token budget ran out; the next turn
# would pass `env.max_turns`; a call passed `env.call_seconds`; the episode passed
# `env.episode_seconds`; the environment raised (or answered something not a `Reply`).
END_REASONS = ("stop", "env", "length", "turns", "call_time", "episode_time", "error")
# Ends that score 0 unless the environment gave a reward: the episode did not finish.
FAILED_ENDS = ("call_time", "episode_time", "error")
# A reply's text is cut to this many characters per token of `env.reply_tokens` before it
# is tokenized (no vocabulary piece is longer), so a huge tool output costs no more to
# tokenize than its kept tokens.
CHARS_PER_TOKEN = 32

log = logging.getLogger(__name__)


class Episode(NamedTuple):
    """A request's G finished episodes: the engine's completion, and per sample [G] (None
    for a single-turn environment) `end` (one of `END_REASONS`), `turns` (policy turns),
    `calls` (`Environment.step` calls), `seconds` (in those calls), `env_reward` (the
    environment's `Reply.reward`, NaN where it gave none), `fixed_reward` (the reward the
    episode's end fixes, NaN where the verifier decides: the environment's, else 0 for a
    failed end) and `info/<key>` (its `Reply.info` counters, summed over the turns)."""

    completed: Completed
    stats: dict[str, np.ndarray] | None

    @property
    def request(self) -> Request:
        return self.completed.request


@dataclasses.dataclass
class _Sample:
    """One sample's episode while it runs."""

    made: concurrent.futures.Future  # Its environment, made and reset (a worker's job).
    start: float | None = None  # When its request started decoding (monotonic seconds).
    turns: int = 0  # Turns the policy ended with a stop.
    calls: int = 0
    written: int = 0  # Completion tokens so far: its turns and the replies appended.
    seconds: float = 0.0
    end: str | None = None
    env_reward: float = math.nan
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Call:
    """An `Environment.step` call in flight for a sample's turn (`Turn.handle`)."""

    sample: _Sample
    room: int  # The turn's room: the reply tokens the sample can take.
    future: concurrent.futures.Future | None = None
    started: float | None = None  # Set by the worker when the call starts.


class Workers:
    """`n` daemon threads that run jobs in the order submitted (`submit` returns the job's
    future). A job abandoned at a deadline (`abandon`) keeps its thread until it returns, if it
    ever does: another thread starts in its place, so `n` stay free for the other episodes'
    calls, and the one left behind ends when its job returns. Daemon threads: a call that
    never returns does not hold the process at its exit (a `ThreadPoolExecutor` joins its
    threads then, so one stuck tool would keep a finished run from exiting)."""

    def __init__(self, n: int, name: str):
        self.name, self.started = name, 0
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.abandoned: set[concurrent.futures.Future] = set()
        for _ in range(n):
            self._start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self.jobs.put((future, fn, args))
        return future

    def abandon(self, future: concurrent.futures.Future) -> None:
        """Nobody waits for `future` any more: cancelled if not started; if running, a new
        thread takes its thread's place."""
        if future.cancel():
            return
        with self.lock:
            if not future.done():
                self.abandoned.add(future)
                self._start()

    def close(self) -> None:
        """Cancels the jobs not started; each thread ends when it comes free."""
        with self.lock:
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            for _ in range(self.started):
                self.jobs.put(None)

    def _start(self) -> None:
        self.started += 1
        name = f"{self.name}_{self.started}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result, error = fn(*args), None
            except BaseException as e:  # The future's to raise.
                result, error = None, e
            with self.lock:  # Atomic with `abandon`'s check: done, or abandoned.
                left_behind = future in self.abandoned
                self.abandoned.discard(future)
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
            if left_behind:
                return


class Episodes:
    """The generator's samples as episodes of `factory`'s environments (one per sample).

    Environments are made, reset and stepped on `cfg.workers` threads (`Workers`), never on
    the thread that calls `step` (the decode thread): a sample whose turn waits decodes nothing
    while the others go on (in its slot, or parked to give the slot to a queued request:
    `Generator(parked=...)`), and when every sample in a slot waits and nothing can take a
    slot, `step` blocks on the calls (until one returns or the nearest deadline) instead of
    spinning. A call ended at a limit leaves its thread behind and another takes its place.

    Args:
      generator: the engine (`SamplingConfig.action_stops`: the environment's stops).
      factory: makes one episode's environment (`registry.make_factory`).
      tokenizer: decodes each turn's exact token ids to the text the environment reads, and
        encodes its replies (no special tokens).
      cfg: the limits of an episode.
    """

    def __init__(self, generator: Generator, factory: EnvFactory, tokenizer, cfg: EnvConfig):
        self.gen, self.factory, self.tokenizer, self.cfg = generator, factory, tokenizer, cfg
        self.multi_turn = factory.multi_turn
        self.pool = None
        if self.multi_turn:
            self.pool = Workers(cfg.workers, "rlscale-env")
        self.samples: dict[tuple[int, int], _Sample] = {}  # (id(request), g) -> its episode.
        self.calls: dict[int, _Call] = {}  # Turn handle -> the call the turn waits for.
        self.unstarted: dict[int, Request] = {}  # id(request) -> a request not yet decoding.
        self._logged_error = False

    # -- the generator's interface ---------------------------------------------------------

    def set_params(self, params, version: int) -> None:
        self.gen.set_params(params, version)

    @property
    def busy(self) -> bool:
        return self.gen.busy

    @property
    def stats(self):
        return self.gen.stats

    def close(self) -> None:
        """Stops the workers; a call still running finishes on its own thread, if ever (a
        sandboxed tool kills its own process at its limit)."""
        if self.pool is not None:
            self.pool.close()

    def submit(self, requests: Sequence[Request], problems: Sequence) -> None:
        """Queues `requests`; `problems[i]` is request i's problem, which each of its G
        samples' environments is reset with (on a worker)."""
        if len(requests) != len(problems):
            raise ValueError(f"{len(requests)} requests but {len(problems)} problems")
        self.gen.submit(requests)
        if not self.multi_turn:
            return
        for r, problem in zip(requests, problems):
            self.unstarted[id(r)] = r
            for g in range(self.gen.cfg.num_samples):
                made = self.pool.submit(self._make, problem)
                self.samples[(id(r), g)] = _Sample(made)

    def step(self, max_steps: int) -> Stepped:
        """Applies the replies that came back (ends the episodes past a limit), decodes up to
        `max_steps` tokens per live slot, sends the turns that stopped to their environments,
        and returns the requests whose episodes all finished (`Episode`s)."""
        if not self.multi_turn:
            stepped = self.gen.step(max_steps)
            return Stepped([Episode(c, None) for c in stepped.completed], [])
        self._settle()
        if self._stalled():
            self._wait()
            self._settle()
            if self._stalled():
                return Stepped([], [])
        t = time.monotonic()
        stepped = self.gen.step(max_steps)
        self._start_clocks(t)
        for turn in stepped.waiting:
            self._turn(turn)
        return Stepped([self._finished(c) for c in stepped.completed], [])

    # -- the workers' side -----------------------------------------------------------------

    def _make(self, problem):
        env = self.factory()
        env.reset(problem)
        return env

    @staticmethod
    def _call(call: _Call, text: str):
        """(The reply or what the environment raised, the seconds the call took)."""
        call.started = time.monotonic()
        try:
            out = call.sample.made.result()  # Made before: its job was queued first.
            out = out.step(text)
        except Exception as e:  # Whatever a user's environment raises ends its episode.
            out = e
        return out, time.monotonic() - call.started

    # -- the decode thread's side ----------------------------------------------------------

    def _start_clocks(self, t: float) -> None:
        """Each request that started decoding in the step begun at `t`: its samples' episode
        clocks start then."""
        if not self.unstarted:
            return
        for r, _ in list(self.gen.running.values()):
            if self.unstarted.pop(id(r), None) is not None:
                for g in range(self.gen.cfg.num_samples):
                    self.samples[(id(r), g)].start = t

    def _turn(self, turn) -> None:
        """A turn that stopped: to its environment, unless the episode is out of time."""
        s = self.samples[(id(turn.request), turn.sample)]
        if s.start is None:  # Admitted and stopped within one step.
            s.start = time.monotonic()
        s.turns += 1
        s.written += len(turn.tokens)
        if time.monotonic() >= s.start + self.cfg.episode_seconds:
            return self._end(turn.handle, s, "episode_time")
        s.calls += 1
        call = _Call(s, turn.room)
        text = self.tokenizer.decode(turn.tokens.tolist())
        call.future = self.pool.submit(self._call, call, text)
        self.calls[turn.handle] = call

    def _settle(self) -> None:
        """The calls that came back, answered (or their episodes ended); those past a
        deadline, their episodes ended."""
        now = time.monotonic()
        for handle, call in list(self.calls.items()):
            s, started = call.sample, call.started
            if call.future.done():
                del self.calls[handle]
                self._answer(handle, call)
            elif started is not None and now >= started + self.cfg.call_seconds:
                s.seconds += now - started
                self._end(handle, s, "call_time")
            elif now >= s.start + self.cfg.episode_seconds:
                s.seconds += 0.0 if started is None else now - started
                self._end(handle, s, "episode_time")

    def _answer(self, handle: int, call: _Call) -> None:
        s = call.sample
        reply, seconds = call.future.result()
        s.seconds += seconds
        try:
            if isinstance(reply, Exception):
                raise reply
            if not isinstance(reply, Reply):
                raise TypeError(f"step returned {type(reply).__name__}, not a Reply")
            for k, v in reply.info.items():
                s.info[k] = s.info.get(k, 0.0) + float(v)
            reward = None if reply.reward is None else float(reply.reward)
        except Exception as e:  # A reply we cannot read: the environment's error.
            reply = e
        if isinstance(reply, Exception):
            if not self._logged_error:  # Once: the count is in the metrics (env/ended_error).
                self._logged_error = True
                log.warning("env.name=%r failed: %r (its episode ends)", self.cfg.name, reply)
            return self._end(handle, s, "error")
        if reply.done:
            s.env_reward = math.nan if reward is None else reward
            return self._end(handle, s, "env")
        if s.turns >= self.cfg.max_turns:
            return self._end(handle, s, "turns")
        n = self.cfg.reply_tokens
        ids = self.tokenizer.encode(reply.text[: n * CHARS_PER_TOKEN])[:n]
        s.written += min(len(ids), call.room)
        self.gen.reply(handle, ids)

    def _end(self, handle: int, s: _Sample, reason: str) -> None:
        s.end = reason
        call = self.calls.pop(handle, None)
        if call is not None:  # Past a limit: nobody reads its reply.
            self.pool.abandon(call.future)
        self.gen.reply(handle, end=True)

    def _stalled(self) -> bool:
        """Every sample in a slot waits for its environment and nothing can take a slot: a
        step would do nothing."""
        return bool(self.calls) and self.gen.stalled

    def _wait(self) -> None:
        """Until a call returns or the nearest deadline (a call not yet started, queued
        behind the others, can start and time out no sooner than `call_seconds` from now)."""
        now, cfg = time.monotonic(), self.cfg
        deadlines = [c.sample.start + cfg.episode_seconds for c in self.calls.values()]
        for c in self.calls.values():
            started = c.started
            deadlines.append((now if started is None else started) + cfg.call_seconds)
        concurrent.futures.wait(
            [c.future for c in self.calls.values()],
            timeout=max(0.0, min(deadlines) - now),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    def _finished(self, c: Completed) -> Episode:
        G = len(c.lengths_G)
        samples = [self.samples.pop((id(c.request), g)) for g in range(G)]
        self.unstarted.pop(id(c.request), None)
        end = [s.end or ("length" if c.truncated_G[g] else "stop") for g, s in enumerate(samples)]
        env_reward = np.array([s.env_reward for s in samples])
        failed = np.isin(end, FAILED_ENDS)
        stats: dict[str, Any] = {
            "end": np.array(end),
            # The turns that stopped, and a last one the policy wrote after the last reply.
            "turns": np.array(
                [s.turns + int(c.lengths_G[g] > s.written) for g, s in enumerate(samples)]
            ),
            "calls": np.array([s.calls for s in samples]),
            "seconds": np.array([s.seconds for s in samples]),
            "env_reward": env_reward,
            "fixed_reward": np.where(
                ~np.isnan(env_reward), env_reward, np.where(failed, 0.0, np.nan)
            ),
        }
        for key in sorted({k for s in samples for k in s.info}):
            stats[f"info/{key}"] = np.array([s.info.get(key, 0.0) for s in samples])
        return Episode(c, stats)
