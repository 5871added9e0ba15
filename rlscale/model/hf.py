"""Hugging Face checkpoints: import into rlscale params, placed on their shards, and export back.

Supported families: Llama (2, 3, 3.1 RoPE scaling), Qwen2/Qwen2.5 (q/k/v biases, YaRN),
Qwen3 (QK-norm), Qwen3-MoE (QK-norm, sparse layers of `moe.MoE`, each expert's tensors
stacked into one parameter) and Gemma (1 + scale norms, GeGLU, scaled embeddings). A checkpoint is a
directory with `config.json` and one `model.safetensors` or several files listed in
`model.safetensors.index.json`.

Import reads one tensor at a time from the memory-mapped files and builds each parameter with
`jax.make_array_from_callback`, so every device receives only its shard and no device ever
holds a full copy of a large model. Export (`save_hf`) writes the same format back and, given
the run's tokenizer and stop tokens, the tokenizer files and special ids that make the
directory serve the policy as rlscale samples it.
"""

import json
import math
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from rlscale import sharding
from rlscale.model import decoder, moe
from rlscale.model.config import ModelConfig

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma": "GemmaForCausalLM",
}
# Tensors some checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _rope_fields(d: dict) -> dict:
    """RoPE settings from either the legacy (`rope_theta`, `rope_scaling`) or the
    transformers-5 (`rope_parameters`) layout."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", 10_000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind in (None, "default"):
        return out
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(
            f"config.json: rope scaling type {kind!r} is not supported "
            "(supported: default, linear, llama3, yarn)"
        )
    out["rope_scaling"] = kind
    out["rope_factor"] = float(merged["factor"])
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(merged["low_freq_factor"])
        out["rope_high_freq_factor"] = float(merged["high_freq_factor"])
    if kind in ("llama3", "yarn"):
        out["rope_original_max_len"] = int(merged["original_max_position_embeddings"])
    if kind == "yarn":
        for ours, theirs in (
            ("rope_yarn_beta_fast", "beta_fast"),
            ("rope_yarn_beta_slow", "beta_slow"),
        ):
            if merged.get(theirs) is not None:
                out[ours] = float(merged[theirs])
        for unsupported in ("attention_factor", "mscale", "mscale_all_dim"):
            if merged.get(unsupported) is not None:
                raise ValueError(f"config.json: yarn {unsupported} is not supported")
        if merged.get("truncate") is False:
            raise ValueError("config.json: yarn truncate=false is not supported")
    return out


def config_from_hf(d: dict, *, dtype: str | None = None, **overrides) -> ModelConfig:
    """Maps a Hugging Face `config.json` dict to a ModelConfig.

    Args:
      d: the parsed config.json.
      dtype: compute and parameter dtype; defaults to the checkpoint's (`torch_dtype`/`dtype`)
        or float32.
      **overrides: any ModelConfig field, e.g. `max_seq_len` to size the KV cache.
    """
    family = d.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"config.json: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    if d.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    if family == "llama" and d.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported for llama")
    heads = d["num_attention_heads"]
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json: activation {act!r} is not supported")
    ckpt_dtype = str(d.get("torch_dtype") or d.get("dtype") or "float32")
    dtype = dtype or ("bfloat16" if ckpt_dtype == "bfloat16" else "float32")
    fields = dict(
        vocab_size=d["vocab_size"],
        num_layers=d["num_hidden_layers"],
        d_model=d["hidden_size"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        mlp_dim=d["intermediate_size"],
        max_seq_len=d.get("max_position_embeddings", 2048),
        norm_eps=d.get("rms_norm_eps", 1e-6),
        norm_plus_one=family == "gemma",
        activation="silu" if act == "silu" else "gelu_tanh",
        attn_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(d.get("tie_word_embeddings", family == "gemma")),
        embed_scale=family == "gemma",
        dtype=dtype,
        param_dtype=dtype,
        **_rope_fields(d),
        **(_moe_fields(d) if family == "qwen3_moe" else {}),
    )
    return ModelConfig(**{**fields, **overrides})


def _moe_fields(d: dict) -> dict:
    """Qwen3-MoE's expert settings (transformers 5 also writes `num_local_experts`)."""
    return dict(
        num_experts=d.get("num_experts") or d["num_local_experts"],
        experts_per_token=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=d.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
    )


def family_of(cfg: ModelConfig) -> str:
    if cfg.norm_plus_one:
        return "gemma"
    if cfg.num_experts:
        return "qwen3_moe"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.attn_bias:
        return "qwen2"
    return "llama"


def config_to_hf(cfg: ModelConfig, family: str | None = None) -> dict:
    """A `config.json` dict that transformers (and vLLM) load as the same model.

    Raises:
      ValueError: for a sliding window or an attention soft-cap, which the exported families'
        configs do not carry (the export would compute another model).
    """
    family = family or family_of(cfg)
    if cfg.sliding_window or cfg.attn_softcap:
        raise ValueError(
            f"sliding_window={cfg.sliding_window}, attn_softcap={cfg.attn_softcap}: the "
            f"{family} family's config.json has no such attention; not exported"
        )
    d = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "torch_dtype": cfg.param_dtype,
        "hidden_act": "silu" if cfg.activation == "silu" else "gelu_pytorch_tanh",
        "attention_bias": False,
    }
    if family == "gemma":
        d["hidden_activation"] = d["hidden_act"]
    if family == "qwen3_moe":
        d.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )
    if cfg.rope_scaling != "none":
        scaling = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
        if cfg.rope_scaling == "llama3":
            scaling.update(
                low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor
            )
        if cfg.rope_scaling in ("llama3", "yarn"):
            scaling["original_max_position_embeddings"] = cfg.rope_original_max_len
        if cfg.rope_scaling == "yarn":
            scaling.update(beta_fast=cfg.rope_yarn_beta_fast, beta_slow=cfg.rope_yarn_beta_slow)
        d["rope_scaling"] = scaling
    return d


# ------------------------------------------------------------------------------------------
# Name and layout mapping: for each rlscale parameter path, the HF tensor name (a tuple of
# names for the experts' stacked weights, one tensor per expert) and the two layout
# transforms (HF -> rlscale, rlscale -> HF). HF linear weights are [out, in].
# ------------------------------------------------------------------------------------------


def _path_str(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _mapping(cfg: ModelConfig, path: tuple[str, ...]) -> tuple[str | tuple, Callable, Callable]:
    """(hf_name or hf_names, to_ours, to_hf) for one rlscale parameter path."""
    D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = (lambda x: x, lambda x: x)
    transpose = (lambda x: x.T, lambda x: x.T)
    if path == ("embedding",):
        return ("model.embed_tokens.weight", *same)
    if path == ("lm_head",):
        return ("lm_head.weight", *transpose)
    if path == ("final_norm", "scale"):
        return ("model.norm.weight", *same)
    assert path[0] == "layers", path
    i, rest = path[1], path[2:]
    prefix = f"model.layers.{i}."
    heads = {"q": H, "k": K, "v": K}
    table = {
        ("attn_norm", "scale"): ("input_layernorm.weight", *same),
        ("mlp_norm", "scale"): ("post_attention_layernorm.weight", *same),
        ("attn", "o"): (
            "self_attn.o_proj.weight",
            lambda x: x.T.reshape(H, E, D),
            lambda x: x.reshape(H * E, D).T,
        ),
        ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", *same),
        ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", *same),
        ("mlp", "gate"): ("mlp.gate_proj.weight", *transpose),
        ("mlp", "up"): ("mlp.up_proj.weight", *transpose),
        ("mlp", "down"): ("mlp.down_proj.weight", *transpose),
        ("moe", "router"): ("mlp.gate.weight", *transpose),
    }
    experts = (lambda x: x.transpose(0, 2, 1), lambda x: x.transpose(0, 2, 1))
    for name in ("gate", "up", "down"):
        names = tuple(f"{prefix}mlp.experts.{j}.{name}_proj.weight" for j in range(cfg.num_experts))
        table[("moe", name)] = (names, *experts)
    for name, n in heads.items():
        table[("attn", name)] = (
            f"self_attn.{name}_proj.weight",
            lambda x, n=n: x.T.reshape(D, n, E),
            lambda x, n=n: x.reshape(D, n * E).T,
        )
        table[("attn", f"{name}_bias")] = (
            f"self_attn.{name}_proj.bias",
            lambda x, n=n: x.reshape(n, E),
            lambda x, n=n: x.reshape(n * E),
        )
    if rest not in table:
        raise ValueError(f"no Hugging Face name for parameter {'/'.join(path)}")
    name, to_ours, to_hf = table[rest]
    return (name if isinstance(name, tuple) else prefix + name, to_ours, to_hf)


def _checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or by scanning the directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path}: no *.safetensors files (and no model.safetensors.index.json)"
        )
    out = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="numpy") as f:
            out.update({name: os.path.join(path, file) for name in f.keys()})
    return out


def _placed(host: np.ndarray, v, mesh, rules) -> jax.Array:
    """`host` as the value of the abstract variable `v`: on the default device, or laid out
    on `mesh` by `rules` and `v`'s logical axes."""
    if mesh is None:
        return jax.device_put(np.array(host))
    spec = sharding.logical_to_spec(v.get_metadata()["axes"], rules, mesh, v.shape)
    target = jax.sharding.NamedSharding(mesh, spec)
    # A copy per shard: on CPU a device buffer may alias the NumPy memory it came from, and
    # replicated shards would then share one buffer, which a donating update writes.
    return jax.make_array_from_callback(v.shape, target, lambda idx: np.array(host[idx]))


def load_hf(
    path: str,
    mesh=None,
    rules: sharding.Rules = sharding.TRAIN_RULES,
    dtype: str | None = None,
    **overrides,
):
    """Reads a Hugging Face checkpoint directory.

    Args:
      path: directory with config.json and safetensors files.
      mesh: place every parameter on this mesh with `rules`; None puts them on the default
        device.
      rules: logical-axis rule table (train or sample layout).
      dtype: compute/parameter dtype (default: the checkpoint's).
      **overrides: ModelConfig fields (e.g. `max_seq_len`).

    Returns:
      (cfg, graphdef, params).

    Raises:
      ValueError / FileNotFoundError: naming the file and tensor for a missing or mis-shaped
        tensor, an unsupported architecture, or tensors the model would silently ignore.
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} does not exist")
    with open(config_path) as f:
        cfg = config_from_hf(json.load(f), dtype=dtype, **overrides)
    problems = [] if mesh is None else moe.mesh_problems(cfg, dict(mesh.shape))
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    files = _checkpoint_files(path)
    graphdef, abstract = decoder.abstract_model(cfg)
    used = set()
    handles = {}

    def read(name):
        if name not in files:
            raise ValueError(f"{path}: tensor {name!r} is missing from the checkpoint")
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="numpy").__enter__()
        used.add(name)
        return handles[file].get_tensor(name)

    def load(p, v):
        name, to_ours, _ = _mapping(cfg, _path_str(p))
        # An expert parameter: its experts' tensors stacked.
        stacked = isinstance(name, tuple)
        host = to_ours(np.stack([read(n) for n in name]) if stacked else read(name))
        if host.shape != v.shape:
            which = f"tensors {name[0]!r}..." if stacked else f"tensor {name!r}"
            raise ValueError(
                f"{files[name[0] if stacked else name]}: {which} has shape {host.shape} after "
                f"conversion, the model expects {v.shape}"
            )
        return v.replace(_placed(host.astype(v.dtype), v, mesh, rules))

    try:
        params = jax.tree_util.tree_map_with_path(
            load, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    leftover = {n for n in files if n not in used and not n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_embeddings:
        leftover.discard("lm_head.weight")
    if leftover:
        raise ValueError(
            f"{path}: tensors the model does not use (unsupported architecture "
            f"feature?): {sorted(leftover)[:8]}"
        )
    logging.info("loaded %s (%d tensors) as %s", path, len(used), cfg)
    return cfg, graphdef, params


def save_hf(
    path: str,
    cfg: ModelConfig,
    params,
    family: str | None = None,
    max_shard_bytes: int = 5 << 30,
    *,
    tokenizer=None,
    stop_tokens: Sequence[int] | None = None,
):
    """Writes params as a Hugging Face checkpoint, loadable by transformers and vLLM.

    `config.json` and safetensors (sharded above `max_shard_bytes`, with an index); with a
    tokenizer also its files and the special ids, so that `AutoTokenizer.from_pretrained(path)`
    and `AutoModelForCausalLM.from_pretrained(path).generate(...)` serve the policy as rlscale
    samples it: the same prompt ids, and generation stops where rlscale's sampler stops.

    Args:
      path: the directory to write.
      cfg: the model's config.
      params: its params (any sharding; gathered one tensor at a time).
      family: the `model_type` to write (default: `family_of(cfg)`).
      max_shard_bytes: the largest safetensors file.
      tokenizer: an `rlscale.tokenizers.Tokenizer`, written as `tokenizer.json` +
        `tokenizer_config.json` (`Tokenizer.to_hf`: a SentencePiece model is converted); its
        bos/eos/pad ids go into `config.json` and `generation_config.json`.
      stop_tokens: the ids rlscale's sampler stops at (`SamplingConfig.stop_tokens`: the EOS
        and, for a chat template, its end of turn); written as `eos_token_id`, a list when
        several. Default: the tokenizer's EOS.

    Returns:
      The bytes of tensors written.

    Raises:
      ValueError: naming every id the model's vocabulary does not hold, or a tokenizer the
        conversion cannot reproduce.
    """
    ids = _special_ids(cfg, tokenizer, stop_tokens)
    hf_tokenizer = tokenizer.to_hf() if tokenizer is not None else None
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for p, v in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        name, _, to_hf = _mapping(cfg, _path_str(p))
        value = to_hf(np.asarray(jax.device_get(v[...])))
        for n, t in zip(name, value) if isinstance(name, tuple) else [(name, value)]:
            tensors[n] = np.ascontiguousarray(t)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, file), metadata=meta)
            weight_map.update({name: file for name in shard})
        total = sum(t.nbytes for t in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config_to_hf(cfg, family), **ids}, f, indent=2)
    if ids:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(ids, f, indent=2)
    if hf_tokenizer is not None:
        hf_tokenizer.save(path)
    return math.fsum(t.nbytes for t in tensors.values())


def _special_ids(cfg: ModelConfig, tokenizer, stop_tokens) -> dict:
    """`bos_token_id`, `eos_token_id` (an int, or the list of stop tokens when several) and
    `pad_token_id` (what rlscale pads with: `Tokenizer.padding_id`), those that exist."""
    if stop_tokens is None:
        has_eos = tokenizer is not None and tokenizer.eos_id >= 0
        stop_tokens = (tokenizer.eos_id,) if has_eos else ()
    stop = [int(t) for t in stop_tokens]
    problems = []
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        problems.append(
            f"the tokenizer has {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size={cfg.vocab_size}"
        )
    bad = [t for t in stop if not 0 <= t < cfg.vocab_size]
    if bad:
        problems.append(f"stop_tokens {bad} are outside the vocabulary [0, {cfg.vocab_size})")
    if problems:
        raise ValueError("save_hf: " + "; ".join(problems))
    ids = {}
    if tokenizer is not None and tokenizer.bos_id >= 0:
        ids["bos_token_id"] = tokenizer.bos_id
    if stop:
        ids["eos_token_id"] = stop[0] if len(stop) == 1 else stop
    if tokenizer is not None and tokenizer.padding_id >= 0:
        ids["pad_token_id"] = tokenizer.padding_id
    return ids
