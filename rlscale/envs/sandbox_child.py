"""The child side of `rlscale.envs.sandbox`: the program that runs one call's code.

`sandbox.run_python` starts it as `python -I -S -c BOOTSTRAP DIR ...` and writes the code to its
stdin; it uses only the standard library, and imports nothing heavy before the code runs. The
host and the child talk over a socket (`ctrl`), one line a message: the child sends `u` (in its
new namespaces: write my user and group maps), `p PID` (G's process id on the host), `s STATUS`
(H's wait status) or `f MESSAGE` (the sandbox itself failed); the host answers `u` with `m`.

In the "namespaces" mode three processes run:
  C  the interpreter started: enters new user, mount, network, pid, IPC, UTS and cgroup
     namespaces, waits for the host to map it (to uid and gid 65534 when the host is root,
     else to the host's own ids), forks G and waits for it.
  G  pid 1 of the new pid namespace: builds the root (`_build_root`), forks H, reaps every
     process left to it until H ends and reports H's wait status. When G exits, the kernel
     kills whatever is left in the namespace, so the host ends the whole tree by killing G.
  H  the code: a nested user namespace (no capability over the mounts and namespaces above),
     the rlimits, no_new_privs and a seccomp filter (`_filter_program`), then the code as
     `__main__`.
In the "rlimits" mode C sets the rlimits and runs the code itself, in the host's directory.
"""

import _signal
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_NAMESPACES = (
    CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
) | CLONE_NEWCGROUP

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SECCOMP_MODE_FILTER = 2
SYS_PIVOT_ROOT = 155  # x86-64.

# The order of the limits in the command line.
LIMITS = (
    "cpu_seconds",
    "memory_bytes",
    "max_processes",
    "file_bytes",
    "open_files",
    "workdir_bytes",
)

# Host paths the sandbox sees (read-only), besides the Python installation; devices bound too.
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_DEV_LINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
}
# Built by `_build_root` itself: never bound from the host.
_SPECIAL = ("/proc", "/sys", "/dev", "/tmp")
# Where the new root is mounted, in the sandbox's own mount namespace (the host's is untouched).
_ROOT = "/tmp"

_libc = None


def _call(name, *args):
    """libc's `name(*args)`, raising OSError on -1."""
    global _libc
    import ctypes

    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    result = getattr(_libc, name)(*args)
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")
    return result


def _ulong(value):
    import ctypes

    return ctypes.c_ulong(value)


def _mount(source, target, fstype=None, flags=0, data=None):
    encode = lambda s: None if s is None else os.fsencode(s)
    try:
        _call("mount", encode(source), encode(target), encode(fstype), _ulong(flags), encode(data))
    except OSError as e:
        raise OSError(e.errno, f"mount {fstype or 'bind'} on {target}: {e.strerror}") from None


def _send(ctrl, message: bytes):
    os.write(ctrl, message + b"\n")


def _fail(ctrl, message: str):
    """Reports that the sandbox (not the code) failed, and exits."""
    try:
        _send(ctrl, b"f " + message.replace("\n", " ").encode(errors="replace"))
    finally:
        os._exit(70)


def _die_with_parent(parent_pid=None):
    """SIGKILL when the parent dies (cleared by a change of ids, so set after them)."""
    _call("prctl", PR_SET_PDEATHSIG, _ulong(_signal.SIGKILL))
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # The parent died first.


def _read_all(fd) -> str:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def main(argv):
    """C's program; see the module docstring. Never returns."""
    isolation, ctrl, host_pid, workdir, *numbers = argv
    ctrl, limits = int(ctrl), dict(zip(LIMITS, map(int, numbers), strict=True))
    try:
        _die_with_parent(int(host_pid))
        if os.geteuid() == 0:
            try:
                os.setgroups([])  # Root's supplementary groups would stay with the code.
            except PermissionError:
                pass  # Not the real root (a user namespace's): its groups are not root's.
        code = _read_all(0)
    except OSError as e:
        _fail(ctrl, f"starting: {e}")
    if isolation == "rlimits":
        try:
            os.chdir(workdir)
            _set_rlimits(limits)
        except OSError as e:
            _fail(ctrl, f"setting up: {e}")
        os.close(ctrl)
        _run(code)
    try:
        _call("unshare", _NAMESPACES)
        _send(ctrl, b"u")
        if os.read(ctrl, 1) != b"m":
            os._exit(1)  # The host gave up.
    except OSError as e:
        _fail(ctrl, f"entering new user, mount, network, pid, IPC, UTS and cgroup namespaces: {e}")
    pid = os.fork()
    if pid == 0:
        try:
            _init(ctrl, code, limits)
        finally:
            os._exit(70)  # Never past here, whatever happened.
    _send(ctrl, b"p %d" % pid)
    os.waitpid(pid, 0)
    os._exit(0)


def _init(ctrl, code, limits):
    """G: pid 1 of the new pid namespace."""
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # pid 1 would take it from the code.
    try:
        _build_root(limits["workdir_bytes"])
    except OSError as e:
        _fail(ctrl, f"building the sandbox's root: {e}")
    pid = os.fork()
    if pid == 0:
        try:
            _code_process(ctrl, code, limits)
        finally:
            os._exit(70)  # Never into G's loop below, whatever happened.
    while True:  # Orphans of the code are reparented here: reap them too.
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if done == pid:
            _send(ctrl, b"s %d" % status)
            os._exit(0)


def _exposed() -> list[str]:
    """The host paths the sandbox sees: the system directories and the Python installation
    (this interpreter, its prefixes, its `sys.path`), none inside another."""
    candidates = {
        *_SYSTEM,
        sys.base_prefix,
        sys.prefix,
        os.path.dirname(sys.executable),
        os.path.dirname(os.path.realpath(sys.executable)),
        *sys.path,
    }
    out = []
    for path in sorted(os.path.abspath(p) for p in candidates if p and os.path.lexists(p)):
        inside = lambda p, q: p == q or p.startswith(q.rstrip("/") + "/")
        if path == "/" or any(inside(path, q) for q in (*out, *_SPECIAL)):
            continue
        out.append(path)
    return out


def _bind_read_only(fd, target, device):
    _mount(f"/proc/self/fd/{fd}", target, flags=MS_BIND)
    # A remount in a user namespace must keep the flags the host's mount is locked with.
    host = os.statvfs(target).f_flag
    kept = host & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    if host & 4096:  # ST_RELATIME
        kept |= MS_RELATIME
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept | (0 if device else MS_NODEV)
    _mount(None, target, flags=flags)


def _build_root(workdir_bytes):
    """G's filesystem: a new root holding only the exposed paths (read-only), a few devices,
    /proc of the new pid namespace and a writable tmpfs of `workdir_bytes` at /tmp, the working
    directory; the host's other files are absent. G takes its mapped ids (unprivileged on the
    host) after opening the paths it binds, which the host's user may reach and it may not."""
    paths = _exposed()
    links = {p: os.readlink(p) for p in paths if os.path.islink(p)}
    dirs = {p for p in paths if os.path.isdir(p)}
    sources = [p for p in paths if p not in links] + [p for p in _DEVICES if os.path.exists(p)]
    fds = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in sources}
    _mount(None, "/", flags=MS_REC | MS_PRIVATE)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    _die_with_parent()
    # The code runs as the same user: without this it could open G's /proc/1/fd/ and write
    # to the host's socket (a forged pid there would be killed at the deadline).
    _call("prctl", PR_SET_DUMPABLE, _ulong(0))
    os.umask(0o022)
    _mount("tmpfs", _ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path, target in {**links, **_DEV_LINKS}.items():
        os.makedirs(_ROOT + os.path.dirname(path), exist_ok=True)
        os.symlink(target, _ROOT + path)
    for path, fd in fds.items():
        target = _ROOT + path
        if path in dirs:
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        _bind_read_only(fd, target, device=path in _DEVICES)
        os.close(fd)
    os.mkdir(_ROOT + "/tmp")
    data = f"size={workdir_bytes},nr_inodes=16384,mode=0700"
    _mount("tmpfs", _ROOT + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, data)
    os.mkdir(_ROOT + "/proc")
    try:  # Refused where the host's /proc is partly hidden (as in Docker): then none.
        _mount("proc", _ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except OSError:
        pass
    os.chdir(_ROOT)
    _call("syscall", _ulong(SYS_PIVOT_ROOT), b".", b".")
    _call("umount2", b".", MNT_DETACH)
    _mount(None, "/", flags=MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/tmp")
    _call("sethostname", b"sandbox", _ulong(7))


def _code_process(ctrl, code, limits):
    """H: drops what G could do, then runs the code."""
    try:
        _call("unshare", CLONE_NEWUSER)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        _set_rlimits(limits)
        _call("prctl", PR_SET_NO_NEW_PRIVS, _ulong(1), _ulong(0), _ulong(0), _ulong(0))
        _install_filter()
    except OSError as e:
        _fail(ctrl, f"dropping privileges: {e}")
    os.close(ctrl)
    _run(code)


def _set_rlimits(limits):
    cpu, memory = limits["cpu_seconds"], limits["memory_bytes"]
    for kind, value, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at `cpu`, SIGKILL a second later.
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_NPROC, limits["max_processes"], limits["max_processes"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"], limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        old_hard = resource.getrlimit(kind)[1]
        if old_hard != resource.RLIM_INFINITY:  # A hard limit can only go down.
            hard = min(hard, old_hard)
        resource.setrlimit(kind, (min(value, hard), hard))


# Syscalls the code may not make (x86-64 numbers), failing with EPERM: new namespaces and
# mounts (which a nested user namespace would allow: a tmpfs there is memory no rlimit
# bounds), tracing and reading other processes, kernel keyrings, BPF, io_uring (whose
# operations bypass this filter), module and kexec loading, and the like.
_DENIED = (
    101, 103, 155, 161, 165, 166, 167, 168, 169, 172, 173, 175, 176, 246, 248, 249, 250, 272,
    298, 303, 304, 308, 310, 311, 312, 313, 320, 321, 323, 425, 426, 427, 428, 429, 430, 431,
    432, 433, 438, 442, 467,
)  # fmt: skip
_CLONE, _CLONE3 = 56, 435
_AUDIT_ARCH_X86_64 = 0xC000003E
_RET_ALLOW, _RET_KILL, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS = 1, 38


def _filter_program() -> bytes:
    """The classic-BPF seccomp program: the wrong architecture or the x32 ABI is killed or
    refused; `clone` with a namespace flag and every `_DENIED` syscall fail with EPERM; `clone3`
    fails with ENOSYS (its flags live in memory a filter cannot read, and libc then falls back
    to `clone`); anything else is allowed."""
    import struct

    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    deny, enosys, clone = "deny", "enosys", "clone"
    prog = [
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, _AUDIT_ARCH_X86_64),
        (ret, 0, 0, _RET_KILL),
        (ld, 0, 0, 0),  # seccomp_data.nr
        (jge, deny, 0, 0x40000000),  # The x32 ABI.
        (jeq, clone, 0, _CLONE),
        (jeq, enosys, 0, _CLONE3),
        *((jeq, deny, 0, nr) for nr in _DENIED),
        (ret, 0, 0, _RET_ALLOW),
        clone,
        (ld, 0, 0, 16),  # The low half of seccomp_data.args[0]: clone's flags.
        (jset, deny, 0, _NAMESPACES),
        (ret, 0, 0, _RET_ALLOW),
        enosys,
        (ret, 0, 0, _RET_ERRNO | _ENOSYS),
        deny,
        (ret, 0, 0, _RET_ERRNO | _EPERM),
    ]
    labels, code = {}, []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(code)
        else:
            code.append(item)
    out = b""
    for i, (op, jt, jf, k) in enumerate(code):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        out += struct.pack("=HBBI", op, jt, jf, k)
    return out


def _install_filter():
    import ctypes

    program = _filter_program()

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    fprog = SockFprog(len(program) // 8, program)
    _call("prctl", PR_SET_SECCOMP, _ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog))


def _run(code: str):
    """Runs `code` as `python -c` would (a fresh `__main__`; a traceback on stderr and exit
    status 1 if it raises), with stdout line-buffered so that a call killed at its deadline
    keeps what it printed. Never returns: see `_exit`."""
    import builtins

    sys.stdout.reconfigure(line_buffering=True)
    sys.argv[:] = ["-c"]
    module = type(sys)("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    try:
        exec(compile(code, "<string>", "exec"), module.__dict__)
    except SystemExit as e:
        _exit(e)
    except BaseException as e:  # noqa: BLE001  (reported as python -c reports it)
        try:
            import linecache
            import traceback

            linecache.cache["<string>"] = (len(code), None, code.splitlines(True), "<string>")
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        finally:
            _exit(SystemExit(1))
    _exit(SystemExit(0))


def _exit(e: SystemExit):
    """Ends the process as the interpreter's exit would (non-daemon threads joined, atexit
    functions run, `SystemExit`'s status or message), without tearing its modules down,
    which would take longer than the rest of a short call."""
    status = 1
    try:
        import atexit

        try:
            if "threading" in sys.modules:
                sys.modules["threading"]._shutdown()
            atexit._run_exitfuncs()
        except SystemExit as again:
            e = again
        if e.code is None or isinstance(e.code, int):
            status = (e.code or 0) & 0xFF
        else:
            print(e.code, file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except BaseException:  # noqa: BLE001  (a broken stream or exit function: status as is)
        pass
    finally:
        os._exit(status)
