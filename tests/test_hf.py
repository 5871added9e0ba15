"""Hugging Face import/export: logits parity with transformers, exact round trips, sharding."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_TINY, subprocess_env

from rlscale import model, sharding
from rlscale.model import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_COMMON = HF_TINY
CASES = {
    "llama": ("LlamaConfig", {}),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500_000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": (
        "Qwen2Config",
        dict(rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0)),
    ),
    "qwen2_yarn": (
        "Qwen2Config",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10_000.0,
                factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", dict(num_key_value_heads=1)),
}


def _hf_model(case, directory):
    name, extra = CASES[case]
    config = getattr(transformers, name)(**{**_COMMON, **extra})
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # Norm scales and biases are ones/zeros at init: make them count.
        for pname, p in m.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.normal_(0.0, 0.3)
    m.save_pretrained(directory)
    return m


def _tokens():
    return np.random.default_rng(0).integers(0, _COMMON["vocab_size"], (2, 24))


def _hf_logits(m, tokens):
    with torch.no_grad():
        return m(torch.tensor(tokens)).logits.numpy()


def _our_logits(graphdef, params, tokens):
    mask = jnp.ones(tokens.shape, bool)
    logits, _ = model.forward(
        graphdef, params, jnp.asarray(tokens, jnp.int32), model.positions_from_mask(mask), mask
    )
    return np.asarray(logits)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    m = _hf_model(case, tmp_path)
    cfg, graphdef, params = hf.load_hf(str(tmp_path))
    assert cfg.dtype == "float32"
    tokens = _tokens()
    err = np.max(np.abs(_our_logits(graphdef, params, tokens) - _hf_logits(m, tokens)))
    assert err <= 1e-4, err


@pytest.mark.parametrize("case", ["llama", "qwen2_yarn", "gemma"])
def test_round_trip_is_exact_and_loads_in_transformers(case, tmp_path):
    m = _hf_model(case, tmp_path / "src")
    cfg, graphdef, params = hf.load_hf(str(tmp_path / "src"))
    hf.save_hf(str(tmp_path / "out"), cfg, params)
    cfg2, _, params2 = hf.load_hf(str(tmp_path / "out"))
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    tokens = _tokens()
    np.testing.assert_allclose(_hf_logits(reloaded, tokens), _hf_logits(m, tokens), atol=1e-6)


def test_sharded_checkpoint_onto_a_mesh(tmp_path):
    _hf_model("qwen3", tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    # Re-save as several files with an index, as large checkpoints come.
    cfg, graphdef, params = hf.load_hf(str(tmp_path))
    hf.save_hf(str(tmp_path / "sharded"), cfg, params, max_shard_bytes=40_000)
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) > 3
    mesh = sharding.make_mesh((2, 2, 2))
    _, _, on_mesh = hf.load_hf(str(tmp_path / "sharded"), mesh=mesh)
    q = on_mesh["layers"][0]["attn"]["q"][...]
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(on_mesh)):
        np.testing.assert_array_equal(a, b)
    assert hf_cfg["model_type"] == "qwen3"


def test_bad_checkpoints_fail_naming_the_problem(tmp_path):
    _hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type 'mistral' is not supported"):
        hf.load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        hf.load_hf(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        hf.load_hf(str(tmp_path / "nowhere"))


def test_convert_tool_round_trip(tmp_path):
    import subprocess
    import sys

    import tokenizers
    from tokenizers import models, pre_tokenizers

    m = _hf_model("qwen2", tmp_path / "hf")
    words = ["<pad>", "<s>", "</s>", "<unk>", "hello", "world", "tokens"]
    backend = tokenizers.Tokenizer(models.WordLevel(dict(zip(words, range(7))), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "hf" / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(special))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = subprocess_env()
    for args in (
        ["--from", "hf", "--to", "rlscale", tmp_path / "hf", tmp_path / "ours"],
        ["--from", "rlscale", "--to", "hf", tmp_path / "ours", tmp_path / "back"],
    ):
        r = subprocess.run(
            [sys.executable, os.path.join(root, "tools", "convert.py"), *map(str, args)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    tokens = _tokens()
    np.testing.assert_array_equal(_hf_logits(back, tokens), _hf_logits(m, tokens))
    # The tokenizer came along both ways, and its ids went into the configs. (Read with
    # rlscale's loader: transformers 5.23 gives every qwen2 directory Qwen's own pipeline.)
    from rlscale import tokenizers as tokenizer_lib

    assert tokenizer_lib.load(tmp_path / "back").encode("hello tokens world") == [4, 6, 5]
    config = json.loads((tmp_path / "back" / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)


@pytest.mark.slow
def test_export_serves_like_the_sampler(tmp_path):
    """A policy with a SentencePiece tokenizer and two stop tokens (the EOS and an end-of-turn
    stand-in), exported: transformers' tokenizer gives rlscale's ids, and transformers'
    greedy `generate` gives rlscale's greedy sampler's completions, stopping where it stops."""
    from rlscale.sampling import Sampler, SamplingConfig
    from rlscale.tokenizers import chat, train_sentencepiece

    rng = np.random.default_rng(0)
    corpus = [
        f"Q: {a}+{b}-{c}= {a + b}-{c}={a + b - c} Answer: {a + b - c}"
        for a, b, c in (rng.integers(0, 50, (300, 3)).tolist())
    ]
    tok = train_sentencepiece(corpus, 300, hard_vocab_limit=False)
    cfg = model.get("tiny", vocab_size=tok.vocab_size)
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    prompts = [f"Q: {a}+{b}=" for a, b in rng.integers(0, 50, (8, 2)).tolist()]
    prompt_ids = [chat.encode_prompt(tok, p) for p in prompts]
    sampler = Sampler(graphdef, cfg)

    def greedy(stop_tokens):
        scfg = SamplingConfig(
            max_new_tokens=16,
            temperature=0.0,
            stop_tokens=stop_tokens,
            pad_id=tok.padding_id,
            buckets=(16,),
        )
        out = sampler(params, prompt_ids, jax.random.key(0), scfg)
        return np.asarray(out.tokens), np.asarray(out.lengths)

    # A random policy never says the EOS: give the EOS the output column of a token row 0
    # says (scaled up, so it wins wherever that token would), and stop at a token row 1 says.
    first, _ = greedy((tok.eos_id,))
    said = int(first[0, 2])
    other = next(int(t) for t in first[1, 1:] if t not in (said, tok.eos_id))
    head = params["lm_head"][...]
    params["lm_head"] = params["lm_head"].replace(head.at[:, tok.eos_id].set(1.05 * head[:, said]))
    stop = (tok.eos_id, other)
    ours, lengths = greedy(stop)
    last = ours[np.arange(len(ours)), lengths - 1]
    # Some completions stop at each stop token and some run to the budget: all three compared.
    assert (last == tok.eos_id).any() and (last == other).any() and (lengths == 16).any()

    hf.save_hf(str(tmp_path), cfg, params, tokenizer=tok, stop_tokens=stop)
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((tmp_path / name).read_text())
        assert ids["eos_token_id"] == list(stop)
        assert (ids["bos_token_id"], ids["pad_token_id"]) == (tok.bos_id, tok.pad_id)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = [*corpus[:50], "  two  spaces,\ttab\nnewline ", "naïve café 世界 🙂", ""]
    for text in texts:
        assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text), text
        assert hf_tok.decode(tok.encode(text)) == text
    batch = hf_tok(prompts, padding=True, return_tensors="pt")  # Left-padded, with the BOS.
    for row, mask, ids in zip(
        batch["input_ids"].numpy(), batch["attention_mask"].numpy(), prompt_ids
    ):
        assert row[mask.astype(bool)].tolist() == ids
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        out = policy.generate(**batch, max_new_tokens=16, do_sample=False)
    theirs = out[:, batch["input_ids"].shape[1] :].numpy()
    # Stopped rows are padded with the pad id on both sides; generate ends with the longest.
    np.testing.assert_array_equal(theirs, ours[:, : theirs.shape[1]])
    assert (ours[:, theirs.shape[1] :] == tok.pad_id).all()
