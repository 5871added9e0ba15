"""Helpers for `configs/*.py`: variant-string parsing and config pieces shared by recipes.

Every config file defines `get_config(arg=None)`; `arg` is the text after `:` in
`--config configs/X.py:key=value,flag`. `parse_arg` turns it into typed values, rejecting keys
the config does not declare.
"""

import dataclasses

import ml_collections

from rlscale import model

# GRPO's objective without its KL to a reference (the shared default; `configs/grpo.py` adds
# the KL): group-std advantages, token ratio, PPO clip 0.2, per-sequence token means.
GRPO_CHAIN = (
    "group_advantages | token_ratio | ppo_clip(eps_low=0.2, eps_high=0.2)"
    " | aggregate(mode=seq_mean_token_mean)"
)
# The quickstart's loss (ScaleRL's, at small scale): CISPO capped at 4 against the
# generator's logprobs, advantages scaled by the batch's std, prompt-level aggregation.
QUICKSTART_CHAIN = (
    "group_advantages(scale=batch_std) | token_ratio | cispo(eps_max=4.0)"
    " | aggregate(mode=prompt_mean)"
)


def _convert(key: str, text: str, default):
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", ""):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"config variant {key}={text!r}: expected a boolean")
    try:
        return type(default)(text) if default is not None else text
    except ValueError:
        raise ValueError(
            f"config variant {key}={text!r}: expected {type(default).__name__}"
        ) from None


def parse_arg(arg: str | None, **spec) -> ml_collections.ConfigDict:
    """Parses `"key=value,flag"` against declared keys and defaults.

    A bare `flag` sets a boolean key to True. Values take the type of their default.

    Raises:
      ValueError: naming an undeclared key or a value of the wrong type.
    """
    values = dict(spec)
    for item in filter(None, (arg or "").split(",")):
        key, _, text = item.partition("=")
        key = key.strip()
        if key not in spec:
            raise ValueError(
                f"unknown config variant {key!r} in {arg!r}; known: {', '.join(sorted(spec))}"
            )
        if not _ and not isinstance(spec[key], bool):
            raise ValueError(f"config variant {key!r} needs a value ({key}=...)")
        values[key] = _convert(key, text.strip(), spec[key])
    return ml_collections.ConfigDict(values)


def model_config(name: str, **overrides) -> ml_collections.ConfigDict:
    """The named architecture as a ConfigDict: every field is overridable from the CLI."""
    return ml_collections.ConfigDict({"name": name, **model.as_dict(model.get(name, **overrides))})


def sampling_config(**overrides) -> ml_collections.ConfigDict:
    from rlscale.sampling import SamplingConfig

    d = dataclasses.asdict(SamplingConfig(**overrides))
    return ml_collections.ConfigDict(d)


def files_task(**overrides) -> ml_collections.ConfigDict:
    """`config.task` of the files task (`rlscale.data.math_data`): problems from the user's
    files, every key present so that `--config.task.x=...` can set it.

    Keys: `files` ({split: path}: .jsonl, .json, .parquet or a `datasets` directory), `format`
    ("auto", or gsm8k | math | polaris | verl | trl | fields), `fields` (the column names of
    the `fields` layout: prompt, answer, demo), `verifier` (auto | math | exact | gsm8k),
    `chat_template` (a family of `rlscale.tokenizers.chat`, "" for text prompts),
    `instruction` (appended to text prompts, "" for none), `system` (a system message, "" for
    none).
    """
    c = dict(
        name="files",
        files={"train": "", "test": ""},
        format="auto",
        fields=dict(prompt="", answer="", demo=""),
        verifier="auto",
        chat_template="",
        instruction="",
        system="",
    )
    unknown = sorted(set(overrides) - set(c)) + [
        f"fields.{k}" for k in sorted(set(overrides.get("fields", {})) - set(c["fields"]))
    ]
    if unknown:
        raise ValueError(f"files_task: unknown keys {unknown}; keys: {', '.join(c)}")
    fields = {**c["fields"], **overrides.pop("fields", {})}
    return ml_collections.ConfigDict({**c, **overrides, "fields": fields})


# Every projection of each block: attention and MLP.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rl_config(**variant) -> ml_collections.ConfigDict:
    """Shared defaults of every RL recipe: one place, overridden by each recipe file."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 40
    c.mesh = dict(shape=(-1, 1, 1))  # (data, fsdp, tensor); -1 takes the remaining devices.
    c.task = dict(name="arithmetic", difficulty=2, seed=0, n_train=4000, n_test=400)
    c.tokenizer = dict(vocab_size=320)
    # A Hugging Face model directory to start from instead of the SFT warm start (its own
    # tokenizer and architecture; `model` then only sets the compute dtype).
    c.init = dict(hf_checkpoint="")
    c.model = model_config(
        "tiny",
        num_layers=4,
        d_model=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mlp_dim=384,
        max_seq_len=128,
    )
    # The warm start imitates demonstrations of which only a quarter state the graded
    # "Answer: N" line: it works problems out well but rarely says the answer (docs/configs.md).
    c.sft = dict(
        max_steps=900,
        batch_size=64,
        lr=3e-3,
        eval_every=300,
        target_pass=0.5,  # Stop early once the warm start solves this much of held-out.
        # Demonstrations that end with the graded "Answer: N" line; the rest stop after the
        # working ("7+15-2=22-2=20"), which the verifier scores 0.
        answer_line_fraction=0.25,
        reuse_from="",  # Another run's workdir whose data, tokenizer and warm start to copy.
        seed=0,  # The warm start's own seed: RL seeds (`seed`) share one warm start.
    )
    # `prompt_pool`: the RL loop draws its prompts from the first `prompt_pool` training
    # problems (0: all), so a data-reuse study trains the same compute on fewer distinct
    # prompts without changing the task or its warm start.
    c.batch = dict(prompts=32, group_size=8, prompt_pool=0)
    c.sampling = dict(
        max_new_tokens=32,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        buckets=(16, 32, 64),
        # Forced interruption (ScaleRL): after think_budget tokens without `think_end` (one
        # token), `interrupt_phrase` is written in and the model answers. 0: off.
        think_budget=0,
        interrupt_phrase=" Answer:",
        think_end=" Answer",
        # The rollouts' generator's weights, activations and KV cache: "float32", "bfloat16"
        # or "float16"; "" keeps the learner's (`model.dtype`, `model.param_dtype`).
        generator_dtype="",
        # The generator's KV cache in blocks of `kv_block_size` columns, a request's samples
        # sharing its prompt's (docs/model_and_sampling.md#a-paged-kv-cache); 0: a dense row
        # per slot. `kv_blocks`: the pool (0: as many blocks as the dense rows take).
        # `kv_preempt`: admit on a prompt's blocks, not a request's worst case, and swap the
        # latest samples out to the host when the pool runs out.
        kv_block_size=0,
        kv_blocks=0,
        kv_preempt=False,
    )
    # Optimizer steps per batch (epochs x minibatches, each accumulating micro-batches), and
    # the real tokens trained on (docs/learner.md): completions are trimmed to one of
    # `length_buckets` lengths (1: always sampling.max_new_tokens); the sequences with
    # trained tokens are packed into forward rows of `pack_length` tokens (0: one sequence per
    # row of the batch's prompt and completion tokens), micro-batches of `pack_rows` rows per
    # batch shard (0: batch.group_size with a pack_length; else a minibatch's rows), as many
    # micro-batches per optimizer step as the batch fills. Memory at
    # real sizes (docs/learner.md): logprobs and entropy over the vocabulary
    # `logprob_chunk` completion tokens at a time; `remat` ("none", "dots", "full") what each
    # block's backward pass recomputes; `offload_ref` keeps the KL reference in host memory.
    # A mixture of experts (docs/model_and_sampling.md#router-replay): `router_replay` "off"
    # (the learner's own routing) or "generator" (the experts the generator recorded);
    # `replay_probe` also measures the logprob gap the other way (one more forward pass).
    # `shared_prefix` (with a pack_length): a group's prompt once per packed row, then its
    # samples' own tokens (docs/learner.md#shared-prefix).
    c.learner = dict(
        epochs=1,
        minibatches=1,
        length_buckets=4,
        pack_length=0,
        pack_rows=0,
        shared_prefix=False,
        logprob_chunk=1024,
        remat="none",
        offload_ref=False,
        router_replay="off",
        replay_probe=False,
    )
    # Generation and training (docs/pipeline.md): "sync" samples each batch with the
    # current policy, then trains on it; "pipeline" generates continuously and takes new
    # weights between decode steps (in-flight updates, sequences keep their KV cache);
    # "async_ppo" generates each batch with one policy version. No token is trained more than
    # `max_staleness` optimizer updates after the version that sampled it (admission control).
    # The generator gets the first `generator_devices` devices (0: it time-slices the
    # trainer's, seen as a (devices / generator_tensor, 1, generator_tensor) mesh where
    # generator_tensor > 1), `generator_tensor` of them per tensor-parallel group, `slots`
    # decode slots (0: batch.prompts x group_size) and runs `decode_chunk` tokens per call
    # between weight and admission checks.
    c.pipeline = dict(
        mode="sync",
        max_staleness=0,
        generator_devices=0,
        generator_tensor=1,
        slots=0,
        decode_chunk=8,
    )
    c.optim = dict(
        lr=1e-4,
        warmup_steps=5,
        schedule="constant",
        decay_steps=1000,
        final_lr_frac=0.1,
        grad_clip=1.0,
        b1=0.9,
        b2=0.99,
        eps=1e-8,
        weight_decay=0.0,
    )
    # The loss as a chain of registered transforms (`rlscale.objectives.registry`); override
    # with --config.objective.chain='group_advantages | token_ratio | ...'.
    c.objective = dict(chain=GRPO_CHAIN)
    # On-policy distillation (docs/objectives.md): the teacher that scores the
    # sampled tokens for a chain reading `teacher_logp` (`distill_advantage`). An rlscale
    # params checkpoint (a run's WORKDIR/final or WORKDIR/sft, its tokenizer.model beside it),
    # a Hugging Face model directory, or "self" (the policy the run starts from); "" for none.
    c.teacher = dict(checkpoint="")
    # Preference optimization (docs/preference_and_reward_models.md),
    # run by the preference driver (`rl.dpo`) when `file` or `iterations_every` is set: each
    # step trains on `batch.prompts` pairs (batch.group_size = 2: chosen, rejected) with a
    # preference loss chain (dpo, ipo, simpo, kto). Offline: `file`, a jsonl/json/parquet
    # file of prompt/chosen/rejected rows, or "sample_at_setup": pairs made once from the
    # warm start's own samples (`prompts` training prompts, 0: the whole prompt pool; cached
    # in WORKDIR/preference_pairs), the reference being the warm start. Iterative:
    # `iterations_every` = K > 0 steps per round; each round samples `samples` completions of
    # `prompts` prompts (0: K x batch.prompts) with the current policy, forms pairs from the
    # verifier's scores and trains K steps against the policy of the round's start. `pairs`:
    # "best_vs_worst" (one per prompt) or "all" (every correct x incorrect).
    c.preference = dict(file="", iterations_every=0, samples=8, pairs="best_vs_worst", prompts=0)
    c.filters = dict(
        zero_variance=False,
        dynamic_sampling=False,
        dynamic_max_rounds=4,
        retire=False,
        retire_threshold=0.9,
        overlong_cache=0,
    )
    c.eval = dict(every=10, prompts=200, samples=4)
    # Checkpoints in WORKDIR/checkpoints: every `every` steps and at the end; the last `keep`
    # are kept, plus every `keep_every`-th step (0: none). A workdir with checkpoints resumes.
    c.checkpoint = dict(every=20, keep=3, keep_every=0)
    c.faults = dict(max_consecutive_skips=3)  # Non-finite updates in a row before stopping.
    # Rewards run in `workers` processes with a per-sample `timeout` (s): a crash, hang or
    # exception costs one sample. workers=0 scores in-process. `fn`: "module:function"
    # called as fn(completion, problem) -> float instead of the task's verifier.
    # Learned rewards (docs/preference_and_reward_models.md; `rl.learned_rewards`): `model`,
    # a reward model directory (`python -m rlscale.main.train_reward_model`) whose r(x, y) is
    # the reward in place of the verifier's (RLMT; the verifier still measures correctness),
    # or "train_at_setup": one trained at set-up for `model_steps` steps (`model_batch_pairs`
    # pairs each, AdamW at `model_lr`) from the warm start on pairs made from its samples
    # (the `preference` section's `samples`, `pairs`, `prompts`), cached in
    # WORKDIR/reward_model. `prm`: a process reward model directory (`python -m
    # rlscale.main.train_prm`) whose step rewards a chain with `process_advantages` reads.
    c.reward = dict(
        fn="",
        workers=2,
        timeout=10.0,
        model="",
        model_steps=200,
        model_batch_pairs=16,
        model_lr=1e-4,
        prm="",
    )
    # The environment of each episode (docs/environments.md): `name`, a registered one
    # ("single_turn": the task's verifier scores one completion) or "module.path:ClassName",
    # built with `kwargs`. Limits: `max_turns` policy turns, `reply_tokens` per reply (cut),
    # `call_seconds` per environment call and `episode_seconds` per episode (wall-clock);
    # `workers` threads run the calls; `parked` parking rows hold samples waiting on a call
    # while queued requests take their slots. An episode's tokens, the policy's and the
    # replies', are sampling.max_new_tokens.
    c.env = dict(
        name="single_turn",
        kwargs={},
        max_turns=4,
        reply_tokens=256,
        call_seconds=10.0,
        episode_seconds=300.0,
        workers=8,
        parked=0,
    )
    # Experiment tracking beside metrics.jsonl (rlscale/tracking.py): a Weights & Biases run
    # in `wandb_project` ("" for none), `wandb_entity` ("": the account's default).
    c.tracking = dict(wandb_project="", wandb_entity="")
    # LoRA (docs/learner.md): rank `rank` adapters (0: off, full fine-tuning) on the `targets`
    # projections (Hugging Face module names), scaled by alpha / rank; only they are trained.
    c.lora = dict(rank=0, alpha=32.0, targets=LORA_TARGETS)
    return c


# The model-size ladder (configs/ladder.py, experiments/ladder): (num_layers, d_model,
# num_heads, num_kv_heads) per size; head_dim = d_model / num_heads, the MLP 3 x d_model.
LADDER_SIZES = {
    "xs": (2, 64, 4, 2),
    "s": (3, 96, 4, 2),
    "m": (4, 128, 4, 2),
    "l": (4, 192, 6, 2),
    "xl": (6, 256, 8, 4),
}
# SFT steps per size: 600 leaves xl below l (SFT loss 0.125 against 0.111, held-out pass@1
# 0.400 against 0.443; experiments/ladder, probe 3), so the largest size trains longer.
LADDER_SFT_STEPS = {"xs": 600, "s": 600, "m": 600, "l": 600, "xl": 1200}


def ladder_testbed(c: ml_collections.ConfigDict, size: str, difficulty: int = 3):
    """Sets the ladder's task, policy, warm start and evaluation on an RL config (its recipe
    stays): multi-step arithmetic with `difficulty` operators, 40,000 training problems (4,000
    let the warm start memorize them, and RL on memorized problems taught nothing), every SFT
    demonstration ending with the graded answer line, a fixed number of SFT steps per size
    (no early stop), 500 held-out problems x 4 samples per evaluation (noise about 0.011,
    below the 0.02 a first-half fit must predict the second half within)."""
    if size not in LADDER_SIZES:
        raise ValueError(f"config variant size={size!r} is not one of {tuple(LADDER_SIZES)}")
    layers, width, heads, kv_heads = LADDER_SIZES[size]
    c.model = model_config(
        "tiny",
        num_layers=layers,
        d_model=width,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=width // heads,
        mlp_dim=3 * width,
        max_seq_len=128,
    )
    c.task.difficulty = difficulty
    c.task.n_train = 40_000
    c.task.n_test = c.eval.prompts = 500
    c.sampling.max_new_tokens = 16 * difficulty  # The working of one step per operator.
    c.sft.answer_line_fraction = 1.0
    c.sft.target_pass = 1.1  # Never reached: every size trains its number of steps.
    c.sft.max_steps = LADDER_SFT_STEPS[size]
    c.learner.pack_length, c.learner.length_buckets = 128, 1
    return c


def long_testbed(c: ml_collections.ConfigDict, size: str = "m", difficulty: int = 7):
    """The ladder's testbed (`ladder_testbed`) on `long_arithmetic`: problems of `difficulty`
    to 2 x `difficulty` operators, so worked completions are long and of unequal lengths
    (difficulty 7: 59 to 264 tokens, median 142), in a context of 352 tokens with a
    generation budget of 288 that leaves every demonstration room (a shorter
    `sampling.max_new_tokens` truncates the longest problems' working). Batches of 16 prompts
    x 8 samples and evaluations every 25 steps keep a 200-step run of size m near half an
    hour on a 2-core CPU."""
    ladder_testbed(c, size, difficulty)
    c.task.name = "long_arithmetic"
    c.model.max_seq_len = c.learner.pack_length = 352
    c.sampling.max_new_tokens = 288
    c.batch.prompts = 16
    c.eval.every = 25
    return c


def smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Shrinks an RL config to a few steps of everything (tests, `:smoke` variants)."""
    c.steps = 3
    c.task.n_train, c.task.n_test = 200, 40
    c.sft.max_steps, c.sft.eval_every = 20, 10
    c.batch.prompts, c.batch.group_size = 8, 4
    c.eval.every, c.eval.prompts, c.eval.samples = 2, 16, 2
    c.checkpoint.every = 2
    c.learner.length_buckets = 1  # One update program per run: compiling is most of its time.
    return c
