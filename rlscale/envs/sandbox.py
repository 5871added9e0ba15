"""Sandboxed Python for tool-integrated RL: `run_python(code, limits)` runs code a policy wrote in
a fresh, confined interpreter and returns its output (`ExecResult`). It owns the limits of one
call (`SandboxLimits`, the `tool.` keys) and the host's side of a call: starting the child
(`sandbox_child`, which sets the confinement up), writing its user namespace's maps, reading
its output through capped pipes, and killing its whole process tree at the deadline.
docs/environments.md has the mechanism, the measured calls per second and the limits.

Contained, with `isolation="namespaces"` (the default; Linux on x86-64 with user namespaces),
each call in its own user, mount, network, pid, IPC, UTS and cgroup namespaces:
  * files: the code sees a root of its own, holding the system directories and the Python
    installation read-only, a few devices, its own /proc, and a fresh tmpfs of
    `workdir_bytes` at /tmp (its working directory, gone with the call). The rest of the
    host's filesystem (/etc/shadow, /home, /root, the host's /tmp) is absent, and nothing
    outside /tmp is writable. Under a root host it runs as uid and gid 65534 on the host, so
    root's permissions never apply (and RLIMIT_NPROC, which never binds uid 0, does);
  * network: none (only a loopback interface, down): not the internet, not the host's
    localhost, not its abstract unix sockets;
  * privileges: no capability over its mounts and namespaces (a nested user namespace), and
    a seccomp filter refuses new namespaces, mounts, ptrace, keyrings, BPF and io_uring;
  * resources: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE,
    RLIMIT_CORE=0, and output read through a cap;
  * processes: the code is pid 2 under an init of ours; killing that init ends every process
    the code started, daemons included, before `run_python` returns;
  * environment: only PATH, HOME, TMPDIR, LANG and one-thread BLAS settings.
Not contained: the rlimits are per process, so the code's processes together may hold
`max_processes` x `memory_bytes` and use every core until the deadline (there is no cgroup);
the kernel is shared (a bug reachable through the allowed syscalls is an escape); the exposed
directories are readable, and timing and the CPU model are observable.

`isolation="rlimits"` (asked for explicitly, weaker) keeps only the rlimits, a fresh working
directory and the scrubbed environment: the code runs as the host's user, can read and write
whatever that user can, has the host's network, and a process that leaves the call's process
group survives the deadline; RLIMIT_NPROC counts all the user's processes, and under a root
host does not bind.
"""

import dataclasses
import functools
import math
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from rlscale import sections
from rlscale.envs import sandbox_child

# `ExecResult.status` values.
OK = "ok"  # The code ran to the end (exit status 0).
ERROR = "error"  # It raised, or exited with a nonzero status.
TIMEOUT = "timeout"  # It passed `wall_seconds` (and was killed) or `cpu_seconds` (SIGXCPU).
MEMORY = "memory"  # It ended with MemoryError (`memory_bytes`).
OUTPUT_LIMIT = "output_limit"  # It printed more than `output_bytes` (and was killed).
KILLED = "killed"  # A signal ended it (a crash, SIGKILL, the OOM killer).
STATUSES = (OK, ERROR, TIMEOUT, MEMORY, OUTPUT_LIMIT, KILLED)

NAMESPACES, RLIMITS = "namespaces", "rlimits"

# The ids a root host maps the sandbox to: nobody / nogroup.
_UNPRIVILEGED_ID = 65534
# Seconds the host waits for the tree to end after killing it (it takes milliseconds).
_KILL_GRACE = 5.0
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); import sandbox_child; del sys.path[0]; "
    "sandbox_child.main(sys.argv[2:])"
)
_CHILD_DIR = os.path.dirname(os.path.abspath(sandbox_child.__file__))
_THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code): it could not be set up on this machine."""


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """What one call did.

    Attributes:
        status: One of `STATUSES`.
        stdout: What the code printed, decoded as UTF-8 (errors replaced), cut at the output
            limit with a marker line.
        stderr: The same for stderr (the traceback when the code raised).
        exit_code: The code's exit status, minus the signal that ended it, or None when the
            sandbox killed it (`timeout` at the wall-clock deadline, `output_limit`).
        seconds: Wall-clock time of the call, set-up included.
    """

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float


@dataclasses.dataclass(frozen=True)
class SandboxLimits(sections.Section):
    """The limits of one tool call (the `tool.` config keys). `wall_seconds` of wall-clock time
    and `cpu_seconds` of CPU time per process (rounded up to whole seconds); `memory_bytes` of
    address space per process; `output_bytes` of stdout and stderr together (the rest is cut
    and the call killed); `max_processes` processes and threads, the code's own included;
    files of at most `file_bytes`; `open_files` file descriptors; a working directory of
    `workdir_bytes` (namespaces only: a tmpfs). `isolation`: "namespaces", or "rlimits" (weaker,
    see the module docstring). `site_packages`: whether the code may import the packages of
    this Python environment (numpy, sympy...), exposed read-only; off, only the standard
    library (and a faster start).

    With "namespaces", construction fails, naming what is missing, where the machine cannot
    run them (the check runs one call, once per process)."""

    wall_seconds: float = 10.0
    cpu_seconds: float = 5.0
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 16
    max_processes: int = 16
    file_bytes: int = 16 << 20
    open_files: int = 64
    workdir_bytes: int = 64 << 20
    isolation: str = NAMESPACES
    site_packages: bool = False

    def problems(self) -> list[str]:
        problems = []
        for key in ("wall_seconds", "cpu_seconds"):
            value = getattr(self, key)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                problems.append(f"tool.{key}={value!r} must be > 0")
        for key, low in (
            ("memory_bytes", 64 << 20),  # The interpreter maps about 13 MiB before any import.
            ("output_bytes", 1),
            ("max_processes", 1),
            ("file_bytes", 1),
            ("open_files", 8),
            ("workdir_bytes", 1 << 16),
        ):
            problems += sections.at_least(f"tool.{key}", getattr(self, key), low)
        if self.isolation not in (NAMESPACES, RLIMITS):
            problems.append(
                f"tool.isolation={self.isolation!r} must be {NAMESPACES!r} or {RLIMITS!r}"
            )
        elif self.isolation == NAMESPACES and (reason := namespaces_unavailable()):
            problems.append(
                f"tool.isolation={NAMESPACES!r} cannot run here: {reason}. It needs Linux on "
                "x86-64 with user namespaces enabled (sysctls user.max_user_namespaces > 0, "
                "kernel.unprivileged_userns_clone=1 where it exists, and no AppArmor "
                "restriction of unprivileged user namespaces); or set "
                f"tool.isolation={RLIMITS!r} to run with rlimits only (weaker: the host's "
                "files, network and user)"
            )
        return problems


@functools.cache
def namespaces_unavailable() -> str | None:
    """Why the "namespaces" isolation cannot run on this machine, or None: found by running
    one call, once per process."""
    machine = os.uname().machine
    if not sys.platform.startswith("linux") or machine != "x86_64":
        return f"this is {sys.platform} on {machine}"
    with sections.deferred():
        limits = SandboxLimits()
    try:
        result = _execute("print('ok')", limits, NAMESPACES)
    except SandboxError as e:
        return str(e)
    if result.status != OK or result.stdout != "ok\n":
        return f"a trial call ended {result.status!r}: {result.stderr[-300:]!r}"
    return None


def run_python(code: str, limits: SandboxLimits) -> ExecResult:
    """Runs `code` as `python -c` would, confined by `limits` (see the module docstring).

    Thread-safe: calls may run in parallel threads, each with its own processes.

    Raises:
        SandboxError: The sandbox could not be set up (never because of what the code does).
    """
    return _execute(code, limits, limits.isolation)


def _execute(code: str, limits: SandboxLimits, isolation: str) -> ExecResult:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="rlscale-tool-") if isolation == RLIMITS else None
    ours, theirs = socket.socketpair()
    try:
        proc = _start(limits, isolation, theirs.fileno(), workdir)
    except BaseException:
        ours.close()
        _remove(workdir)
        raise
    finally:
        theirs.close()
    call = _Call(proc, ours, limits.output_bytes)
    try:
        try:
            proc.stdin.write(code.encode("utf-8", errors="replace"))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # It died at start: the output says why.
        call.supervise(start + limits.wall_seconds)
    finally:
        call.close()
        _remove(workdir)
    return call.result(isolation, time.monotonic() - start)


def _start(limits, isolation, ctrl_fd, workdir) -> subprocess.Popen:
    """The child (`sandbox_child.main`), reading the code from its stdin."""
    python = sys.executable if limits.site_packages else os.path.realpath(sys.executable)
    numbers = {**dataclasses.asdict(limits), "cpu_seconds": math.ceil(limits.cpu_seconds)}
    argv = [
        python,
        "-I",
        *(() if limits.site_packages else ("-S",)),
        "-c",
        _BOOTSTRAP,
        _CHILD_DIR,
        isolation,
        str(ctrl_fd),
        str(os.getpid()),
        workdir or "",
        *(str(numbers[name]) for name in sandbox_child.LIMITS),
    ]
    home = workdir or "/tmp"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, **_THREADS}
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, "LANG": "C.UTF-8"},
        cwd=workdir or "/",
        pass_fds=[ctrl_fd],
        # Its own process group, for the rlimits mode's kill. No `extra_groups` (the child
        # drops root's groups itself): it would make Popen fork rather than vfork, whose cost
        # grows with the host's memory (a 4 GiB host: 8 calls/s instead of 20).
        start_new_session=True,
    )


def _remove(workdir):
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def _write_maps(pid: int):
    """Maps uid and gid 0 of the child's new user namespace to 65534 (a root host) or to the
    host's own ids (anyone else may map only those)."""
    root = os.geteuid() == 0
    uid, gid = (_UNPRIVILEGED_ID,) * 2 if root else (os.geteuid(), os.getegid())
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


class _Call:
    """The host side of one call: reads the child's stdout, stderr and messages (capped), and
    kills its tree at the deadline or the output limit."""

    def __init__(self, proc: subprocess.Popen, ctrl: socket.socket, cap: int):
        self.proc, self.ctrl, self.cap = proc, ctrl, cap
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.cut = set()  # The streams that lost bytes to the cap.
        self.pending = b""  # An incomplete message.
        self.failure = None  # Why the sandbox failed, from the child or the host.
        self.init_pid = self.init_pidfd = self.code_status = None
        self.timed_out = self.killed = self.mapped = False
        self.deadline = math.inf
        try:
            self.exit_fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # Before Linux 5.3: polled.
            self.exit_fd = None

    def supervise(self, deadline: float):
        selector = selectors.DefaultSelector()
        streams = {self.proc.stdout.fileno(): "stdout", self.proc.stderr.fileno(): "stderr"}
        for fd, name in streams.items():
            selector.register(fd, selectors.EVENT_READ, name)
        selector.register(self.ctrl.fileno(), selectors.EVENT_READ, "ctrl")
        if self.exit_fd is not None:
            selector.register(self.exit_fd, selectors.EVENT_READ, "exit")
        self.deadline = deadline
        while not self._exited():
            now = time.monotonic()
            if now >= self.deadline:
                if self.killed:  # The tree outlived its kill by _KILL_GRACE: force it.
                    self.proc.kill()
                    break
                self.timed_out = True
                self._kill()
            wait = self.deadline - now
            for key, _ in selector.select(wait if self.exit_fd is not None else min(wait, 0.02)):
                if key.data != "exit":
                    self._read(key.fd, key.data, selector)
        # Processes the rlimits mode's code left behind in its group (the namespaces' are gone).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # Not reaped yet: the id is still ours.
        except ProcessLookupError:
            pass
        for fd, name in [*streams.items(), (self.ctrl.fileno(), "ctrl")]:
            if fd in selector.get_map():
                os.set_blocking(fd, False)
                while fd in selector.get_map() and self._read(fd, name, selector):
                    pass
        selector.close()
        self.proc.wait()

    def _exited(self) -> bool:
        """Whether the child has exited, leaving it unreaped (its id stays ours). The selector
        wakes the loop on its pidfd; `select.select` would fail on a host past 1024 fds."""
        info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return info is not None

    def _read(self, fd, name, selector) -> bool:
        """Reads one chunk; False at the end of the stream or when nothing is waiting."""
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            selector.unregister(fd)
            return False
        if name == "ctrl":
            self._messages(chunk)
            return True
        room = self.cap - len(self.out["stdout"]) - len(self.out["stderr"])
        self.out[name] += chunk[: max(room, 0)]
        if len(chunk) > room:
            self.cut.add(name)
            self._kill()
        return True

    def _messages(self, chunk: bytes):
        """Acts on the child's messages, in their one valid order: `u`, `p PID`, then `s
        STATUS`; `f MESSAGE` at any point. Others are ignored (none comes from the code,
        which cannot reach the socket, but the host does not rely on that)."""
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        self.pending = self.pending[-4096:]
        for line in lines:
            kind, _, value = line.decode(errors="replace").partition(" ")
            if kind == "f" and self.failure is None:
                self.failure = value
            elif kind == "u" and not self.mapped:
                self.mapped = True
                try:
                    _write_maps(self.proc.pid)
                    self.ctrl.sendall(b"m")
                except OSError as e:
                    self.failure = f"writing the user namespace's maps: {e}"
                    self._kill()
            elif kind == "p" and self.mapped and self.init_pid is None and value.isdigit():
                self.init_pid = int(value)
                try:
                    self.init_pidfd = os.pidfd_open(self.init_pid)
                except (AttributeError, OSError):
                    pass
            elif kind == "s" and self.init_pid and self.code_status is None and value.isdigit():
                self.code_status = int(value)

    def _kill(self):
        """Kills the tree: its pid namespace's init if known (the kernel then kills the rest,
        and the child exits once it is all gone), else the process group."""
        if self.killed:
            return
        self.killed = True
        self.deadline = time.monotonic() + _KILL_GRACE
        try:
            if self.init_pidfd is not None:
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
            elif self.init_pid is not None:
                os.kill(self.init_pid, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self):
        if self.proc.returncode is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr, self.ctrl):
            try:
                f.close()
            except OSError:  # stdin's unwritten code, after the child died.
                pass
        for fd in (self.exit_fd, self.init_pidfd):
            if fd is not None:
                os.close(fd)

    def result(self, isolation: str, seconds: float) -> ExecResult:
        stdout, stderr = (self._text(name) for name in ("stdout", "stderr"))
        if self.failure is not None:
            output = f" (stderr: {stderr.strip()[-500:]!r})" if stderr.strip() else ""
            raise SandboxError(f"the sandbox failed: {self.failure}{output}")
        if isolation == NAMESPACES and self.code_status is None and not self.killed:
            if self.init_pid is None:  # The code never started.
                raise SandboxError(f"the sandbox failed to start: {stderr.strip()[-500:]!r}")
            return ExecResult(KILLED, stdout, stderr, None, seconds)
        if self.cut:
            return ExecResult(OUTPUT_LIMIT, stdout, stderr, None, seconds)
        if self.timed_out:
            return ExecResult(TIMEOUT, stdout, stderr, None, seconds)
        if isolation == NAMESPACES:
            exit_code = os.waitstatus_to_exitcode(self.code_status)
        else:
            exit_code = self.proc.returncode
        status = _status(exit_code, self.out["stderr"])
        return ExecResult(status, stdout, stderr, exit_code, seconds)

    def _text(self, name: str) -> str:
        text = self.out[name].decode("utf-8", errors="replace")
        if name in self.cut:
            text += f"\n[output truncated: stdout and stderr passed {self.cap} bytes]\n"
        return text


def _status(exit_code: int, stderr: bytes) -> str:
    if exit_code == 0:
        return OK
    if exit_code > 0:
        last = stderr.rstrip().rsplit(b"\n", 1)[-1]
        return MEMORY if last.startswith(b"MemoryError") else ERROR
    return TIMEOUT if -exit_code == signal.SIGXCPU else KILLED
