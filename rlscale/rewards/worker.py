"""The worker side of `sandbox.WorkerPool`: a fork server or a worker in a fresh interpreter, never
the caller's `__main__` (standard library only). See docs/data.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
import pickle
import resource
import signal
import socket
import sys
import traceback
import warnings
from multiprocessing.connection import Connection

# Statuses of a call (`sandbox.Result.status`).
OK = "ok"
ERROR = "error"
# Requests to a fork server.
FORK = "fork"
END = "end"
# The first message of a started process: ready for calls (a worker's initializer has run), or
# failed to start: `(FAILED, None, message)` (an import, the function or the initializer).
READY = "ready"
FAILED = "failed"

_PR_SET_PDEATHSIG = 1  # From <sys/prctl.h>.


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a started process needs before its first call (sent by the pool, pickled).

    Attributes:
        sys_path: The pool's `sys.path`, so that the function's module imports as it does there.
        preload: Modules to import first (the verifier's module, heavy dependencies).
        payload: `pickle.dumps((fn, initializer))`, unpickled after the imports above.
        memory_limit_bytes: Address-space limit of each worker (RLIMIT_AS), or None.
        die_with_parent: Ask Linux to SIGKILL each worker when its parent thread exits (only
            where that parent is a fork server's single thread).
    """

    sys_path: list[str]
    preload: tuple[str, ...]
    payload: bytes
    memory_limit_bytes: int | None
    die_with_parent: bool


def _die_with_parent():
    """Asks Linux to SIGKILL this process when its parent dies (best effort)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _load(setup: Setup):
    """Imports the preload modules and unpickles `(fn, initializer)`."""
    sys.path[:] = setup.sys_path
    for name in setup.preload:
        importlib.import_module(name)
    return pickle.loads(setup.payload)


def worker_main(conn: Connection, fn, initializer, memory_limit_bytes, die_with_parent):
    """Worker loop: runs `fn(*args)` for each `(task_id, args)` received, until EOF or None."""
    # Ctrl-C reaches the whole process group; the pool decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if die_with_parent:
        # A stuck worker would not notice its parent's death by reading the socket.
        _die_with_parent()
    if memory_limit_bytes:
        # A runaway big-int or expression tree then fails one call with MemoryError instead of
        # taking the host down.
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    first = (READY, None, None)
    try:
        if initializer is not None:
            initializer()
    except BaseException as e:  # noqa: BLE001  (the pool reports it and stops starting workers)
        first = (FAILED, None, f"the initializer raised {type(e).__name__}: {e}")
    try:
        conn.send(first)
    except OSError:
        return  # The pool is gone.
    if first[0] == FAILED:
        return
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
            return  # The pool is gone.
        except Exception as e:  # noqa: BLE001  (an unpicklable return value)
            conn.send((task_id, ERROR, f"cannot send result: {type(e).__name__}"))


def _fork_worker(conn: Connection, sock: socket.socket, fd: int, setup: Setup, fn, init) -> int:
    """Forks a worker on socket `fd`; returns its process id (in the server)."""
    with warnings.catch_warnings():  # Python 3.12+ warns if a preload module started threads.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        os.close(fd)
        return pid
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # The verifier's own children are its own.
        conn.close()
        sock.close()
        worker_main(Connection(fd), fn, init, setup.memory_limit_bytes, setup.die_with_parent)
        code = 0
    except BaseException:  # noqa: BLE001  (report, then leave without the server's cleanup)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _Children:
    """The server's workers that have exited, reaped as they exit: pid -> exit code."""

    def __init__(self):
        self.exited: dict[int, int] = {}
        signal.signal(signal.SIGCHLD, self._reap)

    def _reap(self, *_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            self.exited[pid] = os.waitstatus_to_exitcode(status)

    def end(self, pid: int) -> int | None:
        """SIGKILL for worker `pid` unless it has exited; its exit code (negative: the signal)."""
        # With SIGCHLD held back, `pid` cannot be reaped (and reused) between the check and
        # the kill.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            if pid not in self.exited:
                try:
                    os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    self.exited[pid] = os.waitstatus_to_exitcode(status)
                except (ProcessLookupError, ChildProcessError):
                    pass
            return self.exited.pop(pid, None)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def serve(conn: Connection, sock: socket.socket, setup: Setup, fn, init):
    """The fork server's loop: `(FORK, None)` + an fd -> a worker's pid; `(END, pid)` -> its
    exit code (None if it is not this server's worker)."""
    children = _Children()
    while True:
        try:
            request, arg = conn.recv()
        except (EOFError, OSError):
            return  # The pool closed or died; the workers die with this process.
        if request == FORK:
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            conn.send(_fork_worker(conn, sock, fds[0], setup, fn, init))
        elif request == END:
            conn.send(children.end(arg))


def main(argv: list[str]):
    """`argv[1:]` = `{server,worker} FD`: receives its `Setup` on socket FD, then
    serves forks (a server: it first replies READY or FAILED) or calls (a worker)."""
    role, fd = argv[1], int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # The pool decides when its processes stop.
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    try:
        setup = conn.recv()
        fn, init = _load(setup)
    except (EOFError, OSError):
        return
    except BaseException as e:  # noqa: BLE001  (any import failure is reported to the pool)
        conn.send((FAILED, None, f"{type(e).__name__}: {e}"))
        return
    if role == "server":
        conn.send((READY, None, None))
        serve(conn, sock, setup, fn, init)
    else:
        sock.close()
        worker_main(conn, fn, init, setup.memory_limit_bytes, setup.die_with_parent)


if __name__ == "__main__":
    main(sys.argv)
