"""Builds the parts of an RL run from its config: the meshes and each role's layout, the
tokenizer, the task and its problems, the policy (warm start or Hugging Face checkpoint), its
frozen reference, a distillation teacher and learned rewards (a reward model, a PRM), the
generator engine and the evaluation sampler, the learner, the rollout source, the verifier
pool, and a preference run's pair file.

The learner keeps params in the training layout (`sharding.TRAIN_RULES`: FSDP over `fsdp`,
tensor parallel over `tensor`) on the trainer's mesh. The generator receives them resharded
to the sampling layout (`sharding.SAMPLE_RULES`: whole weights on each data replica) on its
own mesh: the first `pipeline.generator_devices` devices, or the trainer's mesh when that is
0. Evaluation samples on the trainer's mesh. A teacher (`config.teacher`) lives on the
trainer's mesh in the training layout, as the reference does.
"""

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from rlscale import (
    checkpoint,
    model,
    objectives,
    optim,
    programs,
    saved_policy,
    sharding,
    warm_start,
)
from rlscale import tokenizer as tokenizer_lib
from rlscale.data import filters
from rlscale.data import load as data_load
from rlscale.eval import heldout
from rlscale.model import hf
from rlscale.rewards import isolation
from rlscale.rl import batch_layout, checks, learned_rewards, learner, pairs, rollouts
from rlscale.rl import teacher as teacher_lib
from rlscale.sampling import Sampler, SamplingConfig, scoring
from rlscale.sampling.generator import Generator


@dataclasses.dataclass
class Setup:
    config: Any
    mesh: Any  # The trainer's.
    generator_mesh: Any  # The trainer's mesh unless the generator has its own devices.
    tokenizer: Any
    task: Any
    train_problems: list
    test_problems: list
    model_cfg: Any
    graphdef: Any
    params: Any  # The initial policy, training layout.
    ref_params: Any  # Frozen reference (None unless the objective reads `ref_logp`).
    teacher: teacher_lib.Teacher | None  # None unless the objective reads `teacher_logp`.
    # `reward.model`'s (None without one, and for `MADE`, which `Loop` trains and hands to
    # the rollout source).
    outcome_model: learned_rewards.OutcomeReward | None
    step_rewards: learned_rewards.StepRewards | None  # `reward.prm`'s (None without one).
    warm_start_summary: dict
    scfg: SamplingConfig
    eval_scfg: SamplingConfig
    sampler: Sampler  # The static sampler, for evaluation.
    sample_shardings: Any
    generator: Generator  # The engine that samples training rollouts.
    generator_shardings: Any
    learner: learner.Learner
    pool: Any  # The run's one verifier pool (None: rewards scored in-process).
    train_scorer: scoring.Scorer
    eval_scorer: scoring.Scorer
    programs: programs.Programs
    preference_pairs: list  # `preference.file`'s pairs (read at set-up); empty without one.

    def close(self):
        if self.pool is not None:
            self.pool.close()

    def sampler_params(self, params) -> tuple[Any, float]:
        """The params in the sampling layout on the trainer's devices (evaluation), and the
        seconds the reshard took."""
        return _timed_reshard(params, self.sample_shardings)

    def generator_params(self, params) -> tuple[Any, float]:
        """The params in the generator's layout (on its devices), and the seconds it took.
        Always a copy in pipeline modes: the generator samples while the learner donates."""
        copy = self.config.pipeline.mode != "sync"
        return _timed_reshard(params, self.generator_shardings, copy=copy)

    def rollout_source(self, stream, history) -> rollouts.RolloutSource:
        return rollouts.RolloutSource(
            self.config,
            self.generator,
            self.scfg,
            self.tokenizer,
            self.train_problems,
            self.train_scorer,
            stream,
            history,
            self.teacher,
            self.outcome_model,
            self.step_rewards,
        )

    def evaluate(self, params, rng) -> dict:
        return heldout.pass_rates(
            self.sampler,
            params,
            self.tokenizer,
            self.test_problems[: self.config.eval.prompts],
            rng,
            self.eval_scfg,
            self.eval_scorer,
        )

    def initial_state(self):
        """(TrainState, PromptStream, PassRateHistory) of a fresh run."""
        value_params = {"w": jnp.zeros((self.model_cfg.d_model,)), "b": jnp.zeros(())}
        value_params = sharding.replicate(value_params, self.mesh)
        c = self.config
        return (
            self.learner.init(self.params, value_params),
            filters.PromptStream(c.batch.prompt_pool or len(self.train_problems), seed=c.seed),
            filters.PassRateHistory(c.filters.retire_threshold),
        )


def _timed_reshard(params, shardings, copy=False):
    t = time.time()
    out = jax.block_until_ready(sharding.reshard(params, shardings, copy=copy))
    return out, time.time() - t


def _tokenizer(config, workdir, problems):
    path = os.path.join(workdir, "tokenizer.model")
    if os.path.exists(path):
        return tokenizer_lib.SentencePieceTokenizer(path)
    corpus = [p.prompt + p.demo for p in problems]
    # Chat-formatted prompts: the end-of-turn marker is one token, a stop token when sampling.
    template = data_load.chat_template(config.task)
    symbols = (template.end_of_turn,) if template is not None else ()
    # A small task corpus may support fewer pieces than asked: accept the smaller vocabulary.
    return tokenizer_lib.train_sentencepiece(
        corpus,
        config.tokenizer.vocab_size,
        model_type="bpe",
        user_defined_symbols=symbols,
        path=path,
        hard_vocab_limit=False,
    )


def make_learner(config, graphdef, params, mesh, progs) -> learner.Learner:
    """The run's learner from its config (`build`, and `rlscale.planner` for the same program)."""
    G, M, u = config.batch.group_size, config.sampling.max_new_tokens, config.learner
    return learner.Learner(
        graphdef=graphdef,
        objective=objectives.build(config.objective.chain, group_size=G, max_len=M),
        optimizer=optim.make_optimizer(config.optim, params),
        mesh=mesh,
        logits_cfg=SamplingConfig(
            temperature=config.sampling.temperature,
            top_k=config.sampling.top_k,
            top_p=config.sampling.top_p,
        ),
        epochs=u.epochs,
        layout=learner_layout(config),
        seed=config.seed,
        programs=progs,
        logprob_chunk=u.logprob_chunk,
        remat=u.remat,
        offload_ref=u.offload_ref,
    )


def learner_layout(config) -> batch_layout.Layout:
    """How the learner, its reference and a teacher lay a batch out in forward rows."""
    u = config.learner
    return batch_layout.Layout(
        pack_length=u.pack_length,
        pack_rows=u.pack_rows,
        group_size=config.batch.group_size,
        minibatches=u.minibatches,
        max_len=config.sampling.max_new_tokens,
        length_buckets=u.length_buckets,
    )


def make_teacher(config, mesh, model_cfg, graphdef, params, progs) -> teacher_lib.Teacher:
    """The run's distillation teacher (`config.teacher.checkpoint`, which `checks` has
    compared with the run's tokenizer), on the trainer's mesh in the training layout: an
    rlscale params checkpoint (`model_config.json`), a Hugging Face model directory (in
    `model.dtype`, as the policy would be), or 'self', a copy of the policy the run starts
    from (`params`: the train state's buffers are donated)."""
    path = config.teacher.checkpoint
    if path == checks.TEACHER_SELF:
        params = jax.tree.map(jnp.copy, params)
    elif os.path.isfile(os.path.join(path, "model_config.json")):
        model_cfg, graphdef, params = checkpoint.load_params(path, mesh)
    else:
        model_cfg, graphdef, params = hf.load_hf(path, mesh, dtype=config.model.dtype)
    u = config.learner
    return teacher_lib.Teacher(
        graphdef,
        params,
        model_cfg=model_cfg,
        mesh=mesh,
        temperature=config.sampling.temperature,
        layout=learner_layout(config),
        logprob_chunk=u.logprob_chunk,
        programs=progs,
    )


def _check_with_data(config, tokenizer, tokenizer_source: str, scfg, longest: int) -> list:
    """`preference.file`'s pairs (empty without one), once the checks that need the data and
    the tokenizer pass: packing the longest prompt (`longest` tokens), the teacher's and the
    learned rewards' tokenizers, the pair file. Raises ValueError listing every problem."""
    problems = checks.pack_problems(config, longest)
    problems += checks.teacher_problems(config, tokenizer, tokenizer_source)
    problems += checks.learned_reward_tokenizer_problems(config, tokenizer)
    preference_pairs, trouble = pairs.read_file(config, tokenizer, scfg)
    problems += trouble
    if problems:  # Before the warm start's training.
        raise ValueError("; ".join(problems))
    return preference_pairs


def _verifier_pool(config, reward_fn, task):
    """The run's one verifier pool (`reward.workers` processes), or None (in-process)."""
    if not config.reward.workers:
        return None
    # Workers start with the verifiers' modules already imported.
    modules = sorted({reward_fn.__module__, task.verify.__module__})
    return isolation.verifier_pool(config.reward.workers, preload=modules)


def _policy(config, workdir: str, mesh, tokenizer, task, splits) -> tuple[Any, Any, Any, dict]:
    """(model_cfg, graphdef, params, warm-start summary) of the policy the run starts from:
    `init.hf_checkpoint` (placed directly on the mesh; no summary), else the SFT warm start
    (trained now, or cached in WORKDIR/sft)."""
    if config.init.hf_checkpoint:
        model_cfg, graphdef, params = hf.load_hf(
            config.init.hf_checkpoint, mesh, dtype=config.model.dtype
        )
        return model_cfg, graphdef, params, {}
    model_cfg = model.from_dict({**config.model, "vocab_size": tokenizer.vocab_size})
    graphdef, params, summary = warm_start.train_or_load(
        config, workdir, model_cfg, mesh, tokenizer, task, splits["train"], splits["test"]
    )
    return model_cfg, graphdef, params, summary


def build(config, workdir: str) -> Setup:
    """Every part of the run, from its config (already validated by `checks.validate`)."""
    pipe = config.pipeline
    mesh, gen_mesh = sharding.role_meshes(tuple(config.mesh.shape), pipe.generator_devices)
    warm_start.reuse(config, workdir)
    task, splits = data_load.load_task(config, workdir)
    if config.batch.prompt_pool > len(splits["train"]):
        raise ValueError(
            f"batch.prompt_pool={config.batch.prompt_pool} is more than the task's "
            f"{len(splits['train'])} training problems"
        )
    hf_init = config.init.hf_checkpoint
    if hf_init:  # A pretrained policy brings its own tokenizer.
        tokenizer = tokenizer_lib.load(hf_init)
    else:
        tokenizer = _tokenizer(config, workdir, splits["train"])
    scfg = saved_policy.sampling_config(config, tokenizer, checks.samples_per_prompt(config))
    G = checks.samples_per_prompt(config)
    longest = max(len(p) for p in scoring.encode_prompts(tokenizer, splits["train"]))
    tokenizer_source = hf_init or os.path.join(workdir, "tokenizer.model")
    preference_pairs = _check_with_data(config, tokenizer, tokenizer_source, scfg, longest)
    progs = programs.Programs(mesh)
    reward_fn = checks.import_function(config.reward.fn) if config.reward.fn else task.verify
    pool = _verifier_pool(config, reward_fn, task)
    model_cfg, graphdef, params, summary = _policy(config, workdir, mesh, tokenizer, task, splits)
    sampler = Sampler(graphdef, model_cfg, mesh, sharding.SAMPLE_RULES, programs=progs)
    generator = Generator(
        graphdef,
        model_cfg,
        scfg,
        slots=pipe.slots or config.batch.prompts * G,
        max_prompt_len=longest,
        mesh=gen_mesh,
        programs=progs.on(gen_mesh),
    )
    learn = make_learner(config, graphdef, params, mesh, progs)
    # The reference is the same function with frozen params.
    ref = learn.reference(params) if "ref_logp" in learn.objective.model_terms else None
    teacher = None
    if "teacher_logp" in learn.objective.model_terms:
        teacher = make_teacher(config, mesh, model_cfg, graphdef, params, progs)
    return Setup(
        config=config,
        mesh=mesh,
        generator_mesh=gen_mesh,
        tokenizer=tokenizer,
        task=task,
        train_problems=splits["train"],
        test_problems=splits["test"],
        model_cfg=model_cfg,
        graphdef=graphdef,
        params=params,
        ref_params=ref,
        teacher=teacher,
        outcome_model=learned_rewards.load_outcome(config, mesh),
        step_rewards=learned_rewards.load_steps(config, mesh),
        warm_start_summary=summary,
        scfg=scfg,
        eval_scfg=dataclasses.replace(scfg, num_samples=config.eval.samples),
        sampler=sampler,
        sample_shardings=sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES),
        generator=generator,
        generator_shardings=sharding.param_shardings(params, gen_mesh, sharding.SAMPLE_RULES),
        learner=learn,
        pool=pool,
        train_scorer=scoring.Scorer(reward_fn, pool, config.reward.timeout),
        eval_scorer=scoring.Scorer(task.verify, pool, config.reward.timeout),
        programs=progs,
        preference_pairs=preference_pairs,
    )
