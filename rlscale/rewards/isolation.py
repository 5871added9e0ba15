"""In-process fault isolation for cheap verifiers: one bad sample costs one reward.

A verifier that raises, or returns NaN/inf or a non-number, gives that sample reward 0 and is
counted; the run goes on. (Verifiers that can hang run in `rewards.sandbox` worker processes
with deadlines instead.)
"""

import math
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging


def score_all(fn: Callable, completions: Sequence[str], problems: Sequence) -> tuple:
    """Returns (rewards [N] float64, number of failed samples)."""
    rewards = np.zeros(len(completions))
    failures = 0
    for i, (text, problem) in enumerate(zip(completions, problems)):
        try:
            r = float(fn(text, problem))
            if not math.isfinite(r):
                raise ValueError(f"non-finite reward {r}")
            rewards[i] = r
        except Exception as e:  # noqa: BLE001 - any verifier failure costs this sample only.
            failures += 1
            if failures <= 3:
                logging.warning("reward function failed on sample %d (%r): %s", i, text[:80], e)
    return rewards, failures
