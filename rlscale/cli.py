"""What every command shares: flags defined by `define_flags(fv, argv)` and read by `main(fv)`, run
by `run_command` (in-process by `call`); a user's mistake (bad flag, config key, file or row) is one
`error: ...` line and exit status 1, never a traceback (`RLSCALE_TRACEBACK=1` shows it); anything
else is a bug and keeps its traceback.
"""

import functools
import os
import re
import sys
import traceback

from absl import app, flags
from ml_collections import config_flags

from rlscale import console

_CONFIG_ERROR = "Error whilst parsing config file:"


def fail(message: str, status: int = 1):
    """Ends the command with `error: message` on stderr."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def describe(e: BaseException) -> str:
    """A user's mistake as one message: an OSError about a file names the file."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


# rlscale's own code: a ValueError raised here is its "bad config or input" error.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _raised_in(e: BaseException, dirs: tuple[str, ...]) -> bool:
    """Whether the innermost frame of `e`'s traceback is in a file under one of `dirs`."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(dirs)


def is_user_error(e: BaseException, own_dirs: tuple[str, ...] = (_PACKAGE_DIR,)) -> bool:
    """A bad flag, config or input (see the module docstring), not a bug. `own_dirs`: where a
    `ValueError` must be raised to count (rlscale's package, and the command's directory)."""
    if isinstance(e, app.UsageError):
        return True
    if isinstance(e, OSError):
        return e.filename is not None or isinstance(
            e,
            (
                FileNotFoundError,
                PermissionError,
                IsADirectoryError,
                NotADirectoryError,
                FileExistsError,
            ),
        )
    return isinstance(e, ValueError) and _raised_in(e, own_dirs)


def guard(main, status: int = 1, own=None):
    """`main` with a user's mistake (`is_user_error`) reported by `fail`; a ValueError raised
    in the file of `own` (default `main`) counts as the command's own."""
    code = getattr(own or main, "__code__", None)
    own_dirs = (_PACKAGE_DIR,)
    if code is not None:
        own_dirs += (os.path.dirname(os.path.abspath(code.co_filename)) + os.sep,)

    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as e:
            if not is_user_error(e, own_dirs):
                raise
            if os.environ.get("RLSCALE_TRACEBACK"):
                traceback.print_exc()
            fail(describe(e), status)

    return guarded


def make_dir(path: str, flag: str) -> None:
    """Creates directory `path` (and its parents) for `flag`; ValueError naming the flag when
    that is impossible or the directory is not writable."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag}={path}: cannot create the directory ({e.strerror or e})") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}={path}: the directory is not writable")


def _config_file_error(e: flags.Error) -> str:
    """ml_collections reports a config file that raised as the flag, a banner and the whole
    traceback; the traceback's last line (the exception, less its type) is the message."""
    text = str(e)
    if _CONFIG_ERROR not in text:
        return text
    head = text.split(_CONFIG_ERROR)[0].strip().rstrip(":")
    last = re.sub(r"^\w+(Error|Exception): ", "", text.strip().splitlines()[-1])
    return f"{head}: {last}"


def unloaded_config_files(flag_values=flags.FLAGS) -> list[str]:
    """The config file flags whose file did not load (ml_collections defers that error until
    the config is read), each as `--flag=path: reason`."""
    from ml_collections.config_flags.config_flags import is_config_flag  # Not re-exported.

    bad = []
    for name in flag_values:
        flag = flag_values[name]
        if not is_config_flag(flag) or flag.value is None:
            continue
        try:
            flag.value.keys()
        except OSError as e:
            path = config_flags.get_config_filename(flag).split(":")[0]
            reason = "no such file" if not os.path.exists(path) else _last_line(e)
            bad.append(f"--{name}={path}: {reason}")
    return bad


def _last_line(e: OSError) -> str:
    """The cause of ml_collections' "Failed loading config file" error, whose last line
    names the file and the reason."""
    last = str(e.__cause__ or e).strip().splitlines()[-1].strip()
    return re.sub(r"^\[Errno \d+\] ", "", last)


FLAG_ERRORS = (flags.Error, AttributeError, KeyError, OSError)


def flags_error(e: BaseException, argv) -> str:
    """The one line that says which flag, config key or config file of `argv` failed to
    parse (`e`, one of `FLAG_ERRORS`, raised by absl flags with ml_collections config
    files)."""
    if isinstance(e, flags.Error):
        return _config_file_error(e)
    if isinstance(e, OSError):  # A config file that did not load, read for its overrides.
        return f"config file: {_last_line(e)}"
    # A key the locked config lacks; ml_collections' message quotes it (repr, nested).
    bad = " ".join(a for a in argv[1:] if a.startswith("--config."))
    key = re.search(r"'([^'\\]+)", str(e))
    hint = re.search(r'Did you mean "([^"]+)"', str(e))
    return f"{bad}: no such config key {key.group(1) if key else str(e)!r}" + (
        f"; did you mean {hint.group(1)!r}?" if hint else ""
    )


def define_config(fv: flags.FlagValues, argv, default: str | None = None) -> None:
    """A required, locked ml_collections config file flag `--config` on `fv` (a mistyped
    `--config.a.b` key is an error naming it), reading its overrides from `argv` (None:
    `sys.argv`). A `default` file goes into the arguments when they name none (in place: they
    are what is parsed next), not into the flag: ml_collections would apply the overrides
    while defining the flag, before a bad key could be reported as a flag error."""
    args = sys.argv if argv is None else argv
    if default and not any(a == "--config" or a.startswith("--config=") for a in args[1:]):
        args[1:1] = ["--config", default]
    config_flags.DEFINE_config_file(
        "config",
        None,
        "Config file, optionally with a :variant suffix; --config.a.b=value overrides a field.",
        flag_values=fv,
        lock_config=True,
        sys_argv=argv,
    )
    flags.mark_flag_as_required("config", flag_values=fv)


def _positional(main) -> bool:
    """Whether `main` takes positional arguments (`main(fv, args)`) besides the flags."""
    return main.__code__.co_argcount > 1


def call(define_flags, main, argv):
    """Runs a command in-process: `define_flags` on fresh flags, `argv` (the arguments, without
    the program name) parsed, then `main`; returns what `main` returns.

    Raises:
      ValueError: Naming the bad flag, config key or config file, or an unexpected argument.
    """
    argv = ["rlscale", *argv]
    fv = flags.FlagValues()
    define_flags(fv, argv)
    try:
        rest = fv(argv)
    except FLAG_ERRORS as e:
        raise ValueError(flags_error(e, argv)) from None
    problems = unloaded_config_files(fv)
    if problems:
        raise ValueError("; ".join(problems))
    if _positional(main):
        return main(fv, rest[1:])
    if len(rest) > 1:
        raise ValueError(f"unexpected arguments: {' '.join(rest[1:])}")
    return main(fv)


def load_config(spec: str, overrides=()):
    """The config `--config SPEC` names (a file, optionally with a `:variant` suffix) with its
    `--config.a.b=value` overrides, loaded as a command loads its `--config` (locked: a
    mistyped key is an error), on flags of its own.

    Raises:
      ValueError: Naming the file, variant, key or value that does not load.
    """
    return call(define_config, lambda fv: fv.config, [f"--config={spec}", *overrides])


def run_command(define_flags, main, status: int = 1):
    """A command's `if __name__ == "__main__":` body: `define_flags` on absl's flags, then
    `app.run` with `parse_flags` and `guard`; `main`'s return value is discarded."""
    define_flags(flags.FLAGS, None)

    def absl_main(argv):
        if _positional(main):
            main(flags.FLAGS, argv[1:])
            return
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
        main(flags.FLAGS)

    parser = functools.partial(parse_flags, status=status)
    app.run(guard(absl_main, status, own=main), flags_parser=parser)


def parse_flags(argv, status: int = 1):
    """absl flag parsing (`app.run(..., flags_parser=parse_flags)`) with a bad flag, config key
    or config file reported as one `error:` line; then sets the console from `--verbosity`."""
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{flags_error(e, argv)} (pass --helpshort to see the flags)", status)
    except FLAG_ERRORS as e:
        fail(flags_error(e, argv), status)
    for problem in unloaded_config_files():
        fail(problem, status)
    verbosity = flags.FLAGS["verbosity"]
    console.configure(verbosity.value if verbosity.present else 0)
    return rest


def print_summary(title: str, summary: dict, width: int = 20, quoted: tuple = ()) -> None:
    """A command's closing summary on stdout: the title, then one `key value` line each
    (floats to 4 significant digits; the keys in `quoted` as Python literals)."""
    print(f"\n{title}")
    for key, v in summary.items():
        text = f"{v:.4g}" if isinstance(v, float) else repr(v) if key in quoted else v
        print(f"  {key:<{width}} {text}")
