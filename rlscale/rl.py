"""The RL loop: sample groups of completions, score them, update the policy. Synchronous.

Read top to bottom: mesh, data, models, sample, reward, advantage, update, eval. The sampler
and the learner meet only through `Rollouts` (host arrays) and the params pytree, so an async
mode can put them on different devices and hand params across with `sharding.reshard`.

Dimension letters: N rows (prompts x group), G group size, P padded prompt length,
M completion length, L = P + M, V vocab.
"""

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import shutil
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from rlscale import chat, checkpoint, evaluation, faults, metrics, model, preemption, sft, sharding
from rlscale import tokenizer as tokenizer_lib
from rlscale.data import filters, tasks
from rlscale.data import load as data_load
from rlscale.model import decoder, hf
from rlscale.objectives import recipe
from rlscale.rewards import isolation
from rlscale.sampling import Sampler, SamplingConfig
from rlscale.scaling import compute
from rlscale.tokenizer import SentencePieceTokenizer, train_sentencepiece


class TrainState(NamedTuple):
    params: Any
    value_params: Any  # {"w": [D], "b": []}; unused unless the recipe has a critic.
    opt_state: Any
    obj_state: Any
    step: jax.Array


@dataclasses.dataclass
class Rollouts:
    """One sampled batch, on the host. Rows are prompt-major groups."""

    tokens_NL: np.ndarray
    attn_mask_NL: np.ndarray
    mask_NM: np.ndarray  # Completion tokens that are trained on.
    sampler_logp_NM: np.ndarray
    reward_N: np.ndarray
    row_weight_N: np.ndarray  # 0 for rows of filtered prompts.
    prompt_len: int


# ==========================================================================================
# Configuration checks (everything wrong is reported at once, before any work).
# ==========================================================================================


def validate(config) -> None:
    problems = recipe.validate(config.objective, config.batch.group_size)
    b, u = config.batch, config.learner
    if b.prompts < 1:
        problems.append(f"batch.prompts={b.prompts} must be >= 1")
    if b.group_size < 1:
        problems.append(f"batch.group_size={b.group_size} must be >= 1")
    if u.minibatches < 1 or b.prompts % u.minibatches:
        problems.append(
            f"batch.prompts={b.prompts} is not divisible by learner.minibatches={u.minibatches}"
        )
    elif (b.prompts // u.minibatches) % u.micro_batches:
        problems.append(
            f"prompts per minibatch ({b.prompts // u.minibatches}) is not divisible "
            f"by learner.micro_batches={u.micro_batches}"
        )
    if config.task.name not in (*tasks.TASKS, "math"):
        problems.append(
            f"task.name={config.task.name!r} is not one of {sorted(tasks.TASKS)} or 'math'"
        )
    if config.task.name == "math":
        for split in ("train", "test"):
            path = config.task.files.get(split, "")
            if not path or not os.path.exists(path):
                problems.append(f"task.files.{split}={path!r}: no such file")
        if not config.init.hf_checkpoint:
            problems.append("task.name='math' needs init.hf_checkpoint (a pretrained policy)")
    if config.init.hf_checkpoint and not os.path.isfile(
        os.path.join(config.init.hf_checkpoint, "config.json")
    ):
        problems.append(
            f"init.hf_checkpoint={config.init.hf_checkpoint!r} has no config.json: not a "
            "Hugging Face model directory"
        )
    if (
        config.filters.overlong_cache
        and config.filters.overlong_cache > config.sampling.max_new_tokens
    ):
        problems.append(
            f"filters.overlong_cache={config.filters.overlong_cache} exceeds "
            f"sampling.max_new_tokens={config.sampling.max_new_tokens}"
        )
    if config.reward.fn:
        try:
            if not callable(_import_function(config.reward.fn)):
                raise TypeError("not callable")
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            problems.append(f"reward.fn={config.reward.fn!r} ('module:function') fails: {e}")
    if config.reward.workers and config.reward.timeout <= 0:
        problems.append(f"reward.timeout={config.reward.timeout} must be > 0 with worker processes")
    for key, value, low in (
        ("steps", config.steps, 1),
        ("eval.every", config.eval.every, 1),
        ("checkpoint.every", config.checkpoint.every, 1),
        ("checkpoint.keep", config.checkpoint.keep, 1),
        ("faults.max_consecutive_skips", config.faults.max_consecutive_skips, 1),
        ("reward.workers", config.reward.workers, 0),
        ("sampling.max_new_tokens", config.sampling.max_new_tokens, 1),
    ):
        if not isinstance(value, int) or value < low:
            problems.append(f"{key}={value!r} must be an integer >= {low}")
    numbers = (("optim.lr", config.optim.lr), ("sampling.temperature", config.sampling.temperature))
    for key, value in numbers:
        if not isinstance(value, (int, float)) or value < 0:
            problems.append(f"{key}={value!r} must be a number >= 0")
    if config.sampling.think_budget and (
        config.sampling.think_budget + 2 >= config.sampling.max_new_tokens
    ):
        problems.append(
            f"sampling.think_budget={config.sampling.think_budget} leaves no room to answer "
            f"within sampling.max_new_tokens={config.sampling.max_new_tokens}"
        )
    mesh_devices = int(np.prod([s for s in config.mesh.shape if s > 0]))
    if jax.device_count() % mesh_devices:
        problems.append(
            f"mesh.shape={tuple(config.mesh.shape)} does not fit {jax.device_count()} devices"
        )
    if problems:
        raise ValueError("Invalid config:\n  " + "\n  ".join(problems))


# ==========================================================================================
# Learner functions (pure, jitted).
# ==========================================================================================


def _token_terms(
    graphdef, params, value_params, tokens_NL, attn_mask_NL, P, with_value, with_entropy
):
    """Per completion token: logp of the taken token, entropy, value (state before it)."""
    positions = decoder.positions_from_mask(attn_mask_NL)
    h, _ = decoder.hidden(graphdef, params, tokens_NL, positions, attn_mask_NL)
    h_NMD = h[:, P - 1 : -1]
    logp_all = jax.nn.log_softmax(decoder.logits(graphdef, params, h_NMD).astype(jnp.float32))
    logp = jnp.take_along_axis(logp_all, tokens_NL[:, P:, None], axis=-1)[..., 0]
    out = {"logp": logp}
    if with_entropy:
        out["entropy"] = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    if with_value:
        out["value"] = h_NMD.astype(jnp.float32) @ value_params["w"] + value_params["b"]
    return out


@functools.partial(jax.jit, static_argnames=("graphdef", "P", "with_value"))
def score(graphdef, params, value_params, tokens_NL, attn_mask_NL, *, P, with_value):
    """Behaviour-policy logprobs (and values), computed once per sampled batch."""
    return _token_terms(
        graphdef, params, value_params, tokens_NL, attn_mask_NL, P, with_value, False
    )


@functools.partial(
    jax.jit, static_argnames=("graphdef", "P", "loss_tx", "with_value", "with_entropy")
)
def micro_grads(
    graphdef, params, value_params, obj_state, batch, *, P, loss_tx, with_value, with_entropy
):
    """Gradients of the micro-batch's loss_sum, with its denominator and metrics."""

    def loss_fn(params, value_params):
        t = _token_terms(
            graphdef,
            params,
            value_params,
            batch["tokens"],
            batch["attn_mask"],
            P,
            with_value,
            with_entropy,
        )
        terms = {**{k: v for k, v in batch.items() if k not in ("tokens", "attn_mask")}, **t}
        terms, new_state = loss_tx.update(terms, obj_state)
        return terms["loss_sum"], (terms["denominator"], terms.get("metrics", {}), new_state)

    (loss_sum, (denom, mets, new_state)), grads = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True
    )(params, value_params)
    return grads, loss_sum, denom, mets, new_state


@functools.partial(jax.jit, static_argnames=("optimizer",), donate_argnums=(0,))
def apply_grads(state: TrainState, grads, loss_sum, denom, *, optimizer):
    """One optimizer step on the accumulated gradient sums; skipped (state unchanged, bit for
    bit) when the loss or the gradient norm is not finite."""
    grads = jax.tree.map(lambda g: g / jnp.maximum(denom, 1.0), grads)

    def apply(grads, s):
        params, value_params, opt_state = s
        updates, opt_state = optimizer.update(grads, opt_state, (params, value_params))
        params, value_params = optax.apply_updates((params, value_params), updates)
        return params, value_params, opt_state

    old = (state.params, state.value_params, state.opt_state)
    (params, value_params, opt_state), ok = faults.guarded_update(grads, loss_sum, apply, old)
    return TrainState(params, value_params, opt_state, state.obj_state, state.step + 1), {
        "train/grad_norm": optax.tree.norm(grads),
        "ok": ok,
    }


def make_optimizer(c) -> optax.GradientTransformation:
    warmup = optax.linear_schedule(0.0, c.lr, max(c.warmup_steps, 1))
    if c.schedule == "cosine":
        main = optax.cosine_decay_schedule(c.lr, max(c.decay_steps, 1), alpha=c.final_lr_frac)
    elif c.schedule == "constant":
        main = optax.constant_schedule(c.lr)
    else:
        raise ValueError(f"optim.schedule={c.schedule!r} is not 'constant' or 'cosine'")
    lr = optax.join_schedules([warmup, main], [c.warmup_steps])
    return optax.chain(
        optax.clip_by_global_norm(c.grad_clip),
        optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay),
    )


# ==========================================================================================
# The loop.
# ==========================================================================================


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
)


class PreemptedError(Exception):
    """Raised after a SIGTERM once the checkpoint is saved; rerunning the command resumes.
    `rlscale.main` exits with status 143 (128 + SIGTERM) on it."""


def run(config, workdir: str, *, allow_config_change: bool = False) -> dict:
    """Runs (or resumes) the RL loop in `workdir`; returns the summary."""
    validate(config)
    t_start = time.time()
    rng = jax.random.key(config.seed)
    os.makedirs(workdir, exist_ok=True)

    # ---- mesh --------------------------------------------------------------------------
    mesh = sharding.make_mesh(tuple(config.mesh.shape))
    n_devices = mesh.devices.size

    # ---- data --------------------------------------------------------------------------
    sft.reuse(config, workdir)
    task, splits = data_load.load_task(config, workdir)
    train_problems, test_problems = splits["train"], splits["test"]
    hf_init = config.init.hf_checkpoint
    if hf_init:  # A pretrained policy brings its own tokenizer.
        tokenizer = tokenizer_lib.load(hf_init)
    else:
        tokenizer = _tokenizer(config, workdir, train_problems)

    # ---- models ------------------------------------------------------------------------
    if hf_init:  # Start from a Hugging Face checkpoint, placed directly on the mesh.
        model_cfg, graphdef, params = hf.load_hf(hf_init, mesh, dtype=config.model.dtype)
        sft_summary = {}
    else:  # Start from the SFT warm start (trained now, or cached in WORKDIR/sft).
        model_cfg = model.from_dict({**config.model, "vocab_size": tokenizer.vocab_size})
        graphdef, params, sft_summary = sft.warm_start(
            config, workdir, model_cfg, mesh, tokenizer, task, train_problems, test_problems
        )
    scfg = sampling_config(config, tokenizer)
    eval_scfg = dataclasses.replace(scfg, num_samples=config.eval.samples)
    sampler = Sampler(graphdef, model_cfg, mesh)
    needs = recipe.needs(config.objective)
    # The reference model is the same function with frozen params; copied because the train
    # state's buffers are donated to each update.
    ref_params = jax.tree.map(jnp.copy, params) if needs["ref"] else None
    value_params = {"w": jnp.zeros((model_cfg.d_model,)), "b": jnp.zeros(())}
    G = config.batch.group_size
    batch_tx, loss_tx = recipe.build(config.objective, G, config.sampling.max_new_tokens)
    optimizer = make_optimizer(config.optim)
    state = TrainState(
        params,
        value_params,
        optimizer.init((params, value_params)),
        loss_tx.init(),
        jnp.zeros((), jnp.int32),
    )
    batch_state = batch_tx.init()
    batch_update = jax.jit(batch_tx.update)
    stream = filters.PromptStream(len(train_problems), seed=config.seed)
    history = filters.PassRateHistory(config.filters.retire_threshold)
    counters = {
        "compute/sample_flops": 0.0,
        "compute/train_flops": 0.0,
        "compute/device_seconds": 0.0,
    }
    evals = []

    # ---- checkpoint ------------------------------------------------------------------
    # Everything that decides the rest of the run: device state (params, optimizer and
    # objective state, the batch-level transforms' state, step, RNG) and host state (the
    # prompt stream's cursor and shuffle, the pass-rate history and retired set, compute
    # counters, the metrics file's length, the config). The reference params are the warm
    # start's, reloaded from WORKDIR/sft. A workdir with checkpoints resumes from the latest.
    ckpt = checkpoint.RunCheckpointer(
        os.path.join(workdir, "checkpoints"),
        keep=config.checkpoint.keep,
        keep_every=config.checkpoint.keep_every,
    )
    start_step, metrics_offset = 0, None
    config_dict = json.loads(config.to_json_best_effort())
    if ckpt.latest_step() is not None:
        tree = {"train": state, "batch": batch_state, "rng": rng}
        start_step, tree, host = ckpt.restore(_abstract(tree, mesh))
        diff = checkpoint.config_diff(host["config"], config_dict, ignore=RESUMABLE_CHANGES)
        if diff and not allow_config_change:
            ckpt.close()
            raise ValueError(
                f"{workdir} holds a run with a different config; pass --allow_config_change to "
                "resume it anyway, or use another workdir. Differences (saved -> now):\n  "
                + "\n  ".join(diff)
            )
        state, batch_state, rng = tree["train"], tree["batch"], tree["rng"]
        stream = filters.PromptStream.from_state(host["stream"])
        history = filters.PassRateHistory.from_state(host["history"])
        counters, evals, metrics_offset = host["counters"], host["evals"], host["metrics_offset"]
        logging.info("resuming from the checkpoint at step %d in %s", start_step, workdir)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(config_dict, f, indent=2, sort_keys=True)
    writer = metrics.MetricWriter(
        workdir, config.steps, enabled=jax.process_index() == 0, resume_offset=metrics_offset
    )

    def save(step, wait=False):
        host = {
            "stream": stream.state(),
            "history": history.state(),
            "counters": counters,
            "evals": evals,
            "metrics_offset": writer.offset(),
            "config": config_dict,
        }
        ckpt.save(step, {"train": state, "batch": batch_state, "rng": rng}, host)
        if wait:
            ckpt.wait()

    # ---- reward ----------------------------------------------------------------------
    reward_fn = _reward_fn(config, task)
    pool = isolation.verifier_pool(config.reward.workers) if config.reward.workers else None
    skips = faults.SkipCounter(config.faults.max_consecutive_skips)

    def compute_metrics():
        return {
            **counters,
            "compute/flops": counters["compute/sample_flops"] + counters["compute/train_flops"],
        }

    def run_eval(step):
        t = time.time()
        ev = evaluation.evaluate(
            sampler,
            state.params,
            tokenizer,
            task,
            test_problems[: config.eval.prompts],
            jax.random.fold_in(rng, 10**6 + step),
            eval_scfg,
        )
        counters["compute/device_seconds"] += (time.time() - t) * n_devices
        return ev

    if start_step == 0:
        first_eval = run_eval(0)
        writer.write(0, {**first_eval, **compute_metrics()})
        evals.append(first_eval)

    guard = preemption.PreemptionGuard()
    with guard, contextlib.ExitStack() as cleanup:
        if pool is not None:
            cleanup.callback(pool.close)
        cleanup.callback(ckpt.close)
        cleanup.callback(writer.close)
        for step in range(start_step + 1, config.steps + 1):
            step_rng = jax.random.fold_in(rng, step)
            t_sample = time.time()

            # ---- sample ----------------------------------------------------------------------
            def draw(round_index, params=state.params, step_rng=step_rng):
                ids = stream.next(config.batch.prompts, history.retired)
                chunk = [train_problems[i] for i in ids]
                encoded = evaluation.encode_prompts(tokenizer, chunk)
                out = sampler(
                    params,
                    encoded,
                    jax.random.fold_in(step_rng, round_index),
                    scfg,
                )
                texts = evaluation.completions_text(tokenizer, out)

                # ---- reward ------------------------------------------------------------------
                rows = [chunk[i] for i in out.prompt_index]
                reward, failures = isolation.score_isolated(
                    reward_fn, texts, rows, pool=pool, timeout=pool and config.reward.timeout
                )
                correct = reward > 0
                lengths = np.asarray(out.lengths)
                if config.filters.overlong_cache:
                    reward = reward + filters.overlong_penalty(
                        lengths, config.sampling.max_new_tokens, config.filters.overlong_cache
                    )
                newly = history.update(ids, correct.reshape(-1, G)) if config.filters.retire else []
                filtering = config.filters.zero_variance or config.filters.dynamic_sampling
                keep_P = (
                    filters.zero_variance_keep(reward.reshape(-1, G))
                    if filtering
                    else np.ones(len(ids), bool)
                )
                return {
                    "encoded": encoded,
                    "out": out,
                    "reward": reward,
                    "correct": correct,
                    "lengths": lengths,
                    "failures": failures,
                    "keep": keep_P,
                    "newly": newly,
                }

            draws = [draw(0)]
            if config.filters.dynamic_sampling:  # DAPO: refill filtered groups with fresh ones.
                while (
                    sum(int(d["keep"].sum()) for d in draws) < config.batch.prompts
                    and len(draws) < config.filters.dynamic_max_rounds
                ):
                    draws.append(draw(len(draws)))
            t_reward = time.time()

            # ---- advantage -------------------------------------------------------------------
            roll, keep_P = _assemble(tokenizer, sampler, scfg, draws, config.batch.prompts, G)
            P = roll.prompt_len
            tokens = jnp.asarray(roll.tokens_NL)
            attn = jnp.asarray(roll.attn_mask_NL)
            old = score(
                graphdef,
                state.params,
                state.value_params,
                tokens,
                attn,
                P=P,
                with_value=needs["value"],
            )
            batch = {
                "tokens": tokens,
                "attn_mask": attn,
                "mask": jnp.asarray(roll.mask_NM),
                "reward": jnp.asarray(roll.reward_N, jnp.float32),
                "row_weight": jnp.asarray(roll.row_weight_N, jnp.float32),
                "old_logp": old["logp"],
                "sampler_logp": jnp.asarray(roll.sampler_logp_NM),
            }
            if needs["value"]:
                batch["old_value"] = old["value"]
            if needs["ref"]:
                batch["ref_logp"] = score(
                    graphdef, ref_params, state.value_params, tokens, attn, P=P, with_value=False
                )["logp"]
                batch["logp"] = old["logp"]  # For a KL-in-reward transform before the update.
            mask_f = batch["mask"].astype(jnp.float32)
            logp_gap = jnp.sum(jnp.abs(old["logp"] - batch["sampler_logp"]) * mask_f) / jnp.maximum(
                jnp.sum(mask_f), 1.0
            )
            terms, batch_state = batch_update(batch, batch_state)
            batch["advantage"] = terms["advantage"]
            if "returns" in terms:
                batch["returns"] = terms["returns"]
            batch.pop("logp", None)
            batch.pop("reward")
            reward = np.concatenate([d["reward"] for d in draws])
            correct = np.concatenate([d["correct"] for d in draws])
            lengths = np.concatenate([d["lengths"] for d in draws])
            truncated = np.concatenate([np.asarray(d["out"].truncated) for d in draws])
            interrupted = np.concatenate([np.asarray(d["out"].interrupted) for d in draws])

            # ---- update ----------------------------------------------------------------------
            t_update = time.time()
            step_metrics = {}
            skipped, applied = 0, []
            N = roll.tokens_NL.shape[0]
            n_mini = config.learner.minibatches
            for epoch in range(config.learner.epochs):
                order = np.random.default_rng([config.seed, step, epoch]).permutation(N // G)
                for mb in np.array_split(order, n_mini):
                    grads_acc, denom_acc, loss_acc = None, 0.0, 0.0
                    for micro in np.array_split(mb, config.learner.micro_batches):
                        idx = (micro[:, None] * G + np.arange(G)).reshape(-1)
                        mbatch = {k: v[idx] for k, v in batch.items()}
                        grads, loss_sum, denom, mets, obj_state = micro_grads(
                            graphdef,
                            state.params,
                            state.value_params,
                            state.obj_state,
                            mbatch,
                            P=P,
                            loss_tx=loss_tx,
                            with_value=needs["value"],
                            with_entropy=needs["entropy"],
                        )
                        state = state._replace(obj_state=obj_state)
                        grads_acc = (
                            grads if grads_acc is None else jax.tree.map(jnp.add, grads_acc, grads)
                        )
                        denom_acc = denom_acc + denom
                        for k, v in mets.items():
                            step_metrics.setdefault(f"train/{k}", []).append(v)
                        step_metrics.setdefault("train/loss_sum", []).append(loss_sum)
                        step_metrics.setdefault("train/denominator", []).append(denom)
                        loss_acc = loss_acc + loss_sum
                    state, upd = apply_grads(
                        state, grads_acc, loss_acc, denom_acc, optimizer=optimizer
                    )
                    step_metrics.setdefault("train/grad_norm", []).append(upd["train/grad_norm"])
                    applied.append(upd["ok"])
            jax.block_until_ready(state.params)
            t_done = time.time()
            # A non-finite loss or gradient skipped its update (state unchanged); too many in
            # a row stop the run, keeping the last good checkpoint. Read once the step is done,
            # so the host never waits between updates.
            for ok in map(bool, applied):
                skipped += not ok
                skips.update(ok, step, last_checkpoint=ckpt.latest_step())

            # ---- compute accounting ----------------------------------------------------------
            n_gen = float(lengths.sum())
            prompt_tokens = float(sum(len(p) for d in draws for p in d["encoded"]))
            ctx = P + config.sampling.max_new_tokens / 2
            counters["compute/sample_flops"] += compute.forward_flops(
                model_cfg, prompt_tokens + n_gen, ctx
            )
            seq_tokens = float(roll.attn_mask_NL.sum())
            passes = 1 + int(needs["ref"])
            counters["compute/train_flops"] += (
                compute.forward_flops(model_cfg, seq_tokens, ctx) * passes
                + compute.train_flops(model_cfg, seq_tokens, ctx) * config.learner.epochs
            )
            counters["compute/device_seconds"] += (t_done - t_sample) * n_devices

            # ---- metrics and eval ------------------------------------------------------------
            loss_sum = float(np.sum(step_metrics.pop("train/loss_sum")))
            denom = float(np.sum(step_metrics.pop("train/denominator")))
            record = {
                "train/reward_mean": float(reward.mean()),
                "train/pass_rate": float(correct.mean()),
                "train/loss": loss_sum / max(denom, 1.0),
                "train/response_length": float(lengths.mean()),
                "train/sampler_logp_gap": float(logp_gap),
                "train/truncated_frac": float(np.mean(truncated)),
                "train/interrupted_frac": float(np.mean(interrupted)),
                "train/kept_prompts": int(keep_P.sum()),
                "train/filtered_prompts": int(sum((~d["keep"]).sum() for d in draws)),
                "train/sampling_rounds": len(draws),
                "train/retired_prompts": len(history.retired),
                "train/newly_retired": sum(len(d["newly"]) for d in draws),
                "train/skipped_updates": skipped,
                "reward/failures": sum(sum(d["failures"].values()) for d in draws),
                **{
                    f"reward/failures_{kind}": sum(d["failures"][kind] for d in draws)
                    for kind in draws[0]["failures"]
                },
                "time/sample_s": t_reward - t_sample,
                "time/update_s": t_done - t_update,
                **{k: float(np.mean([float(x) for x in v])) for k, v in step_metrics.items()},
                **compute_metrics(),
            }
            if step % config.eval.every == 0 or step == config.steps:
                ev = run_eval(step)
                evals.append(ev)
                record.update(ev)
                record.update(compute_metrics())
            writer.write(step, record)

            if guard.should_stop(step):
                save(step, wait=True)
                raise PreemptedError(
                    f"preempted ({guard.signal_name}) after step {step}: checkpoint saved in "
                    f"{ckpt.directory}; rerun the same command to resume"
                )
            if step % config.checkpoint.every == 0 or step == config.steps:
                save(step, wait=step == config.steps)

    summary = {
        "start/eval_pass@1": evals[0]["eval/pass@1"],
        "end/eval_pass@1": evals[-1]["eval/pass@1"],
        "start/eval_reward_mean": evals[0]["eval/reward_mean"],
        "end/eval_reward_mean": evals[-1]["eval/reward_mean"],
        **{f"sft/{k}": v for k, v in sft_summary.items()},
        **compute_metrics(),
        "wall_s": time.time() - t_start,
    }
    if jax.process_index() == 0:
        checkpoint.save_params(os.path.join(workdir, "final"), model_cfg, state.params)
        if hf_init:  # Also as a Hugging Face checkpoint, with the tokenizer: servable as is.
            export = os.path.join(workdir, "hf")
            hf.save_hf(export, model_cfg, state.params)
            for name in os.listdir(hf_init):
                if name.startswith(("tokenizer", "special_tokens", "generation_config")):
                    shutil.copy2(os.path.join(hf_init, name), export)
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


# ==========================================================================================
# Helpers.
# ==========================================================================================


def _abstract(tree, mesh):
    """Shape, dtype and sharding of each leaf: where a checkpoint restores onto. Leaves not on
    the mesh (fresh scalars) are replicated over it."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def leaf(x):
        s = x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(leaf, tree)


def _reward_fn(config, task):
    """`config.reward.fn` ("module:function", called as fn(completion, problem) -> float), or
    the task's own verifier."""
    return _import_function(config.reward.fn) if config.reward.fn else task.verify


def _import_function(spec: str):
    """The object named by "module:function"."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _tokenizer(config, workdir, problems):
    path = os.path.join(workdir, "tokenizer.model")
    if os.path.exists(path):
        return SentencePieceTokenizer(path)
    corpus = [p.prompt + p.demo for p in problems]
    # A small task corpus may support fewer pieces than asked: accept the smaller vocabulary.
    return train_sentencepiece(
        corpus, config.tokenizer.vocab_size, model_type="bpe", path=path, hard_vocab_limit=False
    )


def sampling_config(config, tokenizer) -> SamplingConfig:
    """The run's `SamplingConfig`: `config.sampling` with its texts (the forced-interruption
    phrase and end-of-thinking marker) encoded by the run's tokenizer.

    Completions stop at the EOS and, for a chat-formatted task, at the template's end-of-turn
    token. Tokenizers without a pad token (Llama 3) left-pad with the EOS (padding is masked).
    """
    s = config.sampling
    stop = (tokenizer.eos_id,)
    if config.task.name == "math" and config.task.chat_template:
        stop = chat.stop_token_ids(tokenizer, chat.get(config.task.chat_template))
    pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else tokenizer.eos_id
    interrupt_ids, think_end = (), ()
    if s.think_budget:
        interrupt_ids = tuple(tokenizer.encode(s.interrupt_phrase))
        think_end = tuple(tokenizer.encode(s.think_end))
        if len(think_end) != 1:
            raise ValueError(
                f"sampling.think_end={s.think_end!r} is {len(think_end)} tokens "
                f"({list(think_end)}); it must be exactly one token of the tokenizer"
            )
    return SamplingConfig(
        think_budget=s.think_budget,
        interrupt_ids=interrupt_ids,
        think_end_tokens=think_end,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        num_samples=config.batch.group_size,
        stop_tokens=stop,
        pad_id=pad_id,
        buckets=tuple(s.buckets),
    )


def _assemble(tokenizer, sampler, scfg, draws, n_prompts, G):
    """The learner's batch from one or more sampling rounds: the kept groups first, then
    (weight 0, for static shapes) dropped ones, `n_prompts` groups in all. Prompts are
    re-padded on the left to the longest round's bucket."""
    rolls = [
        _rollouts(sampler, d["encoded"], d["out"], scfg, d["reward"], np.repeat(d["keep"], G))
        for d in draws
    ]
    P = max(r.prompt_len for r in rolls)
    picks = [(i, g) for i, d in enumerate(draws) for g in np.flatnonzero(d["keep"])]
    picks += [(i, g) for i, d in enumerate(draws) for g in np.flatnonzero(~d["keep"])]
    picks = picks[:n_prompts]

    def rows(field, pad_value=None):
        out = []
        for i, g in picks:
            x = getattr(rolls[i], field)[g * G : (g + 1) * G]
            if pad_value is not None and rolls[i].prompt_len < P:
                width = P - rolls[i].prompt_len
                x = np.pad(x, ((0, 0), (width, 0)), constant_values=pad_value)
            out.append(x)
        return np.concatenate(out)

    keep_P = np.array([bool(draws[i]["keep"][g]) for i, g in picks])
    roll = Rollouts(
        tokens_NL=rows("tokens_NL", tokenizer.pad_id),
        attn_mask_NL=rows("attn_mask_NL", False),
        mask_NM=rows("mask_NM"),
        sampler_logp_NM=rows("sampler_logp_NM"),
        reward_N=rows("reward_N"),
        row_weight_N=rows("row_weight_N"),
        prompt_len=P,
    )
    return roll, keep_P


def _rollouts(sampler, encoded, out, scfg, reward, keep_N) -> Rollouts:
    """Prompt (left-padded to its bucket) + completion rows for the learner."""
    prompt_BP, prompt_mask_BP = sampler.prepare(encoded, scfg)
    rep = out.prompt_index
    tokens = np.concatenate([prompt_BP[rep], np.asarray(out.tokens)], axis=1)
    # Tokens written by forced interruption are context, not actions: out of the loss.
    comp_mask = np.asarray(out.mask) & ~np.asarray(out.forced) & keep_N[:, None]
    attn = np.concatenate([prompt_mask_BP[rep], np.asarray(out.mask)], axis=1)
    return Rollouts(
        tokens_NL=tokens.astype(np.int32),
        attn_mask_NL=attn,
        mask_NM=comp_mask,
        sampler_logp_NM=np.asarray(out.logprobs, np.float32),
        reward_N=np.asarray(reward, np.float32),
        row_weight_N=keep_N.astype(np.float32),
        prompt_len=prompt_BP.shape[1],
    )
