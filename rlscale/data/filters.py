"""Rollout shaping pieces: the zero-variance test, no-positive-resampling, DAPO's soft
overlong penalty, and the resumable prompt stream they act on. `rl.rollouts.RolloutSource`
puts them together (with DAPO's dynamic sampling).

Rewards arrive as [B, G] (B prompts x G samples per prompt). Everything here runs on the host,
between the sampler and the learner, and its state is plain Python (checkpointed as JSON).
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from rlscale import sections


@dataclasses.dataclass(frozen=True)
class FilterConfig(sections.Section):
    """`config.filters`: zero-variance filtering, DAPO's dynamic sampling (at most
    `dynamic_max_rounds` rounds a batch), retiring prompts solved at `retire_threshold`, and
    the overlong penalty over the last `overlong_cache` tokens (0: off)."""

    zero_variance: bool = False
    dynamic_sampling: bool = False
    dynamic_max_rounds: int = 4
    retire: bool = False
    retire_threshold: float = 0.9
    overlong_cache: int = 0


def zero_variance_keep(reward_BG: np.ndarray) -> np.ndarray:
    """[B] True for prompts whose G rewards are not all equal: the others carry no
    group-relative signal (all advantages 0) and are dropped without resampling (ScaleRL)."""
    reward_BG = np.asarray(reward_BG)
    return np.ptp(reward_BG, axis=1) > 0


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

    def update(self, prompt_ids: Sequence[int], reward_BG: np.ndarray) -> list[int]:
        """Records one group per prompt; returns the newly retired ids."""
        rates = np.mean(np.asarray(reward_BG) > 0, axis=1)
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
