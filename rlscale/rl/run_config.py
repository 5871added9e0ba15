"""The ConfigDict stops here: `resolve` turns a run's config into `RunConfig`, frozen typed
sections owned by the modules that read them, with every derived default filled once
(`batch.samples_per_prompt`, `pipeline.slots`; `batch.prompt_pool`
once the data is read, `BatchConfig.with_pool`), and lists every problem of every section
and between sections (`rl.checks`) at once, each naming its key.
"""

import dataclasses
import json
from typing import Any

import ml_collections

from rlscale import (
    checkpoint,
    faults,
    hub,
    model,
    optim,
    sections,
    sharding,
    tracking,
    warm_start,
)
from rlscale.data import filters
from rlscale.data import load as data_load
from rlscale.envs import registry as env_registry
from rlscale.eval import heldout
from rlscale.model import attention, lora
from rlscale.rewards import isolation
from rlscale.rl import checks, dpo, pipeline, rollouts, setup
from rlscale.saved_policy import SamplingSettings

# The sections: config key -> the dataclass that owns it.
SECTIONS = {
    "mesh": sharding.MeshConfig,
    "tokenizer": setup.TokenizerConfig,
    "init": setup.InitConfig,
    "sft": warm_start.SFTConfig,
    "batch": rollouts.BatchConfig,
    "sampling": SamplingSettings,
    "learner": setup.LearnerConfig,
    "pipeline": pipeline.PipelineConfig,
    "optim": optim.OptimConfig,
    "objective": setup.ObjectiveConfig,
    "teacher": setup.TeacherConfig,
    "preference": dpo.PreferenceConfig,
    "filters": filters.FilterConfig,
    "eval": heldout.EvalConfig,
    "checkpoint": checkpoint.CheckpointConfig,
    "faults": faults.FaultConfig,
    "reward": isolation.RewardConfig,
    "env": env_registry.EnvConfig,
    "tracking": tracking.TrackingConfig,
    "lora": lora.LoraConfig,
}

# The keys that name a checkpoint or a file, which may name one on the Hugging Face Hub
# (`hub`): `resolve` turns them into local paths before any section reads them.
HUB_PATHS = {
    "init.hf_checkpoint": hub.REPO,
    "teacher.checkpoint": hub.REPO,
    "reward.model": hub.REPO,
    "reward.prm": hub.REPO,
    **data_load.HUB_PATHS,
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A resolved RL run: one attribute per config section, named as the ConfigDict names
    them, every checkpoint and file a local path (`HUB_PATHS`). `task` stays a frozen
    ConfigDict (its keys depend on its kind); `model` is the policy's `ModelConfig` (its
    vocabulary set from the tokenizer at set-up), `model_name` the name the config gives it
    (`model.name`, recorded with the settings of the stages made from it). `raw`: the whole
    config as given (Hub names as named), frozen, only for what a checkpoint records
    (`to_dict`)."""

    seed: int
    steps: int
    recipe: str
    mesh: sharding.MeshConfig
    tokenizer: setup.TokenizerConfig
    init: setup.InitConfig
    task: Any
    sft: warm_start.SFTConfig
    model: model.ModelConfig | None
    model_name: str
    batch: rollouts.BatchConfig
    sampling: SamplingSettings
    learner: setup.LearnerConfig
    pipeline: pipeline.PipelineConfig
    optim: optim.OptimConfig
    objective: setup.ObjectiveConfig
    teacher: setup.TeacherConfig
    preference: dpo.PreferenceConfig
    filters: filters.FilterConfig
    eval: heldout.EvalConfig
    checkpoint: checkpoint.CheckpointConfig
    faults: faults.FaultConfig
    reward: isolation.RewardConfig
    env: env_registry.EnvConfig
    tracking: tracking.TrackingConfig
    lora: lora.LoraConfig
    raw: Any

    def to_dict(self) -> dict:
        """The config as it was given (JSON values): what a checkpoint records."""
        return json.loads(self.raw.to_json_best_effort())


def _model(config, problems: list[str]) -> model.ModelConfig | None:
    try:
        cfg = model.from_dict(config.model)
    except (TypeError, ValueError) as e:
        problems.append(f"model: {e}")
        return None
    problems += [f"model.{p}" for p in attention.platform_problems(cfg.attention)]
    return cfg


def _samples_per_prompt(built: dict) -> rollouts.BatchConfig:
    """The batch section with the completions the generator samples per prompt:
    `batch.group_size`, or `preference.samples` in a preference run that forms its pairs from
    samples (its learner batches are then pairs, groups of 2 rows)."""
    b, pref = built["batch"], built["preference"]
    G = pref.samples if pref.samples_pairs else b.group_size
    return dataclasses.replace(b, samples_per_prompt=G)


def _derived(run: RunConfig) -> dict:
    """The defaults that "0" stands for, filled once: decode slots. (`learner.pack_rows`
    depends on the batch's shard count: `batch_layout.Layout.rows` fills it.)"""
    b, p = run.batch, run.pipeline
    return {"pipeline": dataclasses.replace(p, slots=p.slots or b.prompts * b.samples_per_prompt)}


def resolve(config: ml_collections.ConfigDict) -> RunConfig:
    """The run's typed sections, every derived default filled.

    Raises:
      hub.HubError (a ValueError): listing every Hub name (`HUB_PATHS`) that does not resolve,
        before any other check (the others would read the name as a missing path).
      sections.InvalidConfigError (a ValueError): listing every problem, each naming its key.
    """
    given, config = config, hub.localize(config, HUB_PATHS)
    problems = []
    built = sections.build(config, SECTIONS, problems)
    with sections.deferred():
        built["batch"] = _samples_per_prompt(built)
    problems += sections.at_least("steps", config.steps, 1)
    run = RunConfig(
        seed=config.seed,
        steps=config.steps,
        recipe=config.get("recipe", ""),
        task=ml_collections.FrozenConfigDict(config.task),
        model=_model(config, problems),
        model_name=config.model.get("name", ""),
        raw=ml_collections.FrozenConfigDict(given),
        **built,
    )
    problems += data_load.task_problems(run.task)
    problems += checks.problems(run)
    problems += lora.run_problems(run.lora, run.learner, run.preference)
    sections.raise_if(problems)
    return dataclasses.replace(run, **_derived(run))
