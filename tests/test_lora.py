"""LoRA policies: the config section's problems, init and merge against NumPy, adapters-only
optimizer state, the PEFT export loaded by transformers and peft, an update reaching the
generator, and a LoRA run's checkpoints and resume."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_TINY, U, load_config, metric_lines, random_decoder_params, rounding

from rlscale import checkpoint, optim, rl, sections
from rlscale.model import decoder, hf
from rlscale.model import lora as lora_lib
from rlscale.rl import loop

LORA = lora_lib.LoraConfig(rank=4, alpha=8.0)
# Jitted: an eager forward compiles each of its operations for each new shape (1.4 CPU-s),
# a jitted one compiles once (0.3 CPU-s).
_forward = jax.jit(decoder.forward, static_argnums=0)


def _random_adapters(params, cfg: lora_lib.LoraConfig, seed: int):
    """`lora.init`'s adapters with B drawn too (B = 0 would make every merge the base)."""
    adapters = lora_lib.init(params, cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if p[-1].key == "a" else rng.normal(size=x.shape).astype(np.float32) * 0.1,
        adapters,
    )


def test_config_problems_are_named_at_once():
    c = load_config("quickstart", "smoke,lora")
    c.lora.targets = ("q_proj", "qkv_proj", "o_proj")
    c.lora.alpha = 0.0
    c.learner.offload_ref = True
    with pytest.raises(sections.InvalidConfigError) as e:
        rl.resolve(c)
    assert e.value.problems[-3:] == [
        "lora.alpha=0.0 must be a number > 0",
        "lora.targets=('q_proj', 'qkv_proj', 'o_proj'): ['qkv_proj'] name no module; valid "
        "names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        "learner.offload_ref=True with lora.rank > 0: the frozen base, which is the reference, "
        "is also the policy's weights and stays in device memory",
    ]
    c = load_config("quickstart", "smoke,lora")
    c.lora.rank = -2
    with pytest.raises(sections.InvalidConfigError, match=r"lora.rank=-2 must be an integer >= 0"):
        rl.resolve(c)
    c.lora.rank, c.lora.targets = 0, ("nonsense",)  # Off: its other keys are not read.
    assert not rl.resolve(c).lora.enabled


def test_init_is_the_base_and_merge_matches_numpy(tiny_cfg):
    params = random_decoder_params(tiny_cfg, 0)
    fresh = lora_lib.init(params, LORA, jax.random.key(0))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(lora_lib.merged(params, fresh, 2.0))):
        np.testing.assert_array_equal(a, b)  # B = 0: the base, bit for bit.
    adapters = _random_adapters(params, LORA, 1)
    merged = lora_lib.merged(params, adapters, LORA.scale)
    pure, got = nnx_pure(params), nnx_pure(merged)
    n_in = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
    for i, layer in pure["layers"].items():
        for group in ("attn", "mlp"):
            for name, w in layer[group].items():
                if name not in n_in:  # Norm scales.
                    continue
                ad = adapters["layers"][str(i)][group][name]
                a, b = np.asarray(ad["a"], np.float64), np.asarray(ad["b"], np.float64)
                inputs = int(np.prod(w.shape[: n_in[name]]))
                want = np.asarray(w, np.float64).reshape(inputs, -1) + LORA.scale * a @ b
                # W + delta rounded once to float32 (the delta's R products: far below that).
                tol = (np.abs(want) + LORA.scale * np.abs(a) @ np.abs(b)) * (U + rounding(4))
                err = np.abs(np.asarray(got["layers"][i][group][name]).reshape(want.shape) - want)
                assert (err <= tol).all(), (i, name, err.max())
    for key in ("embedding", "lm_head"):  # Not targeted: the base's own arrays.
        np.testing.assert_array_equal(got[key], pure[key])


def nnx_pure(params):
    from flax import nnx

    return nnx.to_pure_dict(params)


def test_optimizer_state_is_the_adapters_only(tiny_cfg):
    params = random_decoder_params(tiny_cfg, 0)
    adapters = lora_lib.init(params, LORA, jax.random.key(0))
    opt = optim.make_optimizer(optim.OptimConfig())
    state = opt.init(adapters)
    counts = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim == 0)
    # AdamW: two moments shaped as the adapters, and scalar step counts.
    assert optim.tree_bytes(state) == 2 * optim.tree_bytes(adapters) + counts
    # Rank 4: q and o 64 -> 64, k and v 64 -> 32, gate and up 64 -> 128, down 128 -> 64.
    per_layer = 2 * 4 * (64 + 64) + 2 * 4 * (64 + 32) + 2 * 4 * (64 + 128) + 4 * (128 + 64)
    assert lora_lib.num_params(adapters) == tiny_cfg.num_layers * per_layer
    # Full fine-tuning's: the moments of every param (8192 of 106,816 here, 7.7%).
    full = optim.tree_bytes(opt.init(nnx_pure(params)))
    assert full == 2 * 4 * tiny_cfg.num_params() + counts


# ------------------------------------------------------------------------------------------
# Export: merged Hugging Face weights, and a PEFT adapter directory.
# ------------------------------------------------------------------------------------------


def test_export_loads_in_transformers_and_peft(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(**{**HF_TINY, "max_position_embeddings": 64})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path / "base")
    cfg, graphdef, params = hf.load_hf(str(tmp_path / "base"))
    lcfg = lora_lib.LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "down_proj"))
    adapters = _random_adapters(params, lcfg, 2)
    merged = lora_lib.merged(params, adapters, lcfg.scale)
    hf.save_hf(str(tmp_path / "merged"), cfg, merged)
    lora_lib.save_peft(str(tmp_path / "adapter"), adapters, lcfg, str(tmp_path / "base"))

    tokens = np.random.default_rng(0).integers(0, 96, (2, 16))
    mask = jnp.ones(tokens.shape, bool)
    ours, _ = _forward(
        graphdef, merged, jnp.asarray(tokens), decoder.positions_from_mask(mask), mask
    )
    ours = np.asarray(ours)
    base_logits, _ = _forward(
        graphdef, params, jnp.asarray(tokens), decoder.positions_from_mask(mask), mask
    )

    def logits(m):
        with torch.no_grad():
            return m.eval()(torch.tensor(tokens)).logits.numpy()

    auto = transformers.AutoModelForCausalLM
    exported = logits(auto.from_pretrained(tmp_path / "merged"))
    base_model = auto.from_pretrained(tmp_path / "base")
    adapted = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter"))
    names = {n for n, _ in adapted.named_parameters() if "lora_" in n}
    assert len(names) == 2 * 2 * 3  # A and B of 3 modules in 2 layers: every tensor used.
    on_the_fly = logits(adapted)
    # Each logit sums about 640 products on its path (2 layers x (64 + 64 + 64 + 96), the
    # head's 64); two float32 implementations each within rounding(640) of its magnitude.
    tol = 2 * rounding(640) * max(np.abs(ours).max(), 1.0)
    assert np.abs(exported - ours).max() <= tol
    assert np.abs(on_the_fly - ours).max() <= tol
    assert np.abs(np.asarray(base_logits) - ours).max() > 100 * tol  # The adapters matter.


# ------------------------------------------------------------------------------------------
# Runs: an update reaches the generator; checkpoints and resume.
# ------------------------------------------------------------------------------------------


def _lora_config(warm, steps=3):
    c = load_config("quickstart", "smoke,lora")
    c.mesh.shape = (1, 1, 1)
    c.reward.fn = "reward_fixtures:even_length"
    c.reward.workers = 0
    c.sft.reuse_from = str(warm)
    c.steps = steps
    # The first update at the full learning rate (1e-3): `test_an_update_reaches_the_generator`
    # needs it, and the run with the same settings compiles the same update program.
    c.optim.warmup_steps = 0
    return c


def _learner_logp(s, params, roll):
    """Each completion token's logprob under `params` (a full forward pass, float32; the
    quickstart samples at temperature 1, no top-k or top-p), and the magnitude of the terms
    it is the difference of (|logit| + |logsumexp|)."""
    mask = jnp.asarray(roll.attn_mask_NL)
    tokens = jnp.asarray(roll.tokens_NL)
    logits, _ = _forward(s.graphdef, params, tokens, decoder.positions_from_mask(mask), mask)
    P, M = roll.prompt_len, roll.mask_NM.shape[1]
    logits = np.asarray(logits, np.float64)[:, P - 1 : P + M - 1]
    chosen = np.take_along_axis(logits, np.asarray(roll.tokens_NL)[:, P:, None], -1)[..., 0]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return chosen - lse, np.abs(chosen) + np.abs(lse)


def test_an_update_reaches_the_generator(warm, tmp_path):
    """One RL step by hand: the generator then samples with the updated adapters merged into
    the base, so its logprobs are the learner's with the new adapters (up to the numerics of
    two programs), and far from the base's."""
    config = _lora_config(warm)  # The first update at the full learning rate (1e-3).
    lp = loop.Loop(rl.resolve(config), str(tmp_path), False)
    s, run = lp.s, lp.run
    try:
        params, _ = s.generator_params(run.train.params)
        roll, _ = lp.source.next(params, jax.random.key(1), 0)
        train, _, applied = s.learner.update(run.train, s.ref_params, roll, 1)
        assert np.asarray(applied).all()
        params, _ = s.generator_params(train.params)
        roll, _ = lp.source.next(params, jax.random.key(2), 1)
        new, magnitude = _learner_logp(s, s.policy_params(train.params), roll)
        old, _ = _learner_logp(s, s.params, roll)  # The base: undonated, step 0's policy.
    finally:
        for close in (s.close, lp.source.close, lp.ckpt.close, lp.writer.close):
            close()
    mask = roll.mask_NM.astype(bool)
    gen = roll.sampler_logp_NM.astype(np.float64)
    # About 2^12 float32 terms reach each logprob (4 layers of norms, projections over 128
    # and 384 inputs and attention over at most 64 positions; the head and a logsumexp over
    # the vocabulary), each program within rounding(2^12) of their magnitudes.
    tol = 2 * rounding(2**12) * magnitude
    assert (np.abs(gen - new) <= tol)[mask].all(), np.abs(gen - new)[mask].max()
    # One update moves most tokens' logprobs by more than 10 such bounds (measured: a median
    # of 47, up to 0.41 nats).
    assert (np.abs(gen - old) > 10 * tol)[mask].mean() > 0.5


@pytest.fixture(scope="module")
def lora_run(warm, shared_workdir):
    config = _lora_config(warm)
    workdir = shared_workdir("lora_smoke", lambda w: rl.run(rl.resolve(config), str(w)))
    return config, workdir


def test_a_run_trains_adapters_only_and_exports_them(lora_run):
    config, workdir = lora_run
    summary = json.loads((workdir / "summary.json").read_text())
    cfg, _, final = checkpoint.load_params(str(workdir / "final"))
    _, _, base = checkpoint.load_params(str(workdir / "sft"))  # The warm start: the base.
    # Trained: the adapters and the value head; AdamW's two moments of each, and counts.
    trained = summary["train/trained_params"]
    assert trained < cfg.num_params() / 5
    assert 2 * summary["train/trained_bytes"] <= summary["train/opt_state_bytes"]
    assert summary["train/opt_state_bytes"] < 2 * summary["train/trained_bytes"] + 64
    # The final params are the merged policy; the PEFT directory holds the same adapters.
    with open(workdir / "adapter" / "adapter_config.json") as f:
        peft_config = json.load(f)
    assert peft_config["r"] == config.lora.rank and peft_config["lora_alpha"] == 32.0
    from safetensors.numpy import load_file

    tensors = load_file(str(workdir / "adapter" / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * cfg.num_layers
    a = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert a.shape == (config.lora.rank, cfg.mlp_dim) and b.shape == (cfg.d_model, config.lora.rank)
    w_base = np.asarray(nnx_pure(base)["layers"][1]["mlp"]["down"], np.float64)
    w_final = np.asarray(nnx_pure(final)["layers"][1]["mlp"]["down"], np.float64)
    scale = config.lora.alpha / config.lora.rank
    want = w_base + scale * (b.astype(np.float64) @ a).T
    # Rounded once to float32, after a float32 A @ B of `rank` products.
    tol = U * np.abs(want) + rounding(config.lora.rank) * scale * (np.abs(b) @ np.abs(a)).T
    assert (np.abs(w_final - want) <= tol).all()
    assert np.abs(w_final - w_base).max() > 0  # Trained.
    # The checkpoint: adapters and their optimizer state, the base's identity, no base.
    host = json.loads((workdir / "checkpoints" / "3" / "host" / "metadata").read_text())
    assert host["base"]["source"].endswith("sft")
    assert host["base"]["fingerprint"] == checkpoint.tree_fingerprint(base)


def test_resume_is_the_same_run_and_refuses_another_base(lora_run, tmp_path):
    config, workdir = lora_run
    resumed = tmp_path / "run"
    shutil.copytree(workdir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "3")  # Resume from step 2.
    rl.run(rl.resolve(config), str(resumed))
    assert metric_lines(resumed) == metric_lines(workdir)
    host = resumed / "checkpoints" / "2" / "host" / "metadata"
    saved = json.loads(host.read_text())
    saved["base"]["fingerprint"] = "0" * 16
    host.write_text(json.dumps(saved))
    shutil.rmtree(resumed / "checkpoints" / "3")
    with pytest.raises(ValueError, match="holds LoRA adapters trained on another base"):
        rl.run(rl.resolve(config), str(resumed))
