"""The held-out metrics a training run logs at each evaluation (the RL loop's, the warm
start's): mean reward, pass@1 and, with n > 1 samples per prompt, the unbiased pass@n.

Dimension letters: B prompts, G = n samples per prompt (the n of pass@n).
"""

import dataclasses
import math

import jax
import numpy as np

from rlscale import sections
from rlscale.eval import estimators
from rlscale.sampling import SamplingConfig, scoring
from rlscale.sampling.generator import Request


@dataclasses.dataclass(frozen=True)
class EvalConfig(sections.Section):
    """`config.eval`: every `every` steps, the first `prompts` held-out problems, `samples`
    completions each."""

    every: int = 10
    prompts: int = 200
    samples: int = 4

    def problems(self) -> list[str]:
        return sections.at_least("eval.every", self.every, 1)


def pass_rates(sampler, params, tokenizer, problems, rng, cfg: SamplingConfig, scorer) -> dict:
    """`eval/reward_mean`, `eval/pass@1` (the mean correctness) and `eval/pass@n` of
    `cfg.num_samples` = n > 1 samples per prompt, sampled and scored 64 prompts at a time."""
    r = scoring.sample_and_score(
        sampler, params, tokenizer, problems, rng, cfg, scorer, chunk=64
    ).reward_N
    return _rates(r, cfg.num_samples)


def episode_pass_rates(episodes, params, tokenizer, problems, rng, n: int, scorer, scfg, chunk):
    """`pass_rates` of `n` samples per prompt, each an episode played against the run's
    environments (`envs.episodes.Episodes` over a generator of `scfg.num_samples` = G samples
    a request: each prompt goes in ceil(n / G) requests, its first n samples count), and
    how those [B * n] rows' episodes went (`Episode.stats`, per row). Request (i, c)
    samples with fold_in(rng, i * copies + c)."""
    G = scfg.num_samples
    copies = math.ceil(n / G)
    prompts = scoring.encode_prompts(tokenizer, problems)
    requests = [
        Request((i, c), p, jax.random.fold_in(rng, i * copies + c))
        for i, p in enumerate(prompts)
        for c in range(copies)
    ]
    episodes.set_params(params, 0)
    episodes.submit(requests, [problems[r.id[0]] for r in requests])
    done = []
    while len(done) < len(requests):
        done += episodes.step(chunk).completed
    done.sort(key=lambda e: e.request.id)
    s = scoring.score_completed(
        tokenizer,
        scorer,
        [e.completed for e in done],
        [problems[e.request.id[0]] for e in done],
        scfg,
        episodes=[e.stats for e in done],
    )
    rows = (np.arange(len(problems))[:, None] * copies * G + np.arange(n)).reshape(-1)
    return _rates(s.reward_N[rows], n), {k: v[rows] for k, v in s.episodes.items()}


def _rates(r, n: int) -> dict:
    out = {"eval/reward_mean": float(r.mean()), "eval/pass@1": float((r > 0).mean())}
    if n > 1:  # Rows are prompt-major: each prompt's n samples give an unbiased pass@n.
        correct_B = (r > 0).reshape(-1, n).sum(axis=1)
        out[f"eval/pass@{n}"] = float(estimators.pass_at_k(n, correct_B, n).mean())
    return out
