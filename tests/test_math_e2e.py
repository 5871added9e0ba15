"""End to end on real-format inputs: a tiny random Qwen2-shaped Hugging Face checkpoint (with
its own tokenizer.json) and 20 GSM8K rows in verl's RL parquet layout (chat-message prompts,
`reward_model.ground_truth`), both named on the Hugging Face Hub (read from a Hub cache laid
out offline), through two RL steps of `configs/math.py`, then the exported policy loaded by
transformers."""

import importlib.util
import json
import os

import numpy as np
import pytest
from huggingface_hub import constants
from test_data_formats import verl_gsm8k, write_verl_parquet
from test_hub import bpe_tokenizer_dir, write_cached_repo

from rlscale import checkpoint, rl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(n=20):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(2, 50, 2))
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many apples now?",
                "answer": f"Tom has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
            }
        )
    return rows


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("math_e2e")
    rows = _rows()
    data = write_verl_parquet(root / "train.parquet", verl_gsm8k(rows, "train"))
    model_dir = root / "qwen"
    model_dir.mkdir()
    corpus = [r["question"] + r["answer"] for r in rows] + [
        "system user assistant Please reason step by step, and put your final answer within "
        "\\boxed{}. You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    ] * 5
    vocab = bpe_tokenizer_dir(model_dir, corpus, 400)
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(model_dir)
    files = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    write_cached_repo(root / "hub", "model", MODEL, files)
    write_cached_repo(root / "hub", "dataset", DATA, {"train.parquet": data.read_bytes()})
    return root, data, model_dir


MODEL, DATA = "tiny-org/tiny-qwen2", "tiny-org/tiny-verl-gsm8k"


def _math_config(arg):
    spec = importlib.util.spec_from_file_location(
        "math_cfg", os.path.join(ROOT, "configs", "math.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


@pytest.mark.slow
def test_rl_on_a_hf_checkpoint_and_verl_parquet_then_export(inputs, tmp_path, monkeypatch):
    root, _, model_dir = inputs
    for key, value in (("HF_HUB_OFFLINE", True), ("HF_HUB_CACHE", str(root / "hub"))):
        monkeypatch.setenv(key, str(int(value)) if value is True else value)
        monkeypatch.setattr(constants, key, value)  # Read once, at import.
    data = f"hf://datasets/{DATA}/train.parquet"
    config = _math_config(f"checkpoint={MODEL},train={data},test={data},smoke")
    assert config.task.format == "auto" and config.task.chat_template == "qwen2.5"
    # A random model never answers right: an easy reward (any digit) gives the update signal.
    config.reward.fn = "reward_fixtures:digits"
    config.optim.lr = 1e-3
    # One device: the checkpoint, the data layout and the export are the point here, and every
    # recipe runs on 8 devices in tests/test_rl.py.
    config.mesh.shape = (1, 1, 1)
    summary = rl.run(rl.resolve(config), str(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert all(np.isfinite(x["train/loss"]) for x in lines[1:])
    gaps = [x["train/logp_gap_abs"] for x in lines[1:] if x["train/logp_gap_abs"] is not None]
    assert gaps and max(gaps) < 1e-4
    assert summary["compute/flops"] > 0
    assert json.loads((tmp_path / "config.json").read_text())["init"]["hf_checkpoint"] == MODEL
    # The layout was detected as verl's (the dataset is named after the layouts it holds).
    built = [p.name for p in (tmp_path / "data" / "math_files").iterdir() if p.name[0] != "."]
    assert len(built) == 1 and built[0].startswith("verl_")
    # The export loads in transformers and computes what rlscale's final params compute.
    export = tmp_path / "hf"
    assert (export / "tokenizer.json").exists()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(export)).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    # Generation stops where the sampler stopped: the chat template's end of turn.
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok("Tom has 3 apples.")["input_ids"]
    with torch.no_grad():
        theirs = reloaded(torch.tensor([ids])).logits.numpy()
    from rlscale import model

    cfg, graphdef, params = checkpoint.load_params(str(tmp_path / "final"))
    tokens = np.array([ids])
    mask = np.ones_like(tokens, bool)
    ours, _ = model.forward(graphdef, params, tokens, model.positions_from_mask(mask), mask)
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)
    # Training moved the policy away from the checkpoint it started from.
    start = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    with torch.no_grad():
        before = start(torch.tensor([ids])).logits.numpy()
    assert np.abs(before - theirs).max() > 1e-6


def test_bad_math_config_names_the_problem(inputs, tmp_path):
    _, data, _ = inputs
    config = _math_config(f"checkpoint={tmp_path},train={data},test={tmp_path / 'nope.jsonl'}")
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert "task.files.test=" in str(e.value) and "no such file" in str(e.value)
    assert "has no config.json" in str(e.value)
