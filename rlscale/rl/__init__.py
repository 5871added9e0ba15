"""RL for LLMs as parts with thin drivers.

run_config the ConfigDict -> `RunConfig`: typed sections, derived defaults, every problem at once
checks    the start-up rules that span sections
setup     meshes and layouts, tokenizer, task, models, generator, learner, verifier pool
rollouts  `RolloutSource`: prompts -> generator requests -> scored, filtered `Rollouts`
learner   `TrainState`, the forward plan of real tokens, one compiled update (`Learner.update`)
state     `RunState`: everything a checkpoint holds; opening and resuming checkpoints
report    compute accounting, the step record, the files a finished run leaves
pairs     `PairSource`: preference pairs (a file's, or formed from samples) -> `Rollouts`
loop      what the drivers share: start-up, evaluation, the end of each step, the finish
sync      the synchronous driver
pipeline  the pipeline driver: a generator thread with in-flight weight updates
dpo       the preference driver: offline and iterative DPO (`config.preference`)
"""

from rlscale import workdir_lock
from rlscale.preemption import PreemptedError
from rlscale.rl import dpo, pipeline, sync
from rlscale.rl.checks import RESUMABLE_CHANGES
from rlscale.rl.run_config import RunConfig, resolve


def run(config: RunConfig, workdir: str, *, allow_config_change: bool = False) -> dict:
    """Runs (or resumes) RL in `workdir` with the driver `config.pipeline.mode` names, or a
    preference run (`config.preference`) with the preference driver; `config` is the
    resolved run (`resolve`). The workdir is locked for the run (`workdir_lock`): a workdir
    another live run holds raises `WorkdirBusyError` before any work."""
    driver = sync if config.pipeline.mode == "sync" else pipeline
    if config.preference.enabled:
        driver = dpo
    with workdir_lock.hold(workdir):
        return driver.run(config, workdir, allow_config_change=allow_config_change)


__all__ = ["RESUMABLE_CHANGES", "PreemptedError", "RunConfig", "resolve", "run"]
