"""Evaluates a params checkpoint on its config's task: pass@k, avg@k, maj@k, best-of-k.

    python -m rlscale.evaluate --config configs/quickstart.py --checkpoint WORKDIR/final \\
        [--split test --k 8 --n 64]

loads the params `checkpoint.save_params` wrote (a run's `WORKDIR/final`, or a converted
Hugging Face model), samples `--k` completions for each of the first `--n` prompts of the
split with the config's sampling settings, scores them with the task's verifier, prints the
metrics and writes them, with the per-prompt rewards, to a JSON file (default
`WORKDIR/eval_{split}.json`, WORKDIR being the checkpoint's parent directory).

The data is materialized in `WORKDIR/data` exactly as the RL loop does (so a run's cached
dataset is reused), and the tokenizer is the run's `WORKDIR/tokenizer.model`, or the
checkpoint directory's own `tokenizer.json` / `tokenizer.model`, or `--tokenizer PATH`.

Tasks: whatever the config's `task` names, loaded as the RL loop loads it
(`rlscale.data.load.load_task`): the synthetic tasks of `rlscale.data.tasks`, a user's problem
files (`task.name="files"`, `config_lib.files_task`: format, fields, verifier, chat template)
or a reasoning-gym generator (`task.name="reasoning_gym"`).

A user's mistake (a missing `--checkpoint`, a bad flag or config key) ends the command with
one `error: ...` line naming it (`rlscale.cli`).

Metrics: `pass@j` for j = 1, 2, 4, ... up to k (unbiased, from the k samples), `avg@k` (mean
reward), `maj@k` (majority vote over extracted answers; tasks with an answer extractor),
`best_of_k/mean_logprob` (the sample the policy itself finds likeliest: its mean token
logprob, a scorer that needs no reward model), plus response length and truncation.
"""

import contextlib
import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rlscale import checkpoint, cli, eval_metrics, rl, sharding
from rlscale import tokenizer as tokenizer_lib
from rlscale.data import load as data_load
from rlscale.data import tasks
from rlscale.rewards import isolation
from rlscale.sampling import Sampler, SamplingConfig, scoring

# Answer extraction for majority voting, per synthetic task (countdown has many correct
# expressions for one target, so a vote over final answers means nothing there).
_ANSWER_FNS = {"arithmetic": tasks.final_answer}


# ==========================================================================================
# Task, tokenizer, sampling settings.
# ==========================================================================================


load_task = data_load.load_task  # Re-exported: the CLI's task is the run's.


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


def sampling_config(config, tokenizer, k: int) -> SamplingConfig:
    """The RL loop's sampling settings for this config, with `k` samples per prompt.

    Stops at the EOS and, for a chat-formatted task, at the template's end-of-turn token.
    Tokenizers without a pad token (Llama 3) left-pad prompts with the EOS (padding is masked).
    """
    return dataclasses.replace(rl.sampling_config(config, tokenizer), num_samples=k)


# ==========================================================================================
# Metrics of scored samples (sampled and scored by `sampling.scoring.sample_and_score`).
# ==========================================================================================


def metrics(samples: scoring.Samples, k: int, answer_fn=None) -> dict:
    """Benchmark numbers (means over prompts) from B prompts x k scored samples.

    A sample is correct when its reward is positive. `answer_fn(completion) -> str | None`
    enables maj@k, `answered` (the share of samples that state an answer) and
    `accuracy_answered` (the share of those that are correct): what separates learning the
    answer format from learning the task.
    """
    rewards_BG = samples.reward_N.reshape(-1, k)
    B = rewards_BG.shape[0]
    correct_B = (rewards_BG > 0).sum(1)
    out = {}
    j = 1
    while j < k:
        out[f"pass@{j}"] = float(eval_metrics.pass_at_k(k, correct_B, j).mean())
        j *= 2
    out[f"pass@{k}"] = float(eval_metrics.pass_at_k(k, correct_B, k).mean())
    out[f"avg@{k}"] = float(eval_metrics.avg_at_k(rewards_BG).mean())
    if answer_fn is not None:
        answers = [answer_fn(t) for t in samples.texts]
        answers_BG = [answers[b * k : (b + 1) * k] for b in range(B)]
        out[f"maj@{k}"] = float(eval_metrics.maj_at_k(answers_BG, rewards_BG).mean())
        # Format against skill: how often a sample states an answer, and how often a stated
        # answer is right (NaN when none is).
        answered_N = np.array([a is not None for a in answers])
        out["answered"] = float(answered_N.mean())
        correct_N = samples.reward_N > 0
        out["accuracy_answered"] = (
            float(correct_N[answered_N].mean()) if answered_N.any() else float("nan")
        )
    mask = samples.mask_NM
    mean_logprob_N = (samples.logprobs_NM * mask).sum(1) / np.maximum(mask.sum(1), 1)
    out[f"best_of_{k}/mean_logprob"] = float(
        eval_metrics.best_of_n(mean_logprob_N.reshape(B, k), rewards_BG).mean()
    )
    out["response_length"] = float(samples.lengths_N.mean())
    out["truncated_frac"] = float(samples.truncated_N.mean())
    out["verifier_failures"] = sum(samples.failures.values())
    out["prompts"] = B
    out["samples_per_prompt"] = k
    return out


def answer_fn_for(config, task):
    """The answer extractor for majority voting, or None when the task has none."""
    if hasattr(task, "extract_answer"):
        return task.extract_answer
    return _ANSWER_FNS.get(config.task.name)


# ==========================================================================================
# The command.
# ==========================================================================================


def run(
    config,
    checkpoint_dir: str,
    *,
    split: str = "test",
    k: int = 8,
    n: int = 64,
    tokenizer_path: str | None = None,
    workdir: str | None = None,
    output: str | None = None,
    batch: int = 32,
    seed: int = 0,
) -> dict:
    """Evaluates a checkpoint (see the module docstring); returns the metrics and writes the
    JSON report."""
    t_start = time.time()
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    workdir = os.path.abspath(workdir or os.path.dirname(checkpoint_dir))
    if k < 1 or n < 1:
        raise ValueError(f"--k={k} and --n={n} must be >= 1")
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(f"--checkpoint={checkpoint_dir}: no such directory")
    mesh = sharding.make_mesh(tuple(config.mesh.shape))
    rules = sharding.SAMPLE_RULES
    model_cfg, graphdef, params = checkpoint.load_params(checkpoint_dir, mesh, rules)
    tokenizer_path = tokenizer_path or default_tokenizer_path(checkpoint_dir, workdir)
    tokenizer = tokenizer_lib.load(tokenizer_path)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer at {tokenizer_path!r} has {tokenizer.vocab_size} ids but the model "
            f"only {model_cfg.vocab_size}: not the tokenizer this checkpoint was trained with"
        )
    task, splits = load_task(config, workdir)
    if split not in splits:
        raise ValueError(f"--split={split!r} is not one of {sorted(splits)}")
    problems = splits[split][:n]
    cfg = sampling_config(config, tokenizer, k)
    # The task's verifier in the config's verifier pool (`reward.workers`, `reward.timeout`).
    workers = config.reward.workers
    with isolation.verifier_pool(workers) if workers else contextlib.nullcontext() as pool:
        samples = scoring.sample_and_score(
            Sampler(graphdef, model_cfg, mesh, rules),
            params,
            tokenizer,
            problems,
            jax.random.key(seed),
            cfg,
            scoring.Scorer(task.verify, pool, config.reward.timeout),
            chunk=batch,
        )
    result = metrics(samples, k, answer_fn_for(config, task))
    result["wall_s"] = time.time() - t_start
    report = {
        "checkpoint": checkpoint_dir,
        "tokenizer": os.path.abspath(tokenizer_path),
        "task": config.task.to_dict(),
        "split": split,
        "seed": seed,
        "sampling": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "top_p": cfg.top_p,
        },
        "metrics": result,
        "per_prompt": {"rewards": samples.reward_N.reshape(-1, k).tolist()},
    }
    output = output or os.path.join(workdir, f"eval_{split}.json")
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(report, f, indent=2)
    return result


def define_flags():
    """The command's flags; defined only when it runs, so importing this module (tests, other
    tools) defines none."""
    config_flags.DEFINE_config_file(
        "config", None, "Config file, optionally with a :variant suffix.", lock_config=True
    )
    flags.DEFINE_string(
        "checkpoint", None, "Params checkpoint (checkpoint.save_params), e.g. WORKDIR/final."
    )
    flags.DEFINE_string("split", "test", "Split of the task to evaluate on.")
    flags.DEFINE_integer("k", 8, "Completions sampled per prompt.")
    flags.DEFINE_integer("n", 64, "Prompts: the first n of the split (all if fewer).")
    flags.DEFINE_string("tokenizer", None, "Tokenizer path (see tokenizer.load).")
    flags.DEFINE_string(
        "workdir", None, "Run directory (data cache, tokenizer); default: the checkpoint's parent."
    )
    flags.DEFINE_string("output", None, "Metrics JSON; default WORKDIR/eval_{split}.json.")
    flags.DEFINE_integer("batch", 32, "Prompts per sampler call.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.mark_flags_as_required(["config", "checkpoint"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    f = flags.FLAGS
    result = run(
        f.config,
        f.checkpoint,
        split=f.split,
        k=f.k,
        n=f.n,
        tokenizer_path=f.tokenizer,
        workdir=f.workdir,
        output=f.output,
        batch=f.batch,
        seed=f.seed,
    )
    print("\nrlscale evaluation")
    for key, v in result.items():
        print(f"  {key:<28} {v:.4g}" if isinstance(v, float) else f"  {key:<28} {v}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
