"""Tests for rlscale.tokenizers."""

import json
import os
import pickle
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from rlscale import tokenizers as tokenizer_lib
from rlscale.tokenizers import SentencePieceTokenizer, Tokenizer, train_sentencepiece

VOCAB_SIZE = 400
SYMBOLS = ("<think>", "</think>")
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every judge "
    "what is the sum of and answer think step by step"
)


def make_corpus(seed: int = 0) -> list[str]:
    """A few hundred arithmetic lines and short English sentences, ASCII only."""
    rng = random.Random(seed)
    words = WORDS.split()
    lines = []
    for _ in range(300):
        a, b = rng.randrange(1000), rng.randrange(1000)
        lines.append(f"{a}+{b}={a + b}")
    for _ in range(200):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randrange(3, 10))) + ".")
    return lines


def train(corpus=None, vocab_size=VOCAB_SIZE, **kwargs) -> SentencePieceTokenizer:
    corpus = make_corpus() if corpus is None else corpus
    return train_sentencepiece(corpus, vocab_size, user_defined_symbols=SYMBOLS, **kwargs)


@pytest.fixture(scope="module")
def tok() -> SentencePieceTokenizer:
    return train()


# Held out: none of these lines is in the corpus, and several use characters
# the corpus never shows (accents, CJK, emoji, tab, newline, '*').
HELD_OUT = [
    "123+456=579",
    "0+0=0",
    "9999*8=79992",
    "what is 17+25? <think>7+5=12</think> 42",
    "  leading, double  spaces,\ttab and newline\n",
    "naïve café — 世界 🙂",
    "trailing space ",
    "",
]


def test_special_ids(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert [tok.token_id(p) for p in ("<pad>", "<unk>", "<s>", "</s>")] == [0, 1, 2, 3]
    assert tok.vocab_size == VOCAB_SIZE
    assert isinstance(tok, Tokenizer)


@pytest.mark.parametrize("text", HELD_OUT)
def test_round_trip_is_exact_and_never_unk(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert 1 not in ids  # byte fallback: nothing becomes <unk>
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_digits_are_single_tokens(tok):
    # split_digits: digits are never merged, even the pairs the corpus repeats most,
    # so arithmetic is tokenized digit by digit.
    arithmetic = [line for line in make_corpus() if "=" in line]
    for line in [*arithmetic, "90817"]:
        pieces = [tok.decode([i]) for i in tok.encode(line)]
        assert "".join(pieces) == line
        assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p)), pieces


def test_unseen_characters_fall_back_to_utf8_bytes(tok):
    for char in ("世", "🙂", "é"):
        expected = [tok.token_id(f"<0x{b:02X}>") for b in char.encode("utf-8")]
        assert tok.encode(char) == expected


def test_user_defined_symbols_are_single_tokens(tok):
    think, end_think = tok.token_id("<think>"), tok.token_id("</think>")
    # They come right after the four specials, in the order given.
    assert (think, end_think) == (4, 5)
    assert tok.encode("<think>") == [think]
    assert tok.encode("</think>") == [end_think]
    ids = tok.encode("a<think>1+1=2</think>b")
    assert ids.count(think) == 1 and ids.count(end_think) == 1
    assert ids.index(think) < ids.index(end_think)


def test_add_bos_and_eos(tok):
    ids = tok.encode("1+2=3")
    assert tok.encode("1+2=3", add_bos=True) == [2, *ids]
    assert tok.encode("1+2=3", add_eos=True) == [*ids, 3]
    assert tok.encode("1+2=3", add_bos=True, add_eos=True) == [2, *ids, 3]
    assert tok.decode([2, *ids, 3]) == "1+2=3"


def test_concatenated_encodings_decode_to_concatenated_text(tok):
    # No dummy prefix: encoding a completion separately invents no leading space.
    for prompt, completion in [("12+30=", "42"), ("the", " fox"), ("a ", " b")]:
        assert tok.decode(tok.encode(prompt) + tok.encode(completion)) == prompt + completion


def test_decode_skips_pad_and_accepts_numpy(tok):
    ids = tok.encode("7+8=15")
    assert tok.decode([*ids, 0, 0, 0]) == "7+8=15"
    assert tok.decode([0, *ids[:2], 0, *ids[2:]]) == "7+8=15"
    assert tok.decode(np.array([*ids, 0], dtype=np.int32)) == "7+8=15"
    assert tok.decode([0, 0]) == ""


@pytest.mark.parametrize("bad_id", [VOCAB_SIZE, VOCAB_SIZE + 1234, -1])
def test_decode_out_of_range_names_the_id(tok, bad_id):
    with pytest.raises(ValueError, match=rf"token id {bad_id} is out of range"):
        tok.decode([5, bad_id])


def test_encode_batch_matches_encode(tok):
    texts = HELD_OUT[:5]
    expected = [tok.encode(t, add_bos=True, add_eos=True) for t in texts]
    assert tok.encode_batch(texts, add_bos=True, add_eos=True) == expected
    # The interface's default implementation agrees with the native override.
    assert Tokenizer.encode_batch(tok, iter(texts), add_bos=True, add_eos=True) == expected
    assert tok.encode_batch([]) == []


def test_token_id_unknown_piece_names_it(tok):
    with pytest.raises(ValueError, match=re.escape("'<no_such_piece>'")):
        tok.token_id("<no_such_piece>")


def test_training_is_deterministic():
    first = train()
    # Same corpus streamed from a generator: identical bytes.
    second = train(corpus=(line for line in make_corpus()))
    assert first.serialized == second.serialized
    # A different corpus gives a different model, so the check above has teeth.
    assert train(corpus=make_corpus(seed=1)).serialized != first.serialized


def test_training_is_deterministic_across_processes(tmp_path):
    # A fresh interpreter with another hash seed must build the same bytes.
    corpus_path, model_path = tmp_path / "corpus.json", tmp_path / "other.model"
    corpus_path.write_text(json.dumps(make_corpus()))
    script = (
        "import json, sys; from rlscale.tokenizers import train_sentencepiece; "
        "corpus = json.load(open(sys.argv[1])); "
        f"t = train_sentencepiece(corpus, {VOCAB_SIZE}, user_defined_symbols={SYMBOLS!r}); "
        "open(sys.argv[2], 'wb').write(t.serialized)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": "123"}
    subprocess.run(
        [sys.executable, "-c", script, str(corpus_path), str(model_path)], check=True, env=env
    )
    assert model_path.read_bytes() == train().serialized


def test_file_and_bytes_round_trips_agree(tok, tmp_path):
    path = tmp_path / "tok.model"
    trained = train(path=path)
    assert path.read_bytes() == trained.serialized == tok.serialized
    from_file = SentencePieceTokenizer(path)
    from_str_path = SentencePieceTokenizer(str(path))
    from_bytes = SentencePieceTokenizer.from_bytes(tok.serialized)
    for other in (from_file, from_str_path, from_bytes):
        assert other.serialized == tok.serialized
        assert other.vocab_size == tok.vocab_size
        assert [other.encode(t) for t in HELD_OUT] == [tok.encode(t) for t in HELD_OUT]


def test_pickle_round_trip(tok):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.serialized == tok.serialized
    assert clone.encode(HELD_OUT[3]) == tok.encode(HELD_OUT[3])


@pytest.mark.parametrize("model_type", ["unigram", "char"])
def test_other_model_types_round_trip(model_type):
    t = train(model_type=model_type, hard_vocab_limit=False)
    assert (t.pad_id, t.bos_id, t.eos_id) == (0, 2, 3)
    for text in HELD_OUT:
        assert t.decode(t.encode(text)) == text


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope" / "missing.model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        SentencePieceTokenizer(path)


def test_corrupt_model_is_a_value_error(tmp_path):
    path = tmp_path / "corrupt.model"
    path.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        SentencePieceTokenizer(path)
    with pytest.raises(ValueError, match="not a valid SentencePiece model"):
        SentencePieceTokenizer.from_bytes(b"not a model")


def test_too_large_vocab_names_the_numbers_and_the_bound_is_exact():
    with pytest.raises(ValueError, match=r"vocab_size=5000 is too large") as info:
        train(vocab_size=5000)
    bound = int(re.search(r"at most (\d+) pieces", str(info.value)).group(1))
    assert f"<= {bound}" in str(info.value)
    # The bound in the message is the real one: it trains, one more does not.
    assert train(vocab_size=bound).vocab_size == bound
    with pytest.raises(ValueError, match=rf"vocab_size={bound + 1} is too large"):
        train(vocab_size=bound + 1)
    # A soft limit accepts the request and stops at the bound.
    assert train(vocab_size=5000, hard_vocab_limit=False).vocab_size == bound


def test_too_small_vocab_names_the_numbers():
    # 4 specials + 2 symbols + 256 bytes + at least one learned piece.
    with pytest.raises(ValueError, match=r"vocab_size=262 is too small.*>= 263"):
        train(vocab_size=262)
    # 60 distinct characters each need a piece on top of 4 specials and 256 bytes.
    chars = [chr(0x4E00 + i) for i in range(60)]
    corpus = ["".join(chars[i : i + 5]) for i in range(0, 60, 5)]
    with pytest.raises(ValueError, match=r"vocab_size=300 is too small.* 320"):
        train_sentencepiece(corpus, 300)
    assert train_sentencepiece(corpus, 320).vocab_size == 320


@pytest.mark.parametrize("corpus", [[], ["", ""], iter(())])
def test_empty_corpus(corpus):
    with pytest.raises(ValueError, match="corpus is empty"):
        train_sentencepiece(corpus, VOCAB_SIZE)


def test_corpus_errors_propagate_unchanged():
    with pytest.raises(TypeError, match="corpus items must be str, got int"):
        train_sentencepiece(["1+1=2", 3], VOCAB_SIZE)

    class CorpusReadError(Exception):
        pass

    def broken():
        yield "1+1=2"
        raise CorpusReadError("disk gone")

    with pytest.raises(CorpusReadError, match="disk gone"):
        train_sentencepiece(broken(), VOCAB_SIZE)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model_type="wordpiece"), "model_type must be one of"),
        (dict(model_type="word"), "model_type must be one of"),
        (dict(user_defined_symbols=["<s>"]), "'<s>' is empty or a special piece"),
        (dict(user_defined_symbols=[""]), "'' is empty or a special piece"),
        (dict(user_defined_symbols=["<a>", "<a>"]), "duplicates"),
        (dict(character_coverage=0.0), "character_coverage"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train_sentencepiece(make_corpus(), VOCAB_SIZE, **kwargs)


def test_fixed_ids_are_exported():
    assert (
        tokenizer_lib.PAD_ID,
        tokenizer_lib.UNK_ID,
        tokenizer_lib.BOS_ID,
        tokenizer_lib.EOS_ID,
    ) == (0, 1, 2, 3)


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Strings over the corpus's characters and others: runs of spaces, tabs, newlines, the
    user-defined symbols inside words, characters only bytes can encode."""
    rng = random.Random(seed)
    alphabet = [*"abcdefghijklmnopqrstuvwxyz0123456789+-=*.?", " ", " ", "  ", "\t", "\n"]
    alphabet += [*SYMBOLS, "é", "世", "🙂", "▁"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(40))) for _ in range(n)]
    words = [line.split(" ") for line in make_corpus(seed=1)]
    return texts + ["  ".join(w[::-1]) for w in words]


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_hugging_face_form_encodes_and_decodes_like_sentencepiece(model_type):
    # A corpus with whitespace runs, so the model learns whitespace-only pieces too.
    corpus = make_corpus() + ["  indented   text\twith    spaces ==== **  aaa aaaa"] * 5
    t = train(corpus, model_type=model_type, hard_vocab_limit=False)
    converted = t.to_hf()
    assert (converted.bos_id, converted.eos_id, converted.pad_id) == (2, 3, 0)
    assert converted.vocab_size == t.vocab_size
    for text in [*HELD_OUT, *corpus[::10], *_random_texts(1500)]:
        ids = t.encode(text)
        assert converted.encode(text) == ids, text
        assert converted.decode(ids) == t.decode(ids), text
    # The post-processor adds the BOS (what transformers' `tokenizer(text)` gives), and only
    # there: `encode` adds nothing unless asked.
    ids = t.encode(HELD_OUT[3])
    assert converted.backend.encode(HELD_OUT[3]).ids == [2, *ids]


def test_hugging_face_form_rejects_settings_it_cannot_reproduce(tok):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString(tok.serialized)
    proto.normalizer_spec.add_dummy_prefix = True
    proto.normalizer_spec.remove_extra_whitespaces = True
    other = SentencePieceTokenizer.from_bytes(proto.SerializeToString())
    with pytest.raises(ValueError, match="add_dummy_prefix=true; remove_extra_whitespaces=true"):
        other.to_hf()
    with pytest.raises(ValueError, match="model_type CHAR"):
        train(model_type="char", hard_vocab_limit=False).to_hf()
