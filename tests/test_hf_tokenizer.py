"""The Hugging Face `tokenizer.json` backend, against transformers on a BPE trained here."""

import json
import pickle
import re

import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers

from rlscale import tokenizers as tokenizer_lib
from rlscale.tokenizers import HFTokenizer, SentencePieceTokenizer, Tokenizer

BOS, EOS, EOT, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|pad|>"
SPECIALS = [BOS, EOS, EOT, "<|start_header_id|>", "<|end_header_id|>", PAD]
CORPUS = [
    "the quick brown fox jumps over the lazy dog 12+30=42",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "what is the sum of 17 and 25? <think>7+5=12, carry 1</think> 42",
] * 30
HELD_OUT = [
    "what is 17+25? <think>7+5=12</think> 42",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "  leading, double  spaces,\ttab and newline\n",
    "naïve café — 世界 🙂",
    "trailing space ",
    "",
]


def _backend() -> tokenizers.Tokenizer:
    """A byte-level BPE like Llama 3's: specials first, `<think>` as non-special added tokens,
    and a post-processor that prepends the BOS."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>")])
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos_id)]
    )
    return backend


def _write_dir(path, backend, config):
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    # The older transformers format: a special token as a serialized AddedToken.
    config = {
        "bos_token": BOS,
        "eos_token": {"__type": "AddedToken", "content": EOT, "special": True},
        "pad_token": PAD,
    }
    return _write_dir(tmp_path_factory.mktemp("hf"), _backend(), config)


@pytest.fixture(scope="module")
def tok(hf_dir) -> HFTokenizer:
    return HFTokenizer(hf_dir)


@pytest.fixture(scope="module")
def reference(hf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(hf_dir))


def test_special_ids_match_transformers(tok, reference):
    assert isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
        reference.pad_token_id,
    )
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 2, 5)
    assert tok.vocab_size == len(reference) == _backend().get_vocab_size()


@pytest.mark.parametrize("text", HELD_OUT)
def test_ids_and_decoding_match_transformers(tok, reference, text):
    ids = tok.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    # add_bos gives what the file's post-processor adds by default.
    assert tok.encode(text, add_bos=True) == reference.encode(text)
    with_eos = tok.encode(text, add_eos=True)
    assert with_eos == [*ids, tok.eos_id]
    assert tok.decode(with_eos) == reference.decode(with_eos, skip_special_tokens=True)


@pytest.mark.parametrize("text", [t for t in HELD_OUT if "<|" not in t])
def test_round_trip_is_exact(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text


def test_special_and_added_tokens(tok):
    header = tok.token_id("<|start_header_id|>")
    ids = tok.encode("<|start_header_id|>user")
    assert ids[0] == header and tok.encode("<|eot_id|>") == [tok.eos_id]
    think, end_think = tok.token_id("<think>"), tok.token_id("</think>")
    assert (think, end_think) == (tok.vocab_size - 2, tok.vocab_size - 1)  # Added last.
    ids = tok.encode("a<think>1+1=2</think>b")
    assert ids.count(think) == 1 and ids.count(end_think) == 1
    # Special tokens decode to "" (like SentencePiece control pieces); <think> is kept.
    assert tok.decode([tok.bos_id, header, *tok.encode("x</think>y"), tok.eos_id]) == "x</think>y"


def test_concatenated_encodings_decode_to_concatenated_text(tok):
    for prompt, completion in [("12+30=", "42"), ("the", " fox"), ("a ", " b")]:
        assert tok.decode(tok.encode(prompt) + tok.encode(completion)) == prompt + completion


def test_decode_skips_pad_and_accepts_numpy(tok):
    ids = tok.encode("7+8=15")
    assert tok.decode([tok.pad_id, *ids, tok.pad_id]) == "7+8=15"
    assert tok.decode(np.array(ids, dtype=np.int32)) == "7+8=15"


@pytest.mark.parametrize("offset", [0, 10_000, -1])
def test_decode_out_of_range_names_the_id(tok, offset):
    bad_id = -1 if offset < 0 else tok.vocab_size + offset
    with pytest.raises(
        ValueError, match=rf"token id {bad_id} is out of range \[0, {tok.vocab_size}\)"
    ):
        tok.decode([5, bad_id])


def test_encode_batch_matches_encode(tok):
    expected = [tok.encode(t, add_bos=True) for t in HELD_OUT]
    assert tok.encode_batch(HELD_OUT, add_bos=True) == expected
    assert Tokenizer.encode_batch(tok, iter(HELD_OUT), add_bos=True) == expected


def test_token_id_unknown_piece_names_it(tok):
    with pytest.raises(ValueError, match=re.escape("'<no_such_piece>'")):
        tok.token_id("<no_such_piece>")


def test_pickle_round_trip(tok):
    clone = pickle.loads(pickle.dumps(tok))
    assert (clone.bos_id, clone.eos_id, clone.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert clone.encode_batch(HELD_OUT) == tok.encode_batch(HELD_OUT)


def test_stored_padding_and_truncation_are_ignored(tmp_path, tok):
    backend = _backend()
    backend.enable_truncation(max_length=4)
    backend.enable_padding(length=64)
    other = HFTokenizer(_write_dir(tmp_path, backend, {"bos_token": BOS}))
    assert other.encode(HELD_OUT[0]) == tok.encode(HELD_OUT[0])
    assert len(tok.encode(HELD_OUT[0])) > 4


def test_missing_roles_are_minus_one_and_add_bos_fails(tmp_path):
    # Qwen-style: no bos; no pad.
    t = HFTokenizer(_write_dir(tmp_path, _backend(), {"bos_token": None, "eos_token": EOT}))
    assert (t.bos_id, t.eos_id, t.pad_id) == (-1, 2, -1)
    with pytest.raises(ValueError, match="add_bos=True but this model has no bos token"):
        t.encode("x", add_bos=True)
    assert t.decode(t.encode("x y")) == "x y"


def test_special_tokens_map_fills_roles_the_config_omits(tmp_path):
    d = _write_dir(tmp_path, _backend(), {"eos_token": EOS})
    (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOT}))
    t = HFTokenizer(d)
    assert (t.bos_id, t.eos_id, t.pad_id) == (0, 1, -1)  # The config's eos wins.
    # No config at all: no special tokens.
    bare = HFTokenizer(_write_dir(tmp_path / "bare", _backend(), None))
    assert (bare.bos_id, bare.eos_id, bare.pad_id) == (-1, -1, -1)


def test_unknown_special_token_names_it_and_the_file(tmp_path):
    d = _write_dir(tmp_path, _backend(), {"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match=r"eos_token '<\|im_end\|>' \(from .*tokenizer_config"):
        HFTokenizer(d)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        HFTokenizer(tmp_path)


def test_from_tokenizer(tok):
    t = HFTokenizer.from_tokenizer(_backend(), bos_token=BOS, eos_token=EOT, pad_token=PAD)
    assert (t.bos_id, t.eos_id, t.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert t.encode_batch(HELD_OUT) == tok.encode_batch(HELD_OUT)


def test_load_picks_the_backend(tmp_path, hf_dir):
    assert isinstance(tokenizer_lib.load(hf_dir), HFTokenizer)
    assert isinstance(tokenizer_lib.load(hf_dir / "tokenizer.json"), HFTokenizer)
    sp = tokenizer_lib.train_sentencepiece(CORPUS, 320, hard_vocab_limit=False)
    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    (sp_dir / "tokenizer.model").write_bytes(sp.serialized)
    (tmp_path / "x.model").write_bytes(sp.serialized)
    for path in (sp_dir, tmp_path / "x.model"):
        loaded = tokenizer_lib.load(path)
        assert isinstance(loaded, SentencePieceTokenizer)
        assert loaded.serialized == sp.serialized
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
        tokenizer_lib.load(empty)
    with pytest.raises(FileNotFoundError, match="tokenizer path not found"):
        tokenizer_lib.load(tmp_path / "missing")


def test_save_round_trips_with_the_config(tmp_path):
    config = {"bos_token": BOS, "eos_token": EOT, "pad_token": PAD, "chat_template": "{{ x }}"}
    tok = HFTokenizer(_write_dir(tmp_path / "src", _backend(), config))
    assert tok.to_hf() is tok
    tok.save(tmp_path / "out")
    again = HFTokenizer(tmp_path / "out")
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert again.encode_batch(HELD_OUT) == tok.encode_batch(HELD_OUT)
    saved = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == "{{ x }}"
