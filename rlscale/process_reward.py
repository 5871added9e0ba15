"""Process rewards: Monte-Carlo step labels, a process reward model (PRM) on the decoder, and
PRM-weighted best-of-N.

    python -m rlscale.process_reward label --config configs/quickstart.py \\
        --checkpoint WORKDIR/final --out labels.jsonl [--split train --n 64 --k 4 \\
        --rollouts 4 --delimiter STR --seed 0]
    python -m rlscale.process_reward train --labels labels.jsonl --out PRM_DIR \\
        [--init WORKDIR/final | --model tiny --tokenizer PATH] \\
        [--heldout FILE | --heldout_frac 0.1] [--label soft --steps N --lr LR]

and `python -m rlscale.evaluate ... --best_of 1,2,4,8,16 --scorer prm --prm PRM_DIR` ranks a
policy's samples with the PRM.

`label` loads the policy, its tokenizer and the config's task as `rlscale.evaluate` does
(`evaluate.load_policy`, `evaluate.load_problems`; `--config.a.b=value` overrides a field),
samples `--k` completions for each of the first `--n` problems of the split with the config's
sampling settings, labels their steps with `--rollouts` continuations per prefix
(`mc_step_labels`) and writes one JSON row per completion (`label_policy`): `problem` (its
index in the split), `sample`, `prompt`, `completion`, `delimiter`, `step_ends` (each step's
end, a character offset), `soft`, `hard` (one label per step) and `outcome` (the verifier's
reward). The delimiter defaults to the task's (`TASK_DELIMITERS`), else a newline. `train`
reads such rows (`read_labels`: `prompt`, `completion` and the `--label` field are required),
holds out `--heldout_frac` of the prompts unless given `--heldout` rows (`split_heldout`),
trains (`train`) and saves (`save`) a PRM, and prints its held-out step accuracy. The
tokenizer defaults to the policy's (`evaluate.default_tokenizer_path` of `--init`).

Steps. A completion is split into steps at a delimiter (`split_steps`): step j ends right
after the j-th occurrence of the delimiter, the text after the last one is the final step,
and a piece with nothing but whitespace and delimiters joins the step before it. The default
is a newline (`DEFAULT_DELIMITER`), the usual step of written solutions (Lightman et al.
2023; Wang et al. 2024). The arithmetic task writes its working on one line,
"7+15-2=22-2=20 Answer: 20", one operation per `=`: there `ARITHMETIC_DELIMITER = "="` gives
one step per operation ("7+15-2=", "22-2=", "20 Answer: 20"), where "\\n" would make every
completion a single step.

Monte-Carlo labels (Math-Shepherd: Wang et al. 2024, arXiv 2312.08935; OmegaPRM: Luo et al.
2024, arXiv 2406.06592). The label of step j of completion y of problem x estimates the value
of its prefix under the policy pi, the probability that a continuation reaches a correct
answer:

    v_j = P_{c ~ pi(. | x, y_<=j)} [verify(y_<=j ++ c) is correct],
    soft_j = (1 / K) sum_k 1[verify(y_<=j ++ c_k) > 0],    hard_j = max_k 1[...],

with K continuations c_k sampled from the prompt followed by the prefix's text
(`mc_step_labels`: one `scoring.sample_and_score` call for all prefixes). The final step's
prefix is the whole completion, so its label is the completion's own verdict (K identical
rollouts), not sampled.

The PRM (Lightman et al. 2023, "Let's Verify Step by Step", arXiv 2305.20050; Wang et al.
2024) is the reward model's decoder and scalar head (`reward_model`: the same params
`{"decoder", "head"}`, init, optimizer, save/load and tokenizer check), read at the last
token of every step instead of the sequence's last token:

    s_j = w . h(x ++ y)[t_j] + b,    p_j = sigmoid(s_j) ~ v_j,

t_j the position of the token holding step j's last character, fitted to the soft labels by
binary cross-entropy,

    loss = -sum_j [soft_j log sigmoid(s_j) + (1 - soft_j) log sigmoid(-s_j)] / #steps,
    d loss_j / d s_j = sigmoid(s_j) - soft_j.

Best-of-N with a PRM ranks a completion by an aggregate of its step probabilities: `prm_min`
(the weakest step; Wang et al. 2024), `prm_product` (the probability that every step is
right; Lightman et al. 2023) or `prm_last` (the value of the whole completion): `prm_scores`.

Dense rewards for RL: `ProcessRewardModel.step_rewards` places p_j at each step's last
completion token (the final step's at the completion's last token), the `step_reward` and
`step_mask` terms of `objectives.process_advantages`.

Tokens: a step's last token is found from the completion's ids, as the RL loop holds them:
the text is their decoding (EOS ids dropped, as `scoring.completions_text`), and token t
covers the text up to `token_char_ends(...)[t]` characters.

A saved PRM is a reward-model directory (`reward_model.save`: decoder/, head.npz, the
tokenizer, reward_model.json) plus `process_reward.json` (the `PRMConfig`, the delimiter with
it).

Dimension letters: N rows, T tokens (the bucket), S steps (padded to the longest row, or to
`max_steps` in training), K rollouts per prefix, M completion tokens, D model width.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags, logging
from ml_collections import config_flags

from rlscale import chat, cli, console
from rlscale import model as model_lib
from rlscale import reward_model as rm
from rlscale import tokenizer as tokenizer_lib
from rlscale.data import formats
from rlscale.model import decoder
from rlscale.model.config import ModelConfig
from rlscale.sampling import scoring
from rlscale.sampling.sampler import SamplingConfig

DEFAULT_DELIMITER = "\n"
ARITHMETIC_DELIMITER = "="  # The arithmetic task's steps: one operation per "=".
TASK_DELIMITERS = {"arithmetic": ARITHMETIC_DELIMITER}  # `label`'s default, by config.task.name.
LABEL_FIELDS = ("soft", "hard")  # The labels of a labels file's row, one per step.
FORMAT = 1  # Version of process_reward.json's layout.
META_FILE = "process_reward.json"
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
    """One completion's Monte-Carlo labels: `soft` [S] (the fraction of the K continuations
    from each step's prefix that are correct) and `hard` [S] (1 if any is), with its `steps`
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
    `num_rollouts` (K) times with `sampler` and `params` at `cfg`'s settings, in one
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
      num_rollouts: K continuations per prefix.
      cfg: sampling settings; `num_samples` is replaced by K.
      rng: the sampling key.
      delimiter: what ends a step (`split_steps`).
      pool, timeout: a verifier pool and its per-sample deadline (`scoring.Scorer`).
      chunk: prefixes per sampler call.

    Returns:
      One `StepLabels` per completion, in order.

    Raises:
      ValueError: On mismatched lengths, K < 1, or a delimiter that occurs in no completion
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
    correct_IK = np.zeros((0, num_rollouts), bool)
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
        correct_IK = samples.reward_N.reshape(len(items), num_rollouts) > 0
    labels, at = [], 0
    for s, r in zip(steps, outcome):
        n = max(s.num_steps - 1, 0)
        c = correct_IK[at : at + n]
        at += n
        final = np.array([float(r > 0)] if s.num_steps else [])
        soft = np.concatenate([c.mean(axis=1), final])
        hard = np.concatenate([c.any(axis=1).astype(np.float64), final])
        labels.append(StepLabels(s, soft, hard))
    return labels


# ==========================================================================================
# The PRM: config, pure functions, the train step.
# ==========================================================================================


@dataclasses.dataclass(frozen=True)
class PRMConfig(rm.TrainSettings):
    """PRM training and scoring settings (`reward_model.TrainSettings`: the bucket, remat and
    AdamW, each sequence being prompt + completion ids); static (hashable) for `train_step`.

    Attributes:
      delimiter: what ends a step; saved with the model, so scoring splits as training did.
      batch_rows: completions per training step.
      eval_batch_rows: completions per scoring call.
      max_steps: training rows are padded to this many steps (rows with more are dropped).
    """

    KIND: ClassVar[str] = "process reward model"

    delimiter: str = DEFAULT_DELIMITER
    batch_rows: int = 32
    eval_batch_rows: int = 128
    max_steps: int = 32

    def __post_init__(self):
        problems = []
        if not isinstance(self.delimiter, str) or not self.delimiter:
            problems.append(f"delimiter={self.delimiter!r} must be a non-empty string")
        for name in ("batch_rows", "eval_batch_rows", "max_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        self._raise(problems or self.settings_problems())

    def rm_config(self) -> rm.RMConfig:
        """The `RMConfig` with the same settings and as many rows per step: what
        `reward_model.save` records and `make_optimizer` reads."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(rm.TrainSettings)}
        return rm.RMConfig(
            **shared,
            batch_pairs=max(1, self.batch_rows // 2),
            eval_batch_pairs=max(1, self.eval_batch_rows // 2),
            add_eos=False,
        )


class StepBatch(NamedTuple):
    """Right-padded rows and their steps: ids [N, T], real tokens per row [N], each step's
    last token's position in the row [N, S] (0 where padded), which steps are real [N, S],
    and the labels [N, S] (0 where padded)."""

    tokens_NT: jax.Array
    lengths_N: jax.Array
    positions_NS: jax.Array
    step_mask_NS: jax.Array
    labels_NS: jax.Array


def token_scores(graphdef, params, tokens_NT, lengths_N, remat: str = "none"):
    """s [N, T] in float32: the head on every token's final-norm hidden state (padding after
    `lengths_N` is masked; attention is causal, so it changes no real token's score)."""
    T = tokens_NT.shape[1]
    mask_NT = jnp.arange(T)[None, :] < lengths_N[:, None]
    positions_NT = decoder.positions_from_mask(mask_NT)
    h_NTD, _ = decoder.hidden(
        graphdef, params["decoder"], tokens_NT, positions_NT, mask_NT, remat=remat
    )
    head = params["head"]
    return h_NTD.astype(jnp.float32) @ head["w"] + head["b"]


def step_scores(graphdef, params, tokens_NT, lengths_N, positions_NS, remat: str = "none"):
    """s [N, S]: `token_scores` at each step's last token."""
    s_NT = token_scores(graphdef, params, tokens_NT, lengths_N, remat)
    return jnp.take_along_axis(s_NT, positions_NS, axis=1)


def step_loss(scores_NS, labels_NS, mask_NS):
    """Binary cross-entropy against soft labels, as (sum over real steps, #real steps), so
    accumulation is exact: -[y log sigmoid(s) + (1 - y) log sigmoid(-s)] per step;
    d / d s = sigmoid(s) - y."""
    m = mask_NS.astype(jnp.float32)
    y = labels_NS.astype(jnp.float32)
    bce = -(y * jax.nn.log_sigmoid(scores_NS) + (1.0 - y) * jax.nn.log_sigmoid(-scores_NS))
    return jnp.sum(bce * m), jnp.sum(m)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "cfg"), donate_argnames=("params", "opt_state")
)
def train_step(graphdef, cfg: PRMConfig, params, opt_state, batch: StepBatch):
    """One AdamW step on the mean step loss of a batch. Returns (params, opt_state, metrics):
    `loss`, `accuracy` (the fraction of steps with sigmoid(s) > 0.5 exactly when the label is
    > 0.5) and `grad_norm`, before the update."""
    optimizer = rm.make_optimizer(cfg)

    def loss_fn(p):
        s_NS = step_scores(
            graphdef, p, batch.tokens_NT, batch.lengths_N, batch.positions_NS, cfg.remat
        )
        total, n = step_loss(s_NS, batch.labels_NS, batch.step_mask_NS)
        return total / jnp.maximum(n, 1.0), s_NS

    (loss, s_NS), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    m = batch.step_mask_NS.astype(jnp.float32)
    agree = ((s_NS > 0) == (batch.labels_NS > 0.5)).astype(jnp.float32)
    metrics = {
        "loss": loss,
        "accuracy": jnp.sum(agree * m) / jnp.maximum(jnp.sum(m), 1.0),
        "grad_norm": optax.tree.norm(grads),
    }
    return params, opt_state, metrics


_token_scores = jax.jit(token_scores, static_argnames=("graphdef", "remat"))


def token_scores_of_rows(graphdef, params, tokens_NT, lengths_N, chunk: int = 128) -> np.ndarray:
    """`token_scores` [N, T], jitted, over any number of rows (`reward_model.in_chunks`)."""
    T = np.shape(tokens_NT)[1]
    return rm.in_chunks(_token_scores, graphdef, params, tokens_NT, lengths_N, chunk, (T,))


# ==========================================================================================
# Host side: encoding labelled completions, training.
# ==========================================================================================


class StepExample(NamedTuple):
    """A training row: a prompt, a completion and one label per step of the completion
    (`StepLabels.soft` or `.hard`)."""

    prompt: str
    completion: str
    labels: Sequence[float]


class Encoded(NamedTuple):
    """Labelled rows as host arrays (`StepBatch`'s fields) with each row's `source` index
    among the examples."""

    batch: StepBatch
    sources: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.sources)


def encode_examples(
    examples: Sequence[StepExample], tokenizer: tokenizer_lib.Tokenizer, cfg: PRMConfig
) -> Encoded:
    """Tokenizes labelled completions as the RL loop holds them (`chat.encode_prompt(prompt)`,
    then the completion's ids, no EOS) and finds each step's last token (`completion_steps`
    with `cfg.delimiter`). Rows longer than `cfg.seq_len`, with more than `cfg.max_steps`
    steps or with none are dropped, with one warning counting each kind.

    Raises:
      ValueError: If there are no examples, none is kept, or a row's labels do not match its
        steps (naming the rows).
    """
    if not examples:
        raise ValueError("no labelled completions to encode")
    check_delimiter([e.completion for e in examples], cfg.delimiter)
    prompts = [chat.encode_prompt(tokenizer, e.prompt) for e in examples]
    completions = tokenizer.encode_batch([e.completion for e in examples])
    rows, mismatched = [], []
    dropped = {"without steps": [], "longer than seq_len": [], "with more than max_steps steps": []}
    for i, (e, p, c) in enumerate(zip(examples, prompts, completions)):
        steps = completion_steps(tokenizer, c, cfg.delimiter)
        if steps.num_steps != len(e.labels):
            mismatched.append(f"row {i} ({len(e.labels)} labels, {steps.num_steps} steps)")
        elif not steps.num_steps:
            dropped["without steps"].append(i)
        elif len(p) + len(c) > cfg.seq_len:
            dropped["longer than seq_len"].append(i)
        elif steps.num_steps > cfg.max_steps:
            dropped["with more than max_steps steps"].append(i)
        else:
            rows.append((i, p + c, [len(p) + t for t in steps.last_tokens], e.labels))
    if mismatched:
        raise ValueError(
            f"{len(mismatched)} rows' labels do not match the steps of their completion split "
            f"at {cfg.delimiter!r} (as encoded and decoded): " + ", ".join(mismatched[:5])
        )
    for why, which in dropped.items():
        if which:
            logging.warning(
                "dropped %d of %d labelled completions %s (seq_len=%d, max_steps=%d): rows %s",
                len(which),
                len(examples),
                why,
                cfg.seq_len,
                cfg.max_steps,
                ", ".join(map(str, which[:5])) + (", ..." if len(which) > 5 else ""),
            )
    if not rows:
        raise ValueError(
            f"no labelled completion fits (seq_len={cfg.seq_len}, max_steps={cfg.max_steps})"
        )
    N, S = len(rows), cfg.max_steps
    tokens = np.full((N, cfg.seq_len), max(tokenizer.padding_id, 0), np.int32)
    lengths = np.zeros(N, np.int32)
    positions = np.zeros((N, S), np.int32)
    mask = np.zeros((N, S), bool)
    labels = np.zeros((N, S), np.float32)
    for r, (_, ids, pos, lab) in enumerate(rows):
        tokens[r, : len(ids)], lengths[r] = ids, len(ids)
        positions[r, : len(pos)], mask[r, : len(pos)], labels[r, : len(pos)] = pos, True, lab
    return Encoded(StepBatch(tokens, lengths, positions, mask, labels), [r[0] for r in rows])


def heldout_metrics(graphdef, params, encoded: Encoded, chunk: int = 128) -> tuple[float, float]:
    """(mean step loss, step accuracy) of `encoded` rows (accuracy as in `train_step`)."""
    b = encoded.batch
    s_NT = token_scores_of_rows(graphdef, params, b.tokens_NT, b.lengths_N, chunk)
    s_NS = np.take_along_axis(s_NT, b.positions_NS, axis=1)
    total, n = step_loss(s_NS, b.labels_NS, b.step_mask_NS)
    agree = (s_NS > 0) == (b.labels_NS > 0.5)
    return float(total) / max(float(n), 1.0), float(agree[b.step_mask_NS].mean())


def train(
    examples: Sequence[StepExample],
    tokenizer: tokenizer_lib.Tokenizer,
    cfg: PRMConfig,
    steps: int,
    *,
    model: ModelConfig | str,
    heldout: Sequence[StepExample] = (),
    log: Callable[[rm.Record], None] | None = None,
) -> rm.Trained:
    """Trains a PRM for `steps` steps of `cfg.batch_rows` rows (`train_step`), from a policy
    checkpoint or a `ModelConfig` (`reward_model.init`). Every `cfg.eval_every` steps and at
    the end it appends a `reward_model.Record` (mean training loss since the last one,
    held-out step accuracy) to the history and passes it to `log`.

    Raises:
      ValueError: On steps < 1, a tokenizer the model does not fit (or a checkpoint that
        carries another one), or examples that do not encode (`encode_examples`).
    """
    model_cfg, graphdef, params = rm.start(model, tokenizer, cfg, steps)
    train_set = encode_examples(examples, tokenizer, cfg)
    held = encode_examples(heldout, tokenizer, cfg) if heldout else None
    stream = rm.batch_indices(train_set.num_rows, cfg.batch_rows, cfg.seed)

    def next_batch():
        rows = next(stream)
        return StepBatch(*(x[rows] for x in train_set.batch))

    def heldout_accuracy(params):
        if held is None:
            return None
        return heldout_metrics(graphdef, params, held, cfg.eval_batch_rows)[1]

    params, history = rm.fit(
        train_step, graphdef, cfg, params, next_batch, heldout_accuracy, steps, log
    )
    return rm.Trained(model_cfg, graphdef, params, history)


# ==========================================================================================
# A trained PRM: scoring, dense rewards, save and load.
# ==========================================================================================


@dataclasses.dataclass(frozen=True)
class ProcessRewardModel:
    """A PRM: what scores the steps of (prompt, completion) id rows."""

    model_cfg: ModelConfig
    graphdef: object
    params: dict
    tokenizer: tokenizer_lib.Tokenizer
    config: PRMConfig
    path: str | None = None

    def with_bucket(self, tokens: int) -> ProcessRewardModel:
        """This PRM scoring in one bucket of at least `tokens` tokens (the scores do not depend
        on the bucket): for rows longer than `config.seq_len`."""
        if tokens <= self.config.seq_len:
            return self
        return dataclasses.replace(self, config=dataclasses.replace(self.config, seq_len=tokens))

    def score_steps(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        chunk: int = 64,
    ) -> tuple[np.ndarray, np.ndarray, list[Steps]]:
        """(s [N, S], mask [N, S], steps): each step's score (a logit; sigmoid(s) estimates
        its prefix's value), S the most steps of any row, and each row's `Steps`. Rows are a
        prompt's ids (with its BOS) and a completion's ids, as the RL loop holds them (an EOS
        at the end changes no score).

        Raises:
          ValueError: On mismatched lengths, or a row longer than `config.seq_len` (naming it).
        """
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
        steps = [completion_steps(self.tokenizer, c, self.config.delimiter) for c in completion_ids]
        rows = [[*p, *c] for p, c in zip(prompt_ids, completion_ids)]
        batch = rm.pad_rows(rows, self.config.seq_len, self.tokenizer.padding_id)
        s_NT = token_scores_of_rows(self.graphdef, self.params, *batch, chunk)
        S = max([s.num_steps for s in steps], default=0)
        scores, mask = np.zeros((len(rows), S), np.float32), np.zeros((len(rows), S), bool)
        for i, (p, s) in enumerate(zip(prompt_ids, steps)):
            pos = len(p) + np.asarray(s.last_tokens, np.int64)
            scores[i, : s.num_steps], mask[i, : s.num_steps] = s_NT[i, pos], True
        return scores, mask, steps

    def step_rewards(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        max_len: int,
        chunk: int = 64,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(step_reward [N, M], step_mask [N, M]) for `objectives.process_advantages`: each
        step's probability sigmoid(s_j) at its last completion token, the final step's at the
        completion's last token (its EOS when sampling stopped there), so every completion
        token lies in a step; 0 / False elsewhere (two steps that end in one token: the
        later one's). M = `max_len`, the completion budget.

        Raises:
          ValueError: If a completion is longer than `max_len` (naming it), or as
            `score_steps`.
        """
        long = [i for i, c in enumerate(completion_ids) if len(c) > max_len]
        if long:
            raise ValueError(
                f"completion {long[0]} has {len(completion_ids[long[0]])} tokens, more than "
                f"max_len={max_len}"
            )
        s_NS, mask_NS, steps = self.score_steps(prompt_ids, completion_ids, chunk)
        p_NS = sigmoid(s_NS)
        reward = np.zeros((len(steps), max_len), np.float32)
        mask = np.zeros((len(steps), max_len), bool)
        for i, (c, s) in enumerate(zip(completion_ids, steps)):
            if not s.num_steps:
                continue
            pos = np.asarray(s.last_tokens, np.int64)
            pos[-1] = len(c) - 1
            reward[i, pos], mask[i, pos] = p_NS[i, : s.num_steps], True
        return reward, mask


def save(
    path: str,
    model_cfg: ModelConfig,
    params: dict,
    tokenizer: tokenizer_lib.Tokenizer,
    cfg: PRMConfig,
    history: Sequence[rm.Record] = (),
) -> None:
    """Writes a PRM directory: a reward-model directory (`reward_model.save`, with
    `cfg.rm_config()`) and `process_reward.json` (the `PRMConfig`)."""
    path = os.path.abspath(path)
    rm.save(path, model_cfg, params, tokenizer, cfg.rm_config(), history)
    if jax.process_index() != 0:
        return
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump({"format": FORMAT, "config": dataclasses.asdict(cfg)}, f, indent=2)


def load(path: str, mesh=None) -> ProcessRewardModel:
    """Reads a PRM directory written by `save` (`reward_model.load` checks the decoder, the
    head and the tokenizer files).

    Raises:
      FileNotFoundError: If `path` has no process_reward.json (not a PRM directory).
      ValueError: On an unknown format or config key, or as `reward_model.load`.
    """
    path = os.path.abspath(path)
    meta_path, meta = rm.read_meta(path, META_FILE, FORMAT, "process reward model")
    cfg = PRMConfig.from_dict(meta["config"], source=f"{meta_path} config")
    loaded = rm.load(path, mesh)
    return ProcessRewardModel(
        loaded.model_cfg, loaded.graphdef, loaded.params, loaded.tokenizer, cfg, path
    )


# ==========================================================================================
# Best-of-N: one score per completion from its step probabilities.
# ==========================================================================================


def sigmoid(s) -> np.ndarray:
    """1 / (1 + e^-s) in float64, to full relative precision in both tails (1 + tanh(s / 2)
    cancels for s << 0)."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(s, np.float64)))


def _check_steps(p_NS, mask_NS):
    p_NS, mask_NS = np.asarray(p_NS, np.float64), np.asarray(mask_NS, bool)
    if p_NS.ndim != 2 or p_NS.shape != mask_NS.shape:
        raise ValueError(
            f"step probabilities {p_NS.shape} and mask {mask_NS.shape} must be one [N, S] shape"
        )
    return p_NS, mask_NS


def prm_min(p_NS, mask_NS) -> np.ndarray:
    """min_j p_j over each row's steps (Wang et al. 2024): a completion is as good as its
    weakest step. A row without steps scores 0."""
    p_NS, mask_NS = _check_steps(p_NS, mask_NS)
    out = np.where(mask_NS, p_NS, np.inf).min(axis=1, initial=np.inf)
    return np.where(mask_NS.any(axis=1), out, 0.0)


def prm_last(p_NS, mask_NS) -> np.ndarray:
    """p of each row's last step: the value of the whole completion. No steps: 0."""
    p_NS, mask_NS = _check_steps(p_NS, mask_NS)
    S = mask_NS.shape[1]
    last = S - 1 - np.argmax(mask_NS[:, ::-1], axis=1) if S else np.zeros(len(p_NS), int)
    out = p_NS[np.arange(len(p_NS)), last] if S else np.zeros(len(p_NS))
    return np.where(mask_NS.any(axis=1), out, 0.0)


def prm_product(p_NS, mask_NS) -> np.ndarray:
    """prod_j p_j over each row's steps (Lightman et al. 2023): the probability that every
    step is right, were they independent. No steps: 0."""
    p_NS, mask_NS = _check_steps(p_NS, mask_NS)
    out = np.prod(np.where(mask_NS, p_NS, 1.0), axis=1)
    return np.where(mask_NS.any(axis=1), out, 0.0)


AGGREGATIONS = {"min": prm_min, "last": prm_last, "product": prm_product}


def prm_scores(
    prm: ProcessRewardModel,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    aggregation: str = "min",
) -> np.ndarray:
    """One score [N] per (prompt, completion) id row for best-of-N
    (`eval_metrics.best_of_n`): the `aggregation` ("min", "last" or "product") of the
    step probabilities sigmoid(s_j) (`ProcessRewardModel.score_steps`).

    Raises:
      ValueError: On an unknown aggregation, or as `score_steps`.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not one of {tuple(AGGREGATIONS)}")
    s_NS, mask_NS, _ = prm.score_steps(prompt_ids, completion_ids)
    return AGGREGATIONS[aggregation](sigmoid(s_NS), mask_NS)


# ==========================================================================================
# The commands: label a policy's completions, train a PRM on the labels.
# ==========================================================================================

_BUCKET_MULTIPLE = 16  # `train`'s default seq_len is the longest row rounded up to this.


def load_config(spec: str, overrides: Sequence[str] = ()):
    """The config `--config SPEC` names (a file, optionally with a `:variant` suffix) with its
    `--config.a.b=value` overrides, loaded as `rlscale.evaluate` loads its `--config`
    (ml_collections' `config_flags`, locked: a mistyped key is an error), on flags of its own
    so that commands can run one after another in one process.

    Raises:
      ValueError: Naming the file, variant, key or value that does not load (`cli`).
    """
    argv = ["", f"--config={spec}", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "config file", flag_values=fv, lock_config=True, sys_argv=argv
    )
    try:
        fv(argv)
    except cli.FLAG_ERRORS as e:
        raise ValueError(cli.flags_error(e, argv)) from None
    problems = cli.unloaded_config_files(fv)
    if problems:
        raise ValueError("; ".join(problems))
    return fv.config


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

    Loads the checkpoint, its tokenizer and the config's task as `rlscale.evaluate` does,
    samples `k` completions for each of the first `n` problems of `split` with the config's
    sampling settings, scores them with the task's verifier, and labels every step of every
    completion with `rollouts` continuations of its prefix (`mc_step_labels`), `batch`
    prompts per sampler call. The completions and the continuations are sampled with two keys
    split from `seed`.

    Args:
      config: an RL config (`configs/*.py`): its task, model mesh, sampling and reward pool.
      checkpoint_dir: a params checkpoint (`checkpoint.save_params`), e.g. a run's
        WORKDIR/final.
      delimiter: what ends a step; default `TASK_DELIMITERS[config.task.name]`, else
        `DEFAULT_DELIMITER`.
      tokenizer_path, workdir: as `rlscale.evaluate` (default: the run's tokenizer, the
        checkpoint's parent directory).

    Returns:
      One row per completion, problem-major: `problem` (its index in the split), `sample`
      (0..k-1), `prompt`, `completion`, `delimiter`, `step_ends`, `soft`, `hard` (one per step:
      `StepLabels`) and `outcome` (the verifier's reward; the last step's labels are
      `outcome > 0`).

    Raises:
      ValueError: On n, k, rollouts or batch < 1, an empty delimiter, an empty split, a
        delimiter that occurs in no completion (`check_delimiter`, naming it), or as
        `evaluate.load_policy` and `evaluate.load_problems`.
    """
    from rlscale import evaluate  # Not at the top: evaluate imports this module.

    if min(n, k, rollouts, batch) < 1:
        raise ValueError(
            f"--n={n}, --k={k}, --rollouts={rollouts} and --batch={batch} must be >= 1"
        )
    if delimiter is None:
        delimiter = TASK_DELIMITERS.get(config.task.name, DEFAULT_DELIMITER)
    _check_delimiter_text(delimiter)
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    workdir = os.path.abspath(workdir or os.path.dirname(checkpoint_dir))
    policy = evaluate.load_policy(config, checkpoint_dir, workdir, tokenizer_path)
    task, problems = evaluate.load_problems(config, workdir, split, n)
    if not problems:
        raise ValueError(f"--split={split!r} has no problems")
    cfg = evaluate.sampling_config(config, policy.tokenizer, k)
    sample_key, rollout_key = jax.random.split(jax.random.key(seed))
    timeout = config.reward.timeout
    with evaluate.verifier_pool(config) as pool:
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


def row_bucket(examples: Sequence[StepExample], tokenizer: tokenizer_lib.Tokenizer) -> int:
    """`train`'s default `seq_len`: the longest row (prompt and completion ids, as
    `encode_examples` encodes them), rounded up to a multiple of `_BUCKET_MULTIPLE`."""
    prompts = [chat.encode_prompt(tokenizer, e.prompt) for e in examples]
    completions = tokenizer.encode_batch([e.completion for e in examples])
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    return -(-longest // _BUCKET_MULTIPLE) * _BUCKET_MULTIPLE


_LABEL_INT_FLAGS = ("n", "k", "rollouts", "seed", "batch")
_TRAIN_INT_FLAGS = ("batch_rows", "max_steps", "eval_every", "seed", "warmup_steps")
_TRAIN_FLOAT_FLAGS = ("lr", "weight_decay")


def _parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m rlscale.process_reward",
        description="Process reward models: label a policy's steps by Monte-Carlo rollouts, "
        "train a PRM on the labels (see the module docstring).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{label,train}")
    lp = sub.add_parser(
        "label",
        help="sample a policy's completions and label their steps",
        description="Samples --k completions for each of the first --n problems of the "
        "config's task, labels each step with --rollouts continuations of its prefix and "
        "writes one JSON row per completion. --config.a.b=value overrides a config field.",
    )
    lp.add_argument(
        "--config", required=True, help="config file, optionally with a :variant suffix"
    )
    lp.add_argument("--checkpoint", required=True, help="policy params, e.g. WORKDIR/final")
    lp.add_argument("--out", required=True, help="labels file to write (JSON lines)")
    lp.add_argument("--split", default="train", help="split of the task (default train)")
    defaults = {"n": 64, "k": 4, "rollouts": 4, "seed": 0, "batch": 32}
    helps = {
        "n": "problems: the first n of the split",
        "k": "completions sampled per problem",
        "rollouts": "continuations sampled per step prefix",
        "seed": "sampling seed",
        "batch": "prompts per sampler call",
    }
    for name in _LABEL_INT_FLAGS:
        help_text = f"{helps[name]} (default {defaults[name]})"
        lp.add_argument(f"--{name}", type=int, default=defaults[name], help=help_text)
    lp.add_argument(
        "--delimiter",
        default=None,
        help="what ends a step (default: the task's, e.g. '=' for arithmetic, else a newline)",
    )
    lp.add_argument("--tokenizer", default=None, help="tokenizer path (as rlscale.evaluate)")
    lp.add_argument("--workdir", default=None, help="run directory (default: the checkpoint's)")

    tp = sub.add_parser(
        "train",
        help="train a PRM on a labels file",
        description="Trains a process reward model on labelled completions and saves it for "
        "rlscale.evaluate --scorer prm --prm DIR.",
    )
    tp.add_argument("--labels", required=True, help="labels file (the label command's rows)")
    tp.add_argument("--out", required=True, help="directory to write the PRM to")
    held = tp.add_mutually_exclusive_group()
    held.add_argument("--heldout", default=None, help="held-out labels file")
    held.add_argument(
        "--heldout_frac",
        type=float,
        default=0.1,
        help="share of the prompts held out when no --heldout is given (default 0.1)",
    )
    init = tp.add_mutually_exclusive_group()
    init.add_argument("--init", default=None, help="policy checkpoint to start from")
    init.add_argument(
        "--model", default="tiny", help="named architecture from scratch (default tiny)"
    )
    tp.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer path; default: --init's own, else its run's WORKDIR/tokenizer.model",
    )
    tp.add_argument("--label", default="soft", choices=LABEL_FIELDS, help="labels to fit")
    tp.add_argument("--delimiter", default=None, help="default: the rows' own")
    tp.add_argument("--steps", type=int, default=200)
    cfg = PRMConfig()
    tp.add_argument(
        "--seq_len",
        type=int,
        default=None,
        help="the bucket: prompt + completion ids (default: the longest row, rounded up to 16)",
    )
    for name in _TRAIN_INT_FLAGS:
        tp.add_argument(f"--{name}", type=int, default=getattr(cfg, name))
    for name in _TRAIN_FLOAT_FLAGS:
        tp.add_argument(f"--{name}", type=float, default=getattr(cfg, name))
    return p


def _print_summary(title: str, summary: dict) -> None:
    print(f"\n{title}")
    for key, v in summary.items():
        if isinstance(v, float):
            print(f"  {key:<20} {v:.4g}")
        else:
            print(f"  {key:<20} {v!r}" if key == "delimiter" else f"  {key:<20} {v}")


def _label_command(args, overrides: Sequence[str]) -> dict:
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        raise ValueError(f"--out={args.out} is a directory: name the labels file to write")
    config = load_config(args.config, overrides)
    cli.make_dir(os.path.dirname(out), "--out")
    rows = label_policy(
        config,
        args.checkpoint,
        split=args.split,
        delimiter=args.delimiter,
        tokenizer_path=args.tokenizer,
        workdir=args.workdir,
        **{name: getattr(args, name) for name in _LABEL_INT_FLAGS},
    )
    if jax.process_index() == 0:
        write_labels(out, rows)
    summary = {**label_summary(rows), "out": out}
    _print_summary("rlscale process reward labels", summary)
    return summary


def _train_command(args) -> dict:
    from rlscale import evaluate  # Not at the top: evaluate imports this module.

    if args.init is not None and not os.path.isdir(args.init):
        raise ValueError(f"--init={args.init}: no such directory")
    examples, delimiter = read_labels(args.labels, label=args.label, delimiter=args.delimiter)
    if args.heldout:
        heldout, _ = read_labels(args.heldout, label=args.label, delimiter=delimiter)
    else:
        examples, heldout = split_heldout(examples, args.heldout_frac, args.seed)
    if args.tokenizer is None:
        if args.init is None:
            raise ValueError("--tokenizer: required unless --init names a policy checkpoint")
        init = os.path.abspath(args.init)
        args.tokenizer = evaluate.default_tokenizer_path(init, os.path.dirname(init))
    tok = tokenizer_lib.load(args.tokenizer)
    cfg = PRMConfig(
        delimiter=delimiter,
        seq_len=row_bucket([*examples, *heldout], tok) if args.seq_len is None else args.seq_len,
        **{name: getattr(args, name) for name in _TRAIN_INT_FLAGS + _TRAIN_FLOAT_FLAGS},
    )
    model = args.init or model_lib.get(args.model, vocab_size=tok.vocab_size)
    cli.make_dir(args.out, "--out")

    return rm.train_and_save(
        train,
        save,
        examples,
        heldout,
        tok,
        cfg,
        args.steps,
        model,
        args.out,
        kind="process reward model",
        rows_name="completions",
        metric="step accuracy",
    )


def main(argv: Sequence[str] | None = None) -> dict:
    """`python -m rlscale.process_reward label|train ...` (see the module docstring); returns
    the command's summary. `label` passes its `--config.a.b=value` overrides to the config."""
    p = _parser()
    args, rest = p.parse_known_args(argv)
    overrides, unknown = [], []
    for i, a in enumerate(rest):
        after = rest[i - 1] if i else ""
        is_value = after.startswith("--config.") and "=" not in after and a[:2] != "--"
        is_override = args.command == "label" and (a.startswith("--config.") or is_value)
        (overrides if is_override else unknown).append(a)
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "label":
        return _label_command(args, overrides)
    return _train_command(args)


if __name__ == "__main__":
    # The package's module, not this __main__ copy: the verifier pool's workers unpickle
    # `PrefixVerifier` by its module path, which `__main__` is not in them.
    from rlscale import process_reward

    console.configure(0)  # Warnings (rows dropped, steps without a delimiter) on stderr.
    cli.guard(process_reward.main)()
