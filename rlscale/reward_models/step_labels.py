"""Monte-Carlo step labels: a completion split into steps, each step's prefix labelled by
the share of the policy's continuations that reach a correct answer, and the labels files the
labelling writes and PRM training reads.

Steps. A completion is split into steps at a delimiter (`split_steps`): step j ends right
after the j-th occurrence of the delimiter, the text after the last one is the final step,
and a piece with nothing but whitespace and delimiters joins the step before it. The default
is a newline (`DEFAULT_DELIMITER`); the arithmetic task writes one operation per `=`
(`ARITHMETIC_DELIMITER`). A step's last token is found from the completion's ids as the RL
loop holds them (`token_char_ends`). The labels' estimator:
docs/preference_and_reward_models.md.

Dimension letters: N rows, J steps, I step prefixes (every completion's, flattened), A rollouts
per prefix, M completion tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from absl import logging

from rlscale import saved_policy
from rlscale import tokenizers as tokenizer_lib
from rlscale.data import formats
from rlscale.sampling import scoring
from rlscale.sampling.sampler import SamplingConfig

DEFAULT_DELIMITER = "\n"
ARITHMETIC_DELIMITER = "="  # The arithmetic task's steps: one operation per "=".
TASK_DELIMITERS = {"arithmetic": ARITHMETIC_DELIMITER}  # `label`'s default, by config.task.name.
LABEL_FIELDS = ("soft", "hard")  # The labels of a labels file's row, one per step.
_WINDOW = 8  # Tokens of context when measuring what one token adds to the decoded text.


# ==========================================================================================
# Steps.
# ==========================================================================================


class Steps(NamedTuple):
    """A completion's steps: step j is `text[starts[j]:ends[j]]` (together they cover the
    text), and `last_tokens[j]` the index, among the completion's ids, of the token holding
    its last character (None when split without token offsets)."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    last_tokens: tuple[int, ...] | None = None

    @property
    def num_steps(self) -> int:
        return len(self.ends)


def _check_delimiter_text(delimiter) -> None:
    if not isinstance(delimiter, str) or not delimiter:
        raise ValueError(f"step delimiter {delimiter!r} must be a non-empty string")


def split_steps(text: str, delimiter: str, token_ends: Sequence[int] | None = None) -> Steps:
    """The steps of `text`: boundaries right after each (non-overlapping) occurrence of
    `delimiter`; the text after the last occurrence is the final step; a piece with nothing
    but whitespace and delimiters joins the step before it (a leading one, the step after),
    so blank lines and a trailing delimiter make no steps. Text without content has none.

    Args:
      text: the completion's text.
      delimiter: what ends a step (e.g. "\\n", or "=" for the arithmetic task).
      token_ends: optional, for each of the completion's tokens the number of characters of
        `text` its prefix through that token covers (`token_char_ends`; non-decreasing).
        Step j's last token is the first t with token_ends[t] >= ends[j].

    Raises:
      ValueError: On an empty delimiter, or token offsets that do not reach the text's end.
    """
    _check_delimiter_text(delimiter)
    bounds, i = [], text.find(delimiter)
    while i >= 0:
        bounds.append(i + len(delimiter))
        i = text.find(delimiter, i + len(delimiter))
    if not bounds or bounds[-1] != len(text):
        bounds.append(len(text))
    steps, start = [], 0
    for end in bounds:
        if text[start:end].replace(delimiter, "").strip():
            steps.append([start, end])
            start = end
        elif steps:  # Nothing but whitespace and delimiters: part of the previous step.
            steps[-1][1] = end
            start = end
        # A leading piece without content: `start` stays, the next step begins at 0.
    starts = tuple(s for s, _ in steps)
    ends = tuple(e for _, e in steps)
    if token_ends is None:
        return Steps(starts, ends)
    token_ends = np.asarray(token_ends, np.int64)
    if ends and (not len(token_ends) or token_ends[-1] < ends[-1]):
        covered = int(token_ends[-1]) if len(token_ends) else 0
        raise ValueError(
            f"the {len(token_ends)} tokens cover {covered} characters but the text has "
            f"{len(text)}: token offsets of another text?"
        )
    last = np.searchsorted(token_ends, np.asarray(ends, np.int64), side="left")
    return Steps(starts, ends, tuple(int(t) for t in last))


def check_delimiter(texts: Sequence[str], delimiter: str) -> int:
    """Raises ValueError, naming the delimiter, when it occurs in none of `texts` (every
    completion would be one step: the wrong delimiter for this task); logs one warning
    counting the completions without it when only some lack it (each is one step, labelled
    by its outcome alone). Returns that count."""
    _check_delimiter_text(delimiter)
    without = [i for i, t in enumerate(texts) if delimiter not in t]
    if texts and len(without) == len(texts):
        raise ValueError(
            f"step delimiter {delimiter!r} occurs in none of the {len(texts)} completions, "
            f"e.g. {texts[0][:60]!r}; every completion would be one step (the arithmetic "
            f"task's steps end with {ARITHMETIC_DELIMITER!r}, written solutions' with "
            f"{DEFAULT_DELIMITER!r})"
        )
    if without:
        logging.warning(
            "%d of %d completions have no step delimiter %r (each is one step), e.g. %s",
            len(without),
            len(texts),
            delimiter,
            ", ".join(str(i) for i in without[:5]),
        )
    return len(without)


def _stable_length(text: str) -> int:
    """Characters of a decoded prefix that are final: a trailing U+FFFD is a character whose
    bytes the next tokens complete (byte-level and byte-fallback decoders write one)."""
    return len(text.rstrip("\ufffd"))


def token_char_ends(tokenizer: tokenizer_lib.Tokenizer, ids: Sequence[int]) -> np.ndarray:
    """ends [T]: how many characters of the completion's text (its ids decoded, EOS ids
    dropped, as `scoring.completions_text`) its tokens 0..t complete: the length of the
    longest common prefix of decode(ids[:t + 1]) and the text. A character split over several
    tokens (UTF-8 bytes) belongs to the token that completes it; an EOS covers nothing.

    Measured with `_WINDOW` tokens of context, what token t adds is
    stable(decode(ids[t-W:t+1])) - stable(decode(ids[t-W:t])) (`_stable_length`), so a
    decoder that drops its first token's leading space counts each character once: O(T W)
    decoding. When those increments do not sum to the text's length, the exact common
    prefixes are used instead (O(T^2))."""
    ids = [int(i) for i in ids]
    eos = tokenizer.eos_id
    kept = [t for t, i in enumerate(ids) if i != eos]
    body = [ids[t] for t in kept]
    decode = tokenizer.decode
    text = decode(body)
    added = [
        _stable_length(decode(body[max(0, t - _WINDOW) : t + 1]))
        - _stable_length(decode(body[max(0, t - _WINDOW) : t]))
        for t in range(len(body))
    ]
    ends_kept = np.cumsum(np.asarray(added, np.int64))
    if len(body) and (ends_kept[-1] != len(text) or min(added) < 0):
        ends_kept = np.array(
            [len(os.path.commonprefix([decode(body[: t + 1]), text])) for t in range(len(body))],
            np.int64,
        )
    ends = np.zeros(len(ids), np.int64)
    ends[kept] = ends_kept
    return np.maximum.accumulate(ends) if len(ids) else ends


def completion_steps(
    tokenizer: tokenizer_lib.Tokenizer, completion_ids: Sequence[int], delimiter: str
) -> Steps:
    """The steps of a completion given as ids: split on its decoded text, with each step's
    last token (an index into `completion_ids`)."""
    eos = tokenizer.eos_id
    text = tokenizer.decode([int(i) for i in completion_ids if int(i) != eos])
    return split_steps(text, delimiter, token_char_ends(tokenizer, completion_ids))


# ==========================================================================================
# Monte-Carlo step labels.
# ==========================================================================================


class StepPrefix(NamedTuple):
    """A problem continued from a prefix of a completion: what `sample_and_score` samples
    (`prompt` is the problem's prompt followed by the prefix) and what the verifier scores
    (the prefix followed by the continuation, against `problem`)."""

    prompt: str
    problem: object
    prefix: str


@dataclasses.dataclass(frozen=True)
class PrefixVerifier:
    """verifier(prefix ++ continuation, problem) of a `StepPrefix`: picklable when the
    verifier is, so it runs in the run's verifier pool."""

    verifier: Callable

    def __call__(self, continuation: str, item: StepPrefix) -> float:
        return self.verifier(item.prefix + continuation, item.problem)


class StepLabels(NamedTuple):
    """One completion's Monte-Carlo labels: `soft` [J] (the fraction of the A continuations
    from each step's prefix that are correct) and `hard` [J] (1 if any is), with its `steps`
    (character offsets)."""

    steps: Steps
    soft: np.ndarray
    hard: np.ndarray


def mc_step_labels(
    sampler,
    params,
    tokenizer: tokenizer_lib.Tokenizer,
    problems: Sequence,
    completions: Sequence[str],
    verifier: Callable,
    *,
    num_rollouts: int,
    cfg: SamplingConfig,
    rng: jax.Array,
    delimiter: str = DEFAULT_DELIMITER,
    pool=None,
    timeout: float | None = None,
    chunk: int | None = None,
) -> list[StepLabels]:
    """Math-Shepherd's Monte-Carlo labels of each step of each completion (module docstring).

    Every prefix but the last (the whole completion) of every completion is continued
    `num_rollouts` (A) times with `sampler` and `params` at `cfg`'s settings, in one
    `scoring.sample_and_score` call (`chunk` prefixes per sampler call, all by default); each
    continuation is scored by `verifier(prefix ++ continuation, problem)`, in `pool` when
    given, and counts as correct when its reward is > 0 (as `scoring.evaluate` counts
    pass@1). The last step's label is `verifier(completion, problem) > 0`.

    Args:
      sampler: a `sampling.Sampler` (or anything with its interface).
      params: the policy's params.
      tokenizer: the policy's tokenizer.
      problems: one problem (with a `.prompt`) per completion.
      completions: the completions' texts.
      verifier: the task's `verify(text, problem) -> reward`.
      num_rollouts: A continuations per prefix.
      cfg: sampling settings; `num_samples` is replaced by A.
      rng: the sampling key.
      delimiter: what ends a step (`split_steps`).
      pool, timeout: a verifier pool and its per-sample deadline (`scoring.Scorer`).
      chunk: prefixes per sampler call.

    Returns:
      One `StepLabels` per completion, in order.

    Raises:
      ValueError: On mismatched lengths, A < 1, or a delimiter that occurs in no completion
        (`check_delimiter`).
    """
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    if num_rollouts < 1:
        raise ValueError(f"num_rollouts={num_rollouts} must be >= 1")
    check_delimiter(completions, delimiter)
    steps = [split_steps(c, delimiter) for c in completions]
    items = [
        StepPrefix(p.prompt + c[:end], p, c[:end])
        for p, c, s in zip(problems, completions, steps)
        for end in s.ends[:-1]
    ]
    outcome, _ = scoring.Scorer(verifier, pool, timeout)(list(completions), list(problems))
    correct_IA = np.zeros((0, num_rollouts), bool)
    if items:
        samples = scoring.sample_and_score(
            sampler,
            params,
            tokenizer,
            items,
            rng,
            dataclasses.replace(cfg, num_samples=num_rollouts),
            scoring.Scorer(PrefixVerifier(verifier), pool, timeout),
            chunk,
        )
        correct_IA = samples.reward_N.reshape(len(items), num_rollouts) > 0
    return _labels(steps, outcome, correct_IA)


def _labels(steps: Sequence[Steps], outcome, correct_IA: np.ndarray) -> list[StepLabels]:
    """Each completion's `StepLabels`: its prefixes' rows of `correct_IA` (completion-major,
    J - 1 rows each) averaged (soft) or any-ed (hard), then its outcome's label."""
    labels, at = [], 0
    for s, r in zip(steps, outcome):
        n = max(s.num_steps - 1, 0)
        c = correct_IA[at : at + n]
        at += n
        final = np.array([float(r > 0)] if s.num_steps else [])
        soft = np.concatenate([c.mean(axis=1), final])
        hard = np.concatenate([c.any(axis=1).astype(np.float64), final])
        labels.append(StepLabels(s, soft, hard))
    return labels


class StepExample(NamedTuple):
    """A training row: a prompt, a completion and one label per step of the completion
    (`StepLabels.soft` or `.hard`)."""

    prompt: str
    completion: str
    labels: Sequence[float]


def label_policy(
    config,
    checkpoint_dir: str,
    *,
    split: str = "train",
    n: int = 64,
    k: int = 4,
    rollouts: int = 4,
    delimiter: str | None = None,
    seed: int = 0,
    tokenizer_path: str | None = None,
    workdir: str | None = None,
    batch: int = 32,
) -> list[dict]:
    """Monte-Carlo step labels of a policy's own completions (the `label` command).

    Loads the checkpoint, its tokenizer and the config's task as `rlscale.main.evaluate` does,
    samples `k` completions for each of the first `n` problems of `split` with the config's
    sampling settings, scores them with the task's verifier, and labels every step of every
    completion with `rollouts` continuations of its prefix (`mc_step_labels`), `batch`
    prompts per sampler call. The completions and the continuations are sampled with two keys
    split from `seed`.

    Args:
      config: an RL config's task, mesh, sampling and reward pool (`saved_policy.resolve`).
      checkpoint_dir: a params checkpoint (`checkpoint.save_params`), e.g. a run's
        WORKDIR/final.
      delimiter: what ends a step; default `TASK_DELIMITERS[config.task.name]`, else
        `DEFAULT_DELIMITER`.
      tokenizer_path, workdir: as `rlscale.main.evaluate` (default: the run's tokenizer, the
        checkpoint's parent directory).

    Returns:
      One row per completion, problem-major: `problem` (its index in the split), `sample`
      (0..k-1), `prompt`, `completion`, `delimiter`, `step_ends`, `soft`, `hard` (one per step:
      `StepLabels`) and `outcome` (the verifier's reward; the last step's labels are
      `outcome > 0`).

    Raises:
      ValueError: On n, k, rollouts or batch < 1, an empty delimiter, an empty split, a
        delimiter that occurs in no completion (`check_delimiter`, naming it), or as
        `saved_policy.load_policy` and `saved_policy.load_problems`.
    """
    delimiter = _label_delimiter(config.task.name, delimiter, n, k, rollouts, batch)
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    workdir = os.path.abspath(workdir or os.path.dirname(checkpoint_dir))
    policy = saved_policy.load_policy(config.mesh, checkpoint_dir, workdir, tokenizer_path)
    task, problems = saved_policy.load_problems(config.task, workdir, split, n)
    if not problems:
        raise ValueError(f"--split={split!r} has no problems")
    cfg = saved_policy.sampling_config(config.sampling, config.task, policy.tokenizer, k)
    sample_key, rollout_key = jax.random.split(jax.random.key(seed))
    timeout = config.reward.timeout
    with saved_policy.verifier_pool(config.reward, task.verify, PrefixVerifier) as pool:
        samples = scoring.sample_and_score(
            policy.sampler,
            policy.params,
            policy.tokenizer,
            problems,
            sample_key,
            cfg,
            scoring.Scorer(task.verify, pool, timeout),
            chunk=batch,
        )
        labels = mc_step_labels(
            policy.sampler,
            policy.params,
            policy.tokenizer,
            [p for p in problems for _ in range(k)],  # Rows are problem-major.
            samples.texts,
            task.verify,
            num_rollouts=rollouts,
            cfg=cfg,
            rng=rollout_key,
            delimiter=delimiter,
            pool=pool,
            timeout=timeout,
            chunk=batch,
        )
    return _label_rows(problems, k, delimiter, samples, labels)


def _label_delimiter(
    task_name: str, delimiter: str | None, n: int, k: int, rollouts: int, batch: int
) -> str:
    """`label_policy`'s delimiter (its default filled in for the task `task_name`), once its
    counts and the delimiter are checked."""
    if min(n, k, rollouts, batch) < 1:
        raise ValueError(
            f"--n={n}, --k={k}, --rollouts={rollouts} and --batch={batch} must be >= 1"
        )
    if delimiter is None:
        delimiter = TASK_DELIMITERS.get(task_name, DEFAULT_DELIMITER)
    _check_delimiter_text(delimiter)
    return delimiter


def _label_rows(
    problems, k: int, delimiter: str, samples: scoring.Samples, labels: Sequence[StepLabels]
) -> list[dict]:
    """`label_policy`'s rows: one per sampled completion, problem-major."""
    return [
        {
            "problem": i // k,
            "sample": i % k,
            "prompt": problems[i // k].prompt,
            "completion": text,
            "delimiter": delimiter,
            "step_ends": list(lab.steps.ends),
            "soft": lab.soft.tolist(),
            "hard": lab.hard.tolist(),
            "outcome": float(reward),
        }
        for i, (text, lab, reward) in enumerate(zip(samples.texts, labels, samples.reward_N))
    ]


def label_summary(rows: Sequence[dict]) -> dict:
    """What `label` prints: completions, problems, steps, the mean soft label over all steps,
    the fraction of completions the verifier passes, and the share of completions holding
    the delimiter at all (the others are one step each)."""
    soft = [x for r in rows for x in r["soft"]]
    delimiter = rows[0]["delimiter"]
    return {
        "completions": len(rows),
        "problems": len({r["problem"] for r in rows}),
        "steps": len(soft),
        "mean_soft_label": float(np.mean(soft)) if soft else float("nan"),
        "correct_frac": float(np.mean([r["outcome"] > 0 for r in rows])),
        "delimiter": delimiter,
        "delimiter_coverage": float(np.mean([delimiter in r["completion"] for r in rows])),
    }


def write_labels(path: str, rows: Sequence[dict]) -> None:
    """Writes `rows` as JSON lines, whole or not at all (a temporary file renamed)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _row_problems(record, label: str, delimiter: str) -> list[str]:
    """What is wrong with one row of a labels file (`read_labels`), field by field."""
    if isinstance(record, ValueError):  # A line that is not JSON (`formats.records`).
        return [str(record)]
    if not isinstance(record, dict):
        return [f"a row must be a JSON object, got {formats.kind(record)}"]
    problems = [f"has no {f!r}" for f in ("prompt", "completion", label) if f not in record]
    problems += [
        f"{f!r} must be a string, got {formats.kind(record[f])}"
        for f in ("prompt", "completion")
        if f in record and not isinstance(record[f], str)
    ]
    d = record.get("delimiter", delimiter)
    if not isinstance(d, str) or not d:
        problems.append(f"'delimiter' must be a non-empty string, got {d!r}")
    if problems:
        return problems
    labels = record[label]
    if not isinstance(labels, list) or not all(map(_is_number, labels)):
        return [f"{label!r} must be a list of numbers, got {str(labels)[:60]}"]
    outside = [x for x in labels if not 0 <= x <= 1]  # NaN included.
    if outside:
        problems.append(f"{label!r} has labels outside [0, 1]: {outside[:3]}")
    ends = list(split_steps(record["completion"], delimiter).ends)
    if len(labels) != len(ends):
        problems.append(
            f"{label!r} has {len(labels)} labels but the completion has {len(ends)} steps "
            f"at {delimiter!r}"
        )
    if "step_ends" in record and record["step_ends"] != ends:
        problems.append(
            f"'step_ends' {str(record['step_ends'])[:60]} are not the completion's steps at "
            f"{delimiter!r}, which end at {ends}"
        )
    return problems


def read_labels(
    path: str, *, label: str = "soft", delimiter: str | None = None
) -> tuple[list[StepExample], str]:
    """(examples, delimiter): the labelled completions of a labels file, in file order, and
    the delimiter their steps end with.

    A row (`label`'s, or any file `formats.records` reads: `.jsonl`, `.json`, `.parquet`)
    needs the string fields `prompt` and `completion` and the `label` field ("soft" or
    "hard"): a list of one number in [0, 1] per step of the completion; `step_ends`, when
    present, must be the steps' ends. The delimiter is `delimiter`, else the rows' `delimiter`
    field, else `DEFAULT_DELIMITER`.

    Raises:
      FileNotFoundError: If `path` does not exist.
      ValueError: On an unknown `label`, an empty file, rows whose delimiters differ (from
        each other or from `delimiter`), or malformed rows: all at once (the first ten
        named), each by file, line and field.
    """
    if label not in LABEL_FIELDS:
        raise ValueError(f"--label={label!r} is not one of {', '.join(LABEL_FIELDS)}")
    if delimiter is not None:
        _check_delimiter_text(delimiter)
    if not os.path.exists(path):
        raise FileNotFoundError(f"labels file not found: {path!r}")
    problem = formats.check_path(path)
    if problem:
        raise ValueError(f"{path}: {problem}")
    rows = list(formats.records(path))
    if not rows:
        raise ValueError(f"{path}: no rows (an empty file)")
    found = {}  # The rows' delimiters, each with the first row that has it.
    for where, _, r in rows:
        d = r.get("delimiter") if isinstance(r, dict) else None
        if isinstance(d, str) and d:
            found.setdefault(d, where)
    listed = ", ".join(f"{d!r} ({where})" for d, where in found.items())
    if delimiter is not None and set(found) - {delimiter}:
        raise ValueError(
            f"{path}: the rows were labelled at the step delimiter {listed}, not at "
            f"--delimiter={delimiter!r}"
        )
    if len(found) > 1:
        raise ValueError(f"{path}: the rows have different step delimiters: {listed}")
    delimiter = delimiter or next(iter(found), DEFAULT_DELIMITER)
    examples, errors = [], []
    for where, _, record in rows:
        wrong = _row_problems(record, label, delimiter)
        if wrong:
            errors.append(f"{path}, {where}: {'; '.join(wrong)}")
        else:
            labels = [float(x) for x in record[label]]
            examples.append(StepExample(record["prompt"], record["completion"], labels))
    if errors:
        raise ValueError(formats.malformed_rows(path, errors))
    return examples, delimiter


def split_heldout(
    examples: Sequence[StepExample], frac: float, seed: int
) -> tuple[list[StepExample], list[StepExample]]:
    """(train, heldout): a random `frac` of the distinct prompts (rounded; at least one and
    all but one at most, when frac > 0) held out with all their completions, so that no
    held-out prompt is trained on.

    Raises:
      ValueError: Naming `--heldout_frac` when it is outside [0, 1), or > 0 with fewer than
        two prompts.
    """
    if not 0 <= frac < 1:
        raise ValueError(f"--heldout_frac={frac} must be in [0, 1)")
    if frac == 0:
        return list(examples), []
    prompts = list(dict.fromkeys(e.prompt for e in examples))
    if len(prompts) < 2:
        raise ValueError(
            f"--heldout_frac={frac}: the labels have {len(prompts)} prompt, none to hold out; "
            "pass --heldout FILE or --heldout_frac 0"
        )
    n = min(max(round(frac * len(prompts)), 1), len(prompts) - 1)
    chosen = np.random.default_rng(seed).choice(len(prompts), n, replace=False)
    held = {prompts[i] for i in chosen}
    return [e for e in examples if e.prompt not in held], [e for e in examples if e.prompt in held]
