"""A Bradley-Terry reward model on the decoder: train it on preference pairs, score with it.

    python -m rlscale.reward_model --pairs train.jsonl --heldout test.jsonl \\
        --tokenizer PATH --out DIR [--init POLICY_DIR | --model tiny] [--steps N]

The reward of a completion y of a prompt x is a scalar head on the decoder's final-norm hidden
state at the sequence's last real token:

    r(x, y) = w . h(x ++ y)[last] + b,

and the model is fitted to pairs (x, y_c preferred to y_r) by the Bradley-Terry likelihood
(Bradley & Terry 1952, "Rank Analysis of Incomplete Block Designs"), as in InstructGPT's
reward model (Ouyang et al. 2022, arXiv 2203.02155):

    P(y_c > y_r | x) = sigmoid(r_c - r_r),   loss = -log sigmoid(r_c - r_r),

    d loss / d r_c = -sigmoid(r_r - r_c) = -d loss / d r_r.

The loss depends on rewards only through differences, so b receives no gradient: `train`
sets it afterwards so that the mean reward over the training completions is 0 (InstructGPT
normalizes its reward model the same way, on demonstrations, before RL).

The head is a plain params pytree next to the decoder's, `params = {"decoder": <the decoder's
nnx.State>, "head": {"w": f32[D], "b": f32[]}}`, rather than an NNX module around the
decoder: the decoder keeps its one graphdef and its params layout, so a policy checkpoint
(`checkpoint.load_params`) initializes the reward model as is, the decoder part saves and
loads with `checkpoint.save_params` / `load_params` unchanged (an RM's `decoder/` is a policy
checkpoint), and two arrays need no module. The policy's LM head [D, V] is kept in
`params["decoder"]` (the graphdef needs it) but unused and frozen: the optimizer holds no
moments for it (`make_optimizer`). The head is initialized w ~ N(0, 1 / (D + 1)), b = 0, as in
Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593).

Sequences: the prompt's ids (`chat.encode_prompt`: the BOS when the tokenizer has one, then
the text) then the completion's ids, encoded separately as the RL loop sees them, then the
EOS when `RMConfig.add_eos` (so the scored token is the same kind of token for every row),
right-padded to one bucket of `seq_len` tokens (one compiled program). A pair with a side
longer than the bucket is dropped, with one warning counting them. A batch holds P pairs as
N = 2P rows, row 2p chosen and row 2p + 1 rejected (the layout of
`rlscale.objectives.preference`).

A saved reward model (`save`, `load`) is a directory:

    decoder/             the decoder: `checkpoint.save_params` (model_config.json, params/)
    head.npz             w [D] and b []
    tokenizer.model      a copy of the tokenizer (SentencePiece), or tokenizer.json and
                         tokenizer_config.json (Hugging Face): `tokenizer.load(DIR)` reads it
    reward_model.json    the `RMConfig`, the tokenizer's identity (kind, vocab size, special
                         ids, sha256 fingerprint) and the training history

`check_tokenizer(rm_dir, tokenizer)` refuses a tokenizer other than the one the reward model
was trained with, naming both: a policy's completions tokenized differently would be scored
as other text.

Dimension letters: P pairs, N rows (2P in a pair batch), T tokens (the bucket), D model width.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from rlscale import chat, checkpoint, cli, console, optim, sharding
from rlscale import model as model_lib
from rlscale import tokenizer as tokenizer_lib
from rlscale.data import preferences
from rlscale.model import decoder
from rlscale.model.config import ModelConfig

FORMAT = 1  # Version of reward_model.json's layout.
META_FILE = "reward_model.json"
HEAD_FILE = "head.npz"
DECODER_DIR = "decoder"
_PROBE = "The answer is 42. Café, naïve: ok!"  # Shown encoded by both sides of a mismatch.
_SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What every scalar head on the decoder (this module's reward model, `process_reward`'s
    PRM) trains and scores with: the bucket, remat, evaluation cadence and AdamW. A subclass
    adds its batch fields and names its `KIND` in messages.

    The optimizer fields have the names and meaning of the RL config's `optim`
    (`make_optimizer`).

    Attributes:
      seq_len: the bucket T: every sequence is padded to it.
      remat: what each block's backward keeps (`decoder.REMAT_POLICIES`).
      eval_every: steps between held-out evaluations (and history records) in `train`.
      seed: the head's init and the order of the training rows.
      lr, warmup_steps, schedule, decay_steps, final_lr_frac, grad_clip, b1, b2, eps,
        weight_decay: AdamW (`make_optimizer`).
    """

    KIND: ClassVar[str] = "scoring head"

    seq_len: int = 256
    remat: str = "none"
    eval_every: int = 50
    seed: int = 0
    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: str = "constant"
    decay_steps: int = 1000
    final_lr_frac: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def settings_problems(self, counts: tuple[str, ...] = ()) -> list[str]:
        """Every problem with these settings; `counts`, a subclass's fields that must be >= 1,
        are checked after `seq_len`."""
        problems = []
        for name in ("seq_len", *counts, "eval_every", "decay_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("lr", "grad_clip", "eps"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        for name in ("warmup_steps", "weight_decay"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("b1", "b2", "final_lr_frac"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.schedule not in _SCHEDULES:
            problems.append(f"schedule={self.schedule!r} is not one of {_SCHEDULES}")
        if self.remat not in decoder.REMAT_POLICIES:
            problems.append(f"remat={self.remat!r} is not one of {tuple(decoder.REMAT_POLICIES)}")
        return problems

    def _raise(self, problems: list[str]) -> None:
        if problems:
            raise ValueError(f"Invalid {self.KIND} config: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None):
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{source or cls.__name__}: unknown {cls.KIND} config keys {unknown}")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class RMConfig(TrainSettings):
    """Reward-model training and scoring settings (`TrainSettings`, each sequence being
    prompt + completion + EOS); static (hashable) for `train_step`.

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
# Params: init, the optimizer.
# ==========================================================================================


def init_head(d_model: int, rng: jax.Array) -> dict:
    """{"w": N(0, 1 / (D + 1)) [D], "b": 0 []} in float32 (Ziegler et al. 2019)."""
    w = jax.random.normal(rng, (d_model,), jnp.float32) / np.sqrt(d_model + 1.0)
    return {"w": w, "b": jnp.zeros((), jnp.float32)}


def init(model: ModelConfig | str, rng: jax.Array, *, mesh=None):
    """(model_cfg, graphdef, params) of a new reward model.

    Args:
      model: a `ModelConfig` (a decoder from scratch) or a policy checkpoint directory
        (`checkpoint.save_params`: a run's `WORKDIR/final`, a converted Hugging Face model).
      rng: initializes the head (and the decoder, from scratch).
      mesh: where the params go (`sharding.TRAIN_RULES`; the head replicated); default one
        device, as `checkpoint.load_params` does.
    """
    if mesh is None:
        mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    decoder_rng, head_rng = jax.random.split(rng)
    if isinstance(model, ModelConfig):
        cfg = model
        graphdef, decoder_params = decoder.init_sharded(cfg, decoder_rng, mesh)
    else:
        cfg, graphdef, decoder_params = checkpoint.load_params(model, mesh)
    head = _replicated(init_head(cfg.d_model, head_rng), mesh)
    return cfg, graphdef, {"decoder": decoder_params, "head": head}


def _replicated(tree, mesh):
    """Every leaf not yet placed on a mesh, replicated on `mesh`: jitted steps then see the
    same input shardings at every call (an uncommitted array compiles another program)."""
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(x):
        if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding):
            return x
        return jax.device_put(x, spec)

    return jax.tree.map(place, tree)


def _mesh(params):
    return jax.tree.leaves(params["decoder"])[0].sharding.mesh


def _labels(params):
    """Each leaf's optimizer: the LM head (unused by the reward) "frozen", the rest "train"."""

    def label(path, _):
        return "frozen" if any(getattr(k, "key", None) == "lm_head" for k in path) else "train"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(cfg: RMConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup, a constant or cosine schedule and global-norm clipping (the
    RL learner's `optim` settings, same names and meaning), on everything but the LM head,
    which gets no update and no optimizer state. Params are float32 (`train` casts)."""
    adamw = optim.make_optimizer(cfg)
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, _labels)


def init_opt_state(cfg: RMConfig, params):
    """The optimizer state, on the params' mesh."""
    return _replicated(make_optimizer(cfg).init(params), _mesh(params))


# ==========================================================================================
# Pure functions: rewards, the loss, the train step.
# ==========================================================================================


class Batch(NamedTuple):
    """Right-padded rows: ids [N, T] and the number of real tokens of each, [N] (>= 1)."""

    tokens_NT: jax.Array
    lengths_N: jax.Array


def rewards(graphdef, params, tokens_NT, lengths_N, remat: str = "none"):
    """r [N] in float32: the head on the final-norm hidden state at token `lengths_N - 1` of
    each row. Tokens after it (padding) are masked, and attention is causal, so they change
    nothing."""
    T = tokens_NT.shape[1]
    mask_NT = jnp.arange(T)[None, :] < lengths_N[:, None]
    positions_NT = decoder.positions_from_mask(mask_NT)
    h_NTD, _ = decoder.hidden(
        graphdef, params["decoder"], tokens_NT, positions_NT, mask_NT, remat=remat
    )
    last_N = jnp.clip(lengths_N - 1, 0, T - 1)
    h_ND = h_NTD[jnp.arange(tokens_NT.shape[0]), last_N].astype(jnp.float32)
    head = params["head"]
    return h_ND @ head["w"] + head["b"]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def score(graphdef, params, tokens_NT, lengths_N):
    """`rewards`, jitted: r(x, y) [N] for right-padded rows (`Batch`)."""
    return rewards(graphdef, params, tokens_NT, lengths_N)


def pair_loss(r_c_P, r_r_P):
    """Bradley-Terry: (sum_p -log sigmoid(r_c - r_r), P), the sum and its denominator, so
    accumulation over micro-batches is exact. d sum / d r_c_p = -sigmoid(r_r_p - r_c_p)."""
    return jnp.sum(-jax.nn.log_sigmoid(r_c_P - r_r_P)), jnp.float32(r_c_P.shape[0])


@functools.partial(
    jax.jit, static_argnames=("graphdef", "cfg"), donate_argnames=("params", "opt_state")
)
def train_step(graphdef, cfg: RMConfig, params, opt_state, batch: Batch):
    """One AdamW step on the mean pair loss of a batch of P pairs (rows 2p chosen, 2p + 1
    rejected). Returns (params, opt_state, metrics): `loss`, `accuracy` (the fraction with
    r_c > r_r), `margin` (mean r_c - r_r) and `grad_norm`, before the update."""
    optimizer = make_optimizer(cfg)

    def loss_fn(p):
        r_N = rewards(graphdef, p, batch.tokens_NT, batch.lengths_N, cfg.remat)
        r_c, r_r = r_N[0::2], r_N[1::2]
        total, n = pair_loss(r_c, r_r)
        return total / n, (r_c, r_r)

    (loss, (r_c, r_r)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {
        "loss": loss,
        "accuracy": jnp.mean((r_c > r_r).astype(jnp.float32)),
        "margin": jnp.mean(r_c - r_r),
        "grad_norm": optax.tree.norm(grads),
    }
    return params, opt_state, metrics


# ==========================================================================================
# Host side: tokenization, batches, scoring in chunks, accuracy.
# ==========================================================================================


class Encoded(NamedTuple):
    """Pairs as padded rows: `tokens_NT` int32 [2P, T] (row 2p chosen, 2p + 1 rejected),
    `lengths_N` int32 [2P], and each pair's `source`."""

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


def in_chunks(fn, graphdef, params, tokens_NT, lengths_N, chunk: int, row_shape=()) -> np.ndarray:
    """`fn(graphdef, params, tokens, lengths)` (a jitted per-row function, each row's output
    of shape `row_shape`) over any number of rows, `chunk` rows per call: the last chunk is
    padded with one-token rows (scored and dropped), so every call has the same shape and
    compiles once."""
    tokens_NT, lengths_N = np.asarray(tokens_NT), np.asarray(lengths_N)
    N, T = tokens_NT.shape
    out = []
    for start in range(0, N, chunk):
        t, n = tokens_NT[start : start + chunk], lengths_N[start : start + chunk]
        fill = chunk - len(n)
        if fill:
            t = np.concatenate([t, np.zeros((fill, T), t.dtype)])
            n = np.concatenate([n, np.ones(fill, n.dtype)])
        out.append(np.asarray(jax.device_get(fn(graphdef, params, t, n)))[: chunk - fill])
    return np.concatenate(out) if out else np.zeros((0, *row_shape), np.float32)


def score_rows(graphdef, params, tokens_NT, lengths_N, chunk: int = 128) -> np.ndarray:
    """`score` [N] over any number of rows (`in_chunks`)."""
    return in_chunks(score, graphdef, params, tokens_NT, lengths_N, chunk)


def accuracy(graphdef, params, encoded: Encoded, chunk_pairs: int = 64) -> float:
    """The fraction of pairs the model orders right, r_c > r_r (a tie counts as wrong)."""
    r_N = score_rows(graphdef, params, encoded.tokens_NT, encoded.lengths_N, 2 * chunk_pairs)
    return float(np.mean(r_N[0::2] > r_N[1::2]))


def center(graphdef, params, encoded: Encoded, chunk_pairs: int = 64):
    """params with b shifted so that the mean reward over `encoded`'s rows is 0."""
    r_N = score_rows(graphdef, params, encoded.tokens_NT, encoded.lengths_N, 2 * chunk_pairs)
    head = params["head"]
    return {**params, "head": {**head, "b": head["b"] - jnp.float32(np.mean(r_N))}}


# ==========================================================================================
# Training.
# ==========================================================================================


class Record(NamedTuple):
    """One point of the training history: the mean training loss over the steps since the
    previous record, and the held-out accuracy then (None without held-out pairs)."""

    step: int
    loss: float
    heldout_accuracy: float | None


class Trained(NamedTuple):
    model_cfg: ModelConfig
    graphdef: object
    params: dict
    history: list[Record]


def batch_indices(num_pairs: int, batch_pairs: int, seed: int) -> Iterator[np.ndarray]:
    """Batches of pair indices: each epoch a fresh seeded permutation, read in order (a batch
    runs across the boundary into the next one), so every pair is seen once per epoch."""
    rng = np.random.default_rng(seed)
    buffer = np.zeros(0, np.int64)
    while True:
        while len(buffer) < batch_pairs:
            buffer = np.concatenate([buffer, rng.permutation(num_pairs)])
        yield buffer[:batch_pairs]
        buffer = buffer[batch_pairs:]


def check_directory_tokenizer(
    directory: str, tokenizer: tokenizer_lib.Tokenizer, what: str
) -> None:
    """When `directory` holds its own tokenizer, it must be `tokenizer` (names both if not)."""
    if _has_tokenizer(directory):
        saved = tokenizer_lib.load(directory)
        if not same_tokenizer(saved, tokenizer):
            raise ValueError(
                _mismatch(f"{what} {directory}", saved, "the given tokenizer", tokenizer)
            )


def train(
    pairs: Sequence[preferences.Pair],
    tokenizer: tokenizer_lib.Tokenizer,
    cfg: RMConfig,
    steps: int,
    *,
    model: ModelConfig | str,
    heldout: Sequence[preferences.Pair] = (),
    log: Callable[[Record], None] | None = None,
) -> Trained:
    """Trains a reward model for `steps` steps of `cfg.batch_pairs` pairs (`train_step`).

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
    model_cfg, graphdef, params = start(model, tokenizer, cfg, steps)
    train_set = encode_pairs(pairs, tokenizer, cfg.seq_len, cfg.add_eos)
    held = encode_pairs(heldout, tokenizer, cfg.seq_len, cfg.add_eos) if heldout else None
    stream = batch_indices(train_set.num_pairs, cfg.batch_pairs, cfg.seed)

    def next_batch():
        rows = (next(stream)[:, None] * 2 + np.arange(2)).reshape(-1)
        return Batch(train_set.tokens_NT[rows], train_set.lengths_N[rows])

    def heldout_accuracy(params):
        return None if held is None else accuracy(graphdef, params, held, cfg.eval_batch_pairs)

    params, history = fit(
        train_step, graphdef, cfg, params, next_batch, heldout_accuracy, steps, log
    )
    params = center(graphdef, params, train_set, cfg.eval_batch_pairs)
    return Trained(model_cfg, graphdef, params, history)


def start(model: ModelConfig | str, tokenizer: tokenizer_lib.Tokenizer, cfg, steps: int):
    """(model_cfg, graphdef, params) of a scalar head to train (`init`) for `steps` steps
    with `cfg` (`TrainSettings`), float32 for AdamW (the compute dtype kept).

    Raises:
      ValueError: On steps < 1, a checkpoint that carries another tokenizer, a tokenizer the
        model does not fit, or a bucket longer than the model's `max_seq_len`.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    if not isinstance(model, ModelConfig):
        model = os.fspath(model)
        check_directory_tokenizer(model, tokenizer, "the policy checkpoint")
    model_cfg, graphdef, params = init(model, jax.random.key(cfg.seed))
    if model_cfg.param_dtype != "float32":  # AdamW on float32 params (compute dtype kept).
        model_cfg = dataclasses.replace(model_cfg, param_dtype="float32")
        graphdef, _ = decoder.abstract_model(model_cfg)
        params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
            f"{model_cfg.vocab_size}: not the tokenizer this model was built for"
        )
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(
            f"seq_len={cfg.seq_len} exceeds the model's max_seq_len={model_cfg.max_seq_len}"
        )
    return model_cfg, graphdef, params


def fit(train_step_fn, graphdef, cfg, params, next_batch, heldout_accuracy, steps, log=None):
    """`steps` optimizer steps of `train_step_fn(graphdef, cfg, params, opt_state, batch)`
    on `next_batch()`; every `cfg.eval_every` steps and at the end a `Record` (mean training
    loss since the last one, `heldout_accuracy(params)`) goes to the history and to `log`.
    Returns (params, history)."""
    opt_state = init_opt_state(cfg, params)
    history, loss_sum, since = [], jnp.zeros((), jnp.float32), 0
    for step in range(1, steps + 1):
        params, opt_state, metrics = train_step_fn(graphdef, cfg, params, opt_state, next_batch())
        loss_sum, since = loss_sum + metrics["loss"], since + 1
        if step % cfg.eval_every == 0 or step == steps:
            record = Record(step, float(loss_sum) / since, heldout_accuracy(params))
            history.append(record)
            if log is not None:
                log(record)
            loss_sum, since = jnp.zeros((), jnp.float32), 0
    return params, history


# ==========================================================================================
# Tokenizer identity.
# ==========================================================================================


def fingerprint(tokenizer: tokenizer_lib.Tokenizer) -> str:
    """sha256 of what defines the tokenizer: a SentencePiece model's serialized proto, or a
    Hugging Face pipeline (`tokenizer.json` as the `tokenizers` library writes it) with its
    bos/eos/pad tokens."""
    h = hashlib.sha256()
    if isinstance(tokenizer, tokenizer_lib.SentencePieceTokenizer):
        h.update(b"sentencepiece\0" + tokenizer.serialized)
    elif isinstance(tokenizer, tokenizer_lib.HFTokenizer):
        h.update(b"hf\0" + tokenizer.backend.to_str().encode())
        h.update(json.dumps(tokenizer.special_tokens, sort_keys=True).encode())
    else:
        raise TypeError(f"no fingerprint for {type(tokenizer).__name__}")
    return h.hexdigest()


def same_tokenizer(a: tokenizer_lib.Tokenizer, b: tokenizer_lib.Tokenizer) -> bool:
    """Whether two tokenizers are the same: equal fingerprints, or, for a SentencePiece model
    and a Hugging Face tokenizer, the SentencePiece model's `to_hf()` conversion (what
    `tools/convert.py` exports with a policy) equals the other."""
    if fingerprint(a) == fingerprint(b):
        return True
    if type(a) is type(b):
        return False
    try:
        return fingerprint(a.to_hf()) == fingerprint(b.to_hf())
    except ValueError:  # A SentencePiece setting the conversion cannot reproduce.
        return False


def identity(tokenizer: tokenizer_lib.Tokenizer) -> dict:
    """What reward_model.json records of the tokenizer."""
    return {
        "kind": type(tokenizer).__name__,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "sha256": fingerprint(tokenizer),
    }


def _describe(name: str, tokenizer: tokenizer_lib.Tokenizer) -> str:
    i = identity(tokenizer)
    return f"{name} ({i['kind']}, vocab {i['vocab_size']}, sha256 {i['sha256'][:12]})"


def _mismatch(name_a: str, a, name_b: str, b) -> str:
    return (
        f"tokenizer mismatch: {_describe(name_a, a)} is not {_describe(name_b, b)}; "
        f"{_PROBE!r} encodes to {a.encode(_PROBE)[:12]} against {b.encode(_PROBE)[:12]}"
    )


def _has_tokenizer(directory: str) -> bool:
    return os.path.isdir(directory) and any(
        os.path.isfile(os.path.join(directory, f))
        for f in (tokenizer_lib.HF_TOKENIZER_FILE, tokenizer_lib.SENTENCEPIECE_FILE)
    )


def check_tokenizer(rm_dir: str, tokenizer: tokenizer_lib.Tokenizer | str) -> None:
    """Raises ValueError, naming both, unless `tokenizer` (an object or a `tokenizer.load`
    path) is the one the reward model in `rm_dir` was trained with (`same_tokenizer`).

    Both are compared as loaded now, not against the hash in reward_model.json: another
    version of the `tokenizers` library may write the same pipeline differently."""
    name = "the policy's tokenizer"
    if isinstance(tokenizer, str | os.PathLike):
        name, tokenizer = (
            f"the policy's tokenizer {os.fspath(tokenizer)}",
            tokenizer_lib.load(tokenizer),
        )
    if not _has_tokenizer(rm_dir):
        raise ValueError(f"{rm_dir}: no tokenizer saved with the reward model")
    saved = tokenizer_lib.load(rm_dir)
    if not same_tokenizer(saved, tokenizer):
        raise ValueError(
            _mismatch(f"the reward model {rm_dir}'s tokenizer", saved, name, tokenizer)
        )


# ==========================================================================================
# Save and load.
# ==========================================================================================


def _save_tokenizer(path: str, tokenizer: tokenizer_lib.Tokenizer) -> None:
    """A copy where `tokenizer.load(path)` finds it; the other kind's files are removed (a
    stale tokenizer.json would win over a new tokenizer.model)."""
    sp = os.path.join(path, tokenizer_lib.SENTENCEPIECE_FILE)
    hf_files = [
        os.path.join(path, f)
        for f in (tokenizer_lib.HF_TOKENIZER_FILE, tokenizer_lib.HF_CONFIG_FILE)
    ]
    if isinstance(tokenizer, tokenizer_lib.SentencePieceTokenizer):
        for f in hf_files:
            if os.path.exists(f):
                os.remove(f)
        with open(sp, "wb") as f:
            f.write(tokenizer.serialized)
    else:
        if os.path.exists(sp):
            os.remove(sp)
        tokenizer.to_hf().save(path)


def save(
    path: str,
    model_cfg: ModelConfig,
    params: dict,
    tokenizer: tokenizer_lib.Tokenizer,
    cfg: RMConfig,
    history: Sequence[Record] = (),
) -> None:
    """Writes a reward model directory (layout in the module docstring)."""
    path = os.path.abspath(path)
    checkpoint.save_params(os.path.join(path, DECODER_DIR), model_cfg, params["decoder"])
    if jax.process_index() != 0:
        return
    head = jax.device_get(params["head"])
    np.savez(os.path.join(path, HEAD_FILE), w=np.asarray(head["w"]), b=np.asarray(head["b"]))
    _save_tokenizer(path, tokenizer)
    meta = {
        "format": FORMAT,
        "config": dataclasses.asdict(cfg),
        "tokenizer": identity(tokenizer),
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
            self.graphdef,
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


def read_meta(path: str, meta_file: str, fmt: int, kind: str) -> tuple[str, dict]:
    """(its path, its contents) of a saved model's metadata file `meta_file` in `path`.

    Raises:
      FileNotFoundError: If there is none: `path` is not a `kind` directory.
      ValueError: If its format is not `fmt`.
    """
    meta_path = os.path.join(path, meta_file)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} does not exist: not a {kind} directory")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != fmt:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {fmt}")
    return meta_path, meta


def load(path: str, mesh=None) -> RewardModel:
    """Reads a reward model directory written by `save`.

    Raises:
      FileNotFoundError: If `path` is not a reward model directory.
      ValueError: On an unknown format or config key, a head that does not fit the decoder
        (naming the file), or tokenizer files other than the ones saved.
    """
    path = os.path.abspath(path)
    meta_path, meta = read_meta(path, META_FILE, FORMAT, "reward model")
    cfg = RMConfig.from_dict(meta["config"], source=f"{meta_path} config")
    model_cfg, graphdef, decoder_params = checkpoint.load_params(
        os.path.join(path, DECODER_DIR), mesh
    )
    head_path = os.path.join(path, HEAD_FILE)
    with np.load(head_path) as npz:
        head = {k: npz[k] for k in ("w", "b") if k in npz}
    want = {"w": (model_cfg.d_model,), "b": ()}
    if set(head) != set(want) or any(head[k].shape != want[k] for k in want):
        got = {k: v.shape for k, v in head.items()}
        raise ValueError(
            f"{head_path}: head {got}, expected {want} for d_model={model_cfg.d_model}"
        )
    head = _replicated(
        {k: jnp.asarray(v, jnp.float32) for k, v in head.items()},
        _mesh({"decoder": decoder_params}),
    )
    tok = tokenizer_lib.load(path)
    # The copy must still be the tokenizer the model was saved with. Kind, size and special
    # ids, not the hash: another `tokenizers` version may write the same pipeline otherwise.
    saved = {k: v for k, v in meta["tokenizer"].items() if k != "sha256"}
    found = {k: v for k, v in identity(tok).items() if k != "sha256"}
    if saved != found:
        raise ValueError(
            f"{path}: the tokenizer files are not the ones saved with the reward model "
            f"({META_FILE} records {saved}, the files hold {found})"
        )
    return RewardModel(
        path, model_cfg, graphdef, {"decoder": decoder_params, "head": head}, tok, cfg
    )


# ==========================================================================================
# The command.
# ==========================================================================================


def main(argv: Sequence[str] | None = None) -> dict:
    """`python -m rlscale.reward_model ...` (see the module docstring); returns the summary."""
    defaults = RMConfig()
    p = cli.ArgumentParser(
        prog="python -m rlscale.reward_model",
        description="Train a Bradley-Terry reward model on preference pairs.",
    )
    p.add_argument("--pairs", required=True, help="training pairs (prompt/chosen/rejected rows)")
    p.add_argument("--heldout", default=None, help="held-out pairs: accuracy is measured on them")
    p.add_argument("--out", required=True, help="directory to write the reward model to")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer path (tokenizer.load); default: the --init checkpoint's own",
    )
    init_group = p.add_mutually_exclusive_group()
    init_group.add_argument("--init", default=None, help="policy checkpoint to start from")
    init_group.add_argument(
        "--model", default="tiny", help="named architecture from scratch (default tiny)"
    )
    p.add_argument("--steps", type=int, default=200)
    for name in ("seq_len", "batch_pairs", "eval_every", "seed", "warmup_steps"):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    for name in ("lr", "weight_decay"):
        p.add_argument(f"--{name}", type=float, default=getattr(defaults, name))
    for name in ("prompt_field", "chosen_field", "rejected_field"):
        p.add_argument(f"--{name}", default=name.split("_")[0])
    args = p.parse_args(argv)

    cfg = RMConfig(
        **{
            k: getattr(args, k)
            for k in ("seq_len", "batch_pairs", "eval_every", "seed", "warmup_steps")
        },
        lr=args.lr,
        weight_decay=args.weight_decay,
    )
    if args.init is not None and not os.path.isdir(args.init):
        raise ValueError(f"--init={args.init}: no such directory")
    if args.tokenizer is None:
        if not (args.init and _has_tokenizer(args.init)):
            raise ValueError("--tokenizer: required unless --init holds its own tokenizer")
        args.tokenizer = args.init
    tok = tokenizer_lib.load(args.tokenizer)
    model = args.init or model_lib.get(args.model, vocab_size=tok.vocab_size)
    fields = {k: getattr(args, k) for k in ("prompt_field", "chosen_field", "rejected_field")}
    pairs = preferences.read_pairs(args.pairs, **fields)
    heldout = preferences.read_pairs(args.heldout, **fields) if args.heldout else []
    cli.make_dir(args.out, "--out")

    return train_and_save(
        train,
        save,
        pairs,
        heldout,
        tok,
        cfg,
        args.steps,
        model,
        args.out,
        kind="reward model",
        rows_name="pairs",
        metric="accuracy",
    )


def train_and_save(
    train_fn, save_fn, rows, heldout, tok, cfg, steps, model, out, *, kind, rows_name, metric
) -> dict:
    """What the training commands (this module's and `process_reward`'s) share: trains
    (`train_fn`, logging each record on stderr), saves (`save_fn`) to `out`, prints the
    held-out `metric` and where the `kind` was written, and returns the summary:
    `train_{rows_name}`, `heldout_{rows_name}`, `steps`, `final_loss`, `heldout_{metric}`
    (spaces as underscores), `out`."""
    key = "heldout_" + metric.replace(" ", "_")

    def log(r: Record):
        acc = "" if r.heldout_accuracy is None else f"  held-out {metric} {r.heldout_accuracy:.3f}"
        print(f"step {r.step}/{steps}  loss {r.loss:.4f}{acc}", file=sys.stderr, flush=True)

    trained = train_fn(rows, tok, cfg, steps, model=model, heldout=heldout, log=log)
    save_fn(out, trained.model_cfg, trained.params, tok, cfg, trained.history)
    summary = {
        f"train_{rows_name}": len(rows),
        f"heldout_{rows_name}": len(heldout),
        "steps": steps,
        "final_loss": trained.history[-1].loss,
        key: trained.history[-1].heldout_accuracy,
        "out": os.path.abspath(out),
    }
    acc = summary[key]
    print(
        f"held-out {metric} {acc:.4f} ({len(heldout)} {rows_name})"
        if acc is not None
        else f"held-out {metric}: no held-out {rows_name}"
    )
    print(f"{kind} written to {summary['out']}")
    return summary


if __name__ == "__main__":
    console.configure(0)  # Warnings (dropped pairs) and rlscale's status lines on stderr.
    cli.guard(main)()
