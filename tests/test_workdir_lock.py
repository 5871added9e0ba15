"""The workdir lock with real processes: a second run on a live workdir fails at start-up
naming the holder and writing nothing; a holder killed with SIGKILL leaves a lock the next
run takes."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import subprocess_env

from rlscale import workdir_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Takes the lock the way a run does, says so, and keeps it until killed.
HOLDER = """
import sys, time
from rlscale import workdir_lock
workdir_lock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def _snapshot(workdir):
    """Every file under `workdir` with its size, modification time and contents."""
    files = {}
    for d, _, names in os.walk(workdir):
        for name in names:
            path = os.path.join(d, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                files[path] = (st.st_size, st.st_mtime_ns, f.read())
    return files


@pytest.fixture
def holder(tmp_path):
    """A process holding `tmp_path / "run"`'s lock; killed (SIGKILL) at the end if alive."""
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(workdir)],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "locked\n"
        yield proc, workdir
    finally:
        proc.kill()
        proc.wait()


def test_second_run_fails_naming_the_holder_and_a_killed_holders_lock_is_taken(holder):
    proc, workdir = holder
    (workdir / "metrics.jsonl").write_text('{"step": 0}\n')  # The live run's output so far.
    before = _snapshot(workdir)
    r = subprocess.run(
        [sys.executable, "-m", "rlscale.main", "--config", "configs/quickstart.py",
         "--workdir", str(workdir)],
        cwd=ROOT, env=subprocess_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = r.stdout + r.stderr
    assert r.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert f"host {socket.gethostname()}, pid {proc.pid}," in errors[0], errors
    assert f"workdir {workdir} is in use by a live run" in errors[0], errors
    assert _snapshot(workdir) == before  # Nothing written, the holder's record included.

    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The stale file stays and names the dead holder; the next taker locks it and names itself.
    assert json.loads((workdir / ".lock").read_text())["pid"] == proc.pid
    fd = workdir_lock.acquire(str(workdir))
    try:
        record = json.loads((workdir / ".lock").read_text())
        assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
    finally:
        workdir_lock.release(fd)


def test_lock_is_held_for_the_block_and_released_when_it_raises(tmp_path):
    workdir = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="the run failed"):
        with workdir_lock.hold(workdir):
            # flock locks per open file: a second open, even in this process, is refused.
            with pytest.raises(workdir_lock.WorkdirBusyError, match=f"pid {os.getpid()},"):
                workdir_lock.acquire(workdir)
            raise RuntimeError("the run failed")
    workdir_lock.release(workdir_lock.acquire(workdir))


def test_a_filesystem_without_locks_runs_unguarded_with_a_warning(tmp_path, monkeypatch, caplog):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(workdir_lock.fcntl, "flock", no_flock)
    with workdir_lock.hold(str(tmp_path)):
        pass
    assert "this filesystem has no flock" in caplog.text and str(tmp_path / ".lock") in caplog.text
