"""Tokenizers: the public entry, `load` and the names callers use.

The rest of rlscale only sees `Tokenizer` (`interface`). `SentencePieceTokenizer` and
`train_sentencepiece` (`sentencepiece`) wrap and build a SentencePiece model; `HFTokenizer`
(`hf`) wraps a Hugging Face `tokenizer.json`. `load(path)` picks the backend from what is on
disk. `Tokenizer.to_hf()` gives any of them as an `HFTokenizer` (a SentencePiece model
converted to an equivalent `tokenizer.json`), which `HFTokenizer.save` writes where
transformers' `AutoTokenizer` reads it: how an exported policy carries its tokenizer.

`chat` turns a conversation into the text a tokenizer encodes (each family's chat template,
the reasoning format) and gives the ids a prompt starts with and a turn ends with.
"""

from __future__ import annotations

import os

from rlscale.tokenizers.hf import (
    HF_CONFIG_FILE,
    HF_SPECIAL_TOKENS_FILE,
    HF_TOKENIZER_FILE,
    HFTokenizer,
)
from rlscale.tokenizers.interface import Tokenizer
from rlscale.tokenizers.sentencepiece import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SENTENCEPIECE_FILE,
    UNK_ID,
    SentencePieceTokenizer,
    train_sentencepiece,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "HF_CONFIG_FILE",
    "HF_SPECIAL_TOKENS_FILE",
    "HF_TOKENIZER_FILE",
    "PAD_ID",
    "SENTENCEPIECE_FILE",
    "UNK_ID",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load",
    "train_sentencepiece",
]


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
