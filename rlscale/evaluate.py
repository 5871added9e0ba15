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

Tasks (`config.task.name`): the synthetic tasks of `rlscale.data.tasks`, and `math`, a local
math dataset read with `rlscale.data.math_data`, configured by

    task = dict(name="math", format="gsm8k" | "math" | "polaris",
                files={"train": PATH, "test": PATH}, chat_template="qwen2.5" (or "" for none),
                instruction=math_data.DEFAULT_INSTRUCTION, system="" (none))

Metrics: `pass@j` for j = 1, 2, 4, ... up to k (unbiased, from the k samples), `avg@k` (mean
reward), `maj@k` (majority vote over extracted answers; tasks with an answer extractor),
`best_of_k/mean_logprob` (the sample the policy itself finds likeliest: its mean token
logprob, a scorer that needs no reward model), plus response length and truncation.
"""

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rlscale import checkpoint, evaluation, rl, sharding
from rlscale import tokenizer as tokenizer_lib
from rlscale.data import load as data_load
from rlscale.data import tasks
from rlscale.rewards import isolation
from rlscale.sampling import Sampler, SamplingConfig

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
# Sampling and scoring.
# ==========================================================================================


@dataclasses.dataclass
class Samples:
    """k completions for each of P prompts, scored. Rows follow the prompts' order."""

    texts_PK: list[list[str]]
    rewards_PK: np.ndarray
    mean_logprob_PK: np.ndarray  # Mean logprob of the sampled tokens under the sampler.
    lengths_PK: np.ndarray
    truncated_PK: np.ndarray
    verifier_failures: int


def score(task, texts: list[str], problems: list) -> tuple[np.ndarray, int]:
    """Rewards of completions: in parallel when the task can (`verify_batch`), else one by one
    with in-process fault isolation. Returns (rewards, failures)."""
    if hasattr(task, "verify_batch"):
        return np.asarray(task.verify_batch(texts, problems), np.float64), 0
    return isolation.score_all(task.verify, texts, problems)


def sample_and_score(
    sampler: Sampler,
    params,
    tokenizer,
    task,
    problems: list,
    rng,
    cfg: SamplingConfig,
    batch: int = 32,
) -> Samples:
    """Samples `cfg.num_samples` completions per problem and scores them.

    Each sampler call takes `batch` prompts; the last call is topped up with repeats of its
    first prompt to a size the mesh's batch axes divide, and their rows are dropped.
    """
    k = cfg.num_samples
    div = 1
    if sampler.layout is not None:
        div = sharding.batch_divisor(sampler.layout.mesh, sampler.layout.rules)
    batch = max(div, batch // div * div)
    texts, rewards, logps, lengths, truncated, failures = [], [], [], [], [], 0
    for call, start in enumerate(range(0, len(problems), batch)):
        chunk = problems[start : start + batch]
        padded = chunk + [chunk[0]] * (-len(chunk) % div)
        out = sampler(
            params, evaluation.encode_prompts(tokenizer, padded), jax.random.fold_in(rng, call), cfg
        )
        rows = len(chunk) * k  # Rows are prompt-major: the padding rows come last.
        chunk_texts = evaluation.completions_text(tokenizer, out)[:rows]
        r, f = score(task, chunk_texts, [chunk[i] for i in out.prompt_index[:rows]])
        mask = np.asarray(out.mask)[:rows]
        logp = (np.asarray(out.logprobs)[:rows] * mask).sum(1) / np.maximum(mask.sum(1), 1)
        texts += [chunk_texts[i * k : (i + 1) * k] for i in range(len(chunk))]
        rewards.append(r)
        logps.append(logp)
        lengths.append(np.asarray(out.lengths)[:rows])
        truncated.append(np.asarray(out.truncated)[:rows])
        failures += f
    shape = (len(problems), k)
    return Samples(
        texts_PK=texts,
        rewards_PK=np.concatenate(rewards).reshape(shape),
        mean_logprob_PK=np.concatenate(logps).reshape(shape),
        lengths_PK=np.concatenate(lengths).reshape(shape),
        truncated_PK=np.concatenate(truncated).reshape(shape),
        verifier_failures=failures,
    )


def metrics(samples: Samples, answer_fn=None) -> dict:
    """Benchmark numbers (means over prompts) from scored samples.

    A sample is correct when its reward is positive. `answer_fn(completion) -> str | None`
    enables maj@k.
    """
    rewards_PK = samples.rewards_PK
    P, k = rewards_PK.shape
    correct_P = (rewards_PK > 0).sum(1)
    out = {}
    j = 1
    while j < k:
        out[f"pass@{j}"] = float(evaluation.pass_at_k(k, correct_P, j).mean())
        j *= 2
    out[f"pass@{k}"] = float(evaluation.pass_at_k(k, correct_P, k).mean())
    out[f"avg@{k}"] = float(evaluation.avg_at_k(rewards_PK).mean())
    if answer_fn is not None:
        answers = [[answer_fn(t) for t in row] for row in samples.texts_PK]
        out[f"maj@{k}"] = float(evaluation.maj_at_k(answers, rewards_PK).mean())
    out[f"best_of_{k}/mean_logprob"] = float(
        evaluation.best_of_n(samples.mean_logprob_PK, rewards_PK).mean()
    )
    out["response_length"] = float(samples.lengths_PK.mean())
    out["truncated_frac"] = float(samples.truncated_PK.mean())
    out["verifier_failures"] = samples.verifier_failures
    out["prompts"] = P
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
    samples = sample_and_score(
        Sampler(graphdef, model_cfg, mesh, rules),
        params,
        tokenizer,
        task,
        problems,
        jax.random.key(seed),
        cfg,
        batch,
    )
    result = metrics(samples, answer_fn_for(config, task))
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
        "per_prompt": {"rewards": samples.rewards_PK.tolist()},
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
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
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
    app.run(main)
