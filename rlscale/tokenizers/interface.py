"""The `Tokenizer` interface: what the rest of rlscale sees of a tokenizer.

Text to ids and back, the special ids and a lookup for marker pieces such as `</think>`.
The backends live in `sentencepiece` and `hf`; the package, `rlscale.tokenizers`, is the
public entry (`load` and these names).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence


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
    def to_hf(self) -> Tokenizer:
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


def add_specials(ids: list[int], bos_id: int, eos_id: int, *, add_bos: bool, add_eos: bool):
    """`ids` with the bos prepended and the eos appended, as asked; the backends' `encode`."""
    if add_bos:
        if bos_id < 0:
            raise ValueError("add_bos=True but this model has no bos token")
        ids = [bos_id, *ids]
    if add_eos:
        if eos_id < 0:
            raise ValueError("add_eos=True but this model has no eos token")
        ids = [*ids, eos_id]
    return ids
