"""A pool of worker processes that runs one function with a per-call deadline.

Reward checks run untrusted model output through libraries (sympy, parsers) that can take
unbounded time or memory on adversarial input, and the usual `signal.alarm` timeout only works in
the main thread and cannot interrupt a long C call (a Python big-int power). This module isolates
each check in a persistent worker process instead:

* a call that passes its deadline gets `Result("timeout")`, and its worker is killed with
  SIGKILL and replaced;
* a call whose worker dies (a crash, `os._exit`, the OOM killer, an allocation abort) gets
  `Result("crash")`, and the worker is replaced;
* a call whose function raises gets `Result("error")`; the worker lives on.

Only the sample at fault is lost, and the pool survives. `WorkerPool.map` is safe to call from
any thread and from several threads at once: each call checks out idle workers for itself, so
no two threads ever share a worker's pipe. A call's deadline starts when a ready worker receives
it, so time spent waiting for a free worker, or for a replacement worker to start, is not
counted against it.

Workers are started with the 'forkserver' method by default (fast restarts: the server has the
preloaded modules imported already) or 'spawn'; never with 'fork', which is unsafe in a process
that runs JAX or any other threaded runtime.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

# Statuses of a `Result`.
OK = "ok"
TIMEOUT = "timeout"
ERROR = "error"
CRASH = "crash"

_PR_SET_PDEATHSIG = 1  # From <sys/prctl.h>.
# Workers dying before they report ready, in a row, that mean a broken setup rather than bad luck.
_MAX_STARTUP_FAILURES = 3


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of one call.

    Attributes:
        status: `OK` (the function returned `value`), `TIMEOUT` (it passed its deadline and its
            worker was killed), `ERROR` (it raised; `error` names the exception) or `CRASH` (its
            worker process died).
        value: The function's return value when `status == OK`, else None.
        error: A short description of what went wrong, else None.
    """

    status: str
    value: Any = None
    error: str | None = None


@dataclasses.dataclass
class PoolStats:
    """Cumulative counters of a `WorkerPool`, for logging.

    Attributes:
        calls: Calls finished, whatever their outcome.
        timeouts: Calls that passed their deadline.
        errors: Calls whose function raised.
        crashes: Calls whose worker died.
        restarts: Workers started to replace a killed or dead one.
    """

    calls: int = 0
    timeouts: int = 0
    errors: int = 0
    crashes: int = 0
    restarts: int = 0


def _die_with_parent():
    """Asks Linux to SIGKILL this process when its parent dies (best effort)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _worker_main(conn, fn, initializer, memory_limit_bytes, die_with_parent):
    """Worker loop: runs `fn(*args)` for each `(task_id, args)` received, until EOF or None."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if die_with_parent:
        # A stuck worker would not notice its parent's death by reading the pipe.
        _die_with_parent()
    if memory_limit_bytes:
        # A runaway big-int or expression tree then fails one call with MemoryError instead of
        # taking the host down.
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    if initializer is not None:
        initializer()
    try:
        conn.send(("ready", None, None))
    except OSError:
        return  # The parent is gone.
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_id, args = message
        try:
            reply = (task_id, OK, fn(*args))
        except Exception as e:  # noqa: BLE001  (any failure of the function costs one call)
            # Only the type name and a bounded message: printing some sympy objects can itself
            # take unbounded time.
            reply = (task_id, ERROR, f"{type(e).__name__}: {str(e)[:200]}")
        try:
            conn.send(reply)
        except OSError:
            return  # The parent is gone.
        except Exception as e:  # noqa: BLE001  (an unpicklable return value)
            conn.send((task_id, ERROR, f"cannot send result: {type(e).__name__}"))


_daemon_flag_lock = threading.Lock()


def _start(process):
    """Starts `process`, also from a daemonic process such as a `multiprocessing.Pool` worker.

    `multiprocessing` refuses children of daemonic processes so that they are not orphaned when
    the daemon is terminated. Ours do not outlive it: a fork server's children get SIGKILL when
    the server exits, which it does when its client (this process) dies, and idle workers exit
    on EOF from their pipe. So the daemon flag is lifted for the duration of `start()` (it is
    private `multiprocessing` state, stable since Python 3.4).
    """
    config = multiprocessing.current_process()._config
    if not config.get("daemon"):
        process.start()
        return
    with _daemon_flag_lock:
        config["daemon"] = False
        try:
            process.start()
        finally:
            config["daemon"] = True


class _Worker:
    """A worker process and the parent's end of its pipe."""

    def __init__(self, ctx, fn, initializer, memory_limit_bytes):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        # PR_SET_PDEATHSIG fires when the parent *thread* exits. A fork server's children have
        # the server's main thread as parent; spawned children would have whichever caller
        # thread started them, which may be a short-lived one.
        die_with_parent = ctx.get_start_method() == "forkserver"
        self.process = ctx.Process(
            target=_worker_main,
            args=(child_conn, fn, initializer, memory_limit_bytes, die_with_parent),
            name="rlscale-reward-worker",
            daemon=True,
        )
        _start(self.process)
        # The child holds its own copy; closing ours lets a recv() see EOF when the child dies.
        child_conn.close()
        self.ready = False
        self.started_at = time.monotonic()

    def kill(self):
        try:
            self.process.kill()
        except (OSError, ValueError):
            pass
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self):
        """Asks an idle worker to exit, then makes sure it did."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=1)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()


class WorkerPool:
    """Persistent worker processes that run `fn(*args)` with a deadline per call.

    Example:
        pool = WorkerPool(check, num_workers=4)
        results = pool.map([(pred, gold), ...], timeout=5.0)  # list[Result], in order
        pool.close()

    Args:
        fn: The function to run. It must be picklable by reference (a module-level function of
            an importable module), and so must its arguments and return value.
        num_workers: Number of worker processes.
        initializer: Optional module-level function each worker runs once before it reports
            ready (imports, warm-up); time spent there is not charged to any call.
        start_method: 'forkserver' or 'spawn'.
        preload: Modules the fork server imports once, so that its forks start warm (only with
            'forkserver'; ignored when the process's fork server is already running, since
            `multiprocessing` keeps one per process).
        memory_limit_bytes: Address-space limit of each worker (RLIMIT_AS), or None.
        startup_timeout: Seconds a new worker may take to become ready before the pool gives up
            with a RuntimeError (a broken environment, not a bad sample).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        num_workers: int,
        *,
        initializer: Callable[[], None] | None = None,
        start_method: str = "forkserver",
        preload: Sequence[str] = (),
        memory_limit_bytes: int | None = None,
        startup_timeout: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver" and preload:
            self._ctx.set_forkserver_preload(list(preload))
        self._fn = fn
        self._initializer = initializer
        self._memory_limit_bytes = memory_limit_bytes
        self._startup_timeout = startup_timeout
        self._cond = threading.Condition()
        self._idle: collections.deque[_Worker] = collections.deque()
        self._all: set[_Worker] = set()
        self._stats = PoolStats()
        self._closed = False
        self._startup_failures = 0
        self._task_ids = itertools.count()
        with self._cond:
            for _ in range(num_workers):
                self._add_worker_locked()

    # -- pool bookkeeping (all under self._cond) ------------------------------------------------

    def _add_worker_locked(self) -> _Worker:
        worker = _Worker(self._ctx, self._fn, self._initializer, self._memory_limit_bytes)
        self._all.add(worker)
        self._idle.append(worker)
        return worker

    def _checkout(self, max_count: int, block: bool) -> list[_Worker]:
        with self._cond:
            if block:
                while not self._idle and not self._closed:
                    self._cond.wait()
            if self._closed:
                raise RuntimeError("WorkerPool is closed")
            taken = []
            while self._idle and len(taken) < max_count:
                taken.append(self._idle.popleft())
            return taken

    def _checkin(self, worker: _Worker):
        with self._cond:
            if not self._closed:
                self._idle.append(worker)
                self._cond.notify()
                return
            self._all.discard(worker)
        worker.stop()

    def _replace(self, worker: _Worker) -> _Worker:
        """Kills `worker` and returns a new one that the caller holds (not yet ready)."""
        worker.kill()
        with self._cond:
            self._all.discard(worker)
            if self._closed:
                raise RuntimeError("WorkerPool is closed")
            self._stats.restarts += 1
            new = _Worker(self._ctx, self._fn, self._initializer, self._memory_limit_bytes)
            self._all.add(new)
            return new

    # -- public API ------------------------------------------------------------------------------

    def map(self, args_list: Sequence[tuple], timeout: float) -> list[Result]:
        """Runs `fn(*args)` for each `args`, in parallel over the workers.

        Args:
            args_list: One argument tuple per call.
            timeout: Seconds each call may run once a worker has received it.

        Returns:
            One `Result` per call, in order.
        """
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        results: list[Result | None] = [None] * len(args_list)
        pending = collections.deque(range(len(args_list)))
        held: list[_Worker] = []  # Workers this call has checked out.
        running: dict[_Worker, tuple[int, int, float]] = {}  # worker -> (index, id, deadline)

        def finish(index: int, result: Result):
            results[index] = result
            with self._cond:
                self._stats.calls += 1
                if result.status == TIMEOUT:
                    self._stats.timeouts += 1
                elif result.status == ERROR:
                    self._stats.errors += 1
                elif result.status == CRASH:
                    self._stats.crashes += 1

        try:
            while pending or running:
                # Hold about as many workers as there are calls left to start; block only when
                # holding none, so one thread's big batch cannot starve another thread.
                free_held = [w for w in held if w not in running]
                wanted = len(pending) - len(free_held)
                if wanted > 0:
                    held += self._checkout(wanted, block=not held)
                # Hand the next calls to ready, idle workers; give back the ones not needed.
                for worker in [w for w in held if w not in running]:
                    if pending and worker.ready:
                        index = pending.popleft()
                        task_id = next(self._task_ids)
                        try:
                            worker.conn.send((task_id, args_list[index]))
                        except (OSError, ValueError):
                            # Died while idle (the OOM killer, say): no call is lost.
                            pending.appendleft(index)
                            held[held.index(worker)] = self._replace(worker)
                            continue
                        running[worker] = (index, task_id, time.monotonic() + timeout)
                    elif not pending:
                        held.remove(worker)
                        self._checkin(worker)
                if not held:
                    continue

                now = time.monotonic()
                wait_s = self._startup_timeout
                if running:
                    wait_s = min(wait_s, max(0.0, min(d for _, _, d in running.values()) - now))
                if pending and wanted > 0:
                    # Poll now and then for workers that other threads give back.
                    wait_s = min(wait_s, 0.05)
                ready_conns = multiprocessing.connection.wait([w.conn for w in held], wait_s)

                by_conn = {w.conn: w for w in held}
                for conn in ready_conns:
                    worker = by_conn[conn]
                    try:
                        task_id, status, payload = conn.recv()
                    except (EOFError, OSError):
                        if worker in running:
                            index, _, _ = running.pop(worker)
                            code = worker.process.exitcode
                            finish(index, Result(CRASH, error=f"worker died (exit code {code})"))
                        elif not worker.ready:
                            with self._cond:
                                self._startup_failures += 1
                                failures = self._startup_failures
                            if failures > _MAX_STARTUP_FAILURES:
                                raise RuntimeError(
                                    f"{failures} reward workers in a row died while starting "
                                    "(check the initializer and the memory limit)."
                                ) from None
                        held[held.index(worker)] = self._replace(worker)
                        continue
                    if task_id == "ready":
                        worker.ready = True
                        with self._cond:
                            self._startup_failures = 0
                        continue
                    index, expected_id, _ = running.pop(worker)
                    assert task_id == expected_id, (task_id, expected_id)
                    if status == OK:
                        finish(index, Result(OK, value=payload))
                    else:
                        finish(index, Result(ERROR, error=payload))

                now = time.monotonic()
                for worker, (index, _, deadline) in list(running.items()):
                    if now >= deadline:
                        del running[worker]
                        finish(index, Result(TIMEOUT, error=f"no result after {timeout:g} s"))
                        held[held.index(worker)] = self._replace(worker)
                for worker in held:
                    if not worker.ready and now - worker.started_at > self._startup_timeout:
                        raise RuntimeError(
                            f"A reward worker did not start within {self._startup_timeout:g} s."
                        )
        except BaseException:
            # Workers in an unknown state (mid-call, half-started) are not given back.
            for worker in held:
                if worker in running or not worker.ready:
                    with self._cond:
                        self._all.discard(worker)
                    worker.kill()
                    try:
                        with self._cond:
                            if not self._closed:
                                self._add_worker_locked()
                                self._cond.notify()
                    except Exception:  # noqa: BLE001  (keep the original exception)
                        pass
                else:
                    self._checkin(worker)
            raise
        for worker in held:
            self._checkin(worker)
        return results  # type: ignore[return-value]

    def stats(self) -> PoolStats:
        """Returns a copy of the cumulative counters."""
        with self._cond:
            return dataclasses.replace(self._stats)

    def reset_stats(self):
        with self._cond:
            self._stats = PoolStats()

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for tests and debugging)."""
        with self._cond:
            return sorted(w.process.pid for w in self._all)

    def close(self):
        """Stops the idle workers now; workers busy in other threads' calls stop when those end."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle = list(self._idle)
            self._idle.clear()
            self._all.difference_update(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Only a safety net: processes are daemonic and also die with the interpreter.
        try:
            if not getattr(self, "_closed", True) and os is not None:
                self.close()
        except Exception:  # noqa: BLE001
            pass
