"""A saved policy and its task, as the commands that sample one load them (evaluation, step
labels, best-of-N): their config's sections (`resolve`: mesh, task, sampling, reward), the
run's sampling settings for a tokenizer, a params checkpoint loaded on the config's mesh in the
sampling layout with its tokenizer, the task's problems of a split and its verifier pool. The
RL run builds its sampling settings here too (`rl.setup`).
"""

import contextlib
import dataclasses
import os
from typing import Any, NamedTuple

import ml_collections

from rlscale import checkpoint, hub, sections, sharding
from rlscale import tokenizers as tokenizer_lib
from rlscale.data import load as data_load
from rlscale.model.config import ModelConfig
from rlscale.rewards import isolation
from rlscale.sampling import Sampler, SamplingConfig, precision
from rlscale.sampling.sampler import think_budget_problems
from rlscale.tokenizers import chat


@dataclasses.dataclass(frozen=True)
class SamplingSettings(sections.Section):
    """`config.sampling`: a run's `SamplingConfig` before a tokenizer gives its token ids.
    Forced interruption (ScaleRL): after `think_budget` tokens without `think_end` (one token),
    `interrupt_phrase` is written in and the model answers (0: off). `generator_dtype`: the
    rollouts' generator's weights, activations and KV cache in "float32", "bfloat16" or
    "float16" ("": the learner's own; `sampling.precision`). `kv_block_size`, `kv_blocks`,
    `kv_preempt`: the generator's paged KV cache (`SamplingConfig`; 0: dense rows)."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    buckets: tuple = (16, 32, 64)
    think_budget: int = 0
    interrupt_phrase: str = " Answer:"
    think_end: str = " Answer"
    generator_dtype: str = ""
    kv_block_size: int = 0
    kv_blocks: int = 0
    kv_preempt: bool = False

    def problems(self) -> list[str]:
        problems = sections.at_least("sampling.max_new_tokens", self.max_new_tokens, 1)
        problems += sections.at_least("sampling.kv_block_size", self.kv_block_size, 0)
        problems += sections.at_least("sampling.kv_blocks", self.kv_blocks, 0)
        problems += precision.problems(self.generator_dtype)
        if not isinstance(self.kv_preempt, bool):
            problems.append(f"sampling.kv_preempt={self.kv_preempt!r} must be True or False")
        elif self.kv_preempt and not self.kv_block_size:
            problems.append("sampling.kv_preempt=True needs sampling.kv_block_size > 0")
        t = self.temperature
        if not isinstance(t, (int, float)) or t < 0:
            problems.append(f"sampling.temperature={t!r} must be a number >= 0")
        # The phrase is at least one token; the exact count is checked once it is encoded.
        return problems + think_budget_problems(
            self.think_budget, 1, self.max_new_tokens, prefix="sampling."
        )


@dataclasses.dataclass(frozen=True)
class SavedPolicyConfig:
    """The sections of a config that a command sampling a saved policy reads (`resolve`):
    `mesh` (`sharding.MeshConfig`), `task` (a frozen ConfigDict: its keys depend on its kind),
    `sampling` and `reward` (`isolation.RewardConfig`: the verifier pool)."""

    mesh: sharding.MeshConfig
    task: Any
    sampling: SamplingSettings
    reward: isolation.RewardConfig


# The sections `resolve` builds: config key -> the dataclass that owns it.
SECTIONS = {
    "mesh": sharding.MeshConfig,
    "sampling": SamplingSettings,
    "reward": isolation.RewardConfig,
}


def resolve(config: ml_collections.ConfigDict) -> SavedPolicyConfig:
    """The sections of an RL config (`configs/*.py`) that the commands sampling a saved policy
    read, each checking its own keys (not the rules of an RL run, `rl.resolve`).

    Raises:
      hub.HubError (a ValueError): naming a task file on the Hugging Face Hub that does not
        resolve (`data_load.HUB_PATHS`), before any other check.
      sections.InvalidConfigError (a ValueError): listing every problem, each naming its key.
    """
    problems = []
    built = sections.build(config, SECTIONS, problems)
    task = ml_collections.FrozenConfigDict(hub.localize(config, data_load.HUB_PATHS).task)
    problems += data_load.task_problems(task)
    sections.raise_if(problems)
    return SavedPolicyConfig(task=task, **built)


def sampling_settings(sampling: SamplingSettings, num_samples: int) -> dict:
    """The `SamplingConfig` fields the sampling section gives as they are, with `num_samples`
    completions per prompt: all but the token ids, which come from a tokenizer."""
    s = sampling
    return dict(
        think_budget=s.think_budget,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        num_samples=num_samples,
        buckets=tuple(s.buckets),
        kv_block_size=s.kv_block_size,
        kv_blocks=s.kv_blocks,
        kv_preempt=s.kv_preempt,
    )


def sampling_config(
    sampling: SamplingSettings, task, tokenizer, num_samples: int
) -> SamplingConfig:
    """The run's `SamplingConfig` with `num_samples` completions per prompt: the sampling
    section with its texts (the forced-interruption phrase and end-of-thinking marker)
    encoded by the run's tokenizer; `task` (the task section) names its chat template.

    Completions stop at the EOS and, for a chat-formatted task, at the template's end-of-turn
    token. Tokenizers without a pad token (Llama 3) left-pad with the EOS (padding is masked).
    """
    s = sampling
    stop = (tokenizer.eos_id,)
    template = data_load.chat_template(task)
    if template is not None:
        try:
            stop = chat.stop_token_ids(tokenizer, template)
        except ValueError:  # The end-of-turn marker is not one token: not this model's format.
            raise ValueError(
                f"task.chat_template={task.chat_template!r}: the tokenizer has no "
                f"{template.end_of_turn!r} token to end the assistant's turn, so the model does "
                "not use this chat template; set the model's family, or "
                "task.chat_template='' for text prompts"
            ) from None
    interrupt_ids, think_end = (), ()
    if s.think_budget:
        interrupt_ids = tuple(tokenizer.encode(s.interrupt_phrase))
        think_end = tuple(tokenizer.encode(s.think_end))
        if len(think_end) != 1:
            raise ValueError(
                f"sampling.think_end={s.think_end!r} is {len(think_end)} tokens "
                f"({list(think_end)}); it must be exactly one token of the tokenizer"
            )
    try:
        return SamplingConfig(
            **sampling_settings(s, num_samples),
            interrupt_ids=interrupt_ids,
            think_end_tokens=think_end,
            stop_tokens=stop,
            pad_id=tokenizer.padding_id,
        )
    except ValueError as e:  # The one set of sampling rules, reported under the config key.
        raise ValueError(f"Invalid config: sampling: {e}") from None


def default_tokenizer_path(checkpoint_dir: str, workdir: str) -> str:
    """The checkpoint's own tokenizer files, else the run's `WORKDIR/tokenizer.model`."""
    for name in (tokenizer_lib.HF_TOKENIZER_FILE, tokenizer_lib.SENTENCEPIECE_FILE):
        if os.path.isfile(os.path.join(checkpoint_dir, name)):
            return checkpoint_dir
    path = os.path.join(workdir, tokenizer_lib.SENTENCEPIECE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no tokenizer in {checkpoint_dir!r} nor {path!r}; pass --tokenizer PATH"
        )
    return path


class Policy(NamedTuple):
    """A params checkpoint loaded to sample from (`load_policy`)."""

    model_cfg: ModelConfig
    graphdef: object
    params: dict
    tokenizer: tokenizer_lib.Tokenizer
    tokenizer_path: str
    sampler: Sampler


def load_policy(
    mesh_cfg: sharding.MeshConfig,
    checkpoint_dir: str,
    workdir: str,
    tokenizer_path: str | None = None,
) -> Policy:
    """The checkpoint's params on the mesh `mesh_cfg` in the sampling layout, its tokenizer
    (`tokenizer_path`, else `default_tokenizer_path`) and a `Sampler` for them.

    Raises:
      ValueError: Naming `--checkpoint` when it is no directory, or the tokenizer when it has
        more ids than the model.
    """
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(f"--checkpoint={checkpoint_dir}: no such directory")
    mesh = sharding.make_mesh(tuple(mesh_cfg.shape))
    rules = sharding.SAMPLE_RULES
    model_cfg, graphdef, params = checkpoint.load_params(checkpoint_dir, mesh, rules)
    tokenizer_path = tokenizer_path or default_tokenizer_path(checkpoint_dir, workdir)
    tokenizer = tokenizer_lib.load(tokenizer_path)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer at {tokenizer_path!r} has {tokenizer.vocab_size} ids but the model "
            f"only {model_cfg.vocab_size}: not the tokenizer this checkpoint was trained with"
        )
    sampler = Sampler(graphdef, model_cfg, mesh, rules)
    return Policy(model_cfg, graphdef, params, tokenizer, tokenizer_path, sampler)


def load_problems(task_cfg, workdir: str, split: str, n: int):
    """(task, problems): the task section's task (`data.load.load_task`, materialized in
    `workdir`) and the first `n` problems of its `split`; ValueError naming `--split` when it
    has none."""
    task, splits = data_load.load_task(task_cfg, workdir)
    if split not in splits:
        raise ValueError(f"--split={split!r} is not one of {sorted(splits)}")
    return task, splits[split][:n]


def verifier_pool(reward: isolation.RewardConfig, *verifiers):
    """`isolation.reward_pool(reward, *verifiers)` as a context manager (a null one when
    `reward.workers` is 0: in-process)."""
    pool = isolation.reward_pool(reward, *verifiers)
    return contextlib.nullcontext() if pool is None else pool
