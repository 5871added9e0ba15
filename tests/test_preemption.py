"""PreemptionGuard: a termination signal sets a flag and the process lives on."""

import os
import signal

import pytest

from rlscale import preemption


def test_sigterm_sets_flag_and_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with preemption.PreemptionGuard() as guard:
        assert signal.getsignal(signal.SIGTERM) != before
        assert not guard.requested and not guard.should_stop(0)
        os.kill(os.getpid(), signal.SIGTERM)  # Delivered before os.kill returns (own process).
        # Still alive, and the loop sees the request at its next check.
        assert guard.requested and guard.signal_name == "SIGTERM"
        assert guard.should_stop(1)
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigint_twice_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with preemption.PreemptionGuard((signal.SIGTERM, signal.SIGINT)) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.requested and guard.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == before


def test_handlers_restored_after_exception():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError):
        with preemption.PreemptionGuard():
            raise ValueError("step failed")
    assert signal.getsignal(signal.SIGTERM) == before
