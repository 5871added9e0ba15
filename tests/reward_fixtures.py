"""Reward functions for the reliability tests, importable by reward worker processes
(`--config.reward.fn=reward_fixtures:NAME` with this directory on PYTHONPATH)."""

import json
import os
import signal
import time


def digits(completion, problem):
    """1 if the completion holds a digit: an easy reward, so prompts get retired."""
    del problem
    return float(any(c.isdigit() for c in completion))


def faulty(completion, problem):
    """Misbehaves on the prompts listed in $RLSCALE_TEST_FAULTS ({prompt: fault}), else
    `digits`. Faults: raise, nan, sleep (past any test timeout), exit (the worker dies)."""
    with open(os.environ["RLSCALE_TEST_FAULTS"]) as f:
        fault = json.load(f).get(problem.prompt)
    if fault == "raise":
        raise RuntimeError("verifier bug")
    if fault == "nan":
        return float("nan")
    if fault == "sleep":
        time.sleep(60)
    if fault == "exit":
        os.kill(os.getpid(), signal.SIGKILL)
    return digits(completion, problem)
