"""RL for LLMs as parts with thin drivers.

checks    start-up validation of a config, every problem at once
setup     mesh and layouts, tokenizer, task, models, sampler, learner, verifier pool
rollouts  the one sample-and-score; `RolloutSource`: prompts -> scored, filtered `Rollouts`
learner   `TrainState`, the per-token terms a chain needs, `Learner.prepare/update`
state     `RunState`: everything a checkpoint holds; opening and resuming checkpoints
report    compute accounting, the step record, the files a finished run leaves
sync      the synchronous driver (`run`)
"""

from rlscale.preemption import PreemptedError
from rlscale.rl.checks import RESUMABLE_CHANGES, validate
from rlscale.rl.setup import sampling_config
from rlscale.rl.sync import run

__all__ = ["RESUMABLE_CHANGES", "PreemptedError", "run", "sampling_config", "validate"]
