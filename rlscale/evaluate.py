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
reward), `maj@k` (majority vote over extracted answers, a tie split evenly; tasks with an
answer extractor), `best_of_k/mean_logprob` (the sample the policy itself finds likeliest:
its mean token logprob, a scorer that needs no reward model), plus response length and
truncation.

Test-time scaling (`rlscale.test_time`): `--best_of 1,2,4,8,16` (each N <= k) adds, for each
N, pass@N, best-of-N under each `--scorer` (`logprob`; `reward_model` with `--reward_model
DIR`, a `python -m rlscale.reward_model` directory whose tokenizer must be the policy's; `prm`
with `--prm DIR`, a process reward model (`rlscale.process_reward`), one curve per
`--prm_aggregation` of its step probabilities: min, last, product), maj@N and score-weighted
majority voting per scorer, each an unbiased estimate over the N-subsets of the k samples;
they go to the report's `test_time` key (with each sample's scores under `per_prompt`), a
printed table and a plot, `WORKDIR/test_time_{split}.png` or `--plot PATH`.

Step search (`rlscale.step_search`): `--step_search W,E` with `--prm DIR` searches each
problem's solution step by step, a beam of W partial solutions each continued E ways per step
and ranked by the PRM (`--step_search_aggregation`, default last), and reports the answer's
accuracy with the tokens the search sampled per problem (the report's `step_search` key),
printed next to the best-of-N curves of `--best_of` and the tokens those sample.
"""

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from rlscale import checkpoint, cli, eval_metrics, process_reward, rl, sharding, test_time
from rlscale import reward_model as reward_model_lib
from rlscale import step_search as step_search_lib
from rlscale import tokenizer as tokenizer_lib
from rlscale.data import load as data_load
from rlscale.data import tasks
from rlscale.model.config import ModelConfig
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


class Policy(NamedTuple):
    """A params checkpoint loaded to sample from (`load_policy`)."""

    model_cfg: ModelConfig
    graphdef: object
    params: dict
    tokenizer: tokenizer_lib.Tokenizer
    tokenizer_path: str
    sampler: Sampler


def load_policy(
    config, checkpoint_dir: str, workdir: str, tokenizer_path: str | None = None
) -> Policy:
    """The checkpoint's params on the config's mesh in the sampling layout, its tokenizer
    (`tokenizer_path`, else `default_tokenizer_path`) and a `Sampler` for them.

    Raises:
      ValueError: Naming `--checkpoint` when it is no directory, or the tokenizer when it has
        more ids than the model.
    """
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
    sampler = Sampler(graphdef, model_cfg, mesh, rules)
    return Policy(model_cfg, graphdef, params, tokenizer, tokenizer_path, sampler)


def load_problems(config, workdir: str, split: str, n: int):
    """(task, problems): the config's task (`load_task`, materialized in `workdir`) and the
    first `n` problems of its `split`; ValueError naming `--split` when it has none."""
    task, splits = load_task(config, workdir)
    if split not in splits:
        raise ValueError(f"--split={split!r} is not one of {sorted(splits)}")
    return task, splits[split][:n]


def verifier_pool(config):
    """The config's verifier pool (`reward.workers` worker processes) as a context manager,
    or None in-process when `reward.workers` is 0."""
    workers = config.reward.workers
    return isolation.verifier_pool(workers) if workers else contextlib.nullcontext()


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
        answers_BG = answers_of(samples, k, answer_fn)
        answers = [a for row in answers_BG for a in row]
        out[f"maj@{k}"] = float(eval_metrics.maj_at_n(answers_BG, rewards_BG).value_B.mean())
        # Format against skill: how often a sample states an answer, and how often a stated
        # answer is right (NaN when none is).
        answered_N = np.array([a is not None for a in answers])
        out["answered"] = float(answered_N.mean())
        correct_N = samples.reward_N > 0
        out["accuracy_answered"] = (
            float(correct_N[answered_N].mean()) if answered_N.any() else float("nan")
        )
    mean_logprob_BG = test_time.mean_logprob(samples).reshape(B, k)
    out[f"best_of_{k}/mean_logprob"] = float(
        eval_metrics.best_of_n(mean_logprob_BG, rewards_BG).mean()
    )
    out["response_length"] = float(samples.lengths_N.mean())
    out["truncated_frac"] = float(samples.truncated_N.mean())
    out["verifier_failures"] = sum(samples.failures.values())
    out["prompts"] = B
    out["samples_per_prompt"] = k
    return out


def answers_of(samples: scoring.Samples, k: int, answer_fn) -> list[list[str | None]]:
    """[B][k] extracted answers of the samples' completions."""
    answers = [answer_fn(t) for t in samples.texts]
    return [answers[b : b + k] for b in range(0, len(answers), k)]


def answer_fn_for(config, task):
    """The answer extractor for majority voting, or None when the task has none."""
    if hasattr(task, "extract_answer"):
        return task.extract_answer
    return _ANSWER_FNS.get(config.task.name)


# ==========================================================================================
# Test-time scaling: the N values, the scorers.
# ==========================================================================================

# `--scorer`'s choices (`test_time.Ranker`s); `prm` is one ranker per `--prm_aggregation`.
SCORERS = ("logprob", "reward_model", "prm")


def _best_of_problems(values: Sequence, k: int) -> tuple[list[int], list[str]]:
    """The N values of `--best_of` (ints, or strings as the flag gives them), increasing, and
    what is wrong with them: no value, a non-integer, N < 1, N > k, a duplicate."""
    problems, ns = [], []
    for v in values:
        try:
            n = int(str(v).strip())
        except ValueError:
            problems.append(f"{str(v)!r} is not an integer")
            continue
        if not 1 <= n <= k:
            problems.append(f"N={n} is outside [1, --k={k}]")
        ns.append(n)
    twice = sorted({n for n in ns if ns.count(n) > 1})
    if twice:
        problems.append(f"N={', '.join(map(str, twice))} given more than once")
    if not values:
        problems.append("no N given")
    return sorted(ns), problems


def check_test_time_flags(
    best_of: Sequence | None,
    k: int,
    scorers: Sequence[str],
    reward_model_dir: str | None,
    plot: str | None,
    prm_dir: str | None = None,
    prm_aggregation: Sequence[str] = ("min",),
    step_search=None,
    step_search_aggregation: str = step_search_lib.DEFAULT_AGGREGATION,
) -> list[int] | None:
    """The N values of `--best_of` (None without it), increasing.

    Raises:
      ValueError: Naming the flags, every problem at once: a bad `--best_of` (no value, a
        non-integer, N < 1, N > k, a duplicate), an unknown or repeated `--scorer`, a
        `reward_model` scorer without `--reward_model` or the reverse (`prm` and `--prm`
        alike), an unknown `--prm_aggregation`, or `--scorer`, `--reward_model`, `--prm` or
        `--plot` without `--best_of`; a malformed `--step_search` (`step_search.parse_beam`),
        one without `--prm`, or an unknown `--step_search_aggregation`. `--prm` with
        `--step_search` needs neither `--scorer=prm` nor `--best_of`.
    """
    problems, ns = [], None
    if best_of is not None:
        ns, wrong = _best_of_problems(best_of, k)
        if wrong:
            problems.append(f"--best_of={','.join(map(str, best_of))}: " + "; ".join(wrong))
    names = list(scorers)
    for name in dict.fromkeys(names):
        if name not in SCORERS:
            problems.append(f"--scorer: {name!r} is not one of {', '.join(SCORERS)}")
        if names.count(name) > 1:
            problems.append(f"--scorer: {name!r} given more than once")
    if "reward_model" in names and not reward_model_dir:
        problems.append("--scorer=reward_model needs --reward_model DIR")
    if reward_model_dir and "reward_model" not in names:
        problems.append(
            f"--reward_model={reward_model_dir} is unused: --scorer does not name reward_model"
        )
    if "prm" in names and not prm_dir:
        problems.append("--scorer=prm needs --prm DIR")
    if prm_dir and "prm" not in names and step_search is None:
        problems.append(f"--prm={prm_dir} is unused: --scorer does not name prm")
    if step_search is not None:
        try:
            step_search_lib.parse_beam(step_search)
        except ValueError as e:
            problems.append(str(e))
        if not prm_dir:
            raw = step_search if isinstance(step_search, str) else ",".join(map(str, step_search))
            problems.append(
                f"--step_search={raw} needs --prm DIR: the process reward model that scores "
                "each step"
            )
        if step_search_aggregation not in process_reward.AGGREGATIONS:
            problems.append(
                f"--step_search_aggregation={step_search_aggregation!r} is not one of "
                f"{', '.join(process_reward.AGGREGATIONS)}"
            )
    bad = [a for a in prm_aggregation if a not in process_reward.AGGREGATIONS]
    if bad:
        problems.append(
            f"--prm_aggregation: {', '.join(map(repr, bad))} not one of "
            f"{', '.join(process_reward.AGGREGATIONS)}"
        )
    if best_of is None and (
        names != ["logprob"] or reward_model_dir or (prm_dir and step_search is None)
    ):
        problems.append(
            "--scorer, --reward_model and --prm score the --best_of curves: pass --best_of"
        )
    if best_of is None and plot:
        problems.append(f"--plot={plot}: plots the --best_of curves: pass --best_of")
    if problems:
        raise ValueError("; ".join(problems))
    return ns


def load_scoring_model(flag: str, path: str, load, tokenizer, longest: int):
    """`load(path)` (`reward_model.load` or `process_reward.load`), checked against the
    policy's tokenizer and the longest row it will score (`longest` tokens: the longest
    prompt, max_new_tokens and the EOS); errors name `--{flag}`."""
    if not os.path.isdir(path):
        raise ValueError(f"--{flag}={path}: no such directory")
    try:
        model = load(path)
        reward_model_lib.check_tokenizer(path, tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--{flag}={path}: {e}") from e
    if longest > model.model_cfg.max_seq_len:
        raise ValueError(
            f"--{flag}={path}: its decoder reads at most max_seq_len="
            f"{model.model_cfg.max_seq_len} tokens, but the longest prompt with "
            f"--config.sampling.max_new_tokens and the EOS makes {longest}"
        )
    return model


def rankers(
    names: Sequence[str], reward_model=None, prm=None, prm_aggregation: Sequence[str] = ("min",)
) -> list[test_time.Ranker]:
    """The `--scorer`s as `test_time.Ranker`s, in order (`reward_model`, `prm`: loaded ones;
    `prm` gives one ranker per aggregation)."""
    out = []
    for name in names:
        if name == "logprob":
            out.append(test_time.logprob_ranker())
        elif name == "reward_model":
            out.append(test_time.reward_model_ranker(reward_model))
        else:
            out += [test_time.prm_ranker(prm, how) for how in prm_aggregation]
    return out


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
    best_of: Sequence | None = None,
    scorers: Sequence[str] = ("logprob",),
    reward_model_dir: str | None = None,
    plot: str | None = None,
    prm_dir: str | None = None,
    prm_aggregation: Sequence[str] = ("min",),
    step_search: str | Sequence | None = None,
    step_search_aggregation: str = step_search_lib.DEFAULT_AGGREGATION,
) -> dict:
    """Evaluates a checkpoint (see the module docstring); writes the JSON report and returns
    it (`metrics`, `test_time` with `best_of`, `step_search` with `step_search`,
    `--step_search` as "W,E" or (W, E))."""
    t_start = time.time()
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    workdir = os.path.abspath(workdir or os.path.dirname(checkpoint_dir))
    if k < 1 or n < 1:
        raise ValueError(f"--k={k} and --n={n} must be >= 1")
    scorers = list(scorers)
    ns = check_test_time_flags(
        best_of,
        k,
        scorers,
        reward_model_dir,
        plot,
        prm_dir,
        list(prm_aggregation),
        step_search,
        step_search_aggregation,
    )
    policy = load_policy(config, checkpoint_dir, workdir, tokenizer_path)
    tokenizer, tokenizer_path = policy.tokenizer, policy.tokenizer_path
    task, problems = load_problems(config, workdir, split, n)
    cfg = sampling_config(config, tokenizer, k)
    rm = prm = None
    scored = ns is not None and {"reward_model", "prm"} & set(scorers)
    if scored or step_search is not None:  # Before sampling anything.
        longest = max(len(p) for p in scoring.encode_prompts(tokenizer, problems))
        longest += cfg.max_new_tokens + 1
        if ns is not None and "reward_model" in scorers:
            rm = load_scoring_model(
                "reward_model", reward_model_dir, reward_model_lib.load, tokenizer, longest
            )
        if prm_dir:
            prm = load_scoring_model("prm", prm_dir, process_reward.load, tokenizer, longest)
    # The task's verifier in the config's verifier pool (`reward.workers`, `reward.timeout`).
    with verifier_pool(config) as pool:
        samples = scoring.sample_and_score(
            policy.sampler,
            policy.params,
            tokenizer,
            problems,
            jax.random.key(seed),
            cfg,
            scoring.Scorer(task.verify, pool, config.reward.timeout),
            chunk=batch,
        )
        searched = None
        if step_search is not None:
            beam, expand = step_search_lib.parse_beam(step_search)
            searched = step_search_lib.beam_search(
                policy.sampler,
                policy.params,
                tokenizer,
                problems,
                task.verify,
                prm,
                beam=beam,
                expand=expand,
                cfg=cfg,
                rng=jax.random.fold_in(jax.random.key(seed), 1),  # Not the samples' key.
                aggregation=step_search_aggregation,
                pool=pool,
                timeout=config.reward.timeout,
                chunk=batch,
            )
    answer_fn = answer_fn_for(config, task)
    result = metrics(samples, k, answer_fn)
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
    if ns is not None:
        chosen = rankers(scorers, rm, prm, list(prm_aggregation))
        scores = {r.name: np.asarray(r.score(samples, problems)).reshape(-1, k) for r in chosen}
        answers = None if answer_fn is None else answers_of(samples, k, answer_fn)
        report["test_time"] = test_time.curves(
            samples.reward_N.reshape(-1, k),
            ns,
            scores,
            answers,
            {r.name: r.vote_weight(scores[r.name]) for r in chosen},
            seed=seed,
        )
        report["per_prompt"]["scores"] = {name: s.tolist() for name, s in scores.items()}
        plot = os.path.abspath(plot or os.path.join(workdir, f"test_time_{split}.png"))
        report["test_time_plot"] = plot
    if searched is not None:
        report["step_search"] = step_search_lib.summary(
            searched, beam, expand, step_search_aggregation
        )
        if ns is not None:  # The same run's best-of-N, with what it samples per problem.
            curves = report["test_time"]
            report["step_search"]["best_of"] = {
                "N": ns,
                "generated_tokens_per_problem": step_search_lib.best_of_tokens(
                    samples.lengths_N, k, ns
                ),
                **{key: v for key, v in curves.items() if key.startswith("best_of/")},
            }
    result["wall_s"] = time.time() - t_start
    output = output or os.path.join(workdir, f"eval_{split}.json")
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(report, f, indent=2)
        if ns is not None:
            os.makedirs(os.path.dirname(plot), exist_ok=True)
            name = os.path.join(*checkpoint_dir.split(os.sep)[-2:])  # E.g. run/final.
            title = f"{name}: {config.task.name} {split}"
            test_time.plot(report["test_time"], plot, title=f"{title}, k={k}, n={len(problems)}")
    return report


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
    flags.DEFINE_list(
        "best_of", None, "N values for the test-time scaling curves, e.g. 1,2,4,8,16 (each <= k)."
    )
    flags.DEFINE_list(
        "scorer", ["logprob"], f"Best-of-N and weighted-vote scorers: {', '.join(SCORERS)}."
    )
    flags.DEFINE_string(
        "reward_model", None, "Reward model directory (python -m rlscale.reward_model)."
    )
    flags.DEFINE_string("prm", None, "Process reward model directory (rlscale.process_reward).")
    flags.DEFINE_list(
        "prm_aggregation", ["min"], "How --scorer=prm scores a completion: min, last, product."
    )
    flags.DEFINE_string(
        "plot", None, "Test-time scaling PNG; default WORKDIR/test_time_{split}.png."
    )
    flags.DEFINE_string(
        "step_search",
        None,
        "W,E: PRM-guided beam search over steps (rlscale.step_search), W partial solutions per "
        "problem, each continued E ways per step; needs --prm.",
    )
    flags.DEFINE_string(
        "step_search_aggregation",
        step_search_lib.DEFAULT_AGGREGATION,
        "How --step_search scores a prefix from its step probabilities: last, min, product.",
    )
    flags.mark_flags_as_required(["config", "checkpoint"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    f = flags.FLAGS
    report = run(
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
        best_of=f.best_of,
        scorers=f.scorer,
        reward_model_dir=f.reward_model,
        prm_dir=f.prm,
        prm_aggregation=f.prm_aggregation,
        plot=f.plot,
        step_search=f.step_search,
        step_search_aggregation=f.step_search_aggregation,
    )
    print("\nrlscale evaluation")
    for key, v in report["metrics"].items():
        print(f"  {key:<28} {v:.4g}" if isinstance(v, float) else f"  {key:<28} {v}")
    if "test_time" in report:
        print("\ntest-time scaling (mean over problems; unbiased over the N-subsets of k)")
        print(test_time.table(report["test_time"]))
        print(f"  plot: {report['test_time_plot']}")
    if "step_search" in report:
        print("\nstep search (PRM-guided beam search over steps)")
        print(step_search_table(report["step_search"]))


def step_search_table(s: dict) -> str:
    """The report's `step_search` entry as text: the search's accuracy and tokens sampled per
    problem, then, with `--best_of`, the same run's best-of-N curves with the tokens each N
    samples per problem."""
    lines = [
        f"  {s['name']}: accuracy {s['accuracy']:.4f}, "
        f"{s['generated_tokens_per_problem']:.1f} tokens per problem ({s['rounds']} rounds)"
    ]
    b = s.get("best_of")
    if b:
        curves = [key for key in b if key.startswith("best_of/")]
        widths = [max(len(key), 9) + 2 for key in curves]
        lines.append("  best-of-N, the same run:")
        head = "".join(f"{key:>{w}}" for key, w in zip(curves, widths))
        lines.append(f"  {'N':>6}{'tokens':>10}{head}")
        for i, n in enumerate(b["N"]):
            cells = "".join(f"{b[key][i]:>{w}.4f}" for key, w in zip(curves, widths))
            lines.append(f"  {n:>6}{b['generated_tokens_per_problem'][i]:>10.1f}{cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
