"""Step search: beam search over a policy's reasoning steps guided by a process reward model, with
its accuracy and the tokens it sampled, for comparison with best-of-N. See docs/evaluation.md.

Dimension letters: B problems, N candidate rows of a round (entries x E).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from rlscale import tokenizers as tokenizer_lib
from rlscale.reward_models import prm as prm_lib
from rlscale.reward_models import step_labels
from rlscale.sampling import scoring
from rlscale.sampling.sampler import SamplingConfig

DEFAULT_AGGREGATION = "last"  # Snell et al. 2024 rank beam prefixes by the last step's value.
FLAG = "--step_search"


class Entry(NamedTuple):
    """A partial or finished solution: its sampled ids (the EOS kept where sampling stopped
    there), their text (EOS dropped, as `scoring.completions_text`), whether it is finished,
    and its PRM score v (NaN before it is scored)."""

    ids: tuple[int, ...]
    text: str
    finished: bool
    score: float


class Result(NamedTuple):
    """What `beam_search` found, one value per problem (`_B`) in order.

    Attributes:
      accuracy: the share of problems whose answer the verifier rewards (> 0).
      rewards_B: the verifier's reward of each answer.
      texts: each answer's text.
      generated_tokens_B: tokens sampled for each problem's candidates, all rounds.
      prefill_tokens_B: prompt and prefix tokens prefilled for each problem, all rounds.
      scores_B: each answer's PRM score v.
      finished_B: whether the answer is a finished solution.
      rounds: rounds run.
      failures: the verifier's failures by kind (`rewards.isolation`).
    """

    accuracy: float
    rewards_B: np.ndarray
    texts: list[str]
    generated_tokens_B: np.ndarray
    prefill_tokens_B: np.ndarray
    scores_B: np.ndarray
    finished_B: np.ndarray
    rounds: int
    failures: dict


def parse_beam(value, flag: str = FLAG) -> tuple[int, int]:
    """(beam W, expansions E) of `--step_search W,E` ("4,4", or the two values as a sequence).

    Raises:
      ValueError: Naming `flag` unless it is two integers >= 1.
    """
    parts = value.split(",") if isinstance(value, str) else list(value)
    raw = ",".join(str(p) for p in parts)
    try:
        beam, expand = (int(str(p).strip()) for p in parts)
    except ValueError:  # Not two values, or not integers.
        beam = expand = 0
    if min(beam, expand) < 1:
        raise ValueError(
            f"{flag}={raw}: expected BEAM,EXPAND, two integers >= 1 (e.g. 4,4: keep 4 partial "
            "solutions per problem, continue each 4 ways per step)"
        )
    return beam, expand


def step_stop_tokens(tokenizer: tokenizer_lib.Tokenizer, delimiter: str) -> tuple[int, ...]:
    """The ids that end a step: every token whose text (decoded alone) ends with `delimiter`,
    in id order (for "\\n" a byte-level BPE has many: ".\\n", "\\n\\n", ...). One pass over
    the vocabulary.

    Raises:
      ValueError: Naming the delimiter when no token's text is exactly it (a sampler stops
        at a token, so a delimiter of several tokens cannot end a step).
    """
    if not isinstance(delimiter, str) or not delimiter:
        raise ValueError(f"step delimiter {delimiter!r} must be a non-empty string")
    texts = {i: tokenizer.decode([i]) for i in range(tokenizer.vocab_size)}
    if delimiter not in texts.values():
        ids = tokenizer.encode(delimiter)
        raise ValueError(
            f"step delimiter {delimiter!r} is not one token of the tokenizer (it encodes to "
            f"{len(ids)} tokens {ids[:8]}): step search stops sampling a step at a token, so "
            f"the PRM's steps must end with one (the arithmetic task's "
            f"{step_labels.ARITHMETIC_DELIMITER!r}, or a newline)"
        )
    return tuple(i for i, t in texts.items() if t.endswith(delimiter))


def step_config(cfg: SamplingConfig, stop_ids: Sequence[int], expand: int) -> SamplingConfig:
    """`cfg` sampling one step per row: E samples per prompt, stopping also at `stop_ids`.

    Raises:
      ValueError: Naming `think_budget` when forced interruption is on: it counts one
        call's tokens, not the solution's.
    """
    if cfg.think_budget:
        raise ValueError(
            f"sampling.think_budget={cfg.think_budget}: forced interruption counts the tokens "
            "of one sampler call, not of a solution sampled step by step; set it to 0 for "
            "step search"
        )
    extra = tuple(i for i in stop_ids if i not in cfg.stop_tokens)
    return dataclasses.replace(cfg, num_samples=expand, stop_tokens=(*cfg.stop_tokens, *extra))


def _unverified(text: str, problem) -> float:
    """The rounds' scorer: a partial solution is not verified (only the answer is)."""
    del text, problem
    return 0.0


def _best(candidates: list[Entry], beam: int) -> list[Entry]:
    """The `beam` entries of highest score, ties in candidate order (NaN ranks last)."""
    key = [-(e.score if not math.isnan(e.score) else -math.inf) for e in candidates]
    order = sorted(range(len(candidates)), key=key.__getitem__)
    return [candidates[i] for i in order[:beam]]


def beam_search(
    sampler,
    params,
    tokenizer: tokenizer_lib.Tokenizer,
    problems: Sequence,
    verifier: Callable,
    prm: prm_lib.ProcessRewardModel,
    *,
    beam: int,
    expand: int,
    cfg: SamplingConfig,
    rng: jax.Array,
    aggregation: str = DEFAULT_AGGREGATION,
    max_steps: int | None = None,
    pool=None,
    timeout: float | None = None,
    chunk: int | None = None,
) -> Result:
    """PRM-guided beam search over steps (module docstring) for every problem at once.

    Args:
      sampler: a `sampling.Sampler` (or anything with its interface).
      params: the policy's params.
      tokenizer: the policy's tokenizer (the PRM's too: the caller checks,
        `evaluate.load_scoring_model`).
      problems: the problems (each with a `.prompt`).
      verifier: the task's `verify(text, problem) -> reward`, applied to the answers.
      prm: the process reward model; its `config.delimiter` ends a step.
      beam: W, entries kept per problem.
      expand: E, continuations of each unfinished entry per round.
      cfg: sampling settings: temperature, top-k/p, the stop tokens that finish a solution,
        and `max_new_tokens`, the budget of one solution (and of one step); `num_samples` is
        replaced by E.
      rng: the sampling key; round r samples with fold_in(rng, r).
      aggregation: how a prefix's step probabilities make its score: "last", "min" or
        "product" (`prm_lib.AGGREGATIONS`).
      max_steps: rounds at most; default `cfg.max_new_tokens`, after which every entry is
        finished (each round adds at least one token to each unfinished one).
      pool, timeout: the verifier pool and its per-sample deadline (`scoring.Scorer`).
      chunk: prompts per sampler call (default, or when more: all B W entries, one call
        per round).

    Returns:
      A `Result`.

    Raises:
      ValueError: On no problems, W, E, max_steps or chunk < 1, an unknown aggregation, a
        delimiter that is not one token (`step_stop_tokens`) or forced interruption on
        (`step_config`).
    """
    _check_search(problems, beam, expand, max_steps, chunk, aggregation)
    step_cfg = step_config(cfg, step_stop_tokens(tokenizer, prm.config.delimiter), expand)
    rounds_max = cfg.max_new_tokens if max_steps is None else max_steps
    prompt_ids, B = scoring.encode_prompts(tokenizer, problems), len(problems)
    pad_to = min(chunk or B * beam, B * beam)  # Every round's prompts: a multiple of it.
    beams = [[Entry((), "", False, math.nan)] * beam for _ in range(B)]  # Round 0: W copies.
    generated_B, prefill_B = np.zeros(B, np.int64), np.zeros(B, np.int64)
    rounds = 0
    while rounds < rounds_max:
        live = [(b, e) for b in range(B) for e in beams[b] if not e.finished]
        if not live:
            break
        samples = scoring.sample_and_score(
            sampler,
            params,
            tokenizer,
            _step_prefixes(problems, live, pad_to),
            jax.random.fold_in(rng, rounds),
            step_cfg,
            scoring.Scorer(_unverified),
            chunk,
        )
        rounds += 1
        new = _continuations(tokenizer, cfg, live, samples, expand, generated_B, prefill_B)
        beams = _keep(beams, new, _prefix_scores(prm, prompt_ids, new, aggregation), beam)
    return _result(beams, problems, verifier, pool, timeout, generated_B, prefill_B, rounds)


def _check_search(problems, beam, expand, max_steps, chunk, aggregation) -> None:
    """Raises `beam_search`'s ValueErrors about its arguments."""
    if not problems:
        raise ValueError("no problems to search")
    if min(beam, expand) < 1:
        raise ValueError(f"beam={beam} and expand={expand} must be >= 1")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps={max_steps} must be >= 1")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    if aggregation not in prm_lib.AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not one of {tuple(prm_lib.AGGREGATIONS)}")


def _step_prefixes(problems, live, pad_to: int) -> list[step_labels.StepPrefix]:
    """A round's prompts: each live (problem, entry)'s problem followed by the entry's text,
    padded with repeats of the first to a multiple of `pad_to` (static shapes; the padding
    rows are sampled and dropped)."""
    items = [
        step_labels.StepPrefix(problems[b].prompt + e.text, problems[b], e.text) for b, e in live
    ]
    return items + [items[0]] * (-len(items) % pad_to)


def _continuations(
    tokenizer, cfg: SamplingConfig, live, samples: scoring.Samples, expand, generated_B, prefill_B
) -> list[tuple[int, tuple[int, ...], str, bool]]:
    """(problem, ids, text, finished) of each of a round's candidates: each live entry
    followed by each of its E sampled steps, cut at `cfg.max_new_tokens`; finished when the
    step adds nothing, ends at one of `cfg.stop_tokens` or reaches the budget. Adds each
    problem's prefilled and sampled tokens to `prefill_B` and `generated_B`."""
    ends, budget, eos = set(cfg.stop_tokens), cfg.max_new_tokens, tokenizer.eos_id
    new = []
    for i, (b, e) in enumerate(live):
        prefill_B[b] += int(samples.prompt_mask_BP[i].sum())
        for n in range(i * expand, (i + 1) * expand):
            sampled = samples.tokens_NM[n, : samples.lengths_N[n]].tolist()
            generated_B[b] += len(sampled)
            ids = e.ids + tuple(sampled[: budget - len(e.ids)])
            finished = len(ids) == len(e.ids) or ids[-1] in ends or len(ids) >= budget
            text = tokenizer.decode([t for t in ids if t != eos])
            new.append((b, ids, text, finished))
    return new


def _prefix_scores(prm: prm_lib.ProcessRewardModel, prompt_ids, new, aggregation: str):
    """The PRM's score v of each candidate (`prm_lib.prm_scores`), in one bucket that holds
    the longest problem and candidate."""
    rows = [list(ids) for _, ids, _, _ in new]
    longest = max(len(prompt_ids[b]) + len(ids) for b, ids, _, _ in new)
    return prm_lib.prm_scores(
        prm.with_bucket(longest), [prompt_ids[b] for b, *_ in new], rows, aggregation
    )


def _keep(beams: list[list[Entry]], new, scores, beam: int) -> list[list[Entry]]:
    """Each problem's next beam: the W best of its candidates and its finished entries."""
    candidates = [[e for e in entries if e.finished] for entries in beams]
    for (b, ids, text, finished), v in zip(new, scores):
        candidates[b].append(Entry(ids, text, finished, float(v)))
    return [_best(c, beam) for c in candidates]


def _result(
    beams, problems, verifier, pool, timeout, generated_B, prefill_B, rounds: int
) -> Result:
    """The search's `Result`: each problem's answer (its best finished entry, else its best
    one) scored by the verifier."""
    answers = [next((e for e in entries if e.finished), entries[0]) for entries in beams]
    texts = [e.text for e in answers]
    rewards, failures = scoring.Scorer(verifier, pool, timeout)(texts, list(problems))
    return Result(
        accuracy=float(np.mean(rewards > 0)),
        rewards_B=np.asarray(rewards, np.float64),
        texts=texts,
        generated_tokens_B=generated_B,
        prefill_tokens_B=prefill_B,
        scores_B=np.array([e.score for e in answers], np.float64),
        finished_B=np.array([e.finished for e in answers], bool),
        rounds=rounds,
        failures=failures,
    )


def summary(result: Result, beam: int, expand: int, aggregation: str) -> dict:
    """The JSON report's `step_search` entry: the settings, accuracy, tokens per problem
    (means), rounds, the share of answers that are finished, verifier failures, and
    `per_problem` rewards, texts, scores and generated tokens."""
    return {
        "name": name(beam, expand, aggregation),
        "beam": beam,
        "expand": expand,
        "aggregation": aggregation,
        "accuracy": result.accuracy,
        "generated_tokens_per_problem": float(result.generated_tokens_B.mean()),
        "prefill_tokens_per_problem": float(result.prefill_tokens_B.mean()),
        "generated_tokens": int(result.generated_tokens_B.sum()),
        "rounds": result.rounds,
        "finished_frac": float(result.finished_B.mean()),
        "verifier_failures": sum(result.failures.values()),
        "per_problem": {
            "rewards": result.rewards_B.tolist(),
            "texts": list(result.texts),
            "scores": result.scores_B.tolist(),
            "generated_tokens": result.generated_tokens_B.tolist(),
        },
    }


def name(beam: int, expand: int, aggregation: str) -> str:
    """How reports name a search: `step_search(beam=4, expand=4, prm_last)`."""
    return f"step_search(beam={beam}, expand={expand}, prm_{aggregation})"


def best_of_tokens(lengths_N, k: int, ns: Sequence[int]) -> list[float]:
    """Tokens best-of-N samples per problem, for each N: N x the mean length of the k samples
    per problem (`lengths_N`, the EOS included, as `generated_tokens_B` counts it)."""
    mean = float(np.asarray(lengths_N).reshape(-1, k).sum(1).mean()) / k
    return [n * mean for n in ns]


def table(s: dict) -> str:
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
