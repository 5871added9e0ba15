"""The sandboxed Python executor (`rlscale.envs.sandbox`): ordinary code runs and is reported;
each adversarial snippet ends within its limits, with the host unaffected and none of its
processes left; bad limits fail naming their keys. Time limits are the sandbox's own: the
tests assert the outcome, never a duration. The tests that need user namespaces are skipped
where `unshare -rn true` fails; the rest run the "rlimits" isolation everywhere."""

import concurrent.futures
import errno
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
import uuid

import numpy
import pytest

from rlscale import sections
from rlscale.envs import sandbox
from rlscale.envs.sandbox import SandboxLimits, run_python

_UNSHARE = shutil.which("unshare")
HAVE_NAMESPACES = bool(_UNSHARE) and subprocess.run([_UNSHARE, "-rn", "true"]).returncode == 0
needs_namespaces = pytest.mark.skipif(
    not HAVE_NAMESPACES, reason="user namespaces are unavailable here (`unshare -rn true` fails)"
)
BOTH = pytest.mark.parametrize(
    "isolation", [pytest.param("namespaces", marks=needs_namespaces), "rlimits"]
)


def limits(isolation="namespaces", **overrides):
    return SandboxLimits(isolation=isolation, **{"wall_seconds": 5.0, **overrides})


def sleeper(token, **popen):
    """Code that starts a process whose command line holds `token`, so the host can find it."""
    args = ", ".join(f"{k}={v!r}" for k, v in popen.items())
    return (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
        f"{token!r}]{', ' + args if args else ''})\n"
    )


def processes_with(*parts: bytes):
    """Host process ids whose command line holds every one of `parts`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # It ended meanwhile.
            continue
        if all(part in cmdline for part in parts):
            found.append(int(pid))
    return found


def leftovers(token: str):
    """The processes a call may have left: those holding `token`, and this process's sandbox
    children (their command line holds its id as an argument)."""
    ours = f"\0{os.getpid()}\0".encode()
    return processes_with(token.encode()) + processes_with(b"sandbox_child", ours)


# ---- ordinary code -------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize(
    "code,status,exit_code,stdout,stderr",
    [
        ("print(1 + 1)", "ok", 0, "2\n", []),
        (
            "x = 1\nprint(x)\n1 / 0",
            "error",
            1,
            "1\n",
            [
                'Traceback (most recent call last):\n  File "<string>", line 3, in <module>\n'
                "    1 / 0\n",
                "ZeroDivisionError: division by zero\n",
            ],
        ),
        ("import sys\nprint('bye')\nsys.exit(3)", "error", 3, "bye\n", []),
        ("raise SystemExit('no')", "error", 1, "", ["no\n"]),
        ("print(", "error", 1, "", ['  File "<string>", line 1\n', "SyntaxError: "]),
    ],
    ids=["print", "exception", "exit_status", "exit_message", "syntax_error"],
)
def test_code_runs_like_python_c(isolation, code, status, exit_code, stdout, stderr):
    result = run_python(code, limits(isolation))
    assert (result.status, result.exit_code, result.stdout) == (status, exit_code, stdout)
    assert all(part in result.stderr for part in stderr), result.stderr
    assert result.stderr.startswith(stderr[0] if stderr else "")
    assert result.stderr == "" or stderr


@BOTH
def test_a_file_written_in_the_working_directory_is_readable_then_gone(isolation):
    code = (
        "import os\n"
        "print(sorted(os.listdir('.')))\n"
        "open('notes.txt', 'w').write('kept')\n"
        "print(open('notes.txt').read(), os.getcwd())\n"
    )
    first = run_python(code, limits(isolation))
    second = run_python(code, limits(isolation))
    assert first.status == second.status == "ok", first.stderr
    listing, text, cwd = first.stdout.split()
    assert (listing, text) == ("[]", "kept")
    assert second.stdout.split()[:2] == ["[]", "kept"]  # A fresh directory each call.
    if isolation == "rlimits":
        assert not os.path.exists(cwd)  # A host directory, deleted after the call.


@BOTH
def test_the_environment_is_scrubbed(isolation, monkeypatch):
    monkeypatch.setenv("RLSCALE_SANDBOX_SECRET", "hunter2")
    result = run_python("import os; print(sorted(os.environ))", limits(isolation))
    assert result.status == "ok"
    assert "RLSCALE_SANDBOX_SECRET" not in result.stdout and "PATH" in result.stdout


@needs_namespaces
def test_calls_in_parallel_threads_each_get_their_own_sandbox():
    code = "import os; open('mine', 'w').write('x'); print(len(os.listdir('.')), {})"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(code.format(i), limits()), range(8)))
    assert [r.stdout for r in results] == [f"1 {i}\n" for i in range(8)]


@needs_namespaces
def test_site_packages_are_importable_only_when_asked_for():
    if os.path.dirname(os.path.dirname(numpy.__file__)) not in site.getsitepackages():
        pytest.skip("numpy comes from PYTHONPATH here, which the sandbox ignores (python -I)")
    code = "import numpy; print(numpy.arange(4).sum())"
    assert run_python(code, limits(site_packages=True)).stdout == "6\n"
    plain = run_python(code, limits())
    assert plain.status == "error" and "ModuleNotFoundError" in plain.stderr


# ---- adversarial code ----------------------------------------------------------------------


@BOTH
def test_an_infinite_loop_times_out_and_its_process_tree_is_gone(isolation):
    token = uuid.uuid4().hex
    code = sleeper(token) + "print('looping')\nwhile True:\n    pass\n"
    result = run_python(code, limits(isolation, wall_seconds=1))
    assert (result.status, result.exit_code) == ("timeout", None)
    assert result.stdout == "looping\n"  # What it printed before the deadline is kept.
    if isolation == "namespaces":  # The rlimits mode kills the group without waiting.
        assert leftovers(token) == []


@BOTH
def test_the_cpu_limit_ends_a_busy_loop(isolation):
    busy = limits(isolation, wall_seconds=30, cpu_seconds=1)
    result = run_python("while True:\n    pass\n", busy)
    assert (result.status, result.exit_code) == ("timeout", -signal.SIGXCPU)


@needs_namespaces
def test_a_fork_bomb_is_contained():
    token = uuid.uuid4().hex
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_python(sleeper(token) + bomb, limits(max_processes=8, wall_seconds=1))
    assert result.status == "timeout"
    assert leftovers(token) == []
    assert subprocess.run(["true"]).returncode == 0  # The host still starts processes.


@needs_namespaces
def test_max_processes_bounds_processes_and_exiting_ends_them():
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print(n, e.errno)\n"
    )
    result = run_python(code, limits(max_processes=8))
    assert result.status == "ok", result.stderr
    assert result.stdout.split() == ["7", str(errno.EAGAIN)]  # 7 children and the code.
    assert leftovers(uuid.uuid4().hex) == []


@BOTH
def test_a_10_gb_allocation_fails_inside(isolation):
    result = run_python("x = bytearray(10 * 1024**3)\nprint(len(x))", limits(isolation))
    assert result.status == "memory" and result.stdout == ""
    assert result.stderr.rstrip().endswith("MemoryError")


@BOTH
def test_printing_100_mb_is_cut_at_the_output_limit(isolation):
    cap = 1 << 16
    result = run_python("print('x' * 100_000_000)", limits(isolation, output_bytes=cap))
    assert (result.status, result.exit_code) == ("output_limit", None)
    kept, marker = result.stdout.rstrip("\n").rsplit("\n", 1)
    assert kept == "x" * cap and "output truncated" in marker


@needs_namespaces
def test_a_grandchild_that_outlives_the_code_is_killed():
    token = uuid.uuid4().hex
    code = sleeper(token, start_new_session=True) + (
        "import os\n"
        "if os.fork() == 0:\n"  # A classic daemon too: its own session, parent gone.
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        argv = [sys.executable, '-c', 'import time; time.sleep(60)', "
        f"{token!r}]\n"
        "        os.execv(sys.executable, argv)\n"
        "    os._exit(0)\n"
        "print('left', p.pid)\n"
    )
    result = run_python(code, limits())
    assert result.status == "ok" and result.stdout.startswith("left"), result.stderr
    assert leftovers(token) == []


@needs_namespaces
def test_there_is_no_network():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"for address in [('1.1.1.1', 80), ('127.0.0.1', {port})]:\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=2)\n"
            "        print('connected')\n"
            "    except OSError as e:\n"
            "        print(e.errno)\n"
        )
        result = run_python(code, limits())
        with pytest.raises(BlockingIOError):
            server.accept()  # Nothing reached the host's localhost.
    assert result.stdout.split() == [str(errno.ENETUNREACH)] * 2, result.stderr


@needs_namespaces
def test_host_files_are_absent(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o600)
    code = (
        "import os\n"
        f"for path in ['/etc/shadow', '/etc/passwd', {str(secret)!r}]:\n"
        "    try:\n"
        "        open(path).read()\n"
        "        print('read')\n"
        "    except OSError as e:\n"
        "        print(e.errno)\n"
        "print(*os.listdir('/etc'))\n"
        "print(*sorted(os.listdir('/')))\n"
    )
    result = run_python(code, limits())
    *errors, etc, root = result.stdout.splitlines()
    assert errors == [str(errno.ENOENT)] * 3, result.stderr
    assert etc in ("", "ld.so.cache")
    # The system directories, and the first directory of the Python installation's path.
    python_top = os.path.realpath(sys.executable).split(os.sep)[1]
    expected = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp"}
    expected |= {"usr"}
    assert set(root.split()) <= expected | {python_top}, root


@needs_namespaces
@pytest.mark.skipif(os.geteuid() != 0, reason="the host is not root: the code runs as its user")
def test_as_root_the_code_holds_an_unprivileged_host_uid():
    token = uuid.uuid4().hex
    code = sleeper(token) + "print(p.wait())\n"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(run_python, code, limits(wall_seconds=30))
        uids = None
        while uids is None and not call.done():
            for pid in processes_with(token.encode()):
                with open(f"/proc/{pid}/status") as f:
                    uids = next(line.split()[1:] for line in f if line.startswith("Uid:"))
                os.kill(pid, signal.SIGKILL)  # Ends the call.
            time.sleep(0.01)
        result = call.result()
    assert uids == ["65534"] * 4
    assert (result.status, result.stdout) == ("ok", f"{-signal.SIGKILL}\n")


@needs_namespaces
def test_writing_outside_the_working_directory_fails(tmp_path):
    outside = str(tmp_path / "escape.txt")
    code = (
        "import sys\n"
        f"paths = [{outside!r}, '/escape.txt', '/usr/escape.txt', sys.prefix + '/escape.txt']\n"
        "for path in paths:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print(e.errno, path)\n"
    )
    result = run_python(code, limits())
    lines = [line.split(" ", 1) for line in result.stdout.splitlines()]
    assert [e for e, _ in lines] == [str(errno.ENOENT)] + [str(errno.EROFS)] * 3, result.stdout
    assert not any(os.path.exists(path) for _, path in lines)


@needs_namespaces
def test_the_code_cannot_undo_its_confinement():
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "remount = libc.mount(None, b'/', None, ctypes.c_ulong(32 | 4096), None)\n"
        "print(remount, ctypes.get_errno())\n"
        "print(libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"
        "try:\n"
        "    os.open('/proc/1/fd/0', os.O_RDONLY)\n"  # The sandbox's init: its fds and socket.
        "except OSError as e:\n"
        "    print(-1, e.errno)\n"
    )
    result = run_python(code, limits())
    assert result.stdout.split("\n")[:3] == [
        f"-1 {errno.EPERM}",  # No remounting / read-write.
        f"-1 {errno.EPERM}",  # No new user or mount namespace.
        f"-1 {errno.EACCES}",
    ], result.stderr


# ---- limits --------------------------------------------------------------------------------


def test_bad_limits_fail_naming_their_keys():
    with pytest.raises(sections.InvalidConfigError) as e:
        SandboxLimits(cpu_seconds=0, wall_seconds=-1.0, memory_bytes=1, isolation="vm")
    assert e.value.problems == [
        "tool.wall_seconds=-1.0 must be > 0",
        "tool.cpu_seconds=0 must be > 0",
        "tool.memory_bytes=1 must be an integer >= 67108864",
        "tool.isolation='vm' must be 'namespaces' or 'rlimits'",
    ]


def test_without_namespaces_construction_fails_unless_rlimits_are_asked_for(monkeypatch):
    monkeypatch.setattr(sandbox, "namespaces_unavailable", lambda: "unshare: EPERM")
    with pytest.raises(sections.InvalidConfigError) as e:
        SandboxLimits()
    (problem,) = e.value.problems
    assert problem.startswith("tool.isolation='namespaces' cannot run here: unshare: EPERM.")
    assert "tool.isolation='rlimits'" in problem
    assert SandboxLimits(isolation="rlimits").isolation == "rlimits"


@needs_namespaces
def test_the_namespaces_check_passes_where_user_namespaces_work():
    assert sandbox.namespaces_unavailable() is None
