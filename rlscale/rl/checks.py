"""The start-up rules that span sections of a resolved run (`rl.resolve.RunConfig`; each
section checks its own keys): the chain against the batch, the sampler, a teacher, preference
pairs and learned rewards; the batch against the learner and the meshes; and, once the data
and the tokenizer are read, packing and the tokenizers of a teacher and of learned rewards.
Every problem names its keys."""

import json
import os

import jax

from rlscale import objectives, sharding
from rlscale import tokenizers as tokenizer_lib
from rlscale.model import attention, moe
from rlscale.objectives import preference as preference_losses
from rlscale.reward_models import bradley_terry, scalar_head
from rlscale.reward_models import prm as prm_lib
from rlscale.rl import learned_rewards

# Config keys that may change between a run and its resumption: they do not change what the
# run computes up to the checkpoint.
RESUMABLE_CHANGES = (
    "steps",
    "eval.every",
    "checkpoint",
    "sft.reuse_from",
    "faults",
    "reward.workers",
    "reward.timeout",
    "pipeline.decode_chunk",  # How often the generator checks for weights: not the samples.
    "env.workers",  # Threads running environment calls: their speed, not their replies.
    "env.parked",  # Parking rows: a parked sample goes on token for token as in its slot.
    "tracking.wandb_project",  # Where the metrics are copied, not what they are.
    "tracking.wandb_entity",
)


def _mesh_problems(config) -> list[str]:
    """The meshes the devices make (`sharding.role_meshes`), and how the batch and the
    generator's slots divide over them."""
    g = config.pipeline.generator_devices
    if not isinstance(g, int) or g < 0:
        return []  # The pipeline section's own problem.
    if g and g >= jax.device_count():
        return [
            f"pipeline.generator_devices={g} leaves no device to train on: there are "
            f"{jax.device_count()} devices (use 0 to time-slice them)"
        ]
    t = config.pipeline.generator_tensor
    if not isinstance(t, int) or t < 1 or (g and g % t):
        return []  # The pipeline section's own problem.
    try:  # The mesh builder's own rules (fill, device count, processes).
        train, gen = sharding.role_meshes(tuple(config.mesh.shape), g)
        if not g and t > 1 and train.devices.size % t:
            return [
                f"pipeline.generator_tensor={t} does not divide the {train.devices.size} "
                f"devices the roles share (mesh.shape={tuple(config.mesh.shape)}, "
                "pipeline.generator_devices=0): the generator's mesh is (devices / "
                "generator_tensor, 1, generator_tensor)"
            ]
        train, gen = sharding.role_meshes(tuple(config.mesh.shape), g, t)
    except ValueError as e:
        left = f" (left by pipeline.generator_devices={g})" if g else ""
        n = jax.device_count() - g
        return [f"mesh.shape={tuple(config.mesh.shape)} does not fit {n} devices{left}: {e}"]
    mesh = tuple(train.shape.values())
    problems = _pipeline_problems(config, sharding.batch_divisor(gen, sharding.SAMPLE_RULES))
    problems += _generator_tensor_problems(config, t)
    if config.model is not None:  # A mixture of experts' expert axis (`model.moe`).
        problems += moe.mesh_problems(config.model, dict(train.shape))
    div = sharding.batch_divisor(train, sharding.TRAIN_RULES)  # data x fsdp (x expert).
    where = f"the mesh's batch axes (mesh.shape={mesh}: data x fsdp = {div})"
    if config.batch.prompts % div:
        problems.append(f"batch.prompts={config.batch.prompts} is not divisible by {where}")
    return problems


def _policy_heads(config) -> tuple[int, int] | None:
    """(query heads, kv heads) of the policy: `init.hf_checkpoint`'s config.json where there
    is one, else the config's model (None when neither is known)."""
    path = os.path.join(config.init.hf_checkpoint, "config.json")
    if config.init.hf_checkpoint and os.path.isfile(path):
        with open(path) as f:
            hf = json.load(f)
        H = hf.get("num_attention_heads")
        return None if H is None else (H, hf.get("num_key_value_heads", H))
    if config.model is None:
        return None
    return config.model.num_heads, config.model.num_kv_heads


def _generator_tensor_problems(config, t: int) -> list[str]:
    """`pipeline.generator_tensor` = t > 1 against the policy's heads: the query heads must
    split t ways (each device attends with its own heads; a tensor axis that splits no
    head would hold every attention weight and compute every head on each device). KV heads
    split where t divides them and are replicated where it does not (each device then
    holds every kv head its query heads read)."""
    heads = _policy_heads(config)
    if t == 1 or heads is None or heads[0] % t == 0:
        return []
    H, K = heads
    splits = [d for d in range(2, H + 1) if H % d == 0]
    return [
        f"pipeline.generator_tensor={t} does not divide the policy's {H} query heads "
        f"({K} kv heads): tensor-parallel decode splits the query heads (kv heads are "
        f"replicated where they do not divide); use one of {splits} (or 1)"
    ]


def _pipeline_problems(config, gen_div: int) -> list[str]:
    """The generator's slots against the batch and its devices, and what the pipeline modes
    cannot do (dynamic sampling, several processes)."""
    p, b = config.pipeline, config.batch
    problems = []
    G = b.samples_per_prompt
    if p.mode not in p.MODES or not isinstance(G, int) or G < 1:
        return []  # Reported by the sections.
    slots = p.slots or b.prompts * G
    if not isinstance(slots, int) or slots < 0 or slots % G:
        what = "preference.samples" if G != b.group_size else "batch.group_size"
        problems.append(f"pipeline.slots={p.slots!r} must be a multiple of {what}={G}")
    elif slots % gen_div:
        problems.append(
            f"pipeline.slots={slots} does not divide the generator's batch axes ({gen_div} devices)"
        )
    parked = config.env.parked
    if isinstance(parked, int) and parked > 0 and parked % gen_div:
        problems.append(
            f"env.parked={parked} does not divide the generator's batch axes ({gen_div} devices)"
        )
    if p.mode == "async_ppo" and slots < b.prompts * b.group_size:
        problems.append(
            f"pipeline.mode='async_ppo' generates a whole batch with one policy version: "
            f"pipeline.slots={slots} must hold batch.prompts x batch.group_size = "
            f"{b.prompts * b.group_size} samples"
        )
    if p.mode != "sync":
        if config.filters.dynamic_sampling:
            problems.append(
                f"filters.dynamic_sampling is not supported with pipeline.mode={p.mode!r}: a "
                "batch must be a known set of prompts to bound its staleness at admission"
            )
        if jax.process_count() > 1:
            problems.append(
                f"pipeline.mode={p.mode!r} runs in one process (its generator thread decides "
                f"when to take new weights); {jax.process_count()} processes were started"
            )
    return problems


# `teacher.checkpoint` naming the policy the run starts from (its warm start, WORKDIR/sft, or
# `init.hf_checkpoint`) rather than a directory: a teacher that needs no other run.
TEACHER_SELF = "self"
# What a teacher directory holds: an rlscale params checkpoint or a Hugging Face model.
TEACHER_FILES = ("model_config.json", "config.json")
TEACHER_KINDS = (
    "model_config.json (an rlscale params checkpoint, such as a run's WORKDIR/final or "
    "WORKDIR/sft) nor config.json (a Hugging Face model directory)"
)


def _teacher_problems(config, readers: list[str] | None) -> list[str]:
    """`teacher.checkpoint` against the chain: a chain that reads `teacher_logp` (through the
    transforms `readers`; None when the chain has problems of its own) needs a teacher, and a
    teacher needs such a chain (a teacher nothing reads is a mistake, not a cost to pay
    quietly: the run would not distill at all); the directory is a checkpoint; sampling is
    not greedy (greedy tokens carry no logprobs)."""
    path, problems = config.teacher.checkpoint, []
    if readers and not path:
        problems.append(
            f"objective.chain reads teacher_logp ({', '.join(readers)}) but teacher.checkpoint "
            "is empty: set it to the teacher's directory (an rlscale params checkpoint such as "
            "a run's WORKDIR/final, or a Hugging Face model directory), or to "
            f"'{TEACHER_SELF}' for the policy the run starts from"
        )
    if path and readers == []:
        problems.append(
            f"teacher.checkpoint={path!r} is set but objective.chain reads no teacher_logp: add "
            "distill_advantage to the chain, or set teacher.checkpoint='' (no teacher)"
        )
    if path and path != TEACHER_SELF:
        if not os.path.isdir(path):
            problems.append(f"teacher.checkpoint={path!r} does not exist (or is not a directory)")
        elif not any(os.path.isfile(os.path.join(path, f)) for f in TEACHER_FILES):
            problems.append(f"teacher.checkpoint={path!r} holds neither {TEACHER_KINDS}")
    if readers and config.sampling.temperature == 0:
        problems.append(
            "sampling.temperature=0 (greedy) gives the sampled tokens no logprobs, and on-policy "
            "distillation needs them (objective.chain reads teacher_logp): set it > 0"
        )
    return problems


def _learned_reward_problems(config, steps: list[str] | None) -> list[str]:
    """`reward.model` and `reward.prm` (`rl.learned_rewards`): directories of their kind, a
    PRM exactly when the chain reads `step_reward` (through the transforms `steps`; None when
    the chain has problems of its own), neither beside what they would contradict."""
    r, problems = config.reward, []
    meta = bradley_terry.META_FILE
    if r.model and r.model != learned_rewards.TRAIN_AT_SETUP:
        if not os.path.isfile(os.path.join(r.model, meta)):
            problems.append(
                f"reward.model={r.model!r} is not a reward model directory (no {meta}): write "
                "one with python -m rlscale.main.train_reward_model, or set "
                f"{learned_rewards.TRAIN_AT_SETUP!r} (once 'warm_start') to train one at set-up"
            )
    if r.model == learned_rewards.TRAIN_AT_SETUP and config.init.hf_checkpoint:
        problems.append(
            f"reward.model={learned_rewards.TRAIN_AT_SETUP!r} trains from the SFT warm start, "
            "which a run from init.hf_checkpoint has not: train one with python -m "
            "rlscale.main.train_reward_model --init DIR and name its directory"
        )
    if r.prm and not os.path.isfile(os.path.join(r.prm, prm_lib.META_FILE)):
        problems.append(
            f"reward.prm={r.prm!r} is not a process reward model directory (no "
            f"{prm_lib.META_FILE}): write one with python -m rlscale.main.train_prm"
        )
    if steps and not r.prm:
        problems.append(
            f"objective.chain reads step_reward ({', '.join(steps)}) but reward.prm is empty: "
            "set it to a process reward model directory"
        )
    if r.prm and steps == []:
        problems.append(
            f"reward.prm={r.prm!r} is set but objective.chain reads no step_reward: add "
            "process_advantages to the chain, or set reward.prm='' (no PRM)"
        )
    if (r.model or r.prm) and config.preference.enabled:
        problems.append(
            "reward.model and reward.prm reward sampled RL batches; a preference run trains on "
            "pairs labelled by the verifier: unset them"
        )
    return problems


def learned_reward_tokenizer_problems(reward, tokenizer) -> list[str]:
    """A reward model or PRM directory (of the reward section `reward`) whose tokenizer is not
    the run's: it would score the policy's token ids as other text
    (`scalar_head.check_tokenizer`)."""
    problems = []
    for key in ("model", "prm"):
        path = getattr(reward, key)
        if path and path != learned_rewards.TRAIN_AT_SETUP:
            try:
                scalar_head.check_tokenizer(path, tokenizer)
            except ValueError as e:
                problems.append(f"reward.{key}={path!r}: {e}")
    return problems


def teacher_problems(teacher, init, tokenizer, source: str) -> list[str]:
    """What keeps `teacher.checkpoint` (of the teacher section, `rl.setup.TeacherConfig`)
    from scoring the run's tokens, known once the run has its tokenizer (`tokenizer`, read
    from `source`, or from `init.hf_checkpoint` of the init section, `rl.setup.InitConfig`)
    and before any weights are read: a
    tokenizer other than the run's, or fewer token ids than the policy samples from. Nothing
    to check without a teacher or with 'self'.

    The teacher scores the student's token ids, so an id must mean the same token to both.
    The teacher's tokenizer is the one in its directory (a Hugging Face model's
    `tokenizer.json`) or, for an rlscale checkpoint, in it or its parent (a run's workdir
    holds `tokenizer.model` beside `final/` and `sft/`). They are compared id by id;
    special-token roles may differ (a base and an instruct model of one family do).
    """
    path = teacher.checkpoint
    if path in ("", TEACHER_SELF):
        return []
    key = f"teacher.checkpoint={path!r}"
    problems = []
    hf_init = init.hf_checkpoint
    policy_V = _vocab_size(hf_init) if hf_init else tokenizer.vocab_size
    teacher_V = _vocab_size(path)
    if teacher_V < policy_V:
        problems.append(
            f"{key} has {teacher_V} token ids, fewer than the {policy_V} the policy samples "
            "from: it cannot score every token the student may sample"
        )
    places = [path]
    if not os.path.isfile(os.path.join(path, "config.json")):  # rlscale: the run's workdir.
        places.append(os.path.dirname(os.path.abspath(path)))
    for place in places:
        try:
            theirs = tokenizer_lib.load(place)
            break
        except FileNotFoundError:
            continue
    else:
        return problems + [
            f"{key}: no tokenizer (tokenizer.json or tokenizer.model) in {' or '.join(places)}, "
            "so nothing shows that the teacher shares the run's tokenizer; copy the tokenizer "
            f"it was trained with into {path}"
        ]
    ours, theirs = _pieces(tokenizer), _pieces(theirs)
    differ = [i for i in sorted(set(ours) | set(theirs)) if ours.get(i) != theirs.get(i)]
    if differ:
        i = differ[0]
        problems.append(
            f"{key}: the teacher's tokenizer ({place}: {len(theirs)} ids) is not the run's "
            f"({source}: {len(ours)} ids): {len(differ)} ids differ, e.g. id {i} is "
            f"{theirs.get(i)!r} for the teacher and {ours.get(i)!r} for the run. The teacher "
            "scores the student's token ids, so both must use one tokenizer (two runs of an "
            "embedded task share one with --config.sft.reuse_from=TEACHER_RUN_WORKDIR)"
        )
    return problems


def _vocab_size(directory: str) -> int:
    """The vocabulary of the model in `directory` (`model_config.json` or `config.json`)."""
    for name in TEACHER_FILES:
        if os.path.isfile(os.path.join(directory, name)):
            with open(os.path.join(directory, name)) as f:
                return json.load(f)["vocab_size"]
    raise FileNotFoundError(f"{directory} holds neither {TEACHER_KINDS}")


def _pieces(tokenizer) -> dict[int, str]:
    """id -> token, of any backend (a SentencePiece model as its `tokenizer.json` form)."""
    vocab = tokenizer.to_hf().backend.get_vocab(with_added_tokens=True)
    return {i: piece for piece, i in vocab.items()}


def _preference_problems(config, resolved) -> list[str]:
    """A preference run (`preference.file` or `preference.iterations_every`; the section
    checks its own keys): a chain that ends in a preference loss (a transform of
    `objectives.preference`; `resolved`: the chain's transforms, None when it has problems of
    its own), batches of pairs (`batch.group_size` = 2), samples that can differ, and none of
    what only RL batches have (filters, pipeline modes)."""
    p, b = config.preference, config.batch
    well_typed = isinstance(p.iterations_every, int) and p.iterations_every >= 0
    if not (well_typed and isinstance(p.file, str) and p.enabled):
        return []  # Not a preference run, or the section's own problem.
    problems, which = [], p.key
    losses = [
        e.name for e in objectives.entries() if e.factory.__module__ == preference_losses.__name__
    ]
    if resolved is not None and resolved[-1][0].name not in losses:
        problems.append(
            f"objective.chain={config.objective.chain!r} is not a preference loss: with {which} "
            f"set, the run trains on preference pairs, so the chain must end in one of "
            f"{', '.join(losses)} (e.g. objective.chain='dpo(beta=0.1)')"
        )
    if b.group_size != 2:
        problems.append(
            f"batch.group_size={b.group_size}: with {which} set, batches are preference pairs "
            "(groups of 2 rows: chosen, rejected); set batch.group_size=2 (batch.prompts "
            "counts pairs)"
        )
    if p.samples_pairs and config.sampling.temperature == 0:
        problems.append(
            f"sampling.temperature=0 (greedy) gives every one of a prompt's "
            f"preference.samples={p.samples} completions the same text: no pair; set it > 0"
        )
    on = [k for k in ("zero_variance", "dynamic_sampling", "retire") if getattr(config.filters, k)]
    on += ["overlong_cache"] * bool(config.filters.overlong_cache)
    if on:
        problems.append(
            f"filters.{', filters.'.join(on)} act on sampled RL batches; with {which} set the "
            "run trains on pairs: turn them off"
        )
    if config.pipeline.mode != "sync":
        problems.append(
            f"pipeline.mode={config.pipeline.mode!r}: a preference run ({which}) has its own "
            "driver, which samples rounds and trains in turn; set pipeline.mode='sync'"
        )
    return problems


def problems(config) -> list[str]:
    """Every problem between the sections of the resolved run `config`."""
    found = _objective_problems(config)
    found += _batch_problems(config)
    found += _mesh_problems(config)
    if not config.env.single_turn and config.preference.enabled:
        found.append(
            f"env.name={config.env.name!r}: a preference run ({config.preference.key}) trains "
            "on pairs of single-turn completions; set env.name='single_turn'"
        )
    found += _router_replay_problems(config)
    f, M = config.filters, config.sampling.max_new_tokens
    if f.overlong_cache and isinstance(M, int) and f.overlong_cache > M:
        found.append(
            f"filters.overlong_cache={f.overlong_cache} exceeds sampling.max_new_tokens={M}"
        )
    return found


def _router_replay_problems(config) -> list[str]:
    """`learner.router_replay` and `learner.replay_probe` need a mixture of experts (the
    config's model, or `init.hf_checkpoint`'s) whose routing a generator recorded: not a
    dense model, nor a preference run's pairs."""
    u = config.learner
    on = [f"learner.router_replay={u.router_replay!r}"] * (u.router_replay == "generator")
    on += ["learner.replay_probe=True"] * (u.replay_probe is True)
    if not on:
        return []
    experts = config.model.num_experts if config.model is not None else 1
    path = os.path.join(config.init.hf_checkpoint, "config.json")
    if config.init.hf_checkpoint and os.path.isfile(path):
        with open(path) as f:
            experts = json.load(f).get("num_experts", 0)
    problems = []
    if not experts:
        where = config.init.hf_checkpoint or "model.num_experts=0"
        problems.append(
            f"{' and '.join(on)} replays a mixture of experts' routing, but the policy "
            f"({where}) is dense: it has no routers; set learner.router_replay='off' and "
            "learner.replay_probe=False"
        )
    if config.preference.enabled:
        problems.append(
            f"{' and '.join(on)}: a preference run ({config.preference.key}) trains on pairs "
            "whose routing no generator recorded; set learner.router_replay='off'"
        )
    return problems


def _objective_problems(config) -> list[str]:
    """The chain's own problems (`objectives.check`), then those of what its transforms read:
    a teacher's logprobs, preference pairs, learned step rewards."""
    b = config.batch
    problems = objectives.check(
        config.objective.chain,
        group_size=b.group_size,
        max_len=config.sampling.max_new_tokens,
        absent=_absent_terms(config),
    )
    readers = resolved = None
    try:  # Unless the chain has problems of its own (a term the run lacks is not one).
        resolved = objectives.resolve(
            config.objective.chain, group_size=b.group_size, max_len=config.sampling.max_new_tokens
        )
    except ValueError:
        pass
    else:  # The transforms that read the teacher's logprobs.
        readers = [e.name for e, kwargs in resolved if "teacher_logp" in e.required(kwargs)]
    problems += _teacher_problems(config, readers)
    problems += _preference_problems(config, resolved)
    steps = (
        None
        if resolved is None
        else [e.name for e, kwargs in resolved if "step_reward" in e.required(kwargs)]
    )
    return problems + _learned_reward_problems(config, steps)


def _absent_terms(config) -> dict[str, str]:
    """Terms the batch carries but this run cannot fill, with why: the generator's logprobs
    (`sampler_logp`) of greedy samples (0) and of preference pairs (never sampled); a dense
    model's auxiliary MoE losses."""
    absent = {}
    if config.model is not None and not config.model.num_experts:
        why = "the model has no experts (model.num_experts=0)"
        absent.update(moe_lb=why, moe_z=why)
    if config.sampling.temperature == 0:
        why = "sampling.temperature=0 (greedy) gives the sampled tokens no logprobs"
    elif config.preference.enabled:
        why = f"a preference run ({config.preference.key}) trains on pairs no generator sampled"
    else:
        return absent
    return {**absent, "sampler_logp": why}


def _batch_problems(config) -> list[str]:
    """How `batch` divides into the learner's minibatches, and packed rows against the
    completion budget."""
    b, u, M = config.batch, config.learner, config.sampling.max_new_tokens
    problems = []
    if u.minibatches < 1 or b.prompts % u.minibatches:
        problems.append(
            f"batch.prompts={b.prompts} is not divisible by learner.minibatches={u.minibatches}"
        )
    if not isinstance(u.pack_length, int) or not (u.pack_length == 0 or u.pack_length > M):
        problems.append(
            f"learner.pack_length={u.pack_length!r} must be 0 (one sequence per row) or more than "
            f"sampling.max_new_tokens={M}"
        )
    return problems + _shared_prefix_problems(config) + split_problems(config)


def _shared_prefix_problems(config) -> list[str]:
    """`learner.shared_prefix`: a bool, with packed rows (`pack_length` > 0: one sequence per
    row leaves no room to share), an attention that reads a whole mask and no sliding window
    (`attention.prefix_problems`)."""
    u = config.learner
    if not isinstance(u.shared_prefix, bool):
        return [f"learner.shared_prefix={u.shared_prefix!r} must be True or False"]
    if not u.shared_prefix:
        return []
    problems = []
    if u.pack_length == 0:
        problems.append(
            "learner.shared_prefix=True needs packed rows: learner.pack_length=0 puts one "
            "sequence in each row, so no group's samples share one (set a pack_length)"
        )
    if config.model is not None:
        problems += attention.prefix_problems(config.model.attention, config.model.sliding_window)
    return problems


def split_problems(config) -> list[str]:
    """`learner.pack_rows` below `batch.group_size` lets a micro-batch hold part of a group
    (`batch_layout.Layout.split_groups`): `aggregate(mode=prompt_mean)` then divides by each
    group's token count over the optimizer step, counted before the loss stage, so a
    loss-stage transform that narrows the mask (its kept tokens would be the count) cannot
    precede it."""
    u, b = config.learner, config.batch
    if not (isinstance(u.pack_rows, int) and 0 < u.pack_rows < b.group_size):
        return []
    try:
        chain = objectives.resolve(
            config.objective.chain, group_size=b.group_size, max_len=config.sampling.max_new_tokens
        )
    except ValueError:  # `_objective_problems` reports the chain's own problems.
        return []
    narrowing = [e.name for e, _ in chain if e.stage == "loss" and "mask" in e.provides]
    prompt_mean = any(e.name == "aggregate" and k.get("mode") == "prompt_mean" for e, k in chain)
    if not (narrowing and prompt_mean):
        return []
    return [
        f"learner.pack_rows={u.pack_rows} below batch.group_size={b.group_size} splits groups "
        "over micro-batches, where aggregate(mode=prompt_mean) counts each group's tokens "
        f"before the loss stage, but {', '.join(narrowing)} narrows the mask in it; set "
        f"learner.pack_rows to 0 or at least {b.group_size}"
    ]


def pack_problems(learner, batch, sampling, longest_prompt: int) -> list[str]:
    """What packing cannot hold, given the longest training prompt (in tokens): a sequence
    longer than `learner.pack_length`. Any `learner.pack_rows` holds the data: a row holds
    at least one sequence, and below what a group needs a micro-batch holds part of one
    (`batch_layout.Layout.split_groups`; `split_problems`)."""
    u, M = learner, sampling.max_new_tokens
    longest = longest_prompt + M
    if u.pack_length and u.pack_length < longest:
        return [
            f"learner.pack_length={u.pack_length} cannot hold the longest training sequence: "
            f"its prompt has {longest_prompt} tokens, plus sampling.max_new_tokens={M}"
        ]
    return []
