"""Rollout shaping: zero-variance filtering, DAPO dynamic sampling, no-positive-resampling,
DAPO's soft overlong penalty, and the resumable prompt stream they act on.

Rewards arrive as [P, G] (prompts x samples). Everything here runs on the host, between the
sampler and the learner, and its state is plain Python (checkpointed as JSON).
"""

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


def zero_variance_keep(reward_PG: np.ndarray) -> np.ndarray:
    """[P] True for prompts whose G rewards are not all equal: the others carry no
    group-relative signal (all advantages 0) and are dropped without resampling (ScaleRL)."""
    reward_PG = np.asarray(reward_PG)
    return np.ptp(reward_PG, axis=1) > 0


def overlong_penalty(lengths: np.ndarray, max_len: int, cache_len: int) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the reward:

    0 for |y| <= max_len - cache_len, (max_len - cache_len - |y|) / cache_len up to max_len
    (a linear ramp down to -1), and -1 beyond max_len.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong penalty: need 0 < cache_len={cache_len} <= max_len={max_len}")
    lengths = np.asarray(lengths, np.float64)
    free = max_len - cache_len
    ramp = (free - lengths) / cache_len
    return np.where(lengths <= free, 0.0, np.where(lengths <= max_len, ramp, -1.0))


@dataclasses.dataclass
class PassRateHistory:
    """Per-prompt pass rates; prompts at or above `threshold` are retired for good
    (ScaleRL's no-positive-resampling: Khatri et al. 2025).

    Attributes:
      threshold: pass rate (over one group of samples) that retires a prompt.
      last: prompt id -> pass rate at its latest sampling.
      retired: prompt ids never to be sampled again.
    """

    threshold: float = 0.9
    last: dict[int, float] = dataclasses.field(default_factory=dict)
    retired: set[int] = dataclasses.field(default_factory=set)

    def update(self, prompt_ids: Sequence[int], reward_PG: np.ndarray) -> list[int]:
        """Records one group per prompt; returns the newly retired ids."""
        rates = np.mean(np.asarray(reward_PG) > 0, axis=1)
        newly = []
        for pid, rate in zip(prompt_ids, rates):
            pid = int(pid)
            self.last[pid] = float(rate)
            if rate >= self.threshold and pid not in self.retired:
                self.retired.add(pid)
                newly.append(pid)
        return newly

    def state(self) -> dict:
        return {
            "threshold": self.threshold,
            "last": {str(k): v for k, v in self.last.items()},
            "retired": sorted(self.retired),
        }

    @classmethod
    def from_state(cls, d: dict) -> "PassRateHistory":
        return cls(d["threshold"], {int(k): v for k, v in d["last"].items()}, set(d["retired"]))


@dataclasses.dataclass
class PromptStream:
    """Training prompt ids in reshuffled epochs, skipping retired prompts; resumable from
    (epoch, position) and the seed."""

    num_prompts: int
    seed: int = 0
    epoch: int = 0
    position: int = 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def next(self, n: int, retired: set[int] = frozenset()) -> list[int]:
        """The next n prompt ids that are not retired."""
        if len(retired) >= self.num_prompts:
            raise RuntimeError("every training prompt has been retired: nothing left to sample")
        out = []
        order = self._order(self.epoch)
        while len(out) < n:
            if self.position >= self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order(self.epoch)
                if len(retired) >= self.num_prompts:
                    break
            pid = int(order[self.position])
            self.position += 1
            if pid not in retired:
                out.append(pid)
        return out

    def state(self) -> dict:
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
        }

    @classmethod
    def from_state(cls, d: dict) -> "PromptStream":
        return cls(**d)


def dynamic_sampling(
    draw: Callable[[int], tuple[list[int], np.ndarray, object]],
    batch_prompts: int,
    max_rounds: int = 8,
):
    """DAPO dynamic sampling (Yu et al. 2025): keep drawing groups and keep those with reward
    variance until `batch_prompts` are collected or `max_rounds` draws are spent.

    Args:
      draw: n -> (prompt_ids [n], reward_PG [n, G], rollouts) for n fresh prompts, where
        `rollouts` can be indexed by a boolean [n] mask.
      batch_prompts: prompts wanted.
      max_rounds: upper bound on draws (a batch may come back short; the caller pads).

    Returns:
      (list of (prompt_ids, reward_PG, rollouts) kept per round, number of rounds, number of
      prompts drawn).
    """
    kept, have, rounds, drawn = [], 0, 0, 0
    while have < batch_prompts and rounds < max_rounds:
        ids, reward, rollouts = draw(batch_prompts - have)
        rounds += 1
        drawn += len(ids)
        keep = zero_variance_keep(reward)
        if keep.any():
            kept.append(
                (
                    [i for i, k in zip(ids, keep) if k],
                    np.asarray(reward)[keep],
                    rollouts[keep] if hasattr(rollouts, "__getitem__") else rollouts,
                )
            )
            have += int(keep.sum())
    return kept, rounds, drawn
