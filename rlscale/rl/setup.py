"""Builds the parts of an RL run from its config: the meshes and each role's layout, the
tokenizer, the task and its problems, the policy (warm start or Hugging Face checkpoint), its
frozen reference, a distillation teacher and learned rewards (a reward model, a PRM), the
generator engine and the evaluation sampler, the learner, the rollout source, the verifier
pool, and a preference run's pair file.

The learner keeps params in the training layout (`sharding.TRAIN_RULES`: FSDP over `fsdp`,
tensor parallel over `tensor`) on the trainer's mesh. The generator receives them resharded
to the sampling layout (`sharding.SAMPLE_RULES`: split only over `tensor`) on its own mesh
(the first `pipeline.generator_devices`, `pipeline.generator_tensor` ways tensor parallel)
or the trainer's (when that is 0). Evaluation samples on the trainer's mesh; a teacher
(`config.teacher`) lives there in the training layout, as the reference does.

Everything here reads the resolved run (`rl.resolve.RunConfig`); the sections this module
owns are those of what it builds: the learner, the policy's start, its tokenizer, the
objective and the teacher.
"""

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from rlscale import (
    checkpoint,
    objectives,
    optim,
    programs,
    saved_policy,
    sections,
    sharding,
    stage_cache,
    warm_start,
)
from rlscale import tokenizers as tokenizer_lib
from rlscale.data import filters
from rlscale.data import load as data_load
from rlscale.envs import episodes as env_episodes
from rlscale.envs import registry as env_registry
from rlscale.eval import heldout
from rlscale.model import decoder, hf
from rlscale.model import lora as lora_lib
from rlscale.rewards import isolation
from rlscale.rl import batch_layout, checks, learned_rewards, learner, pairs, report, rollouts
from rlscale.rl import teacher as teacher_lib
from rlscale.sampling import Sampler, SamplingConfig, precision, scoring
from rlscale.sampling.generator import Generator


@dataclasses.dataclass(frozen=True)
class LearnerConfig(sections.Section):
    """`config.learner` (docs/learner.md): `epochs` x `minibatches` optimizer steps per batch,
    each accumulating its micro-batches; completions trimmed to one of `length_buckets`
    lengths; sequences packed into rows of `pack_length` tokens (0: one a row), `pack_rows`
    rows per batch shard a micro-batch (0: `Layout.rows`; below `batch.group_size` part of a
    group: `Layout.split_groups`), `shared_prefix` a group's prompt once per row; logprobs
    `logprob_chunk` tokens at a time; `remat` what each block's backward pass recomputes;
    `offload_ref` the KL reference in host memory; `router_replay` a MoE's routing."""

    epochs: int = 1
    minibatches: int = 1
    length_buckets: int = 4
    pack_length: int = 0
    pack_rows: int = 0
    shared_prefix: bool = False
    logprob_chunk: int = 1024
    remat: str = "none"
    offload_ref: bool = False
    router_replay: str = "off"
    replay_probe: bool = False

    def problems(self) -> list[str]:
        problems = sections.at_least("learner.length_buckets", self.length_buckets, 1)
        problems += sections.at_least("learner.logprob_chunk", self.logprob_chunk, 1)
        if self.remat not in decoder.REMAT_POLICIES:
            problems.append(
                f"learner.remat={self.remat!r} is not one of {tuple(decoder.REMAT_POLICIES)}"
            )
        if self.router_replay not in learner.ROUTER_REPLAY:
            modes = learner.ROUTER_REPLAY
            problems.append(f"learner.router_replay={self.router_replay!r} is not one of {modes}")
        if not isinstance(self.offload_ref, bool):
            problems.append(f"learner.offload_ref={self.offload_ref!r} must be True or False")
        if not isinstance(self.pack_rows, int) or self.pack_rows < 0:
            problems.append(
                f"learner.pack_rows={self.pack_rows!r} must be an integer >= 0 (0: derived "
                "from the batch)"
            )
        return problems


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig(sections.Section):
    """`config.objective`: the loss as a chain of registered transforms (`objectives`; its
    problems depend on the batch and sampling sections: `rl.checks`)."""

    chain: str = ""


@dataclasses.dataclass(frozen=True)
class TeacherConfig(sections.Section):
    """`config.teacher`: the distillation teacher's directory, "self" (the policy the run
    starts from) or "" (none); checked against the chain by `rl.checks`."""

    checkpoint: str = ""


@dataclasses.dataclass(frozen=True)
class InitConfig(sections.Section):
    """`config.init`: a Hugging Face model directory to start from instead of the SFT warm
    start ("": the warm start)."""

    hf_checkpoint: str = ""

    def problems(self) -> list[str]:
        path = self.hf_checkpoint
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            return [
                f"init.hf_checkpoint={path!r} has no config.json: not a Hugging Face model "
                "directory"
            ]
        return []


@dataclasses.dataclass(frozen=True)
class TokenizerConfig(sections.Section):
    """`config.tokenizer`: the pieces of the SentencePiece model trained on the task's corpus
    (a run from a Hugging Face checkpoint uses its own)."""

    vocab_size: int = 320


@dataclasses.dataclass
class Setup:
    config: Any  # The resolved run (`rl.resolve.RunConfig`), its prompt pool filled.
    mesh: Any  # The trainer's.
    generator_mesh: Any  # The trainer's mesh unless the generator has its own devices.
    tokenizer: Any
    task: Any
    train_problems: list
    test_problems: list
    model_cfg: Any
    graphdef: Any
    params: Any  # The initial policy, training layout; with LoRA the frozen base.
    # Frozen reference (None unless the objective reads `ref_logp`); with LoRA `params`
    # itself, whatever the objective: the base the adapters merge into (no second copy).
    ref_params: Any
    teacher: teacher_lib.Teacher | None  # None unless the objective reads `teacher_logp`.
    # `reward.model`'s (None without one, and for `TRAIN_AT_SETUP`, which `Loop` trains and
    # hands to the rollout source).
    outcome_model: learned_rewards.OutcomeReward | None
    step_rewards: learned_rewards.StepRewards | None  # `reward.prm`'s (None without one).
    warm_start_summary: dict
    scfg: SamplingConfig
    eval_scfg: SamplingConfig
    sampler: Sampler  # The static sampler, for evaluation.
    sample_shardings: Any
    generator: Generator  # The engine that samples training rollouts.
    episodes: env_episodes.Episodes  # The engine, driven through the run's environments.
    # Held-out episodes, where the environment has turns (the static sampler has none): a
    # second engine on the trainer's devices (its own cache; the rollouts' programs where
    # the meshes agree). None for a single-turn run.
    eval_episodes: env_episodes.Episodes | None
    generator_shardings: Any
    learner: learner.Learner
    pool: Any  # The run's one verifier pool (None: rewards scored in-process).
    train_scorer: scoring.Scorer
    eval_scorer: scoring.Scorer
    programs: programs.Programs
    preference_pairs: list  # `preference.file`'s pairs (read at set-up); empty without one.
    stage_settings: dict  # Stage (`stage_cache.STAGES`) -> its settings (`stage_settings`).
    # The dtype `generator_params` casts to ("": none; `precision.generator_model`).
    generator_cast: str = ""
    # With LoRA, the frozen base's identity, which its checkpoints hold instead of the base:
    # {"source": init.hf_checkpoint as given, or the warm start's directory, "fingerprint":
    # `checkpoint.tree_fingerprint`}. None without LoRA.
    base_identity: dict | None = None

    def close(self):
        self.episodes.close()
        if self.eval_episodes is not None:
            self.eval_episodes.close()
        if self.pool is not None:
            self.pool.close()

    def policy_params(self, params):
        """The policy's params from the train state's (`params`): with LoRA the base with
        the adapters merged in (`lora.merged`, in the training layout), else `params`."""
        lora = self.config.lora
        return lora_lib.merged(self.params, params, lora.scale) if lora.enabled else params

    def sampler_params(self, params) -> tuple[Any, float]:
        """The policy (`params`: the train state's) in the sampling layout on the trainer's
        devices (evaluation), and the seconds the merge and reshard took."""
        return _timed_reshard(self.policy_params(params), self.sample_shardings)

    def generator_params(self, params) -> tuple[Any, float]:
        """The policy (`params`: the train state's; with LoRA merged here, at each weight
        swap) in the generator's layout (on its devices) and dtype (`sampling.generator_dtype`),
        and the seconds it took. Always a copy in pipeline modes: the generator samples while
        the learner donates (a cast is one)."""
        t, copy = time.time(), self.config.pipeline.mode != "sync"
        params = self.policy_params(params)
        if self.generator_cast:  # In the training layout: the reshard then moves fewer bytes.
            cast = {"dtype": self.generator_cast}
            params = self.programs.run("generator_cast", precision.cast_params, (params,), cast)
            copy = False  # The cast's buffers are new.
        params, _ = _timed_reshard(params, self.generator_shardings, copy=copy)
        return params, time.time() - t

    def generator_shapes(self, params):
        """`generator_params(params)`'s shapes, dtypes and shardings, computing nothing (with
        LoRA the base's: a merge keeps them)."""
        params = self.params if self.config.lora.enabled else params
        dtype = self.generator_cast or None
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=sh),
            params,
            self.generator_shardings,
        )

    def rollout_source(self, stream, history) -> rollouts.RolloutSource:
        c = self.config
        return rollouts.RolloutSource(
            c.batch,
            c.filters,
            c.pipeline.decode_chunk,
            self.episodes,
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
        """Held-out metrics of `params` (sampling layout, trainer's devices): through the
        run's environments where they have turns (with the `eval/` episode metrics), else
        the static sampler's single completions."""
        if self.eval_episodes is not None:
            rates, episodes = heldout.episode_pass_rates(
                self.eval_episodes,
                params,
                self.tokenizer,
                self.test_problems[: self.config.eval.prompts],
                rng,
                self.config.eval.samples,
                self.eval_scorer,
                self.scfg,
                self.config.pipeline.decode_chunk,
            )
            kept = ("env/turns_mean", "env/calls_per_episode", "env/episodes_with_calls")
            env = report.episode_record(episodes)
            return {**rates, **{f"eval/{k.removeprefix('env/')}": env[k] for k in kept}}
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
        trained = self.params
        if c.lora.enabled:  # Replicated: rank x (I + O) floats a weight.
            rng = jax.random.fold_in(jax.random.key(c.seed), LORA_STREAM)
            trained = sharding.replicate(lora_lib.init(self.params, c.lora, rng), self.mesh)
        return (
            self.learner.init(trained, value_params),
            filters.PromptStream(c.batch.prompt_pool, seed=c.seed),
            filters.PassRateHistory(c.filters.retire_threshold),
        )


# `fold_in` stream of the run's seed that draws the LoRA adapters' init.
LORA_STREAM = 7


def _environment(config, tokenizer, scfg):
    """The run's environment factory, and `scfg` with its stops (as the run's tokenizer writes
    them) as the ones that end the generator's turns (none: single-turn)."""
    factory = env_registry.make_factory(config.env)
    stops = env_registry.action_stops(
        factory, config.env, tokenizer, config.sampling.max_new_tokens
    )
    return factory, dataclasses.replace(scfg, action_stops=stops)


def _generator(config, graphdef, model_cfg, scfg, longest: int, gen_mesh, progs) -> Generator:
    """The engine that samples the rollouts, on the generator's devices, in its numerics
    (`sampling.generator_dtype`): the policy's own, or a derived config whose graph computes
    in the lower dtype (`precision.generator_model`)."""
    gen_cfg = precision.generator_model(model_cfg, config.sampling.generator_dtype)
    return Generator(
        graphdef if gen_cfg is model_cfg else decoder.abstract_model(gen_cfg)[0],
        gen_cfg,
        scfg,
        slots=config.pipeline.slots,
        max_prompt_len=longest,
        mesh=gen_mesh,
        programs=progs.on(gen_mesh),
        parked=config.env.parked,
    )


def _eval_episodes(config, env_factory, tokenizer, rollouts, test, longest, sampler, progs):
    """Held-out episodes for a run whose environment has turns: an engine like the
    rollouts' generator (its sampling settings and slots) for the static `sampler`'s policy
    (the learner's numerics) on its devices (the trainer's), for the `test` problems'
    prompts and ones as long as the `longest` training prompt; None for a single-turn run."""
    if not env_factory.multi_turn:
        return None
    longest = max([longest] + [len(p) for p in scoring.encode_prompts(tokenizer, test)])
    mesh = sampler.layout.mesh
    generator = Generator(
        sampler.graphdef,
        sampler.model_cfg,
        rollouts.cfg,
        slots=rollouts.slots,
        max_prompt_len=longest,
        mesh=mesh,
        programs=progs,
        parked=config.env.parked,
    )
    return env_episodes.Episodes(generator, env_factory, tokenizer, config.env)


def _timed_reshard(params, shardings, copy=False):
    t = time.time()
    out = jax.block_until_ready(sharding.reshard(params, shardings, copy=copy))
    return out, time.time() - t


def _tokenizer(tok: TokenizerConfig, task, workdir, problems):
    path = os.path.join(workdir, "tokenizer.model")
    if os.path.exists(path):
        return tokenizer_lib.SentencePieceTokenizer(path)
    corpus = [p.prompt + p.demo for p in problems]
    # Chat-formatted prompts: the end-of-turn marker is one token, a stop token when sampling.
    template = data_load.chat_template(task)
    symbols = (template.end_of_turn,) if template is not None else ()
    # A small task corpus may support fewer pieces than asked: accept the smaller vocabulary.
    return tokenizer_lib.train_sentencepiece(
        corpus,
        tok.vocab_size,
        model_type="bpe",
        user_defined_symbols=symbols,
        path=path,
        hard_vocab_limit=False,
    )


def make_learner(config, graphdef, params, mesh, progs) -> learner.Learner:
    """The run's learner from the resolved run's objective, batch, sampling, learner and optim
    sections (`build`, and `rlscale.planning` for the same program)."""
    G, M, u = config.batch.group_size, config.sampling.max_new_tokens, config.learner
    lora = config.lora if config.lora.enabled else None
    return learner.Learner(
        graphdef=graphdef,
        objective=objectives.build(config.objective.chain, group_size=G, max_len=M),
        # LoRA trains float32 adapters: no master weights whatever the base's dtype.
        optimizer=optim.make_optimizer(config.optim, None if lora else params),
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
        lora=lora,
        router_replay=u.router_replay,
        replay_probe=u.replay_probe,
        routing_lc=learner.routing_lc(graphdef, params),
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
        shared_prefix=u.shared_prefix,
    )


def make_teacher(config, mesh, model_cfg, graphdef, params, progs) -> teacher_lib.Teacher:
    """The run's distillation teacher (`config.teacher.checkpoint` of the resolved run, which
    `checks` has
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
        model_cfg, graphdef, params = hf.load_hf(
            path, mesh, dtype=config.model.dtype, attention=config.model.attention
        )
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
    problems = checks.pack_problems(config.learner, config.batch, config.sampling, longest)
    problems += checks.teacher_problems(config.teacher, config.init, tokenizer, tokenizer_source)
    problems += checks.learned_reward_tokenizer_problems(config.reward, tokenizer)
    preference_pairs, trouble = pairs.read_file(config.preference, tokenizer, scfg)
    problems += trouble
    if problems:  # Before the warm start's training.
        raise ValueError("; ".join(problems))
    return preference_pairs


def stage_settings(config) -> dict:
    """What each stage of the run's cache (`stage_cache.STAGES`) is made with, from the
    resolved run's sections as configured (before set-up fills `batch.prompt_pool`)."""
    c = config
    start = warm_start.settings(
        c.sft, c.task, c.tokenizer, c.model_name, c.model, c.eval, c.sampling
    )
    made_pairs = pairs.made_settings(
        seed=c.seed,
        task=c.task,
        tokenizer=c.tokenizer,
        model_name=c.model_name,
        model=c.model,
        sft=c.sft,
        init=c.init,
        sampling=c.sampling,
        batch=c.batch,
        reward=c.reward,
        preference=c.preference,
    )
    return {
        stage_cache.WARM_START: start,
        stage_cache.PREFERENCE_PAIRS: made_pairs,
        stage_cache.REWARD_MODEL: learned_rewards.made_settings(c.reward, made_pairs),
    }


def _policy(
    config, workdir: str, mesh, tokenizer, task, splits, start: dict
) -> tuple[Any, Any, Any, dict]:
    """(model_cfg, graphdef, params, warm-start summary) of the policy the run starts from:
    `init.hf_checkpoint` (placed directly on the mesh; no summary), else the SFT warm start
    (trained now, or cached in WORKDIR/sft, by `warm_start`; `start`: its settings)."""
    if config.init.hf_checkpoint:
        model_cfg, graphdef, params = hf.load_hf(
            config.init.hf_checkpoint,
            mesh,
            dtype=config.model.dtype,
            attention=config.model.attention,
        )
        return model_cfg, graphdef, params, {}
    model_cfg = dataclasses.replace(config.model, vocab_size=tokenizer.vocab_size)
    graphdef, params, summary = warm_start.train_or_load(
        config.sft,
        config.eval,
        config.sampling,
        start,
        workdir,
        model_cfg,
        mesh,
        tokenizer,
        task,
        splits["train"],
        splits["test"],
    )
    return model_cfg, graphdef, params, summary


def _reference(config, learn, params, workdir: str) -> tuple[Any, dict | None]:
    """The frozen reference (the same function with frozen params: a copy of the initial
    policy where the chain reads `ref_logp`, else None) and, with LoRA, the base's identity:
    then the reference is the base itself (`params`), whatever the chain."""
    if not config.lora.enabled:
        return (
            learn.reference(params) if "ref_logp" in learn.objective.model_terms else None
        ), None
    source = config.raw.init.hf_checkpoint or stage_cache.path(workdir, stage_cache.WARM_START)
    return params, {"source": source, "fingerprint": checkpoint.tree_fingerprint(params)}


def build(config, workdir: str) -> Setup:
    """Every part of the run, from the resolved run (`rl.resolve.resolve`)."""
    p = config.pipeline
    mesh, gmesh = sharding.role_meshes(config.mesh.shape, p.generator_devices, p.generator_tensor)
    settings = stage_settings(config)  # Before the prompt pool is filled.
    warm_start.reuse(config.sft, settings[stage_cache.WARM_START], workdir)
    task, splits = data_load.load_task(config.task, workdir)
    config = dataclasses.replace(config, batch=config.batch.with_pool(len(splits["train"])))
    hf_init = config.init.hf_checkpoint
    if hf_init:  # A pretrained policy brings its own tokenizer.
        tokenizer = tokenizer_lib.load(hf_init)
    else:
        tokenizer = _tokenizer(config.tokenizer, config.task, workdir, splits["train"])
    scfg = saved_policy.sampling_config(
        config.sampling, config.task, tokenizer, config.batch.samples_per_prompt
    )
    env_factory, scfg = _environment(config, tokenizer, scfg)
    longest = max(len(p) for p in scoring.encode_prompts(tokenizer, splits["train"]))
    tokenizer_source = hf_init or os.path.join(workdir, "tokenizer.model")
    preference_pairs = _check_with_data(config, tokenizer, tokenizer_source, scfg, longest)
    progs = programs.Programs(mesh)
    reward_fn = isolation.import_function(config.reward.fn) if config.reward.fn else task.verify
    pool = isolation.reward_pool(config.reward, reward_fn, task.verify)
    model_cfg, graphdef, params, summary = _policy(
        config, workdir, mesh, tokenizer, task, splits, settings[stage_cache.WARM_START]
    )
    sampler = Sampler(graphdef, model_cfg, mesh, sharding.SAMPLE_RULES, programs=progs)
    generator = _generator(config, graphdef, model_cfg, scfg, longest, gmesh, progs)
    learn = make_learner(config, graphdef, params, mesh, progs)
    ref, base_identity = _reference(config, learn, params, workdir)
    teacher = None
    if "teacher_logp" in learn.objective.model_terms:
        teacher = make_teacher(config, mesh, model_cfg, graphdef, params, progs)
    return Setup(
        config=config,
        mesh=mesh,
        generator_mesh=gmesh,
        tokenizer=tokenizer,
        task=task,
        train_problems=splits["train"],
        test_problems=splits["test"],
        model_cfg=model_cfg,
        graphdef=graphdef,
        params=params,
        ref_params=ref,
        teacher=teacher,
        outcome_model=learned_rewards.load_outcome(config.reward, mesh),
        step_rewards=learned_rewards.load_steps(config.reward, mesh),
        warm_start_summary=summary,
        scfg=scfg,
        eval_scfg=dataclasses.replace(scfg, num_samples=config.eval.samples),
        sampler=sampler,
        sample_shardings=sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES),
        generator=generator,
        episodes=env_episodes.Episodes(generator, env_factory, tokenizer, config.env),
        eval_episodes=_eval_episodes(
            config, env_factory, tokenizer, generator, splits["test"], longest, sampler, progs
        ),
        generator_shardings=sharding.param_shardings(params, gmesh, sharding.SAMPLE_RULES),
        learner=learn,
        pool=pool,
        train_scorer=scoring.Scorer(reward_fn, pool, config.reward.timeout),
        eval_scorer=scoring.Scorer(task.verify, pool, config.reward.timeout),
        programs=progs,
        preference_pairs=preference_pairs,
        stage_settings=settings,
        generator_cast="" if generator.model_cfg is model_cfg else generator.model_cfg.dtype,
        base_identity=base_identity,
    )
