"""The Hugging Face backend: `HFTokenizer` over a `tokenizer.json` (the `tokenizers` library,
what transformers' fast tokenizers run), with its special tokens from `tokenizer_config.json`,
and `HFTokenizer.save`, which writes them where transformers' `AutoTokenizer` reads them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import tokenizers

from rlscale.tokenizers.interface import Tokenizer, add_specials

# Files of a Hugging Face tokenizer directory.
HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_SPECIAL_TOKENS_FILE = "special_tokens_map.json"
SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token")


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
        for role in SPECIAL_ROLES:
            token = special.get(role)
            if token is None:
                ids[role] = -1
                continue
            i = backend.token_to_id(token)
            if i is None:
                raise ValueError(f"{role} {token!r} (from {source}) is not in the vocabulary")
            ids[role] = i
        self._bos_id, self._eos_id, self._pad_id = (ids[r] for r in SPECIAL_ROLES)
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
        return add_specials(ids, self.bos_id, self.eos_id, add_bos=add_bos, add_eos=add_eos)

    def encode_batch(
        self, texts: Iterable[str], *, add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        # One native call encodes the whole list (in parallel in Rust).
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [
            add_specials(e.ids, self.bos_id, self.eos_id, add_bos=add_bos, add_eos=add_eos)
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
            for role in SPECIAL_ROLES:
                if role in config and role not in special:
                    special[role] = _token_content(config[role])
        except ValueError as e:  # json.JSONDecodeError is a ValueError.
            raise ValueError(f"{path!r}: {e}") from e
    source = " and ".join(read) if read else f"no {HF_CONFIG_FILE} in {directory!r}"
    return {role: special.get(role) for role in SPECIAL_ROLES}, source, tokenizer_config
