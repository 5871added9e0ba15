"""Sample and score: the one way completions are sampled and scored (RL rollouts, in-loop
evaluation, the warm start's evaluation, `python -m rlscale.main.evaluate`).

Prompts go to the sampler in chunks padded to the mesh's batch axes; the outputs are fetched
to every host; each process scores its share of rows (`sharding.process_share`) with the
reward function, in the run's verifier pool or in-process; the rewards are gathered, so every
process ends with the same scored samples.

Dimension letters: B prompts, G samples per prompt, N = B * G rows, P padded prompt length,
M new tokens.
"""

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rlscale import sharding
from rlscale.rewards import isolation
from rlscale.sampling.sampler import Sampler, SamplingConfig
from rlscale.tokenizers import chat


@dataclasses.dataclass
class Scorer:
    """A reward function run on each process's share of rows, in the run's one verifier pool
    (worker processes with a per-sample timeout) or in-process (`pool=None`)."""

    fn: Callable
    pool: object = None
    timeout: float | None = None

    def __call__(self, texts: Sequence[str], problems: Sequence) -> tuple[np.ndarray, dict]:
        return isolation.score_isolated(
            self.fn, texts, problems, pool=self.pool, timeout=self.timeout if self.pool else None
        )


@dataclasses.dataclass
class Samples:
    """Completions of B prompts x G samples, scored; host arrays, rows prompt-major."""

    prompt_BP: np.ndarray
    prompt_mask_BP: np.ndarray
    tokens_NM: np.ndarray
    mask_NM: np.ndarray
    logprobs_NM: np.ndarray
    forced_NM: np.ndarray
    lengths_N: np.ndarray
    truncated_N: np.ndarray
    interrupted_N: np.ndarray
    texts: list
    reward_N: np.ndarray
    failures: dict
    versions_NM: np.ndarray | None = None  # Policy version of each token (the engine's).
    # The environment's tokens of multi-turn episodes (the engine's; None: the static
    # sampler's, which has none).
    env_NM: np.ndarray | None = None
    # Per row, how each episode went (`envs.episodes.Episode.stats`); None: single-turn.
    episodes: dict | None = None
    # A mixture of experts' routing of each row's prompt (padded as `prompt_BP`) and
    # completion tokens, [N, P + M, l, c] (the engine's; None: a dense model, the sampler's).
    experts_NLlc: np.ndarray | None = None

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt_mask_BP.sum())

    @property
    def policy_lengths_N(self) -> np.ndarray:
        """The policy's tokens of each completion: its length less the environment's."""
        if self.env_NM is None:
            return self.lengths_N
        return (self.lengths_N - self.env_NM.sum(1)).astype(self.lengths_N.dtype)

    def take(self, order_B) -> "Samples":
        """The prompts `order_B` (and their rows), in that order."""
        B, N = self.prompt_BP.shape[0], self.tokens_NM.shape[0]
        G = N // B
        rows = (np.asarray(order_B)[:, None] * G + np.arange(G)).reshape(-1)
        fields = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("prompt_BP", "prompt_mask_BP"):
                v = v[order_B]
            elif f.name == "texts":
                v = [v[i] for i in rows]
            elif f.name == "episodes" and v is not None:
                v = {k: x[rows] for k, x in v.items()}
            elif f.name != "failures" and v is not None:
                v = v[rows]
            fields[f.name] = v
        return Samples(**fields)


def encode_prompts(tokenizer, problems) -> list[list[int]]:
    """Prompt ids, with the BOS when the tokenizer has one (Qwen tokenizers have none)."""
    return [chat.encode_prompt(tokenizer, p.prompt) for p in problems]


def completions_text(tokenizer, tokens_NM, lengths_N, env_NM=None) -> list[str]:
    """Each completion's text, the EOS dropped; with `env_NM`, the policy's tokens only (an
    environment's replies left out, so an answer counts only where the policy wrote it)."""
    eos = tokenizer.eos_id
    texts = []
    for i in range(tokens_NM.shape[0]):
        ids = tokens_NM[i, : lengths_N[i]]
        if env_NM is not None:
            ids = ids[~env_NM[i, : lengths_N[i]]]
        texts.append(tokenizer.decode([t for t in ids if t != eos]))
    return texts


def concat_episodes(parts: list[dict]) -> dict:
    """Episode stats (`Episode.stats`) of several requests or chunks as one: the rows of
    each in turn, a counter absent from one 0 on its rows."""
    keys = dict.fromkeys(k for v in parts for k in v)
    return {
        k: np.concatenate([v[k] if k in v else np.zeros(len(v["end"])) for v in parts])
        for k in keys
    }


def concat(parts: list[Samples], pad_id: int) -> Samples:
    """One `Samples` from chunks whose prompts may be padded to different buckets."""
    if len(parts) == 1:
        return parts[0]
    P = max(s.prompt_BP.shape[1] for s in parts)

    def left_pad(x, value):
        return np.pad(x, ((0, 0), (P - x.shape[1], 0)), constant_values=value)

    fields = {}
    for f in dataclasses.fields(Samples):
        values = [getattr(s, f.name) for s in parts]
        if f.name in ("prompt_BP", "prompt_mask_BP"):
            values = [left_pad(v, pad_id if f.name == "prompt_BP" else False) for v in values]
        if f.name == "experts_NLlc" and values[0] is not None:  # Prompts in columns [0, P).
            M = values[0].shape[1] - parts[0].prompt_BP.shape[1]
            values = [np.pad(v, ((0, 0), (P + M - v.shape[1], 0), (0, 0), (0, 0))) for v in values]
        if f.name == "texts":
            fields[f.name] = [t for v in values for t in v]
        elif values[0] is None:
            fields[f.name] = None
        elif f.name == "failures":
            fields[f.name] = {k: sum(v[k] for v in values) for k in values[0]}
        elif f.name == "episodes":
            fields[f.name] = concat_episodes(values)
        else:
            fields[f.name] = np.concatenate(values)
    return Samples(**fields)


def _score(
    tokenizer, scorer, host: dict, problems_N: list, prompt_BP, prompt_mask_BP, episodes=None
) -> Samples:
    """Scores fetched completions (every process holds all rows): each process its share of
    rows, then the rewards and failure counts gathered to all. With `episodes` (per row,
    `Episode.stats`), the reward an episode's end fixes replaces the verifier's."""
    N = len(problems_N)
    texts = completions_text(tokenizer, host["tokens_NM"], host["lengths_N"], host.get("env_NM"))
    share = sharding.process_share(N)
    reward, failures = scorer(texts[share], problems_N[share])
    counts = sharding.sum_over_processes(np.array(list(failures.values())))
    reward_N = sharding.gather_host(reward, N)
    if episodes is not None:
        fixed_N = episodes["fixed_reward"]
        reward_N = np.where(np.isnan(fixed_N), reward_N, fixed_N).astype(reward_N.dtype)
    return Samples(
        prompt_BP=prompt_BP,
        prompt_mask_BP=prompt_mask_BP,
        texts=texts,
        reward_N=reward_N,
        failures=dict(zip(failures, counts.tolist())),
        episodes=episodes,
        **host,
    )


def score_completed(
    tokenizer, scorer, completed: Sequence, problems: Sequence, cfg, episodes=None
) -> Samples:
    """`Samples` of requests the generator engine completed (`generator.Completed`), in the order
    given; `problems[i]` is request i's problem. Prompts are left-padded to the bucket of the
    longest, as the static sampler pads a batch.

    Multi-turn episodes (`episodes[i]`: request i's `envs.episodes.Episode.stats`, or None
    for single-turn ones): the verifier reads the policy's tokens only, and the reward an
    episode's end fixes (the environment's; 0 for a failed end) replaces the verifier's."""
    longest = max(len(c.request.prompt) for c in completed)
    P = cfg.bucket(longest)
    prompt_BP = np.full((len(completed), P), cfg.pad_id, np.int32)
    prompt_mask_BP = np.zeros((len(completed), P), bool)
    for i, c in enumerate(completed):
        prompt_BP[i, P - len(c.request.prompt) :] = c.request.prompt
        prompt_mask_BP[i, P - len(c.request.prompt) :] = True

    def cat(field):
        return np.concatenate([getattr(c, field) for c in completed])

    host = {
        "tokens_NM": cat("tokens_GM"),
        "mask_NM": cat("mask_GM"),
        "logprobs_NM": cat("logprobs_GM"),
        "forced_NM": cat("forced_GM"),
        "lengths_N": cat("lengths_G"),
        "truncated_N": cat("truncated_G"),
        "interrupted_N": cat("interrupted_G"),
        "versions_NM": cat("versions_GM"),
        "env_NM": cat("env_GM"),
    }
    if completed[0].experts_GLlc is not None:  # Each prompt left-padded to P, as `prompt_BP`.
        L = P + cfg.max_new_tokens
        pad = [((0, 0), (L - c.experts_GLlc.shape[1], 0), (0, 0), (0, 0)) for c in completed]
        host["experts_NLlc"] = np.concatenate(
            [np.pad(c.experts_GLlc, w) for c, w in zip(completed, pad)]
        )
    G = completed[0].tokens_GM.shape[0]
    rows = [p for p in problems for _ in range(G)]
    per_row = None if episodes is None else concat_episodes(episodes)
    return _score(tokenizer, scorer, host, rows, prompt_BP, prompt_mask_BP, per_row)


def sample_and_score(
    sampler: Sampler,
    params,
    tokenizer,
    problems: Sequence,
    rng,
    cfg: SamplingConfig,
    scorer: Scorer,
    chunk: int | None = None,
) -> Samples:
    """Samples `cfg.num_samples` completions per problem and scores them.

    Prompts go to the sampler `chunk` at a time (all at once by default; chunk i > 0 samples
    with the key folded with i); a chunk the mesh's batch axes do not divide is topped up
    with repeats of its first prompt, whose rows are dropped. Every process decodes every row
    but scores only its share (`sharding.process_share`); the rewards are then gathered.
    """
    div = 1
    if sampler.layout is not None:
        div = sharding.batch_divisor(sampler.layout.mesh, sampler.layout.rules)
    chunk = max(div, (chunk or len(problems)) // div * div)
    parts = []
    for call, start in enumerate(range(0, len(problems), chunk)):
        real = list(problems[start : start + chunk])
        padded = real + [real[0]] * (-len(real) % div)
        out = sampler(
            params,
            encode_prompts(tokenizer, padded),
            jax.random.fold_in(rng, call) if call else rng,
            cfg,
        )
        N = len(real) * cfg.num_samples  # Rows are prompt-major: the padding rows come last.
        host = sharding.fetch(
            {
                "tokens_NM": out.tokens,
                "mask_NM": out.mask,
                "logprobs_NM": out.logprobs,
                "forced_NM": out.forced,
                "lengths_N": out.lengths,
                "truncated_N": out.truncated,
                "interrupted_N": out.interrupted,
            }
        )
        host = {k: v[:N] for k, v in host.items()}
        rows = [real[i] for i in out.prompt_index[:N]]
        prompt = (out.prompt_BP[: len(real)], out.prompt_mask_BP[: len(real)])
        parts.append(_score(tokenizer, scorer, host, rows, *prompt))
    return concat(parts, cfg.pad_id)
