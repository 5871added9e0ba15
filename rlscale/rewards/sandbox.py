"""A pool of worker processes that runs one function with a per-call deadline: a timeout, a crash or
an exception costs that call only, and the worker is replaced. See docs/data.md.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import multiprocessing.connection
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from rlscale.rewards import worker as worker_lib

# Statuses of a `Result`.
OK = worker_lib.OK
TIMEOUT = "timeout"
ERROR = worker_lib.ERROR
CRASH = "crash"

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


# The worker processes' main program. `-c`, not `-m rlscale.rewards.worker`: `-m` puts the working
# directory first on `sys.path` before the worker's own imports, so a user's file named like a
# standard module (`math.py`, `selectors.py`) there would shadow it. Here `sys.path[0]` is
# rlscale's root until the worker installs the pool's `sys.path`.
_BOOTSTRAP = (
    "import sys; sys.path[0] = sys.argv[1]; "
    "from rlscale.rewards import worker; worker.main(sys.argv[1:])"
)


def _launch(
    role: str, setup: worker_lib.Setup
) -> tuple[subprocess.Popen, Connection, socket.socket]:
    """Starts `rlscale.rewards.worker.main` in a fresh interpreter as ROLE and sends it `setup`.

    Returns the process, a connection to it and the raw socket under that connection (to pass
    file descriptors on). The process runs `_BOOTSTRAP`, so it never imports the caller's
    `__main__`; it finds `rlscale` where this process did and gets this process's `sys.path`
    with its setup.
    """
    ours, theirs = socket.socketpair()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(worker_lib.__file__))))
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, root, role, str(theirs.fileno())],
            stdin=subprocess.DEVNULL,  # A caller reading its script from stdin keeps it.
            pass_fds=[theirs.fileno()],
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    conn = Connection(os.dup(ours.fileno()))
    conn.send(setup)
    return process, conn, ours


class _ForkServer:
    """A `worker` process in its 'server' role: the preloaded modules and the function are
    imported once there, and each worker is a fork of it (fast to start and to replace).

    Raises:
        RuntimeError: The server could not import a preload module or the function (the
            message says which and why), or did not start within `startup_timeout` seconds.
    """

    def __init__(self, setup: worker_lib.Setup, startup_timeout: float):
        self._process, self._conn, self._sock = _launch("server", setup)
        self._lock = threading.Lock()
        try:
            if not self._conn.poll(startup_timeout):
                raise RuntimeError(
                    f"the reward workers' fork server did not start within {startup_timeout:g} s"
                )
            status, _, message = self._conn.recv()
        except (EOFError, OSError):
            self.close()
            raise RuntimeError(
                "the reward workers' fork server exited while starting (exit code "
                f"{self._process.wait()})"
            ) from None
        except BaseException:
            self.close()
            raise
        if status == worker_lib.FAILED:
            self.close()
            raise RuntimeError(f"reward workers cannot load the verifier: {message}")

    def fork(self) -> tuple[int, Connection]:
        """A new worker: its process id and a connection to it."""
        ours, theirs = socket.socketpair()
        with self._lock:
            try:
                self._conn.send((worker_lib.FORK, None))
                socket.send_fds(self._sock, [b"F"], [theirs.fileno()])
                pid = self._conn.recv()
            except (EOFError, OSError):
                ours.close()
                raise RuntimeError(
                    f"the reward workers' fork server died (exit code {self._process.poll()})"
                ) from None
            finally:
                theirs.close()
        return pid, Connection(ours.detach())

    def end(self, pid: int) -> int | None:
        """Kills worker `pid` unless it has exited, and reaps it; its exit code (None if
        unknown)."""
        with self._lock:
            try:
                self._conn.send((worker_lib.END, pid))
                return self._conn.recv()
            except (EOFError, OSError):
                return None

    def close(self):
        """Ends the server (it exits when its socket closes); its remaining workers die with it."""
        with self._lock:
            self._conn.close()
            self._sock.close()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class _Worker:
    """A worker process and the pool's end of its socket."""

    def __init__(self, server: _ForkServer | None, setup: worker_lib.Setup):
        if server is not None:
            self.pid, self.conn = server.fork()
            self._end = lambda: server.end(self.pid)
        else:  # 'spawn': a fresh interpreter of its own.
            process, self.conn, sock = _launch("worker", setup)
            sock.close()
            self.pid = process.pid
            # Popen signals only a process it has not reaped.
            self._end = lambda: (process.kill(), process.wait())[1]
        self.ready = False
        self.started_at = time.monotonic()
        self._exitcode: int | None = None
        self._ended = False

    def kill(self) -> int | None:
        """Kills the worker unless it has exited, and reaps it (once); returns its exit code
        (negative: the signal that ended it; None if unknown)."""
        if not self._ended:
            self._exitcode, self._ended = self._end(), True
        self.conn.close()
        return self._exitcode

    def stop(self):
        """Asks an idle worker to exit, then makes sure it did."""
        try:
            self.conn.send(None)
            self.conn.poll(1)  # EOF once it has exited.
        except (OSError, ValueError):
            pass
        self.kill()


@dataclasses.dataclass
class _MapCall:
    """One `WorkerPool.map` call's bookkeeping: its calls' results, the calls not yet started,
    the workers it has checked out and the ones running a call (index, task id, deadline)."""

    args_list: Sequence[tuple]
    timeout: float
    results: list[Result | None] = dataclasses.field(init=False)
    pending: collections.deque[int] = dataclasses.field(init=False)
    held: list[_Worker] = dataclasses.field(default_factory=list)
    running: dict[_Worker, tuple[int, int, float]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.results = [None] * len(self.args_list)
        self.pending = collections.deque(range(len(self.args_list)))


class WorkerPool:
    """Persistent worker processes that run `fn(*args)` with a deadline per call.

    Example:
        pool = WorkerPool(check, num_workers=4)
        results = pool.map([(pred, gold), ...], timeout=5.0)  # list[Result], in order
        pool.close()

    Args:
        fn: The function to run. It must be picklable by reference (a module-level function of
            an importable module, not of the main script), and so must its arguments and return
            value.
        num_workers: Number of worker processes.
        initializer: Optional module-level function each worker runs once before it reports
            ready (imports, warm-up); time spent there is not charged to any call.
        start_method: 'forkserver' (the pool's own fork server imports the preload modules and
            `fn` once, and each worker is a fork of it) or 'spawn' (each worker is a fresh
            interpreter). Either way the workers run `rlscale.rewards.worker` as their main
            module and never import the caller's.
        preload: Modules to import before `fn`'s (in the fork server, or in each spawned worker).
        memory_limit_bytes: Address-space limit of each worker (RLIMIT_AS), or None.
        startup_timeout: Seconds a new worker may take to become ready before the pool gives up
            with a RuntimeError (a broken environment, not a bad sample).

    Raises:
        ValueError: `fn` or `initializer` is defined in `__main__`.
        RuntimeError: A worker cannot import a preload module or `fn`, or its initializer
            raised (here for 'forkserver', or at the first `map` for 'spawn').
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
        for f in (fn, initializer):
            owner = getattr(f, "__self__", f)  # A bound method pickles its object.
            module = getattr(owner, "__module__", None) or type(owner).__module__
            if f is not None and module == "__main__":
                raise ValueError(
                    f"{getattr(f, '__qualname__', f)!r} is defined in the main script or "
                    "notebook, which worker processes never import: define it in a module"
                )
        forks = start_method == "forkserver"
        self._setup = worker_lib.Setup(
            sys_path=list(sys.path),
            preload=tuple(preload),
            payload=pickle.dumps((fn, initializer)),
            memory_limit_bytes=memory_limit_bytes,
            # The server's single thread is its workers' parent; a spawned worker's parent is
            # whichever caller thread started it, which may be a short-lived one.
            die_with_parent=forks,
        )
        self._server = _ForkServer(self._setup, startup_timeout) if forks else None
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
        worker = _Worker(self._server, self._setup)
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
        self._close_server_if_done()

    def _close_server_if_done(self):
        """The fork server outlives a closed pool's last busy worker (it reaps them), no more."""
        with self._cond:
            server = self._server if self._closed and not self._all else None
            if server is not None:
                self._server = None
        if server is not None:
            server.close()

    def _replace(self, worker: _Worker) -> _Worker:
        """Kills `worker` and returns a new one that the caller holds (not yet ready)."""
        worker.kill()
        with self._cond:
            self._all.discard(worker)
            if not self._closed:
                self._stats.restarts += 1
                new = _Worker(self._server, self._setup)
                self._all.add(new)
                return new
        self._close_server_if_done()
        raise RuntimeError("WorkerPool is closed")

    # -- one map call's steps (`_MapCall`) -------------------------------------------------------

    def _finish(self, call: _MapCall, index: int, result: Result):
        call.results[index] = result
        with self._cond:
            self._stats.calls += 1
            if result.status == TIMEOUT:
                self._stats.timeouts += 1
            elif result.status == ERROR:
                self._stats.errors += 1
            elif result.status == CRASH:
                self._stats.crashes += 1

    def _dispatch(self, call: _MapCall) -> int:
        """Checks out workers and hands the next calls to the ready, idle ones; gives back those
        not needed. Returns how many more workers the call wanted."""
        held, pending, running = call.held, call.pending, call.running
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
                    worker.conn.send((task_id, call.args_list[index]))
                except (OSError, ValueError):
                    # Died while idle (the OOM killer, say): no call is lost.
                    pending.appendleft(index)
                    held[held.index(worker)] = self._replace(worker)
                    continue
                running[worker] = (index, task_id, time.monotonic() + call.timeout)
            elif not pending:
                held.remove(worker)
                self._checkin(worker)
        return wanted

    def _wait(self, call: _MapCall, wanted: int) -> list:
        """Waits for messages from the held workers until the next deadline."""
        now = time.monotonic()
        wait_s = self._startup_timeout
        if call.running:
            wait_s = min(wait_s, max(0.0, min(d for _, _, d in call.running.values()) - now))
        if call.pending and wanted > 0:
            # Poll now and then for workers that other threads give back.
            wait_s = min(wait_s, 0.05)
        return multiprocessing.connection.wait([w.conn for w in call.held], wait_s)

    def _receive(self, call: _MapCall, worker: _Worker):
        """Handles one message from `worker`: ready, failed to start, a result, or its death."""
        held, running = call.held, call.running
        conn = worker.conn
        try:
            task_id, status, payload = conn.recv()
        except (EOFError, OSError):
            if worker in running:
                index, _, _ = running.pop(worker)
                code = worker.kill()
                self._finish(call, index, Result(CRASH, error=f"worker died (exit code {code})"))
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
            return
        if task_id == worker_lib.READY:
            worker.ready = True
            with self._cond:
                self._startup_failures = 0
            return
        if task_id == worker_lib.FAILED:
            raise RuntimeError(f"a reward worker could not start: {payload}")
        index, expected_id, _ = running.pop(worker)
        assert task_id == expected_id, (task_id, expected_id)
        if status == OK:
            self._finish(call, index, Result(OK, value=payload))
        else:
            self._finish(call, index, Result(ERROR, error=payload))

    def _expire(self, call: _MapCall):
        """Times out the calls past their deadline (their workers replaced); fails when a worker
        takes longer than `startup_timeout` to start."""
        held, running = call.held, call.running
        now = time.monotonic()
        for worker, (index, _, deadline) in list(running.items()):
            if now >= deadline:
                del running[worker]
                self._finish(
                    call, index, Result(TIMEOUT, error=f"no result after {call.timeout:g} s")
                )
                held[held.index(worker)] = self._replace(worker)
        for worker in held:
            if not worker.ready and now - worker.started_at > self._startup_timeout:
                raise RuntimeError(
                    f"A reward worker did not start within {self._startup_timeout:g} s."
                )

    def _abandon(self, call: _MapCall):
        """After an exception: gives back the call's idle workers; workers in an unknown state
        (mid-call, half-started) are killed and replaced in the pool, not given back."""
        for worker in call.held:
            if worker in call.running or not worker.ready:
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
        self._close_server_if_done()

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
        call = _MapCall(args_list, timeout)
        try:
            while call.pending or call.running:
                wanted = self._dispatch(call)
                if not call.held:
                    continue
                ready_conns = self._wait(call, wanted)
                by_conn = {w.conn: w for w in call.held}
                for conn in ready_conns:
                    self._receive(call, by_conn[conn])
                self._expire(call)
        except BaseException:
            self._abandon(call)
            raise
        for worker in call.held:
            self._checkin(worker)
        return call.results  # type: ignore[return-value]

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
            return sorted(w.pid for w in self._all)

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
        self._close_server_if_done()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Only a safety net: the workers also end with this process (the fork server sees EOF,
        # and its workers get SIGKILL with it; idle spawned workers see EOF).
        try:
            if not getattr(self, "_closed", True) and os is not None:
                self.close()
        except Exception:  # noqa: BLE001
            pass
