"""One live run per workdir: an exclusive lock on WORKDIR/.lock, held for the run's life.

A second run on a live workdir (a re-launch, a SLURM requeue while the old job still runs)
would write the same checkpoints and `metrics.jsonl`; `hold` refuses it before any work with a
`WorkdirBusyError` (a ValueError, so a command reports it as one `error:` line) that names the
holder's host, pid and start time. The lock is `flock(LOCK_EX | LOCK_NB)` on the file, which
the OS releases when its holder exits however it exits: a run killed with SIGKILL leaves a
stale file that the next run simply locks. The file holds the last taker's host, pid and start
time; only the flock says whether that run still holds it. A filesystem without `flock` (Lustre
mounted without `-o flock`) cannot lock: the run goes on unguarded, with a warning.

In a multi-process job every process shares the workdir and only process 0 takes the lock;
the others learn from it whether it did, so every process of a refused job fails at the same
point instead of waiting in a collective for a process that has exited.
"""

import contextlib
import errno
import fcntl
import json
import os
import socket
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

LOCK_FILE = ".lock"

# flock's errors on a filesystem that has no locks (not a lock someone holds).
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class WorkdirBusyError(ValueError):
    """The workdir is locked by another live run."""


def _holder(fd: int) -> str:
    """The holder that the lock file at `fd` names, as words."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {record['host']}, pid {record['pid']}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        # The holder writes its record just after locking: this is the moment between.
        return "a run that has not yet written its host and pid"


def acquire(workdir: str) -> int | None:
    """Locks `workdir` for this process (creating it if needed) and writes this process's
    record into the lock file; returns the file descriptor, which holds the lock until
    `release` (or the process's exit), or None with a warning where the filesystem has no
    locks.

    Raises:
      WorkdirBusyError: another live process holds the lock; the message names it.
      OSError: the directory or the lock file cannot be created or opened.
    """
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    # Opening never truncates: a refused run must leave the holder's record as it is.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise WorkdirBusyError(
            f"workdir {workdir} is in use by a live run ({holder}; it holds {path}): "
            "stop that run or wait for it to end, or use another workdir"
        ) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in _NO_LOCKS:
            raise
        logging.warning(
            "cannot lock %s (%s): this filesystem has no flock, so nothing stops a second run "
            "from writing into %s at the same time",
            path,
            os.strerror(e.errno),
            workdir,
        )
        return None
    except BaseException:
        os.close(fd)
        raise
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    return fd


def release(fd: int | None) -> None:
    """Releases the lock that `acquire` returned. The file stays: removing it would let a run
    that opened it just before lock a file that no longer has a name, beside a newer one."""
    if fd is None:
        return
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def hold(workdir: str):
    """Holds `workdir`'s lock for the block: taken by process 0, the outcome shared with the
    other processes of a multi-process job, so each raises the same way.

    Raises:
      WorkdirBusyError: another live run holds the workdir (every process raises).
      OSError: process 0 could not create or open the lock file (the others raise
        WorkdirBusyError saying so).
    """
    fd, error = None, None
    if jax.process_index() == 0:
        try:
            fd = acquire(workdir)
        except (OSError, ValueError) as e:
            error = e
    if jax.process_count() > 1:
        refused = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if refused and error is None:
            error = WorkdirBusyError(
                f"workdir {workdir}: process 0 could not lock it (its error names the holder)"
            )
    if error is not None:
        raise error
    try:
        yield
    finally:
        release(fd)
