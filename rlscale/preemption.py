"""SIGTERM as a flag the training loop polls between steps (`guard.should_stop(step)`); on several
processes, JAX's preemption sync point instead, so every host stops at one step. Why:
docs/reliability.md.
"""

import signal
import threading
from collections.abc import Sequence

import jax
from absl import logging
from jax.experimental import multihost_utils


class PreemptionGuard:
    """Context manager that records termination signals instead of dying on them.

    Example:
        with PreemptionGuard() as guard:
            for step in range(start, config.steps):
                state = update(state, batch)
                if guard.should_stop(step):
                    ckpt.save(step + 1, state, host, force=True)
                    ckpt.wait()
                    break

    Args:
        signals: The signals to catch while inside the `with` block (single process only).
            SIGINT may be added for interactive runs: a first Ctrl-C then stops after the
            current step, a second one raises KeyboardInterrupt as usual.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)):
        self.signals = tuple(signals)
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._multihost = False

    def _handle(self, signum, frame):
        del frame
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        # Only flag it: the loop saves at the next step boundary. (No logging here: a handler
        # runs between two bytecodes of the main thread, possibly inside a logging call.)
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard must be entered in the main thread")
        self._multihost = jax.process_count() > 1
        if self._multihost:
            return self  # JAX's preemption service decides (see the module docstring).
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def should_stop(self, step: int) -> bool:
        """Whether to save and exit after `step`; call it once per step, on every host."""
        if self._multihost:
            stop = multihost_utils.reached_preemption_sync_point(step)
        else:
            stop = self.requested
        if stop:
            logging.warning(
                "preemption: stopping after step %d (%s)", step, self.signal_name or "sync point"
            )
        return stop


class PreemptedError(Exception):
    """Raised after a SIGTERM once the checkpoint is saved; rerunning the command resumes.
    `rlscale.main` exits with status 143 (128 + SIGTERM) on it."""
