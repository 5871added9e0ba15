"""Evaluates a params checkpoint on its config's task (`python -m rlscale.main.evaluate`):
samples k completions for each of the first n prompts of a split with the run's sampling
settings (`saved_policy`), scores them with the task's verifier and reports pass@j for
j = 1, 2, 4, ... k, avg@k, maj@k (tasks with an answer extractor), best-of-k by the policy's
own mean logprob, response length and truncation; with `best_of`, the test-time scaling
curves (`best_of_n`); with `step_search`, a PRM-guided beam search over steps
(`step_search`). The report is one JSON file (default WORKDIR/eval_{split}.json). Flags and
figures: docs/evaluation.md.

Dimension letters: B prompts, G = k samples per prompt (the k of pass@k), N = B * G rows.
"""

import json
import os
import time
from collections.abc import Sequence

import jax
import numpy as np

from rlscale import saved_policy
from rlscale.data import tasks
from rlscale.eval import best_of_n, estimators
from rlscale.eval import step_search as step_search_lib
from rlscale.reward_models import bradley_terry
from rlscale.reward_models import prm as prm_lib
from rlscale.sampling import scoring

# Answer extraction for majority voting, per synthetic task (countdown has many correct
# expressions for one target, so a vote over final answers means nothing there).
_ANSWER_FNS = {"arithmetic": tasks.final_answer}


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
        out[f"pass@{j}"] = float(estimators.pass_at_k(k, correct_B, j).mean())
        j *= 2
    out[f"pass@{k}"] = float(estimators.pass_at_k(k, correct_B, k).mean())
    out[f"avg@{k}"] = float(estimators.avg_at_k(rewards_BG).mean())
    if answer_fn is not None:
        answers_BG = answers_of(samples, k, answer_fn)
        answers = [a for row in answers_BG for a in row]
        out[f"maj@{k}"] = float(estimators.maj_at_n(answers_BG, rewards_BG).value_B.mean())
        # Format against skill: how often a sample states an answer, and how often a stated
        # answer is right (NaN when none is).
        answered_N = np.array([a is not None for a in answers])
        out["answered"] = float(answered_N.mean())
        correct_N = samples.reward_N > 0
        out["accuracy_answered"] = (
            float(correct_N[answered_N].mean()) if answered_N.any() else float("nan")
        )
    mean_logprob_BG = best_of_n.mean_logprob(samples).reshape(B, k)
    out[f"best_of_{k}/mean_logprob"] = float(
        estimators.best_of_n(mean_logprob_BG, rewards_BG).mean()
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


def answer_fn_for(task_name: str, task):
    """The answer extractor for majority voting of `task` (named `task_name` by the task
    section), or None when the task has none."""
    if hasattr(task, "extract_answer"):
        return task.extract_answer
    return _ANSWER_FNS.get(task_name)


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
    """Evaluates a checkpoint (see the module docstring) with the sections of `config`
    (`saved_policy.resolve`); writes the JSON report and returns it (`metrics`, `test_time`
    with `best_of`, `step_search` with `step_search`, `--step_search` as "W,E" or (W, E))."""
    t_start = time.time()
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    workdir = os.path.abspath(workdir or os.path.dirname(checkpoint_dir))
    if k < 1 or n < 1:
        raise ValueError(f"--k={k} and --n={n} must be >= 1")
    scorers = list(scorers)
    ns = best_of_n.check_test_time_flags(
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
    policy = saved_policy.load_policy(config.mesh, checkpoint_dir, workdir, tokenizer_path)
    task, problems = saved_policy.load_problems(config.task, workdir, split, n)
    cfg = saved_policy.sampling_config(config.sampling, config.task, policy.tokenizer, k)
    rm, prm = _scoring_models(  # Before sampling anything.
        ns, scorers, step_search, reward_model_dir, prm_dir, policy.tokenizer, problems, cfg
    )
    reward = config.reward  # The verifier pool's section.
    samples, searched = _sample_and_search(
        reward, policy, task, problems, cfg, prm, seed, batch, step_search, step_search_aggregation
    )
    answer_fn = answer_fn_for(config.task.name, task)
    result = metrics(samples, k, answer_fn)
    report = _report(config.task, checkpoint_dir, policy.tokenizer_path, split, seed, cfg, result)
    report["per_prompt"] = {"rewards": samples.reward_N.reshape(-1, k).tolist()}
    if ns is not None:
        chosen = best_of_n.rankers(scorers, rm, prm, list(prm_aggregation))
        report["test_time"], scores = _test_time(samples, problems, k, ns, chosen, answer_fn, seed)
        report["per_prompt"]["scores"] = {name: s.tolist() for name, s in scores.items()}
        plot = os.path.abspath(plot or os.path.join(workdir, f"test_time_{split}.png"))
        report["test_time_plot"] = plot
    if searched is not None:
        report["step_search"] = searched
        if ns is not None:  # The same run's best-of-N, with what it samples per problem.
            searched["best_of"] = {
                "N": ns,
                "generated_tokens_per_problem": step_search_lib.best_of_tokens(
                    samples.lengths_N, k, ns
                ),
                **{key: v for key, v in report["test_time"].items() if key.startswith("best_of/")},
            }
    result["wall_s"] = time.time() - t_start
    output = output or os.path.join(workdir, f"eval_{split}.json")
    if jax.process_index() == 0:
        _write(report, output, plot if ns is not None else None, config.task.name, k, len(problems))
    return report


def _scoring_models(ns, scorers, step_search, reward_model_dir, prm_dir, tokenizer, problems, cfg):
    """(reward model, PRM) that `run` ranks or searches with (None where not asked for), in
    a bucket that holds the longest prompt and a full-length completion."""
    rm = prm = None
    scored = ns is not None and {"reward_model", "prm"} & set(scorers)
    if scored or step_search is not None:
        longest = max(len(p) for p in scoring.encode_prompts(tokenizer, problems))
        longest += cfg.max_new_tokens + 1
        if ns is not None and "reward_model" in scorers:
            rm = best_of_n.load_scoring_model(
                "reward_model", reward_model_dir, bradley_terry.load, tokenizer, longest
            )
        if prm_dir:
            prm = best_of_n.load_scoring_model("prm", prm_dir, prm_lib.load, tokenizer, longest)
    return rm, prm


def _sample_and_search(
    reward, policy, task, problems, cfg, prm, seed, batch, step_search, aggregation
) -> tuple[scoring.Samples, dict | None]:
    """`run`'s samples, scored by the task's verifier in the reward section's verifier pool
    (`reward.workers`, `reward.timeout`), and with `step_search` the report's `step_search`
    entry (`step_search.summary`): the PRM-guided beam search over steps of every problem,
    with a key other than the samples'."""
    with saved_policy.verifier_pool(reward, task.verify) as pool:
        samples = scoring.sample_and_score(
            policy.sampler,
            policy.params,
            policy.tokenizer,
            problems,
            jax.random.key(seed),
            cfg,
            scoring.Scorer(task.verify, pool, reward.timeout),
            chunk=batch,
        )
        if step_search is None:
            return samples, None
        beam, expand = step_search_lib.parse_beam(step_search)
        searched = step_search_lib.beam_search(
            policy.sampler,
            policy.params,
            policy.tokenizer,
            problems,
            task.verify,
            prm,
            beam=beam,
            expand=expand,
            cfg=cfg,
            rng=jax.random.fold_in(jax.random.key(seed), 1),  # Not the samples' key.
            aggregation=aggregation,
            pool=pool,
            timeout=reward.timeout,
            chunk=batch,
        )
    return samples, step_search_lib.summary(searched, beam, expand, aggregation)


def _report(task_cfg, checkpoint_dir, tokenizer_path, split, seed, cfg, result: dict) -> dict:
    """The report's settings (`task_cfg`: the task section) and `metrics` (`result`)."""
    return {
        "checkpoint": checkpoint_dir,
        "tokenizer": os.path.abspath(tokenizer_path),
        "task": task_cfg.to_dict(),
        "split": split,
        "seed": seed,
        "sampling": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "top_p": cfg.top_p,
        },
        "metrics": result,
    }


def _test_time(samples, problems, k: int, ns, chosen, answer_fn, seed: int):
    """(the report's `test_time` curves, each ranker's [B, k] scores): best-of-N for N in
    `ns` by each of the `chosen` rankers (`best_of_n.curves`)."""
    scores = {r.name: np.asarray(r.score(samples, problems)).reshape(-1, k) for r in chosen}
    answers = None if answer_fn is None else answers_of(samples, k, answer_fn)
    curves = best_of_n.curves(
        samples.reward_N.reshape(-1, k),
        ns,
        scores,
        answers,
        {r.name: r.vote_weight(scores[r.name]) for r in chosen},
        seed=seed,
    )
    return curves, scores


def _write(report: dict, output: str, plot: str | None, task_name: str, k: int, n: int) -> None:
    """Writes the JSON report to `output` and, when given a `plot` path, its test-time curves
    (n: the prompts evaluated)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=2)
    if plot is not None:
        os.makedirs(os.path.dirname(plot), exist_ok=True)
        name = os.path.join(*report["checkpoint"].split(os.sep)[-2:])  # E.g. run/final.
        title = f"{name}: {task_name} {report['split']}"
        best_of_n.plot(report["test_time"], plot, title=f"{title}, k={k}, n={n}")
