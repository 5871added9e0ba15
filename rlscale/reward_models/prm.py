"""A process reward model (PRM): the reward model's decoder and scalar head read at the last
token of every step of a completion, p_j = sigmoid(s_j) estimating the step's Monte-Carlo
label (`step_labels`), fitted by binary cross-entropy; best-of-N aggregates of its step
probabilities (`prm_min`, `prm_last`, `prm_product`); dense step rewards for RL
(`ProcessRewardModel.step_rewards`). Derivations: docs/preference_and_reward_models.md.

A saved PRM is a reward-model directory (`head.save`: decoder/, head.npz, the tokenizer,
reward_model.json) plus `process_reward.json` (the `PRMConfig`, the delimiter with it).

Dimension letters: N rows, T tokens (the bucket), J steps (padded to the longest row, or to
`max_steps` in training), M completion tokens, D model width.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlscale import tokenizers as tokenizer_lib
from rlscale.model import decoder
from rlscale.model.config import ModelConfig
from rlscale.reward_models import bradley_terry as rm
from rlscale.reward_models import scalar_head, step_labels
from rlscale.tokenizers import chat

FORMAT = 1  # Version of process_reward.json's layout.
META_FILE = "process_reward.json"
_BUCKET_MULTIPLE = 16  # `train`'s default seq_len is the longest row rounded up to this.


# ==========================================================================================
# The PRM: config, pure functions, the loss.
# ==========================================================================================


@dataclasses.dataclass(frozen=True)
class PRMConfig(scalar_head.TrainSettings):
    """PRM training and scoring settings (`reward_model.TrainSettings`: the bucket, remat and
    AdamW, each sequence being prompt + completion ids); hashable.

    Attributes:
      delimiter: what ends a step; saved with the model, so scoring splits as training did.
      batch_rows: completions per training step.
      eval_batch_rows: completions per scoring call.
      max_steps: training rows are padded to this many steps (rows with more are dropped).
    """

    KIND: ClassVar[str] = "process reward model"

    delimiter: str = step_labels.DEFAULT_DELIMITER
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
        `bradley_terry.save` records."""
        shared = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(scalar_head.TrainSettings)
        }
        return rm.RMConfig(
            **shared,
            batch_pairs=max(1, self.batch_rows // 2),
            eval_batch_pairs=max(1, self.eval_batch_rows // 2),
            add_eos=False,
        )


class StepBatch(NamedTuple):
    """Right-padded rows and their steps: ids [N, T], real tokens per row [N], each step's
    last token's position in the row [N, J] (0 where padded), which steps are real [N, J],
    and the labels [N, J] (0 where padded)."""

    tokens_NT: jax.Array
    lengths_N: jax.Array
    positions_NJ: jax.Array
    step_mask_NJ: jax.Array
    labels_NJ: jax.Array


def token_scores(spec: decoder.ForwardSpec, params, tokens_NT, lengths_N):
    """s [N, T] in float32: the head on every token's final-norm hidden state (padding after
    `lengths_N` is masked; attention is causal, so it changes no real token's score)."""
    T = tokens_NT.shape[1]
    mask_NT = jnp.arange(T)[None, :] < lengths_N[:, None]
    positions_NT = decoder.positions_from_mask(mask_NT)
    h_NTD, _ = decoder.hidden(
        spec.graphdef, params["decoder"], tokens_NT, positions_NT, mask_NT, remat=spec.remat
    )
    head = params["head"]
    return h_NTD.astype(jnp.float32) @ head["w"] + head["b"]


def step_scores(spec: decoder.ForwardSpec, params, tokens_NT, lengths_N, positions_NJ):
    """s [N, J]: `token_scores` at each step's last token."""
    s_NT = token_scores(spec, params, tokens_NT, lengths_N)
    return jnp.take_along_axis(s_NT, positions_NJ, axis=1)


def step_loss(scores_NJ, labels_NJ, mask_NJ):
    """Binary cross-entropy against soft labels, as (sum over real steps, #real steps), so
    accumulation is exact: -[y log sigmoid(s) + (1 - y) log sigmoid(-s)] per step;
    d / d s = sigmoid(s) - y."""
    m = mask_NJ.astype(jnp.float32)
    y = labels_NJ.astype(jnp.float32)
    bce = -(y * jax.nn.log_sigmoid(scores_NJ) + (1.0 - y) * jax.nn.log_sigmoid(-scores_NJ))
    return jnp.sum(bce * m), jnp.sum(m)


def loss(spec: decoder.ForwardSpec, params, batch: StepBatch):
    """The loss `supervised.train_step` minimizes on a batch: `step_loss`, and the metric
    `accuracy` (the fraction of steps with sigmoid(s) > 0.5 exactly when the label is
    > 0.5)."""
    s_NJ = step_scores(spec, params, batch.tokens_NT, batch.lengths_N, batch.positions_NJ)
    total, n = step_loss(s_NJ, batch.labels_NJ, batch.step_mask_NJ)
    m = batch.step_mask_NJ.astype(jnp.float32)
    agree = ((s_NJ > 0) == (batch.labels_NJ > 0.5)).astype(jnp.float32)
    return total, n, {"accuracy": jnp.sum(agree * m) / jnp.maximum(jnp.sum(m), 1.0)}


_token_scores = jax.jit(token_scores, static_argnames=("spec",))


def token_scores_of_rows(spec, params, tokens_NT, lengths_N, chunk: int = 128) -> np.ndarray:
    """`token_scores` [N, T], jitted, over any number of rows, `chunk` rows per call
    (`scalar_head.in_chunks`)."""
    T = np.shape(tokens_NT)[1]
    return scalar_head.in_chunks(_token_scores, spec, params, tokens_NT, lengths_N, chunk, (T,))


# ==========================================================================================
# Host side: encoding labelled completions, training.
# ==========================================================================================


class Encoded(NamedTuple):
    """Labelled rows as host arrays (`StepBatch`'s fields) with each row's `source` index
    among the examples."""

    batch: StepBatch
    sources: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.sources)


def encode_examples(
    examples: Sequence[step_labels.StepExample], tokenizer: tokenizer_lib.Tokenizer, cfg: PRMConfig
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
    step_labels.check_delimiter([e.completion for e in examples], cfg.delimiter)
    prompts = [chat.encode_prompt(tokenizer, e.prompt) for e in examples]
    completions = tokenizer.encode_batch([e.completion for e in examples])
    rows, mismatched = [], []
    dropped = {"without steps": [], "longer than seq_len": [], "with more than max_steps steps": []}
    for i, (e, p, c) in enumerate(zip(examples, prompts, completions)):
        steps = step_labels.completion_steps(tokenizer, c, cfg.delimiter)
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
    N, J = len(rows), cfg.max_steps
    tokens = np.full((N, cfg.seq_len), max(tokenizer.padding_id, 0), np.int32)
    lengths = np.zeros(N, np.int32)
    positions = np.zeros((N, J), np.int32)
    mask = np.zeros((N, J), bool)
    labels = np.zeros((N, J), np.float32)
    for r, (_, ids, pos, lab) in enumerate(rows):
        tokens[r, : len(ids)], lengths[r] = ids, len(ids)
        positions[r, : len(pos)], mask[r, : len(pos)], labels[r, : len(pos)] = pos, True, lab
    return Encoded(StepBatch(tokens, lengths, positions, mask, labels), [r[0] for r in rows])


def heldout_metrics(spec, params, encoded: Encoded, chunk: int = 128) -> tuple[float, float]:
    """(mean step loss, step accuracy) of `encoded` rows (accuracy as in `loss`)."""
    b = encoded.batch
    s_NT = token_scores_of_rows(spec, params, b.tokens_NT, b.lengths_N, chunk)
    s_NJ = np.take_along_axis(s_NT, b.positions_NJ, axis=1)
    total, n = step_loss(s_NJ, b.labels_NJ, b.step_mask_NJ)
    agree = (s_NJ > 0) == (b.labels_NJ > 0.5)
    return float(total) / max(float(n), 1.0), float(agree[b.step_mask_NJ].mean())


def train(
    examples: Sequence[step_labels.StepExample],
    tokenizer: tokenizer_lib.Tokenizer,
    cfg: PRMConfig,
    steps: int,
    *,
    model: ModelConfig | str,
    heldout: Sequence[step_labels.StepExample] = (),
    log: Callable[[scalar_head.Record], None] | None = None,
) -> scalar_head.Trained:
    """Trains a PRM for `steps` steps of `cfg.batch_rows` rows (`loss`, through
    `scalar_head.fit`), from a policy
    checkpoint or a `ModelConfig` (`scalar_head.init`). Every `cfg.eval_every` steps and at
    the end it appends a `reward_model.Record` (mean training loss since the last one,
    held-out step accuracy) to the history and passes it to `log`.

    Raises:
      ValueError: On steps < 1, a tokenizer the model does not fit (or a checkpoint that
        carries another one), or examples that do not encode (`encode_examples`).
    """
    model_cfg, graphdef, params = scalar_head.start(model, tokenizer, cfg, steps)
    train_set = encode_examples(examples, tokenizer, cfg)
    held = encode_examples(heldout, tokenizer, cfg) if heldout else None
    stream = scalar_head.batch_indices(train_set.num_rows, cfg.batch_rows, cfg.seed)

    def next_batch():
        rows = next(stream)
        return StepBatch(*(x[rows] for x in train_set.batch))

    def heldout_accuracy(params):
        if held is None:
            return None
        return heldout_metrics(decoder.ForwardSpec(graphdef), params, held, cfg.eval_batch_rows)[1]

    params, history = scalar_head.fit(
        loss, graphdef, cfg, params, next_batch, heldout_accuracy, steps, log
    )
    return scalar_head.Trained(model_cfg, graphdef, params, history)


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

    @property
    def forward(self) -> decoder.ForwardSpec:
        """The description its scorers take."""
        return decoder.ForwardSpec(self.graphdef)

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
    ) -> tuple[np.ndarray, np.ndarray, list[step_labels.Steps]]:
        """(s [N, J], mask [N, J], steps): each step's score (a logit; sigmoid(s) estimates
        its prefix's value), J the most steps of any row, and each row's `Steps`. Rows are a
        prompt's ids (with its BOS) and a completion's ids, as the RL loop holds them (an EOS
        at the end changes no score).

        Raises:
          ValueError: On mismatched lengths, or a row longer than `config.seq_len` (naming it).
        """
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
        steps = [
            step_labels.completion_steps(self.tokenizer, c, self.config.delimiter)
            for c in completion_ids
        ]
        rows = [[*p, *c] for p, c in zip(prompt_ids, completion_ids)]
        batch = rm.pad_rows(rows, self.config.seq_len, self.tokenizer.padding_id)
        s_NT = token_scores_of_rows(self.forward, self.params, *batch, chunk)
        J = max([s.num_steps for s in steps], default=0)
        scores, mask = np.zeros((len(rows), J), np.float32), np.zeros((len(rows), J), bool)
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
        s_NJ, mask_NJ, steps = self.score_steps(prompt_ids, completion_ids, chunk)
        p_NJ = sigmoid(s_NJ)
        reward = np.zeros((len(steps), max_len), np.float32)
        mask = np.zeros((len(steps), max_len), bool)
        for i, (c, s) in enumerate(zip(completion_ids, steps)):
            if not s.num_steps:
                continue
            pos = np.asarray(s.last_tokens, np.int64)
            pos[-1] = len(c) - 1
            reward[i, pos], mask[i, pos] = p_NJ[i, : s.num_steps], True
        return reward, mask


def save(
    path: str,
    model_cfg: ModelConfig,
    params: dict,
    tokenizer: tokenizer_lib.Tokenizer,
    cfg: PRMConfig,
    history: Sequence[scalar_head.Record] = (),
) -> None:
    """Writes a PRM directory: a reward-model directory (`bradley_terry.save`, with
    `cfg.rm_config()`) and `process_reward.json` (the `PRMConfig`)."""
    path = os.path.abspath(path)
    rm.save(path, model_cfg, params, tokenizer, cfg.rm_config(), history)
    if jax.process_index() != 0:
        return
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump({"format": FORMAT, "config": dataclasses.asdict(cfg)}, f, indent=2)


def load(path: str, mesh=None) -> ProcessRewardModel:
    """Reads a PRM directory written by `save` (`bradley_terry.load` checks the decoder, the
    head and the tokenizer files).

    Raises:
      FileNotFoundError: If `path` has no process_reward.json (not a PRM directory).
      ValueError: On an unknown format or config key, or as `bradley_terry.load`.
    """
    path = os.path.abspath(path)
    meta_path, meta = scalar_head.read_meta(path, META_FILE, FORMAT, "process reward model")
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


def _check_steps(p_NJ, mask_NJ):
    p_NJ, mask_NJ = np.asarray(p_NJ, np.float64), np.asarray(mask_NJ, bool)
    if p_NJ.ndim != 2 or p_NJ.shape != mask_NJ.shape:
        raise ValueError(
            f"step probabilities {p_NJ.shape} and mask {mask_NJ.shape} must be one [N, S] shape"
        )
    return p_NJ, mask_NJ


def prm_min(p_NJ, mask_NJ) -> np.ndarray:
    """min_j p_j over each row's steps (Wang et al. 2024): a completion is as good as its
    weakest step. A row without steps scores 0."""
    p_NJ, mask_NJ = _check_steps(p_NJ, mask_NJ)
    out = np.where(mask_NJ, p_NJ, np.inf).min(axis=1, initial=np.inf)
    return np.where(mask_NJ.any(axis=1), out, 0.0)


def prm_last(p_NJ, mask_NJ) -> np.ndarray:
    """p of each row's last step: the value of the whole completion. No steps: 0."""
    p_NJ, mask_NJ = _check_steps(p_NJ, mask_NJ)
    J = mask_NJ.shape[1]
    last = J - 1 - np.argmax(mask_NJ[:, ::-1], axis=1) if J else np.zeros(len(p_NJ), int)
    out = p_NJ[np.arange(len(p_NJ)), last] if J else np.zeros(len(p_NJ))
    return np.where(mask_NJ.any(axis=1), out, 0.0)


def prm_product(p_NJ, mask_NJ) -> np.ndarray:
    """prod_j p_j over each row's steps (Lightman et al. 2023): the probability that every
    step is right, were they independent. No steps: 0."""
    p_NJ, mask_NJ = _check_steps(p_NJ, mask_NJ)
    out = np.prod(np.where(mask_NJ, p_NJ, 1.0), axis=1)
    return np.where(mask_NJ.any(axis=1), out, 0.0)


AGGREGATIONS = {"min": prm_min, "last": prm_last, "product": prm_product}


def prm_scores(
    prm: ProcessRewardModel,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    aggregation: str = "min",
) -> np.ndarray:
    """One score [N] per (prompt, completion) id row for best-of-N
    (`estimators.best_of_n`): the `aggregation` ("min", "last" or "product") of the
    step probabilities sigmoid(s_j) (`ProcessRewardModel.score_steps`).

    Raises:
      ValueError: On an unknown aggregation, or as `score_steps`.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not one of {tuple(AGGREGATIONS)}")
    s_NJ, mask_NJ, _ = prm.score_steps(prompt_ids, completion_ids)
    return AGGREGATIONS[aggregation](sigmoid(s_NJ), mask_NJ)


def row_bucket(
    examples: Sequence[step_labels.StepExample], tokenizer: tokenizer_lib.Tokenizer
) -> int:
    """`train`'s default `seq_len`: the longest row (prompt and completion ids, as
    `encode_examples` encodes them), rounded up to a multiple of `_BUCKET_MULTIPLE`."""
    prompts = [chat.encode_prompt(tokenizer, e.prompt) for e in examples]
    completions = tokenizer.encode_batch([e.completion for e in examples])
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    return -(-longest // _BUCKET_MULTIPLE) * _BUCKET_MULTIPLE
