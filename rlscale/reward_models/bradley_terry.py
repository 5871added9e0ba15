"""A Bradley-Terry reward model on the decoder: train it on preference pairs, score with it.

The reward of a completion y of a prompt x is a scalar head (`head`) on the decoder's
final-norm hidden state at the sequence's last real token, r(x, y) = w . h(x ++ y)[last] + b,
fitted to pairs (x, y_c preferred to y_r) by -log sigmoid(r_c - r_r) (Bradley & Terry 1952;
InstructGPT, Ouyang et al. 2022); b is set after training so that the training completions'
mean reward is 0. Sequences are the prompt's ids (`chat.encode_prompt`), the completion's
ids and the EOS when `RMConfig.add_eos`, right-padded to one bucket of `seq_len` tokens; a
pair with a side longer than the bucket is dropped, with one warning counting them. The
derivation and the saved directory's layout: docs/preference_and_reward_models.md.

Dimension letters: B pairs, N rows (2B in a pair batch: row 2p chosen, 2p + 1 rejected, the
layout of `rlscale.objectives.preference`), T tokens (the bucket), D model width.
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
from absl import logging

from rlscale import checkpoint, sharding
from rlscale import tokenizers as tokenizer_lib
from rlscale.data import preferences
from rlscale.model import decoder
from rlscale.model.config import ModelConfig
from rlscale.reward_models import scalar_head
from rlscale.tokenizers import chat

FORMAT = 1  # Version of reward_model.json's layout.
META_FILE = "reward_model.json"


@dataclasses.dataclass(frozen=True)
class RMConfig(scalar_head.TrainSettings):
    """Reward-model training and scoring settings (`TrainSettings`, each sequence being
    prompt + completion + EOS); hashable.

    Attributes:
      batch_pairs: pairs per training step (2 x batch_pairs rows).
      eval_batch_pairs: pairs per scoring call when measuring held-out accuracy.
      add_eos: append the EOS to every sequence (when the tokenizer has one).
    """

    KIND: ClassVar[str] = "reward model"

    batch_pairs: int = 16
    eval_batch_pairs: int = 64
    add_eos: bool = True

    def __post_init__(self):
        self._raise(self.settings_problems(("batch_pairs", "eval_batch_pairs")))


# ==========================================================================================
# Pure functions: rewards, the loss.
# ==========================================================================================


class Batch(NamedTuple):
    """Right-padded rows: ids [N, T] and the number of real tokens of each, [N] (>= 1)."""

    tokens_NT: jax.Array
    lengths_N: jax.Array


def rewards(spec: decoder.ForwardSpec, params, tokens_NT, lengths_N):
    """r [N] in float32: the head on the final-norm hidden state at token `lengths_N - 1` of
    each row. Tokens after it (padding) are masked, and attention is causal, so they change
    nothing."""
    T = tokens_NT.shape[1]
    mask_NT = jnp.arange(T)[None, :] < lengths_N[:, None]
    positions_NT = decoder.positions_from_mask(mask_NT)
    h_NTD, _ = decoder.hidden(
        spec.graphdef, params["decoder"], tokens_NT, positions_NT, mask_NT, remat=spec.remat
    )
    last_N = jnp.clip(lengths_N - 1, 0, T - 1)
    h_ND = h_NTD[jnp.arange(tokens_NT.shape[0]), last_N].astype(jnp.float32)
    head = params["head"]
    return h_ND @ head["w"] + head["b"]


@functools.partial(jax.jit, static_argnames=("spec",))
def score(spec: decoder.ForwardSpec, params, tokens_NT, lengths_N):
    """`rewards`, jitted: r(x, y) [N] for right-padded rows (`Batch`)."""
    return rewards(spec, params, tokens_NT, lengths_N)


def pair_loss(r_c_B, r_r_B):
    """Bradley-Terry: (sum_p -log sigmoid(r_c - r_r), B), the sum and its denominator, so
    accumulation over micro-batches is exact. d sum / d r_c_p = -sigmoid(r_r_p - r_c_p)."""
    return jnp.sum(-jax.nn.log_sigmoid(r_c_B - r_r_B)), jnp.float32(r_c_B.shape[0])


def loss(spec: decoder.ForwardSpec, params, batch: Batch):
    """The loss `supervised.train_step` minimizes on a batch of B pairs (rows 2p chosen,
    2p + 1 rejected): `pair_loss`, and the metrics `accuracy` (the fraction with r_c > r_r)
    and `margin` (mean r_c - r_r)."""
    r_N = rewards(spec, params, batch.tokens_NT, batch.lengths_N)
    r_c, r_r = r_N[0::2], r_N[1::2]
    total, n = pair_loss(r_c, r_r)
    metrics = {
        "accuracy": jnp.mean((r_c > r_r).astype(jnp.float32)),
        "margin": jnp.mean(r_c - r_r),
    }
    return total, n, metrics


# ==========================================================================================
# Host side: tokenization, batches, scoring in chunks, accuracy.
# ==========================================================================================


class Encoded(NamedTuple):
    """Pairs as padded rows: `tokens_NT` int32 [2B, T] (row 2p chosen, 2p + 1 rejected),
    `lengths_N` int32 [2B], and each pair's `source`."""

    tokens_NT: np.ndarray
    lengths_N: np.ndarray
    sources: list[str]

    @property
    def num_pairs(self) -> int:
        return len(self.sources)


def encode_rows(
    tokenizer: tokenizer_lib.Tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    add_eos: bool = True,
) -> list[list[int]]:
    """The ids of each (prompt, completion) row: `chat.encode_prompt(prompt)`, then the
    completion's ids, then the EOS when `add_eos` and the tokenizer has one."""
    eos = [tokenizer.eos_id] if add_eos and tokenizer.eos_id >= 0 else []
    prompt_ids = [chat.encode_prompt(tokenizer, p) for p in prompts]
    completion_ids = tokenizer.encode_batch(completions)
    return [p + c + eos for p, c in zip(prompt_ids, completion_ids)]


def pad_rows(rows: Sequence[Sequence[int]], seq_len: int, pad_id: int) -> Batch:
    """Right-pads id lists to [N, seq_len] (host arrays); every row must fit and be non-empty."""
    tokens = np.full((len(rows), seq_len), max(pad_id, 0), np.int32)
    lengths = np.array([len(r) for r in rows], np.int32)
    for i, r in enumerate(rows):
        if not 1 <= len(r) <= seq_len:
            raise ValueError(f"row {i} has {len(r)} tokens; rows need 1 to seq_len={seq_len}")
        tokens[i, : len(r)] = r
    return Batch(tokens, lengths)


def encode_pairs(
    pairs: Sequence[preferences.Pair],
    tokenizer: tokenizer_lib.Tokenizer,
    seq_len: int,
    add_eos: bool = True,
) -> Encoded:
    """Tokenizes and pads pairs (`encode_rows`, `pad_rows`). Pairs with a side longer than
    `seq_len` are dropped with one warning (their number and first sources).

    Raises:
      ValueError: If there are no pairs, none fits, or a side has no tokens at all.
    """
    if not pairs:
        raise ValueError("no preference pairs to encode")
    prompts = [p.prompt for p in pairs for _ in range(2)]
    completions = [c for p in pairs for c in (p.chosen, p.rejected)]
    rows = encode_rows(tokenizer, prompts, completions, add_eos)
    empty = [pairs[i // 2].source or f"pair {i // 2}" for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(
            f"{len(empty)} sequences have no tokens (an empty prompt and completion, and a "
            f"tokenizer without BOS/EOS): {', '.join(empty[:5])}"
        )
    keep = [p for p in range(len(pairs)) if max(len(rows[2 * p]), len(rows[2 * p + 1])) <= seq_len]
    if len(keep) < len(pairs):
        long = sorted(set(range(len(pairs))) - set(keep))
        names = [pairs[p].source or f"pair {p}" for p in long[:5]]
        longest = max(len(r) for r in rows)
        logging.warning(
            "dropped %d of %d pairs longer than seq_len=%d tokens (the longest has %d): %s",
            len(long),
            len(pairs),
            seq_len,
            longest,
            ", ".join(names) + (", ..." if len(long) > 5 else ""),
        )
        if not keep:
            raise ValueError(
                f"every pair is longer than seq_len={seq_len} tokens (the longest has "
                f"{longest}); raise seq_len"
            )
    batch = pad_rows([rows[2 * p + s] for p in keep for s in (0, 1)], seq_len, tokenizer.padding_id)
    sources = [pairs[p].source or f"pair {p}" for p in keep]
    return Encoded(batch.tokens_NT, batch.lengths_N, sources)


def score_rows(spec, params, tokens_NT, lengths_N, chunk: int = 128) -> np.ndarray:
    """`score` [N] over any number of rows, `chunk` rows per call (`in_chunks`)."""
    return scalar_head.in_chunks(score, spec, params, tokens_NT, lengths_N, chunk)


def accuracy(spec, params, encoded: Encoded, chunk_pairs: int = 64) -> float:
    """The fraction of pairs the model orders right, r_c > r_r (a tie counts as wrong)."""
    r_N = score_rows(spec, params, encoded.tokens_NT, encoded.lengths_N, 2 * chunk_pairs)
    return float(np.mean(r_N[0::2] > r_N[1::2]))


def center(spec, params, encoded: Encoded, chunk_pairs: int = 64):
    """params with b shifted so that the mean reward over `encoded`'s rows is 0."""
    r_N = score_rows(spec, params, encoded.tokens_NT, encoded.lengths_N, 2 * chunk_pairs)
    head = params["head"]
    return {**params, "head": {**head, "b": head["b"] - jnp.float32(np.mean(r_N))}}


# ==========================================================================================
# Training.
# ==========================================================================================


def train(
    pairs: Sequence[preferences.Pair],
    tokenizer: tokenizer_lib.Tokenizer,
    cfg: RMConfig,
    steps: int,
    *,
    model: ModelConfig | str,
    heldout: Sequence[preferences.Pair] = (),
    log: Callable[[scalar_head.Record], None] | None = None,
) -> scalar_head.Trained:
    """Trains a reward model for `steps` steps of `cfg.batch_pairs` pairs (`loss`, through
    `scalar_head.fit`).

    Every `cfg.eval_every` steps and at the end it appends a `Record` to the history (and
    passes it to `log`). Afterwards b is set so that the training completions' mean reward
    is 0 (`center`).

    Args:
      pairs: the training pairs.
      tokenizer: the tokenizer of the policy the reward model will score.
      cfg: the settings.
      steps: optimizer steps.
      model: a `ModelConfig` (from scratch) or a policy checkpoint directory (`init`). A
        checkpoint that carries its own tokenizer must carry `tokenizer`.
      heldout: pairs to measure accuracy on.
      log: called with each `Record`.

    Raises:
      ValueError: On steps < 1, a tokenizer the model does not fit, or pairs that do not
        encode (`encode_pairs`).
    """
    model_cfg, graphdef, params = scalar_head.start(model, tokenizer, cfg, steps)
    train_set = encode_pairs(pairs, tokenizer, cfg.seq_len, cfg.add_eos)
    held = encode_pairs(heldout, tokenizer, cfg.seq_len, cfg.add_eos) if heldout else None
    stream = scalar_head.batch_indices(train_set.num_pairs, cfg.batch_pairs, cfg.seed)

    def next_batch():
        rows = (next(stream)[:, None] * 2 + np.arange(2)).reshape(-1)
        return Batch(train_set.tokens_NT[rows], train_set.lengths_N[rows])

    spec = decoder.ForwardSpec(graphdef)

    def heldout_accuracy(params):
        return None if held is None else accuracy(spec, params, held, cfg.eval_batch_pairs)

    params, history = scalar_head.fit(
        loss, graphdef, cfg, params, next_batch, heldout_accuracy, steps, log
    )
    params = center(spec, params, train_set, cfg.eval_batch_pairs)
    return scalar_head.Trained(model_cfg, graphdef, params, history)


def save(
    path: str,
    model_cfg: ModelConfig,
    params: dict,
    tokenizer: tokenizer_lib.Tokenizer,
    cfg: RMConfig,
    history: Sequence[scalar_head.Record] = (),
) -> None:
    """Writes a reward model directory (layout in the module docstring)."""
    path = os.path.abspath(path)
    checkpoint.save_params(
        os.path.join(path, scalar_head.DECODER_DIR), model_cfg, params["decoder"]
    )
    if jax.process_index() != 0:
        return
    head = jax.device_get(params["head"])
    np.savez(
        os.path.join(path, scalar_head.HEAD_FILE), w=np.asarray(head["w"]), b=np.asarray(head["b"])
    )
    scalar_head.save_tokenizer(path, tokenizer)
    meta = {
        "format": FORMAT,
        "config": dataclasses.asdict(cfg),
        "tokenizer": scalar_head.identity(tokenizer),
        "history": [r._asdict() for r in history],
    }
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


@dataclasses.dataclass(frozen=True)
class RewardModel:
    """A loaded reward model: what scores (prompt, completion) texts or id rows."""

    path: str
    model_cfg: ModelConfig
    graphdef: object
    params: dict
    tokenizer: tokenizer_lib.Tokenizer
    config: RMConfig

    @property
    def forward(self) -> decoder.ForwardSpec:
        """The description its scorers take."""
        return decoder.ForwardSpec(self.graphdef)

    def with_bucket(self, tokens: int) -> RewardModel:
        """This reward model scoring in one bucket of at least `tokens` tokens (the scores do
        not depend on the bucket): for rows longer than `config.seq_len`."""
        if tokens <= self.config.seq_len:
            return self
        return dataclasses.replace(self, config=dataclasses.replace(self.config, seq_len=tokens))

    def score_ids(self, rows: Sequence[Sequence[int]], chunk: int = 64) -> np.ndarray:
        """r [N] of id rows (prompt + completion ids, as `encode_rows` makes them).

        Raises:
          ValueError: If a row is empty or longer than `config.seq_len` (naming it).
        """
        return score_rows(
            self.forward,
            self.params,
            *pad_rows(rows, self.config.seq_len, self.tokenizer.padding_id),
            chunk,
        )

    def score_completions(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        chunk: int = 64,
    ) -> np.ndarray:
        """r [N] of sampled rows as the RL loop holds them: a prompt's ids (with its BOS) and
        a completion's ids, which end with the EOS when sampling stopped there. The EOS is
        appended to the others when `config.add_eos`, so every row is scored as in training."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
        eos = self.tokenizer.eos_id
        add = self.config.add_eos and eos >= 0
        rows = [
            [*p, *c] + ([eos] if add and (not len(c) or c[-1] != eos) else [])
            for p, c in zip(prompt_ids, completion_ids)
        ]
        return self.score_ids(rows, chunk)

    def score_texts(self, prompts: Sequence[str], completions: Sequence[str], chunk: int = 64):
        """r [N] of N (prompt, completion) rows, tokenized as in training."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        rows = encode_rows(self.tokenizer, prompts, completions, self.config.add_eos)
        return self.score_ids(rows, chunk)


def load(path: str, mesh=None) -> RewardModel:
    """Reads a reward model directory written by `save`.

    Raises:
      FileNotFoundError: If `path` is not a reward model directory.
      ValueError: On an unknown format or config key, a head that does not fit the decoder
        (naming the file), or tokenizer files other than the ones saved.
    """
    path = os.path.abspath(path)
    meta_path, meta = scalar_head.read_meta(path, META_FILE, FORMAT, "reward model")
    cfg = RMConfig.from_dict(meta["config"], source=f"{meta_path} config")
    model_cfg, graphdef, decoder_params = checkpoint.load_params(
        os.path.join(path, scalar_head.DECODER_DIR), mesh
    )
    head_path = os.path.join(path, scalar_head.HEAD_FILE)
    with np.load(head_path) as npz:
        head = {k: npz[k] for k in ("w", "b") if k in npz}
    want = {"w": (model_cfg.d_model,), "b": ()}
    if set(head) != set(want) or any(head[k].shape != want[k] for k in want):
        got = {k: v.shape for k, v in head.items()}
        raise ValueError(
            f"{head_path}: head {got}, expected {want} for d_model={model_cfg.d_model}"
        )
    head = sharding.replicate_unplaced(
        {k: jnp.asarray(v, jnp.float32) for k, v in head.items()},
        scalar_head.params_mesh({"decoder": decoder_params}),
    )
    tok = tokenizer_lib.load(path)
    # The copy must still be the tokenizer the model was saved with. Kind, size and special
    # ids, not the hash: another `tokenizers` version may write the same pipeline otherwise.
    saved = {k: v for k, v in meta["tokenizer"].items() if k != "sha256"}
    found = {k: v for k, v in scalar_head.identity(tok).items() if k != "sha256"}
    if saved != found:
        raise ValueError(
            f"{path}: the tokenizer files are not the ones saved with the reward model "
            f"({META_FILE} records {saved}, the files hold {found})"
        )
    return RewardModel(
        path, model_cfg, graphdef, {"decoder": decoder_params, "head": head}, tok, cfg
    )
