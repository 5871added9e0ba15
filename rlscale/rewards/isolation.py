"""Fault isolation for verifiers: one bad sample costs one reward, and the run goes on.

A verifier that raises, returns NaN/inf or a non-number gives that sample reward 0 and is
counted. Cheap, trusted verifiers run in this process (`score_all`, or `score_isolated` without a
pool). Verifiers that can hang or crash (a parser on adversarial text, a native extension) run in
a `rewards.sandbox.WorkerPool` of worker processes (`verifier_pool`) with a deadline per sample:
a sample past its deadline, or whose worker dies, also scores 0, and the pool replaces the worker.
"""

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

from rlscale import sections
from rlscale.rewards import sandbox

# The kinds of failure `score_isolated` counts.
ERROR = "error"  # The verifier raised, or returned something that is not a number.
NONFINITE = "nonfinite"  # It returned NaN or +-inf.
TIMEOUT = "timeout"  # It ran past its deadline (in a pool); its worker was killed and replaced.
CRASH = "crash"  # Its worker process died (os._exit, a signal, the OOM killer); replaced.
FAILURE_KINDS = (ERROR, NONFINITE, TIMEOUT, CRASH)
_POOL_FAILURES = {sandbox.ERROR: ERROR, sandbox.TIMEOUT: TIMEOUT, sandbox.CRASH: CRASH}

# Seconds a sample may take in a pool when the caller gives no timeout.
DEFAULT_TIMEOUT = 10.0
# Failures logged per call (the counts cover all of them).
_MAX_LOGGED = 3


def import_function(spec: str):
    """The object named by "module:function"."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class RewardConfig(sections.Section):
    """`config.reward`: how samples are rewarded. `fn` ("module:function", fn(completion,
    problem) -> float) in place of the task's verifier; `workers` processes with a
    per-sample `timeout` (s) (0: in-process); a learned outcome reward `model` (a directory,
    or "train_at_setup": one trained at set-up for `model_steps` steps of `model_batch_pairs`
    pairs at `model_lr`) and a process reward model `prm` (`rl.learned_rewards`)."""

    fn: str = ""
    workers: int = 2
    timeout: float = 10.0
    model: str = ""
    model_steps: int = 200
    model_batch_pairs: int = 16
    model_lr: float = 1e-4
    prm: str = ""

    def problems(self) -> list[str]:
        problems = []
        if self.fn:
            try:
                if not callable(import_function(self.fn)):
                    raise TypeError("not callable")
            except (ImportError, AttributeError, TypeError, ValueError) as e:
                problems.append(f"reward.fn={self.fn!r} ('module:function') fails: {e}")
        if self.workers and self.timeout <= 0:
            problems.append(f"reward.timeout={self.timeout} must be > 0 with worker processes")
        problems += sections.at_least("reward.workers", self.workers, 0)
        if self.model and self.fn:
            problems.append(
                f"reward.model={self.model!r} and reward.fn={self.fn!r} both replace the "
                "verifier's reward: set one"
            )
        for key in ("model_steps", "model_batch_pairs"):
            problems += sections.at_least(f"reward.{key}", getattr(self, key), 1)
        if not self.model_lr > 0:
            problems.append(f"reward.model_lr={self.model_lr!r} must be > 0")
        return problems


def call(fn: Callable, *args):
    """Runs `fn(*args)`: the function a `verifier_pool` runs, so that one pool serves any
    picklable verifier (a module-level function, or a bound method such as `task.verify` of a
    picklable object), passed with each call."""
    return fn(*args)


def verifier_pool(
    num_workers: int,
    *,
    start_method: str = "forkserver",
    preload: Sequence[str] = (),
    memory_limit_bytes: int | None = None,
) -> sandbox.WorkerPool:
    """A `sandbox.WorkerPool` for `score_isolated`; close it (or use it in `with`) when done.

    Args:
        num_workers: Worker processes (samples verified in parallel).
        start_method: 'forkserver' (fast worker restarts) or 'spawn'.
        preload: Modules the fork server imports once (the verifier's module, heavy
            dependencies), so that each worker and each replacement starts warm. The workers
            never import the caller's `__main__`, so verifiers must live in modules.
        memory_limit_bytes: Address-space limit of each worker, or None.
    """
    return sandbox.WorkerPool(
        call,
        num_workers,
        start_method=start_method,
        preload=(__name__, *preload),
        memory_limit_bytes=memory_limit_bytes,
    )


def reward_pool(reward: RewardConfig, *verifiers) -> sandbox.WorkerPool | None:
    """The reward section's verifier pool (`reward.workers` processes), or None (0: verify
    in-process). Its workers start with the `verifiers`' modules imported (a function's, or
    a callable object's class's): a module first imported by a call (unpickling its verifier)
    would spend that call's `reward.timeout` on imports."""
    if not reward.workers:
        return None
    return verifier_pool(reward.workers, preload=sorted({v.__module__ for v in verifiers}))


def _as_reward(value) -> tuple[float, str | None, str | None]:
    """(reward, failure kind or None, message) for a verifier's return value."""
    try:
        r = float(value)
    except (TypeError, ValueError) as e:
        return 0.0, ERROR, f"not a number: {type(value).__name__} ({e})"
    if not math.isfinite(r):
        return 0.0, NONFINITE, f"non-finite reward {r}"
    return r, None, None


def score_isolated(
    fn: Callable,
    completions: Sequence[str],
    problems: Sequence,
    *,
    pool: sandbox.WorkerPool | None = None,
    timeout: float | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """Scores `fn(completion, problem)` for each pair; a failing sample scores 0.

    Args:
        fn: The verifier. With a pool it must be picklable (a module-level function or a bound
            method of a picklable object, like `Task.verify`), as must its arguments and result.
        completions: The sampled texts.
        problems: One problem per completion.
        pool: A `verifier_pool` to run each call in a worker process with a deadline; None runs
            them here, where a call that hangs or kills the process cannot be contained.
        timeout: Seconds each call may take in the pool (default `DEFAULT_TIMEOUT`).

    Returns:
        (rewards [N] float64, failures): `failures` counts the failed samples of each kind in
        `FAILURE_KINDS` (every kind present, zero or not).

    Raises:
        ValueError: `timeout` without a pool, or mismatched lengths.
    """
    if len(completions) != len(problems):
        raise ValueError(f"{len(completions)} completions but {len(problems)} problems")
    if pool is None and timeout is not None:
        raise ValueError("a timeout needs a pool: an in-process call cannot be interrupted")
    n = len(completions)
    rewards = np.zeros(n)
    failures = dict.fromkeys(FAILURE_KINDS, 0)
    outcomes = []  # (index, reward, failure kind, message)
    if pool is None:
        for i, (text, problem) in enumerate(zip(completions, problems)):
            try:
                outcomes.append((i, *_as_reward(fn(text, problem))))
            except Exception as e:  # noqa: BLE001 - any verifier failure costs this sample only.
                outcomes.append((i, 0.0, ERROR, f"{type(e).__name__}: {e}"))
    else:
        jobs = [(fn, text, problem) for text, problem in zip(completions, problems)]
        results = pool.map(jobs, DEFAULT_TIMEOUT if timeout is None else timeout) if n else []
        for i, result in enumerate(results):
            if result.status == sandbox.OK:
                outcomes.append((i, *_as_reward(result.value)))
            else:
                outcomes.append((i, 0.0, _POOL_FAILURES[result.status], result.error))
    for i, r, kind, message in outcomes:
        rewards[i] = r
        if kind is None:
            continue
        failures[kind] += 1
        if sum(failures.values()) <= _MAX_LOGGED:
            logging.warning(
                "reward function failed on sample %d (%s; %r): %s",
                i,
                kind,
                completions[i][:80],
                message,
            )
    return rewards, failures


def score_all(fn: Callable, completions: Sequence[str], problems: Sequence) -> tuple:
    """In-process `score_isolated`; returns (rewards [N] float64, number of failed samples)."""
    rewards, failures = score_isolated(fn, completions, problems)
    return rewards, sum(failures.values())
