"""Reward fault isolation: each failing verifier call costs its own sample and nothing else."""

import os
import signal
import time

import numpy as np
import pytest

from rlscale.data import tasks
from rlscale.rewards import isolation, sandbox

TIMEOUT = 0.5


def flaky_verify(text: str, problem: str):
    """1.0 if the text equals the problem, else 0.0; misbehaves on marker texts."""
    if text == "raise":
        raise RuntimeError("injected failure")
    if text == "nan":
        return float("nan")
    if text == "inf":
        return float("-inf")
    if text == "string":
        return "yes"
    if text == "sleep":
        time.sleep(60)
    if text == "exit":
        os._exit(1)
    if text == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return float(text == problem)


def good_samples(n: int, offset: int = 0):
    """n samples alternating right (1.0) and wrong (0.0) answers."""
    problems = [f"p{offset + i}" for i in range(n)]
    texts = [p if i % 2 == 0 else "wrong" for i, p in enumerate(problems)]
    return texts, problems, np.arange(n) % 2 == 0


def with_faults(faults):
    """Good samples with the fault markers interleaved; returns texts, problems, expected."""
    texts, problems, right = good_samples(6)
    expected = right.astype(float).tolist()
    for k, marker in enumerate(faults):
        at = 2 * k + 1
        texts.insert(at, marker)
        problems.insert(at, marker)  # Would score 1.0 if the verifier behaved.
        expected.insert(at, 0.0)
    return texts, problems, expected


@pytest.fixture(scope="module")
def pool():
    # The verifier's module preloaded, as the RL loop does: importing it in a worker on its
    # first call would count against that call's deadline.
    with isolation.verifier_pool(2, start_method="forkserver", preload=[__name__]) as p:
        yield p


def test_in_process_faults_cost_one_sample_each():
    texts, problems, expected = with_faults(["raise", "nan", "inf", "string"])
    rewards, failures = isolation.score_isolated(flaky_verify, texts, problems)
    assert rewards.dtype == np.float64 and rewards.tolist() == expected
    assert failures == {"error": 2, "nonfinite": 2, "timeout": 0, "crash": 0}
    # score_all keeps its (rewards, number of failures) contract.
    rewards, count = isolation.score_all(flaky_verify, texts, problems)
    assert rewards.tolist() == expected and count == 4
    with pytest.raises(ValueError, match="needs a pool"):
        isolation.score_isolated(flaky_verify, texts, problems, timeout=1.0)
    with pytest.raises(ValueError, match="problems"):
        isolation.score_isolated(flaky_verify, texts, problems[:-1])


def test_pool_faults_cost_one_sample_each(pool):
    texts, problems, expected = with_faults(["raise", "nan", "sleep", "exit", "kill", "string"])
    rewards, failures = isolation.score_isolated(
        flaky_verify, texts, problems, pool=pool, timeout=TIMEOUT
    )
    assert rewards.tolist() == expected
    # The hung call was cut at its deadline, not waited for: after its minute's sleep it would
    # have scored, not timed out.
    assert failures == {"error": 2, "nonfinite": 1, "timeout": 1, "crash": 2}
    stats = pool.stats()
    assert (stats.timeouts, stats.crashes) == (1, 2) and stats.restarts >= 3
    # The pool still works, with its full complement of workers.
    texts, problems, right = good_samples(8, offset=100)
    rewards, failures = isolation.score_isolated(
        flaky_verify, texts, problems, pool=pool, timeout=TIMEOUT
    )
    assert rewards.tolist() == right.astype(float).tolist()
    assert sum(failures.values()) == 0
    assert len(pool.worker_pids()) == 2


def test_task_verifier_in_pool_matches_in_process(pool):
    task = tasks.Arithmetic(difficulty=2)
    rows = list(task.problems("train", 6))
    texts = [
        f"{p.demo}" if i % 3 else f"1+1=2 Answer: {int(p.answer) + 1}" for i, p in enumerate(rows)
    ]
    here, here_failures = isolation.score_isolated(task.verify, texts, rows)
    there, there_failures = isolation.score_isolated(
        task.verify, texts, rows, pool=pool, timeout=5.0
    )
    assert there.tolist() == here.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert here_failures == there_failures == dict.fromkeys(isolation.FAILURE_KINDS, 0)
    # An empty batch is fine too.
    rewards, _ = isolation.score_isolated(task.verify, [], [], pool=pool, timeout=5.0)
    assert rewards.shape == (0,)


def test_a_verifier_the_workers_cannot_import_is_refused_naming_it():
    def from_main(text, problem):
        return 1.0

    from_main.__module__ = "__main__"  # As if defined in a script or a notebook cell.
    with pytest.raises(ValueError, match="'.*from_main' is defined in the main script"):
        sandbox.WorkerPool(from_main, 1)
    with pytest.raises(RuntimeError, match="cannot load the verifier: ModuleNotFoundError.*nosuch"):
        isolation.verifier_pool(1, preload=["rlscale.nosuch"])
