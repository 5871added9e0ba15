"""Scalar heads on the decoder: what the reward model (`bradley_terry`) and the PRM (`prm`)
share. The params `{"decoder": <the decoder's nnx.State>, "head": {"w": f32[D], "b": f32[]}}`
(a policy checkpoint initializes the decoder as is; the unused LM head is frozen), the forward
pass's description (`decoder.ForwardSpec`), the training settings, training through the one
supervised loop (`supervised.fit`) with held-out records, scoring in fixed-shape chunks, the saved
directory's metadata, and the tokenizer's identity (a head refuses a tokenizer other than the
one it was trained with, naming both).

Dimension letters: N rows, T tokens (the bucket), D model width.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlscale import checkpoint, optim, sharding, supervised
from rlscale import tokenizers as tokenizer_lib
from rlscale.model import decoder
from rlscale.model.config import ModelConfig

HEAD_FILE = "head.npz"
DECODER_DIR = "decoder"
_PROBE = "The answer is 42. Café, naïve: ok!"  # Shown encoded by both sides of a mismatch.
_SCHEDULES = ("constant", "cosine")
FROZEN = ("lm_head",)  # Unused by a scalar head: no update, no optimizer state.


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

    def optim_settings(self) -> optim.OptimConfig:
        """The AdamW fields, as `optim.make_optimizer` reads them."""
        return optim.OptimConfig.of(self)

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
    head = sharding.replicate_unplaced(init_head(cfg.d_model, head_rng), mesh)
    return cfg, graphdef, {"decoder": decoder_params, "head": head}


def params_mesh(params):
    return jax.tree.leaves(params["decoder"])[0].sharding.mesh


def in_chunks(
    fn, spec: decoder.ForwardSpec, params, tokens_NT, lengths_N, chunk: int, row_shape=()
):
    """`fn(spec, params, tokens, lengths)` (a jitted per-row function, each row's output
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
        out.append(np.asarray(jax.device_get(fn(spec, params, t, n)))[: chunk - fill])
    return np.concatenate(out) if out else np.zeros((0, *row_shape), np.float32)


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

    @property
    def forward(self) -> decoder.ForwardSpec:
        """The description its scorers take."""
        return decoder.ForwardSpec(self.graphdef)


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
    if has_tokenizer(directory):
        saved = tokenizer_lib.load(directory)
        if not same_tokenizer(saved, tokenizer):
            raise ValueError(
                _mismatch(f"{what} {directory}", saved, "the given tokenizer", tokenizer)
            )


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


def fit_spec(loss, graphdef, cfg) -> supervised.Fit:
    """What a scalar head's training step is compiled for: `loss` (`bradley_terry.loss`,
    `prm.loss`) over `ForwardSpec(graphdef, cfg.remat)`, AdamW from `cfg` (`TrainSettings`), the
    LM head frozen."""
    spec = decoder.ForwardSpec(graphdef, cfg.remat)
    return supervised.Fit(loss, spec, cfg.optim_settings(), FROZEN)


def fit(loss, graphdef, cfg, params, next_batch, heldout_accuracy, steps, log=None):
    """`steps` steps of the one supervised loop (`supervised.fit`, `fit_spec`) on
    `next_batch()`; every `cfg.eval_every` steps and at the end a `Record` (mean training
    loss since the last one, `heldout_accuracy(params)`) goes to the history and to `log`.
    Returns (params, history)."""
    history = []

    def record(params, progress: supervised.Progress) -> None:
        history.append(Record(progress.step, progress.mean_loss, heldout_accuracy(params)))
        if log is not None:
            log(history[-1])

    spec = fit_spec(loss, graphdef, cfg)
    params, _ = supervised.fit(
        spec, params, next_batch, steps, every=cfg.eval_every, callback=record
    )
    return params, history


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


def has_tokenizer(directory: str) -> bool:
    return os.path.isdir(directory) and any(
        os.path.isfile(os.path.join(directory, f))
        for f in (tokenizer_lib.HF_TOKENIZER_FILE, tokenizer_lib.SENTENCEPIECE_FILE)
    )


def check_tokenizer(rm_dir: str, tokenizer: tokenizer_lib.Tokenizer | str) -> None:
    """Raises ValueError, naming both, unless `tokenizer` (an object or a `tokenizers.load`
    path) is the one the reward model in `rm_dir` was trained with (`same_tokenizer`).

    Both are compared as loaded now, not against the hash in reward_model.json: another
    version of the `tokenizers` library may write the same pipeline differently."""
    name = "the policy's tokenizer"
    if isinstance(tokenizer, str | os.PathLike):
        name, tokenizer = (
            f"the policy's tokenizer {os.fspath(tokenizer)}",
            tokenizer_lib.load(tokenizer),
        )
    if not has_tokenizer(rm_dir):
        raise ValueError(f"{rm_dir}: no tokenizer saved with the reward model")
    saved = tokenizer_lib.load(rm_dir)
    if not same_tokenizer(saved, tokenizer):
        raise ValueError(
            _mismatch(f"the reward model {rm_dir}'s tokenizer", saved, name, tokenizer)
        )


# ==========================================================================================
# Save and load.
# ==========================================================================================


def save_tokenizer(path: str, tokenizer: tokenizer_lib.Tokenizer) -> None:
    """A copy where `tokenizers.load(path)` finds it; the other kind's files are removed (a
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
