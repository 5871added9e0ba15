"""What a run shows on the terminal, and what it keeps quiet.

By default (`configure(0)`, which the commands apply unless given `--verbosity`) the console
holds one line per RL step (`StepLines`: step, reward, pass@1 when evaluated, loss, tokens/s,
elapsed time and ETA), rlscale's own status lines (its INFO logs: SFT progress, resuming from
a checkpoint, reusing a warm start), every warning and error, and the command's summary. The
libraries' INFO logs (orbax, TFDS, JAX, absl), TFDS's progress bars and its "Downloading and
preparing dataset" prints appear only from `configure(1)` (`--verbosity=1`); 2 adds DEBUG logs.

Every line is a whole line on stderr (written with `tqdm.write`, never a carriage return), so a
terminal, a log file (CI, `nohup`) and a notebook show the same thing, and a warning can never
land in the middle of a progress line. tqdm keeps the step count, the smoothed rate and ETA.

In a notebook or a script that calls `rl.run` directly, `configure()` turns the same console
on (without it, absl shows warnings only).
"""

import contextlib
import io
import logging
import os
import sys
import time

import tqdm
from absl import flags
from absl import logging as absl_logging

# This package's directory: log records from files under it are rlscale's own.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_verbosity = 0


def verbosity() -> int:
    """The console's level: 0 quiet (the default), 1 libraries' INFO logs, 2 DEBUG logs."""
    return _verbosity


# Library warnings that say nothing to a user: TFDS warns about every custom BuilderConfig,
# which is how rlscale's builders name each materialized dataset; matplotlib about each
# missing math font it replaces (drawing the scaling fit on a machine without them).
_NOISE = (
    "Using custom data configuration: %s",
    "findfont: Font family %s not found. Falling back to %s.",
)


class _QuietLibraries(logging.Filter):
    """Passes warnings and errors, and rlscale's own INFO records (shown as bare messages)."""

    def filter(self, record):
        if record.msg in _NOISE:
            return False
        return record.levelno >= logging.WARNING or record.pathname.startswith(_PACKAGE_DIR)


class _BareInfo(logging.Formatter):
    """rlscale's INFO records as bare messages; warnings and errors in absl's format (level,
    time, file and line)."""

    def __init__(self):
        super().__init__()
        self._absl = absl_logging.PythonFormatter()

    def format(self, record):
        if record.levelno >= logging.WARNING:
            return self._absl.format(record)
        return record.getMessage()


_QUIET_FILTER = _QuietLibraries()


def configure(level: int = 0) -> None:
    """Sets what the console shows (see the module docstring); `level` as `verbosity()`."""
    global _verbosity
    _verbosity = level
    if not flags.FLAGS.is_parsed():  # A notebook or plain script: no absl flags to parse.
        flags.FLAGS.mark_as_parsed()
    absl_logging.use_absl_handler()
    handler = absl_logging.get_absl_handler().python_handler
    handler.removeFilter(_QUIET_FILTER)
    if level <= 0:
        handler.addFilter(_QUIET_FILTER)
        handler.setFormatter(_BareInfo())
        absl_logging.set_verbosity(absl_logging.INFO)
    else:
        handler.setFormatter(absl_logging.PythonFormatter())
        absl_logging.set_verbosity(absl_logging.INFO if level == 1 else absl_logging.DEBUG)
    from tensorflow_datasets.core.utils import tqdm_utils  # Heavy: only when configuring.

    tqdm_utils.display_progress_bar(level > 0)


@contextlib.contextmanager
def library_prints():
    """Swallows what a library call prints to stdout unless `verbosity() > 0` (TFDS prints
    "Downloading and preparing dataset ..." whatever its logging level)."""
    if _verbosity > 0:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def line(text: str) -> None:
    """Writes one whole line to stderr, above any live tqdm bar."""
    tqdm.tqdm.write(text, file=sys.stderr)


class _Meter(tqdm.tqdm):
    """tqdm's step count, elapsed time and smoothed rate, drawn nowhere: `StepLines` writes
    whole lines instead of a bar redrawn in place."""

    def display(self, msg=None, pos=None):
        return True


# Metrics shown in a step line, in order, as (record key, label, format).
STEP_FIELDS = (
    ("train/reward_mean", "reward", "{:.3f}"),
    ("eval/pass@1", "pass@1", "{:.3f}"),
    ("train/loss", "loss", "{:.4f}"),
    ("train/kl", "kl", "{:.3g}"),
    ("time/tokens_per_s", "tok/s", None),  # tqdm's SI format: 1.23k.
)


class StepLines:
    """One line per RL step, e.g.

        step 12/80  reward 0.412  pass@1 0.531  loss 0.0123  tok/s 1.23k  00:35 elapsed, ETA 01:55

    (`pass@1` on the steps that evaluate). The clock starts when this is built.
    The ETA divides the steps left by tqdm's smoothed rate (so the first steps' compilation
    fades out of it); `?` until a step has finished.
    """

    def __init__(self, total: int | None):
        self.total = total
        self._meter = None
        self._start = time.time()  # The clock tqdm reads (`tqdm._time`).

    def write(self, step: int, record: dict) -> None:
        if self._meter is None:  # A resumed run's count starts at its checkpoint.
            self._meter = _Meter(
                total=self.total,
                initial=max(step - 1, 0),
                file=io.StringIO(),
                miniters=1,
                mininterval=0,
            )
            self._meter.start_t = self._meter.last_print_t = self._start
        meter = self._meter
        if step > meter.n:
            meter.update(step - meter.n)
        parts = [f"step {step}" + (f"/{self.total}" if self.total else "")]
        for key, label, fmt in STEP_FIELDS:
            value = record.get(key)
            if value is not None:
                text = fmt.format(value) if fmt else tqdm.tqdm.format_sizeof(value)
                parts.append(f"{label} {text}")
        stats = meter.format_dict
        rate = stats["rate"]
        if rate is None and meter.n > meter.initial and stats["elapsed"] > 0:
            rate = (meter.n - meter.initial) / stats["elapsed"]
        eta = "?"
        if rate and self.total:
            eta = tqdm.tqdm.format_interval(round(max(self.total - step, 0) / rate))
        parts.append(f"{tqdm.tqdm.format_interval(stats['elapsed'])} elapsed, ETA {eta}")
        line("  ".join(parts))

    def close(self):
        if self._meter is not None:
            self._meter.close()
