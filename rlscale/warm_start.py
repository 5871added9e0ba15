"""Supervised warm start: train a policy from scratch on task demonstrations until it solves
a minority of held-out problems, so RL has something to improve. A stage of the run's cache
(`stage_cache.WARM_START`, WORKDIR/sft: a params checkpoint).

Its section is `SFTConfig` (`config.sft`). `settings` records what a warm start depends on
(the sections of the run it reads); `train_or_load` returns the cached warm start, or trains
(`supervised.fit`) and caches it; `reuse` copies another run's. Dimension letters: B problems
(one SFT batch).
"""

import dataclasses

import jax
import numpy as np
from absl import logging

from rlscale import checkpoint, model, next_token, optim, sections, stage_cache, supervised
from rlscale.data import tasks
from rlscale.eval import heldout
from rlscale.sampling import Sampler, SamplingConfig, scoring


def demo_ids(tokenizer, task, demo: str) -> tuple[list[int], list[bool]]:
    """A demonstration's token ids, with the end of sequence, and which are targets: each of
    its turns (`tasks.demo_turns`) tokenized on its own, as the episode tokenizes the
    environment's replies and the policy writes its turns; the replies are context, not
    targets, as they are out of the RL loss."""
    ids, target = [], []
    for text, by_env in tasks.demo_turns(task, demo):
        turn = tokenizer.encode(text)
        ids += turn
        target += [not by_env] * len(turn)
    return ids + [tokenizer.eos_id], target + [True]


def _batch(tokenizer, task, problems, length, bare_B=None):
    """Token, attention and target masks; `bare_B[i]` drops the "Answer: N" line from
    problem i's demonstration."""
    tokens = np.full((len(problems), length), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(problems), length), bool)
    target = np.zeros((len(problems), length), bool)
    for i, p in enumerate(problems):
        prompt = tokenizer.encode(p.prompt, add_bos=True)
        demo = p.demo
        if bare_B is not None and bare_B[i]:
            demo = tasks.without_answer_line(p)
        completion, targets = demo_ids(tokenizer, task, demo)
        seq = (prompt + completion)[:length]
        tokens[i, : len(seq)] = seq
        mask[i, : len(seq)] = True
        target[i, len(prompt) : len(seq)] = targets[: len(seq) - len(prompt)]
    return tokens, mask, target


# Model fields that change how the policy computes, not its parameters: a warm start trained
# with one setting serves runs with another (an RL ablation of the FP32 LM head, bf16 compute).
COMPUTE_ONLY = (
    "dtype",
    "fp32_lm_head",
    "attention",
    "expert_dispatch",
    "expert_capacity_factor",
)


@dataclasses.dataclass(frozen=True)
class SFTConfig(sections.Section):
    """`config.sft`: the supervised warm start. Up to `max_steps` steps of `batch_size`
    demonstrations at `lr` (`optim.warmup_cosine`), held-out pass@1 measured every
    `eval_every` steps, stopped once it reaches `target_pass`; `answer_line_fraction` of the
    demonstrations end with the graded "Answer: N" line. `reuse_from`: another run's workdir
    whose data, tokenizer and warm start to copy (`reuse`); `seed`: the warm start's own."""

    max_steps: int = 900
    batch_size: int = 64
    lr: float = 3e-3
    eval_every: int = 300
    target_pass: float = 0.5
    answer_line_fraction: float = 0.25
    reuse_from: str = ""
    seed: int = 0

    def problems(self) -> list[str]:
        problems = sections.at_least("sft.max_steps", self.max_steps, 0)
        problems += sections.at_least("sft.batch_size", self.batch_size, 1)
        problems += sections.at_least("sft.eval_every", self.eval_every, 1)
        f = self.answer_line_fraction
        if not isinstance(f, (int, float)) or not 0 <= f <= 1:
            problems.append(f"sft.answer_line_fraction={f!r} must be a number in [0, 1]")
        if not isinstance(self.reuse_from, str):
            problems.append(f"sft.reuse_from={self.reuse_from!r} must be a workdir or ''")
        return problems


def model_settings(name: str, model_cfg) -> dict:
    """The model section as a config gives it (`config_lib.model_config`): its `name` and
    every field, as a stage's settings record it."""
    return {"name": name, **model.as_dict(model_cfg)}


def settings(sft: SFTConfig, task, tokenizer, model_name: str, model_cfg, eval_cfg, sampling):
    """What a warm start depends on (with its data and tokenizer), from the run's sections:
    `task` (a frozen ConfigDict), `tokenizer` (`rl.setup.TokenizerConfig`), the model as
    configured (`model_name`, `model_cfg`: before the tokenizer sets its vocabulary), `eval`
    (`heldout.EvalConfig`) and `sampling` (`saved_policy.SamplingSettings`)."""
    m = model_settings(model_name, model_cfg)
    sft_settings = {k: v for k, v in dataclasses.asdict(sft).items() if k != "reuse_from"}
    if getattr(tasks.TASKS.get(task.name), "demo_stop", None):
        sft_settings["replies_in_loss"] = False  # Warm starts before `demo_ids` had them in.
    return {
        "task": task.to_dict(),
        "tokenizer": dataclasses.asdict(tokenizer),
        "model": {k: v for k, v in m.items() if k not in COMPUTE_ONLY},
        "sft": sft_settings,
        "eval": {"prompts": eval_cfg.prompts, "samples": eval_cfg.samples},
        "sampling": {"max_new_tokens": sampling.max_new_tokens},
    }


def reuse(sft: SFTConfig, inputs: dict, workdir) -> None:
    """Copies the data, tokenizer and warm start of `sft.reuse_from` (another run's workdir)
    into `workdir`, so runs that differ only after the warm start (a sweep over RL settings)
    train it once. Fails, listing the differences, unless that warm start was made with the
    same settings `inputs` (`settings`: task, tokenizer, model and SFT)."""
    src = sft.reuse_from
    if not src or stage_cache.record(workdir, stage_cache.WARM_START) is not None:
        return
    stage_cache.copy(
        src,
        workdir,
        stage_cache.WARM_START,
        inputs,
        "sft.reuse_from",
        with_files=("data", "tokenizer.model"),
    )
    logging.info("copied the warm start, data and tokenizer of %s", src)


def train_or_load(
    sft: SFTConfig,
    eval_cfg,
    sampling,
    inputs: dict,
    workdir,
    model_cfg,
    mesh,
    tokenizer,
    task,
    train_problems,
    test_problems,
):
    """(graphdef, params, summary): from the stage cache, or trained now and cached, with the
    stage's settings `inputs` (`settings`). SFT as `sft` says; held-out pass@1 of the first
    `eval_cfg.prompts` test problems (`heldout.EvalConfig`), `eval_cfg.samples` completions
    each of `sampling.max_new_tokens` tokens in `sampling.buckets`
    (`saved_policy.SamplingSettings`).

    Raises:
      ValueError: If the cache holds a warm start made with other settings (listing them), or
        for a different model (up to `COMPUTE_ONLY`).
    """
    summary = stage_cache.lookup(workdir, stage_cache.WARM_START, inputs)
    if summary is not None:
        return _load(stage_cache.path(workdir, stage_cache.WARM_START), summary, model_cfg, mesh)
    path = stage_cache.begin(workdir, stage_cache.WARM_START)
    rng = jax.random.key(sft.seed)
    graphdef, params = model.init_sharded(model_cfg, jax.random.fold_in(rng, 1), mesh)
    summary = {"steps": 0, "pass@1": None}
    if sft.max_steps > 0:
        params, summary = _train(
            sft,
            eval_cfg,
            sampling,
            graphdef,
            params,
            model_cfg,
            mesh,
            rng,
            tokenizer,
            task,
            train_problems,
            test_problems,
        )
    checkpoint.save_params(path, model_cfg, params)  # Every process writes its shards.
    stage_cache.complete(workdir, stage_cache.WARM_START, inputs, summary)
    return graphdef, params, summary


def _load(path, summary: dict, model_cfg, mesh):
    """(graphdef, params, summary) of the warm start cached in `path` (WORKDIR/sft), once it
    is shown to be for `model_cfg` (up to `COMPUTE_ONLY`)."""
    cfg, _, params = checkpoint.load_params(path, mesh=mesh)
    compute_only = {k: getattr(model_cfg, k) for k in COMPUTE_ONLY}
    if dataclasses.replace(cfg, **compute_only) != model_cfg:
        raise ValueError(
            f"{path} holds a warm start for a different model; delete it or "
            f"use another workdir (cached {cfg}, wanted {model_cfg})"
        )
    logging.info("reusing the SFT warm start in %s: %s", path, summary)
    graphdef, _ = model.abstract_model(model_cfg)  # This run's compute settings.
    return graphdef, params, summary


def _train(
    c: SFTConfig,
    eval_cfg,
    sampling,
    graphdef,
    params,
    model_cfg,
    mesh,
    rng,
    tokenizer,
    task,
    train_problems,
    test_problems,
):
    """(params, summary) after SFT on the demonstrations (`c`), stopped at `sft.max_steps` or
    once held-out pass@1, measured every `sft.eval_every` steps with keys folded from `rng`,
    reaches `sft.target_pass`."""
    lengths = [
        len(tokenizer.encode(p.prompt)) + len(demo_ids(tokenizer, task, p.demo)[0]) + 1
        for p in train_problems
    ]
    length = -(-max(lengths) // 8) * 8
    sampler = Sampler(graphdef, model_cfg, mesh)
    scfg = SamplingConfig(
        max_new_tokens=sampling.max_new_tokens,
        temperature=1.0,
        num_samples=eval_cfg.samples,
        stop_tokens=(tokenizer.eos_id,),
        pad_id=tokenizer.pad_id,
        buckets=tuple(sampling.buckets),
    )
    order_rng = np.random.default_rng([c.seed, 7])

    def next_batch():
        idx = order_rng.integers(0, len(train_problems), c.batch_size)
        bare_B = order_rng.random(c.batch_size) >= c.answer_line_fraction
        return next_token.Batch(
            *_batch(tokenizer, task, [train_problems[i] for i in idx], length, bare_B)
        )

    pass_at_1 = [0.0]

    def evaluate(params, progress: supervised.Progress) -> bool:
        ev = heldout.pass_rates(
            sampler,
            params,
            tokenizer,
            test_problems[: eval_cfg.prompts],
            jax.random.fold_in(rng, progress.step),
            scfg,
            scoring.Scorer(task.verify),
        )
        pass_at_1[0] = ev["eval/pass@1"]
        loss = float(progress.metrics["loss"])
        logging.info(
            "sft step %d loss %.3f held-out pass@1 %.3f", progress.step, loss, pass_at_1[0]
        )
        return pass_at_1[0] >= c.target_pass

    fit = supervised.Fit(next_token.batch_loss, graphdef, optim.warmup_cosine(c.lr, c.max_steps))
    params, last = supervised.fit(
        fit, params, next_batch, c.max_steps, every=c.eval_every, callback=evaluate, label="sft"
    )
    return params, {"steps": last.step, "pass@1": pass_at_1[0], "loss": float(last.metrics["loss"])}
