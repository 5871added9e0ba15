"""The SentencePiece backend: `SentencePieceTokenizer`, its conversion to an equivalent
`tokenizer.json` (`to_hf`), and `train_sentencepiece`, which builds a model in memory with
fixed special ids (pad 0, unk 1, bos 2, eos 3) so that downstream code can pad with 0.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable, Iterator, Sequence

import sentencepiece as spm
import tokenizers
from sentencepiece import sentencepiece_model_pb2
from tokenizers import AddedToken, decoders, models, normalizers, processors

from rlscale.tokenizers.hf import SPECIAL_ROLES, HFTokenizer
from rlscale.tokenizers.interface import Tokenizer, add_specials

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

# The SentencePiece file of a model directory.
SENTENCEPIECE_FILE = "tokenizer.model"


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
        return add_specials(ids, self.bos_id, self.eos_id, add_bos=add_bos, add_eos=add_eos)

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
            for role, i in zip(SPECIAL_ROLES, (self.bos_id, self.eos_id, self.pad_id))
        }
        if special["bos_token"] is not None:
            bos = special["bos_token"]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, self.bos_id)]
            )
        # rlscale left-pads prompts; a batch that transformers pads must be padded the same way.
        return HFTokenizer.from_tokenizer(backend, **special, config={"padding_side": "left"})


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
    user_defined_symbols = _check_training_args(
        vocab_size, model_type, user_defined_symbols, character_coverage
    )
    serialized = _train_model(
        corpus,
        vocab_size,
        model_type=model_type,
        user_defined_symbols=user_defined_symbols,
        character_coverage=character_coverage,
        hard_vocab_limit=hard_vocab_limit,
    )
    tokenizer = SentencePieceTokenizer.from_bytes(serialized)
    if path is not None:
        with open(path, "wb") as f:
            f.write(tokenizer.serialized)
    return tokenizer


def _check_training_args(
    vocab_size: int, model_type: str, user_defined_symbols: Sequence[str], character_coverage: float
) -> list[str]:
    """Checks `train_sentencepiece`'s arguments, before any training.

    Returns:
      `user_defined_symbols` as a list.

    Raises:
      ValueError: Naming the first invalid argument.
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
    return user_defined_symbols


def _train_model(
    corpus: Iterable[str],
    vocab_size: int,
    *,
    model_type: str,
    user_defined_symbols: list[str],
    character_coverage: float,
    hard_vocab_limit: bool,
) -> bytes:
    """Runs the SentencePiece trainer with rlscale's fixed settings (see `train_sentencepiece`).

    Returns:
      The serialized model.

    Raises:
      ValueError: An actionable `_training_error`, or the corpus's own exception.
    """
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
    return writer.getvalue()


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
