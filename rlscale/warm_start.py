"""Supervised warm start: train a policy from scratch on task demonstrations until it solves
a minority of held-out problems, so RL has something to improve. Cached in WORKDIR/sft.

`train_or_load` returns the cached warm start, or trains and caches it; `reuse` copies another
run's. Dimension letters: B problems (one SFT batch).
"""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import optax
from absl import logging

from rlscale import checkpoint, model, next_token
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


def _inputs(config) -> dict:
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
    if not src or os.path.exists(os.path.join(workdir, "sft", "sft.json")):
        return
    inputs_path = os.path.join(src, "sft", "inputs.json")
    if not os.path.exists(inputs_path):
        raise ValueError(f"sft.reuse_from={src!r}: {inputs_path} does not exist (no warm start)")
    with open(inputs_path) as f:
        diff = checkpoint.config_diff(json.load(f), _inputs(config))
    if diff:
        raise ValueError(
            f"sft.reuse_from={src!r} was trained with different settings:\n  " + "\n  ".join(diff)
        )
    os.makedirs(workdir, exist_ok=True)
    for name in ("data", "tokenizer.model", "sft"):
        from_path, to_path = os.path.join(src, name), os.path.join(workdir, name)
        if os.path.isdir(from_path):
            shutil.copytree(from_path, to_path, dirs_exist_ok=True)
        else:
            shutil.copy2(from_path, to_path)
    logging.info("copied the warm start, data and tokenizer of %s", src)


def train_or_load(config, workdir, model_cfg, mesh, tokenizer, task, train_problems, test_problems):
    """(graphdef, params, summary): from the cache, or trained now and cached."""
    path = os.path.join(workdir, "sft")
    summary_path = os.path.join(path, "sft.json")
    inputs = _inputs(config)
    if os.path.exists(summary_path):
        return _load(path, inputs, model_cfg, mesh)
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
    if jax.process_index() == 0:
        with open(os.path.join(path, "inputs.json"), "w") as f:
            json.dump(inputs, f, indent=2)
        with open(summary_path, "w") as f:  # Written last: its presence marks a complete cache.
            json.dump(summary, f, indent=2)
    return graphdef, params, summary


def _load(path, inputs: dict, model_cfg, mesh):
    """(graphdef, params, summary) of the warm start cached in `path` (WORKDIR/sft), once it
    is shown to be made with `inputs` (`_inputs`) for `model_cfg` (up to `COMPUTE_ONLY`)."""
    inputs_path = os.path.join(path, "inputs.json")
    if not os.path.exists(inputs_path):
        raise ValueError(
            f"{path} holds a warm start with no record of the settings it was made with "
            "(an older rlscale); delete it or use another workdir"
        )
    with open(inputs_path) as f:
        diff = checkpoint.config_diff(json.load(f), inputs)
    if diff:
        raise ValueError(
            f"{path} holds a warm start made with different settings; delete it or use "
            "another workdir:\n  " + "\n  ".join(diff)
        )
    cfg, _, params = checkpoint.load_params(path, mesh=mesh)
    compute_only = {k: getattr(model_cfg, k) for k in COMPUTE_ONLY}
    if dataclasses.replace(cfg, **compute_only) != model_cfg:
        raise ValueError(
            f"{path} holds a warm start for a different model; delete it or "
            f"use another workdir (cached {cfg}, wanted {model_cfg})"
        )
    with open(os.path.join(path, "sft.json")) as f:
        summary = json.load(f)
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
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(
                0.0, c.lr, min(20, c.max_steps // 2), c.max_steps, c.lr * 0.1
            )
        ),
    )
    step_fn = next_token.make_train_step(graphdef, optimizer)
    state = next_token.init_state(params, optimizer)
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
    pass_at_1 = 0.0
    for step in range(1, c.max_steps + 1):
        idx = order_rng.integers(0, len(train_problems), c.batch_size)
        bare_B = order_rng.random(c.batch_size) >= c.answer_line_fraction
        tokens, mask, target = _batch(tokenizer, [train_problems[i] for i in idx], length, bare_B)
        state, mets = step_fn(state, tokens, mask, target)
        if step % c.eval_every == 0 or step == c.max_steps:
            ev = heldout.pass_rates(
                sampler,
                state.params,
                tokenizer,
                test_problems[: config.eval.prompts],
                jax.random.fold_in(rng, step),
                scfg,
                scoring.Scorer(task.verify),
            )
            pass_at_1 = ev["eval/pass@1"]
            logging.info(
                "sft step %d loss %.3f held-out pass@1 %.3f", step, float(mets["loss"]), pass_at_1
            )
            if pass_at_1 >= c.target_pass:
                break
    return state.params, {"steps": step, "pass@1": pass_at_1, "loss": float(mets["loss"])}
