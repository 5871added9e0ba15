"""The held-out metrics a training run logs at each evaluation (the RL loop's, the warm
start's): mean reward, pass@1 and, with n > 1 samples per prompt, the unbiased pass@n.

Dimension letters: B prompts, G = n samples per prompt (the n of pass@n).
"""

import dataclasses

from rlscale import sections
from rlscale.eval import estimators
from rlscale.sampling import SamplingConfig, scoring


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
    out = {"eval/reward_mean": float(r.mean()), "eval/pass@1": float((r > 0).mean())}
    n = cfg.num_samples
    if n > 1:  # Rows are prompt-major: each prompt's n samples give an unbiased pass@n.
        correct_B = (r > 0).reshape(-1, n).sum(axis=1)
        out[f"eval/pass@{n}"] = float(estimators.pass_at_k(n, correct_B, n).mean())
    return out
