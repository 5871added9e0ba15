"""Reward functions for the reliability tests, importable by reward worker processes
(`--config.reward.fn=reward_fixtures:NAME` with this directory on PYTHONPATH)."""

import json
import os
import signal
import tempfile
import time

# Where `faulty` reads its {prompt: fault} table. A fixed path, not an environment variable:
# reward workers fork from a server that may predate the test and its environment.
FAULTS_PATH = os.path.join(tempfile.gettempdir(), f"rlscale_test_faults_{os.getuid()}.json")


def digits(completion, problem):
    """1 if the completion holds a digit: an easy reward, so prompts get retired."""
    del problem
    return float(any(c.isdigit() for c in completion))


def faulty(completion, problem):
    """Misbehaves on the prompts listed in `FAULTS_PATH` ({prompt: fault}), else `digits`.
    Faults: raise, nan, sleep (past any test timeout), exit (the worker dies)."""
    with open(FAULTS_PATH) as f:
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


def even_length(completion, problem):
    """1 if the completion has an even number of characters: about half the samples pass, so
    groups have reward variance (the golden-metrics runs)."""
    del problem
    return float(len(completion) % 2 == 0)
