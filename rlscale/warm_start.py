"""Supervised warm start: train a policy from scratch on task demonstrations until it solves
a minority of held-out problems, so RL has something to improve. A stage of the run's cache
(`stage_cache.WARM_START`, WORKDIR/sft: a params checkpoint).

`train_or_load` returns the cached warm start, or trains (`supervised.fit`) and caches it;
`reuse` copies another run's. Dimension letters: B problems (one SFT batch).
"""

import dataclasses

import jax
import numpy as np
from absl import logging

from rlscale import checkpoint, model, next_token, optim, stage_cache, supervised
from rlscale.data import tasks
from rlscale.eval import heldout
from rlscale.sampling import Sampler, SamplingConfig, scoring


def _batch(tokenizer, problems, length, bare_B=None):
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
        completion = tokenizer.encode(demo, add_eos=True)
        seq = (prompt + completion)[:length]
        tokens[i, : len(seq)] = seq
        mask[i, : len(seq)] = True
        target[i, len(prompt) : len(seq)] = True
    return tokens, mask, target


# Model fields that change how the policy computes, not its parameters: a warm start trained
# with one setting serves runs with another (an RL ablation of the FP32 LM head, bf16 compute).
COMPUTE_ONLY = ("dtype", "fp32_lm_head")


def settings(config) -> dict:
    """The config sections a warm start depends on (with its data and tokenizer)."""
    sft = {k: v for k, v in config.sft.to_dict().items() if k != "reuse_from"}
    return {
        "task": config.task.to_dict(),
        "tokenizer": config.tokenizer.to_dict(),
        "model": {k: v for k, v in config.model.to_dict().items() if k not in COMPUTE_ONLY},
        "sft": sft,
        "eval": {"prompts": config.eval.prompts, "samples": config.eval.samples},
        "sampling": {"max_new_tokens": config.sampling.max_new_tokens},
    }


def reuse(config, workdir) -> None:
    """Copies the data, tokenizer and warm start of `config.sft.reuse_from` (another run's
    workdir) into `workdir`, so runs that differ only after the warm start (a sweep over RL
    settings) train it once. Fails, listing the differences, unless that warm start was made
    with the same task, tokenizer, model and SFT settings."""
    src = config.sft.reuse_from
    if not src or stage_cache.record(workdir, stage_cache.WARM_START) is not None:
        return
    stage_cache.copy(
        src,
        workdir,
        stage_cache.WARM_START,
        settings(config),
        "sft.reuse_from",
        with_files=("data", "tokenizer.model"),
    )
    logging.info("copied the warm start, data and tokenizer of %s", src)


def train_or_load(config, workdir, model_cfg, mesh, tokenizer, task, train_problems, test_problems):
    """(graphdef, params, summary): from the stage cache, or trained now and cached.

    Raises:
      ValueError: If the cache holds a warm start made with other settings (listing them), or
        for a different model (up to `COMPUTE_ONLY`).
    """
    inputs = settings(config)
    summary = stage_cache.lookup(workdir, stage_cache.WARM_START, inputs)
    if summary is not None:
        return _load(stage_cache.path(workdir, stage_cache.WARM_START), summary, model_cfg, mesh)
    path = stage_cache.begin(workdir, stage_cache.WARM_START)
    rng = jax.random.key(config.sft.seed)
    graphdef, params = model.init_sharded(model_cfg, jax.random.fold_in(rng, 1), mesh)
    summary = {"steps": 0, "pass@1": None}
    if config.sft.max_steps > 0:
        params, summary = _train(
            config,
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
    config, graphdef, params, model_cfg, mesh, rng, tokenizer, task, train_problems, test_problems
):
    """(params, summary) after SFT on the demonstrations (`config.sft`), stopped at
    `sft.max_steps` or once held-out pass@1, measured every `sft.eval_every` steps with keys
    folded from `rng`, reaches `sft.target_pass`."""
    c = config.sft
    lengths = [
        len(tokenizer.encode(p.prompt)) + len(tokenizer.encode(p.demo)) + 2 for p in train_problems
    ]
    length = -(-max(lengths) // 8) * 8
    sampler = Sampler(graphdef, model_cfg, mesh)
    scfg = SamplingConfig(
        max_new_tokens=config.sampling.max_new_tokens,
        temperature=1.0,
        num_samples=config.eval.samples,
        stop_tokens=(tokenizer.eos_id,),
        pad_id=tokenizer.pad_id,
        buckets=tuple(config.sampling.buckets),
    )
    order_rng = np.random.default_rng([c.seed, 7])

    def next_batch():
        idx = order_rng.integers(0, len(train_problems), c.batch_size)
        bare_B = order_rng.random(c.batch_size) >= c.answer_line_fraction
        return next_token.Batch(
            *_batch(tokenizer, [train_problems[i] for i in idx], length, bare_B)
        )

    pass_at_1 = [0.0]

    def evaluate(params, progress: supervised.Progress) -> bool:
        ev = heldout.pass_rates(
            sampler,
            params,
            tokenizer,
            test_problems[: config.eval.prompts],
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
        fit, params, next_batch, c.max_steps, every=c.eval_every, callback=evaluate
    )
    return params, {"steps": last.step, "pass@1": pass_at_1[0], "loss": float(last.metrics["loss"])}
