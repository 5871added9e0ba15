"""Evaluation on a held-out split: sampled pass@1 and mean reward (more metrics later)."""

import numpy as np

from rlscale.rewards import isolation
from rlscale.sampling import Sampler, SamplingConfig


def encode_prompts(tokenizer, problems):
    return [tokenizer.encode(p.prompt, add_bos=True) for p in problems]


def completions_text(tokenizer, out) -> list[str]:
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    eos = tokenizer.eos_id
    return [
        tokenizer.decode([t for t in tokens[i, : lengths[i]] if t != eos])
        for i in range(tokens.shape[0])
    ]


def evaluate(
    sampler: Sampler, params, tokenizer, task, problems, rng, cfg: SamplingConfig, batch: int = 64
) -> dict:
    """Samples `cfg.num_samples` completions per problem; pass@1 is the mean correctness."""
    rewards = []
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        out = sampler(params, encode_prompts(tokenizer, chunk), rng, cfg)
        texts = completions_text(tokenizer, out)
        probs = [chunk[i] for i in out.prompt_index]
        r, _ = isolation.score_all(task.verify, texts, probs)
        rewards.append(r)
    r = np.concatenate(rewards)
    return {"eval/reward_mean": float(r.mean()), "eval/pass@1": float((r > 0).mean())}
