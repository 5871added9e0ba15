"""Tokenizers: the `Tokenizer` interface and its SentencePiece and Hugging Face backends.

The rest of rlscale only sees `Tokenizer`: text to ids and back, the special ids
and a lookup for marker pieces such as `</think>`. `SentencePieceTokenizer` wraps
a SentencePiece model, and `train_sentencepiece` builds one in memory from a
corpus, with fixed special ids (pad 0, unk 1, bos 2, eos 3) so that downstream
code can rely on padding with 0. `HFTokenizer` wraps a Hugging Face `tokenizer.json`
(the `tokenizers` library, what transformers' fast tokenizers run), with its special
tokens from `tokenizer_config.json`. `load(path)` picks the backend from what is on disk.
`Tokenizer.to_hf()` gives any of them as an `HFTokenizer` (a SentencePiece model converted to
an equivalent `tokenizer.json`), which `HFTokenizer.save` writes where transformers'
`AutoTokenizer` reads it: how an exported policy carries its tokenizer.
"""

from __future__ import annotations

import abc
import io
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence

import sentencepiece as spm
import tokenizers
from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, decoders, models, normalizers, processors

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
_SPECIAL_PIECES = ("<pad>", "<unk>", "<s>", "</s>")

# With byte_fallback every model carries one piece per byte value, so that any
# UTF-8 text encodes without <unk>.
_NUM_BYTE_PIECES = 256
# "word" is left out: it byte-encodes the "▁" of unseen words, which then
# decodes as "▁" instead of a space, breaking exact round trips.
_MODEL_TYPES = ("bpe", "unigram", "char")


class Tokenizer(abc.ABC):
    """Maps text to token ids and back.

    Special ids are -1 when the model has no such token.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; valid ids are `0 <= id < vocab_size`."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> int:
        """Beginning-of-sequence id, or -1."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id, or -1."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """Padding id, or -1."""

    @abc.abstractmethod
    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Encodes one string.

        Args:
          text: The string to encode.
          add_bos: Whether to prepend `bos_id`.
          add_eos: Whether to append `eos_id`.

        Returns:
          The token ids.

        Raises:
          ValueError: If `add_bos` or `add_eos` is set but the model has no such token.
        """

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Decodes ids to a string.

        Pad ids are skipped, so a padded row decodes like the unpadded one.

        Args:
          ids: Token ids; any integer-like values (Python or NumPy ints).

        Returns:
          The decoded string.

        Raises:
          ValueError: If an id is outside `[0, vocab_size)`.
        """

    @abc.abstractmethod
    def token_id(self, piece: str) -> int:
        """Returns the id of a vocabulary piece, e.g. an end-of-thinking marker.

        Raises:
          ValueError: If `piece` is not in the vocabulary.
        """

    @abc.abstractmethod
    def to_hf(self) -> HFTokenizer:
        """This tokenizer as an `HFTokenizer`: the same ids for every text, and the same text
        for every ids, in the format transformers reads (`HFTokenizer.save`).

        Raises:
          ValueError: If the model uses a setting the conversion cannot reproduce.
        """

    @property
    def padding_id(self) -> int:
        """The id prompts are padded with: `pad_id`, or the EOS for tokenizers without a pad
        token (Llama 3). Padding is masked, so this only decides what fills the gaps."""
        return self.pad_id if self.pad_id >= 0 else self.eos_id

    def encode_batch(self, texts: Iterable[str], **kwargs) -> list[list[int]]:
        """Encodes several strings; `kwargs` are passed to `encode`."""
        return [self.encode(text, **kwargs) for text in texts]


class SentencePieceTokenizer(Tokenizer):
    """A `Tokenizer` backed by a SentencePiece model.

    Build it from a `.model` file with `SentencePieceTokenizer(path)` or from the
    serialized model with `SentencePieceTokenizer.from_bytes(b)`. `serialized`
    gives those bytes back, so the tokenizer can be stored in a checkpoint.
    """

    def __init__(self, path: str | os.PathLike[str]):
        """Loads a model file.

        Args:
          path: Path of a SentencePiece `.model` file.

        Raises:
          FileNotFoundError: If `path` does not exist.
          ValueError: If the file is not a SentencePiece model.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"SentencePiece model file not found: {path!r}")
        with open(path, "rb") as f:
            proto = f.read()
        self._init_from_proto(proto, source=repr(path))

    @classmethod
    def from_bytes(cls, serialized: bytes) -> SentencePieceTokenizer:
        """Builds a tokenizer from a serialized model (the `serialized` property).

        Raises:
          ValueError: If `serialized` is not a SentencePiece model.
        """
        self = cls.__new__(cls)
        self._init_from_proto(bytes(serialized), source="the given bytes")
        return self

    def _init_from_proto(self, proto: bytes, *, source: str) -> None:
        sp = spm.SentencePieceProcessor()
        try:
            sp.load_from_serialized_proto(proto)
        except RuntimeError as e:
            raise ValueError(f"{source} is not a valid SentencePiece model: {e}") from e
        self._sp = sp
        self._vocab_size = sp.get_piece_size()

    def __reduce__(self):
        # The SWIG processor does not pickle by itself; rebuilding from the proto
        # lets the tokenizer cross process boundaries (data loader workers).
        return (SentencePieceTokenizer.from_bytes, (self.serialized,))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size})"

    @property
    def serialized(self) -> bytes:
        """The serialized `ModelProto`; `from_bytes(t.serialized)` rebuilds `t`."""
        return self._sp.serialized_model_proto()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self._wrap(self._sp.encode(text), add_bos=add_bos, add_eos=add_eos)

    def encode_batch(
        self, texts: Iterable[str], *, add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        # One native call encodes the whole list without a Python loop per string.
        return [
            self._wrap(ids, add_bos=add_bos, add_eos=add_eos)
            for ids in self._sp.encode(list(texts))
        ]

    def _wrap(self, ids: list[int], *, add_bos: bool, add_eos: bool) -> list[int]:
        return _add_specials(ids, self.bos_id, self.eos_id, add_bos=add_bos, add_eos=add_eos)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"token id {i} is out of range [0, {self._vocab_size})")
        # SentencePiece decodes control pieces (pad, bos, eos) to "", which is
        # what skips pad ids; out-of-range ids would raise a bare IndexError.
        return self._sp.decode(ids)

    def token_id(self, piece: str) -> int:
        i = self._sp.piece_to_id(piece)
        # SentencePiece answers unk_id for unknown pieces instead of failing.
        if self._sp.id_to_piece(i) != piece:
            raise ValueError(f"piece {piece!r} is not in the vocabulary")
        return i

    def to_hf(self) -> HFTokenizer:
        """The model as a `tokenizers` pipeline (see `_sentencepiece_backend`), with its bos,
        eos and pad pieces as the special tokens and a post-processor that prepends the BOS,
        so that transformers' `tokenizer(text)` gives `chat.encode_prompt`'s ids.

        Text that spells a control piece ("<s>", "</s>", "<pad>", "<unk>") encodes differently:
        SentencePiece splits it into ordinary pieces, transformers matches the special token.
        """
        backend = _sentencepiece_backend(self.serialized)
        special = {
            role: self._sp.id_to_piece(i) if i >= 0 else None
            for role, i in zip(_SPECIAL_ROLES, (self.bos_id, self.eos_id, self.pad_id))
        }
        if special["bos_token"] is not None:
            bos = special["bos_token"]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, self.bos_id)]
            )
        # rlscale left-pads prompts; a batch that transformers pads must be padded the same way.
        return HFTokenizer.from_tokenizer(backend, **special, config={"padding_side": "left"})


# Files of a Hugging Face tokenizer directory.
HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_SPECIAL_TOKENS_FILE = "special_tokens_map.json"
SENTENCEPIECE_FILE = "tokenizer.model"
_SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token")


class HFTokenizer(Tokenizer):
    """A `Tokenizer` backed by a Hugging Face `tokenizer.json` (the `tokenizers` library).

    Build it from a model directory (or the `tokenizer.json` file in it) with
    `HFTokenizer(path)`, or from a `tokenizers.Tokenizer` with `from_tokenizer`. The bos,
    eos and pad tokens are read from the directory's `tokenizer_config.json` (a role it does
    not mention is taken from `special_tokens_map.json`); a role that is absent or null has
    id -1 (Qwen has no bos token, Llama 3 no pad token).

    Encoding matches transformers' `tokenizer.encode(text, add_special_tokens=False)`: special
    tokens written in the text (`<|im_start|>`, `<|eot_id|>`, ...) become their single ids,
    and nothing is added unless `add_bos` / `add_eos` ask for it (the file's post-processor,
    which would add a bos for Llama 3, is not applied). Decoding matches
    `decode(ids, skip_special_tokens=True)`: special tokens (bos, eos, pad, end-of-turn
    markers) decode to "", as SentencePiece control pieces do, while non-special added tokens
    such as Qwen3's `<think>` are kept. Padding and truncation settings stored in the file are
    switched off.
    """

    def __init__(self, path: str | os.PathLike[str]):
        """Loads a Hugging Face tokenizer.

        Args:
          path: A directory holding `tokenizer.json` (and usually `tokenizer_config.json`),
            or the path of a `tokenizer.json` file (its directory is searched for the config).

        Raises:
          FileNotFoundError: If there is no `tokenizer.json`.
          ValueError: If a file is not valid, or a special token it names is not in the
            vocabulary.
        """
        path = os.fspath(path)
        directory, file = (
            (path, os.path.join(path, HF_TOKENIZER_FILE))
            if os.path.isdir(path)
            else (os.path.dirname(path), path)
        )
        if not os.path.isfile(file):
            raise FileNotFoundError(f"Hugging Face tokenizer file not found: {file!r}")
        try:
            backend = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # The Rust side raises a bare Exception on bad JSON.
            raise ValueError(f"{file!r} is not a valid tokenizer.json: {e}") from e
        special, source, config = _read_special_tokens(directory)
        self._init(backend, special, source=source, config=config)

    @classmethod
    def from_tokenizer(
        cls,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        config: dict | None = None,
    ) -> HFTokenizer:
        """Wraps a `tokenizers.Tokenizer` (a copy of it), with the given special tokens.

        Args:
          backend: the pipeline to wrap.
          bos_token, eos_token, pad_token: the special tokens' strings (None: absent).
          config: other `tokenizer_config.json` entries for `save` to write (a chat
            template, `padding_side`).

        Raises:
          ValueError: If a special token is not in the vocabulary.
        """
        self = cls.__new__(cls)
        special = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        backend = tokenizers.Tokenizer.from_str(backend.to_str())
        self._init(backend, special, source="arguments", config=config)
        return self

    def _init(
        self,
        backend: tokenizers.Tokenizer,
        special: dict,
        *,
        source: str,
        config: dict | None = None,
    ) -> None:
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self._special_tokens = dict(special)
        self._config = dict(config or {})
        ids = {}
        for role in _SPECIAL_ROLES:
            token = special.get(role)
            if token is None:
                ids[role] = -1
                continue
            i = backend.token_to_id(token)
            if i is None:
                raise ValueError(f"{role} {token!r} (from {source}) is not in the vocabulary")
            ids[role] = i
        self._bos_id, self._eos_id, self._pad_id = (ids[r] for r in _SPECIAL_ROLES)
        # Added tokens may sit above the base vocabulary with gaps; every id maps below this.
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    def __reduce__(self):
        # Rebuilt from the JSON, so the tokenizer crosses process boundaries as a value.
        return (_hf_from_json, (self._backend.to_str(), self._special_tokens, self._config))

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """The bos, eos and pad token strings (None when absent)."""
        return dict(self._special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return _add_specials(ids, self.bos_id, self.eos_id, add_bos=add_bos, add_eos=add_eos)

    def encode_batch(
        self, texts: Iterable[str], *, add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        # One native call encodes the whole list (in parallel in Rust).
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [
            _add_specials(e.ids, self.bos_id, self.eos_id, add_bos=add_bos, add_eos=add_eos)
            for e in encodings
        ]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"token id {i} is out of range [0, {self._vocab_size})")
        # The pad token is normally special (skipped below); drop it even when it is not.
        ids = [i for i in ids if i != self._pad_id]
        return self._backend.decode(ids, skip_special_tokens=True)

    def token_id(self, piece: str) -> int:
        i = self._backend.token_to_id(piece)
        if i is None:
            raise ValueError(f"piece {piece!r} is not in the vocabulary")
        return i

    def to_hf(self) -> HFTokenizer:
        return self

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes `tokenizer.json` and `tokenizer_config.json` into `directory`: what
        `HFTokenizer(directory)` and transformers' `AutoTokenizer.from_pretrained` read.

        The config is the one this tokenizer was read with (its chat template, its tokenizer
        class), with the bos, eos and pad tokens written out; padding and truncation stay off.
        Without a tokenizer class it names the generic one, which runs `tokenizer.json` as is:
        transformers would otherwise pick the class of the model's family, which may rebuild
        the pipeline its own way. (transformers 5.23 does that for `model_type: qwen2`
        whatever the config names.)
        """
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self._backend.save(os.path.join(directory, HF_TOKENIZER_FILE))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self._config}
        config.update(self._special_tokens)
        with open(os.path.join(directory, HF_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)


def _hf_from_json(backend_json: str, special: dict, config: dict) -> HFTokenizer:
    self = HFTokenizer.__new__(HFTokenizer)
    self._init(
        tokenizers.Tokenizer.from_str(backend_json), special, source="a pickle", config=config
    )
    return self


def _sentencepiece_backend(serialized: bytes) -> tokenizers.Tokenizer:
    """A `tokenizers` pipeline that encodes and decodes like the SentencePiece model.

    SentencePiece writes spaces as "▁", then runs its model over the whole text: BPE merges
    the adjacent pair whose union has the best score (the leftmost on ties), unigram takes the
    best-scoring segmentation; characters outside the vocabulary fall back to byte pieces.
    The pipeline does the same: a "▁" normalizer, then a BPE whose merges are every split of a
    piece into two pieces, ranked by the piece's score (or a unigram with the same scores),
    with byte fallback; user-defined symbols become added tokens, control pieces special ones.
    Supported: the settings `train_sentencepiece` uses (identity normalization, no dummy
    prefix, whitespace kept, byte fallback, BPE or unigram).

    Raises:
      ValueError: naming every setting of the model the pipeline would not reproduce.
    """
    proto = sentencepiece_model_pb2.ModelProto.FromString(serialized)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    types = sentencepiece_model_pb2.TrainerSpec.ModelType
    piece_types = sentencepiece_model_pb2.ModelProto.SentencePiece
    problems = []
    if spec.model_type not in (types.BPE, types.UNIGRAM):
        problems.append(f"model_type {types.Name(spec.model_type)} (supported: BPE, UNIGRAM)")
    if norm.precompiled_charsmap or norm.name not in ("", "identity"):
        problems.append(f"normalization {norm.name!r} (supported: identity)")
    if norm.add_dummy_prefix:
        problems.append("add_dummy_prefix=true")
    if norm.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces=true")
    if not norm.escape_whitespaces:
        problems.append("escape_whitespaces=false")
    if spec.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix=true")
    if not spec.byte_fallback:
        problems.append("byte_fallback=false")
    if problems:
        raise ValueError(
            "this SentencePiece model cannot be converted to a tokenizer.json: "
            + "; ".join(problems)
        )
    pieces = proto.pieces
    unk = pieces[spec.unk_id].piece
    if spec.model_type == types.BPE:
        vocab = {p.piece: i for i, p in enumerate(pieces)}
        normal = {p.piece for p in pieces if p.type == piece_types.NORMAL}
        ranked = []
        for i, p in enumerate(pieces):
            if p.type != piece_types.NORMAL:
                continue
            for k in range(1, len(p.piece)):
                left, right = p.piece[:k], p.piece[k:]
                if left in normal and right in normal:
                    ranked.append((-p.score, i, k, (left, right)))
        merges = [pair for *_, pair in sorted(ranked)]
        model = models.BPE(vocab, merges, unk_token=unk, byte_fallback=True)
    else:
        model = models.Unigram(
            [(p.piece, p.score) for p in pieces], unk_id=spec.unk_id, byte_fallback=True
        )
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # Added tokens match the raw text, before the "▁" normalizer, as SentencePiece matches them.
    backend.add_tokens(
        [
            AddedToken(p.piece, special=False, normalized=False)
            for p in pieces
            if p.type == piece_types.USER_DEFINED
        ]
    )
    backend.add_special_tokens(
        [
            AddedToken(p.piece, special=True, normalized=False)
            for p in pieces
            if p.type in (piece_types.CONTROL, piece_types.UNKNOWN)
        ]
    )
    return backend


def _add_specials(ids: list[int], bos_id: int, eos_id: int, *, add_bos: bool, add_eos: bool):
    if add_bos:
        if bos_id < 0:
            raise ValueError("add_bos=True but this model has no bos token")
        ids = [bos_id, *ids]
    if add_eos:
        if eos_id < 0:
            raise ValueError("add_eos=True but this model has no eos token")
        ids = [*ids, eos_id]
    return ids


def _token_content(value) -> str | None:
    """A special-token entry of a tokenizer config: a string, null, or a serialized
    `AddedToken` (`{"content": "<s>", ...}`, the older transformers format)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognized special-token entry {value!r}")


def _read_special_tokens(directory: str) -> tuple[dict[str, str | None], str, dict]:
    """The bos/eos/pad strings of a Hugging Face tokenizer directory.

    `tokenizer_config.json` decides; a role it does not mention at all is taken from
    `special_tokens_map.json` (older checkpoints keep them there). A role in neither is None.

    Returns:
      ({role: token or None}, the files read, for error messages, the parsed
      `tokenizer_config.json` ({} without one)).
    """
    special: dict[str, str | None] = {}
    read = []
    tokenizer_config = {}
    for name in (HF_CONFIG_FILE, HF_SPECIAL_TOKENS_FILE):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        read.append(repr(path))
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if name == HF_CONFIG_FILE:
                tokenizer_config = config
            for role in _SPECIAL_ROLES:
                if role in config and role not in special:
                    special[role] = _token_content(config[role])
        except ValueError as e:  # json.JSONDecodeError is a ValueError.
            raise ValueError(f"{path!r}: {e}") from e
    source = " and ".join(read) if read else f"no {HF_CONFIG_FILE} in {directory!r}"
    return {role: special.get(role) for role in _SPECIAL_ROLES}, source, tokenizer_config


def load(path: str | os.PathLike[str]) -> Tokenizer:
    """Loads a tokenizer, picking the backend from what `path` holds.

    * a SentencePiece `.model` file: `SentencePieceTokenizer`;
    * a `tokenizer.json` file, or a directory holding one (a Hugging Face model directory):
      `HFTokenizer`;
    * a directory holding only `tokenizer.model`: `SentencePieceTokenizer`.

    Raises:
      FileNotFoundError: If `path` holds none of these, naming what was looked for.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, HF_TOKENIZER_FILE)):
            return HFTokenizer(path)
        if os.path.isfile(os.path.join(path, SENTENCEPIECE_FILE)):
            return SentencePieceTokenizer(os.path.join(path, SENTENCEPIECE_FILE))
        raise FileNotFoundError(
            f"{path!r} holds neither {HF_TOKENIZER_FILE} nor {SENTENCEPIECE_FILE}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer path not found: {path!r}")
    if path.endswith(".json"):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)


def train_sentencepiece(
    corpus: Iterable[str],
    vocab_size: int,
    *,
    model_type: str = "bpe",
    user_defined_symbols: Sequence[str] = (),
    character_coverage: float = 1.0,
    hard_vocab_limit: bool = True,
    path: str | os.PathLike[str] | None = None,
) -> SentencePieceTokenizer:
    """Trains a SentencePiece model in memory.

    The model has pad 0, unk 1, bos 2 and eos 3, then `user_defined_symbols`
    (always single tokens, never split), then one piece per byte, then the
    learned pieces. Text round-trips exactly through `encode`/`decode`: no
    normalization, whitespace kept as is, no dummy prefix (no space is invented
    at the start, so `decode(encode(a) + encode(b)) == a + b`), digits split one
    per token, and characters outside the learned pieces fall back to UTF-8
    bytes instead of <unk>.

    Training is deterministic: the same corpus, in the same order, with the same
    arguments gives a byte-identical model. Nothing is sampled (every sentence is
    used) and training runs on one thread, so there is no seed to set.

    Sentences longer than 4192 bytes are skipped by SentencePiece; split long
    documents into lines first.

    Args:
      corpus: Training sentences, read once (a generator is fine).
      vocab_size: Total number of pieces, specials and byte pieces included.
      model_type: One of "bpe", "unigram", "char".
      user_defined_symbols: Pieces that are always single tokens, e.g. "<think>".
      character_coverage: Fraction of characters covered by character pieces;
        the rest are encoded as bytes.
      hard_vocab_limit: If False, a corpus too small for `vocab_size` gives a
        smaller vocabulary instead of an error.
      path: If given, the `.model` file is also written there.

    Returns:
      The trained tokenizer.

    Raises:
      ValueError: On invalid arguments, an empty corpus, or a `vocab_size` the
        corpus cannot support (the message gives the admissible bound).
    """
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"model_type must be one of {_MODEL_TYPES}, got {model_type!r}")
    user_defined_symbols = list(user_defined_symbols)
    if len(set(user_defined_symbols)) != len(user_defined_symbols):
        raise ValueError(f"user_defined_symbols has duplicates: {user_defined_symbols}")
    for symbol in user_defined_symbols:
        # SentencePiece would silently alias a special piece, so text containing
        # "<s>" would encode to the bos id.
        if not symbol or symbol in _SPECIAL_PIECES:
            raise ValueError(
                f"user-defined symbol {symbol!r} is empty or a special piece {_SPECIAL_PIECES}"
            )
    min_vocab = 4 + len(user_defined_symbols) + _NUM_BYTE_PIECES + 1
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: 4 special tokens, "
            f"{len(user_defined_symbols)} user-defined symbols and {_NUM_BYTE_PIECES} byte "
            f"pieces need vocab_size >= {min_vocab}"
        )
    if not 0.0 < character_coverage <= 1.0:
        raise ValueError(f"character_coverage must be in (0, 1], got {character_coverage}")

    counter = _CountingIterator(corpus)
    writer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=counter,
            model_writer=writer,
            vocab_size=vocab_size,
            model_type=model_type,
            user_defined_symbols=user_defined_symbols,
            character_coverage=character_coverage,
            hard_vocab_limit=hard_vocab_limit,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            split_digits=True,
            byte_fallback=True,
            # Exact round trips: no NFKC, no whitespace collapsing, no leading "▁".
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            # Determinism: use every sentence (no sampling) on a single thread.
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as e:
        # SWIG turns an exception raised by the corpus iterator into a RuntimeError;
        # give the caller the original one.
        if counter.error is not None:
            raise counter.error from None
        raise _training_error(e, vocab_size, counter.num_nonempty) from e

    tokenizer = SentencePieceTokenizer.from_bytes(writer.getvalue())
    if path is not None:
        with open(path, "wb") as f:
            f.write(tokenizer.serialized)
    return tokenizer


class _CountingIterator(Iterator[str]):
    """Passes a corpus through, counting non-empty sentences to explain failures.

    It also keeps any exception the corpus raises, which SentencePiece would
    otherwise replace with a RuntimeError.
    """

    def __init__(self, corpus: Iterable[str]):
        self._it = iter(corpus)
        self.num_nonempty = 0
        self.error: Exception | None = None

    def __next__(self) -> str:
        try:
            sentence = next(self._it)
            if not isinstance(sentence, str):
                raise TypeError(f"corpus items must be str, got {type(sentence).__name__}")
        except StopIteration:
            raise
        except Exception as e:
            self.error = e
            raise
        if sentence:
            self.num_nonempty += 1
        return sentence


def _training_error(e: RuntimeError, vocab_size: int, num_nonempty: int) -> ValueError:
    """Turns a SentencePiece trainer failure into an actionable ValueError."""
    if num_nonempty == 0:
        return ValueError("corpus is empty: it has no non-empty sentences")
    msg = str(e)
    if m := re.search(r"Please set it to a value <= (\d+)", msg):
        return ValueError(
            f"vocab_size={vocab_size} is too large for this corpus: it supports at most "
            f"{m.group(1)} pieces. Lower vocab_size to <= {m.group(1)}, use a larger "
            f"corpus, or pass hard_vocab_limit=False to accept a smaller vocabulary."
        )
    if m := re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg):
        return ValueError(
            f"vocab_size={vocab_size} is too small for this corpus: its distinct characters "
            f"plus the special and byte pieces need {m.group(2)}. Raise vocab_size to "
            f">= {m.group(2)} or lower character_coverage."
        )
    return ValueError(f"SentencePiece training failed: {msg}")
