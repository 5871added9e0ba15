"""Model configuration: one frozen dataclass and the named architectures and sizes.

A `ModelConfig` is static (hashable), so it can be closed over by jitted functions. Configs in
`configs/` hold it as a ConfigDict (`model_config_dict`) so every field is overridable from the
command line with `--config.model.<field>=value`.
"""

import dataclasses

import jax.numpy as jnp

from rlscale.model import attention as attention_lib

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
ACTIVATIONS = ("silu", "gelu_tanh")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder architecture and numerics.

    Attributes:
      vocab_size: number of token ids.
      num_layers: transformer blocks.
      d_model: residual stream width D.
      num_heads: query heads H.
      num_kv_heads: key/value heads K (grouped-query attention when K < H).
      head_dim: per-head width E (not necessarily d_model / num_heads, e.g. Gemma).
      mlp_dim: gated-MLP hidden width F.
      max_seq_len: longest sequence (prompt + completion) the KV cache may hold.
      rope_theta: RoPE base frequency (10k Llama 2, 500k Llama 3, 1M Qwen2.5).
      rope_scaling: "none", "linear" (position interpolation), "llama3" (Llama 3.1 frequency
        bands) or "yarn" (Qwen2.5 long context).
      rope_factor: context extension factor for the scalings.
      rope_low_freq_factor, rope_high_freq_factor: Llama 3.1 band edges.
      rope_original_max_len: pre-extension context length (llama3 and yarn).
      rope_yarn_beta_fast, rope_yarn_beta_slow: YaRN ramp edges, in rotations.
      norm_eps: RMSNorm epsilon.
      norm_plus_one: RMSNorm multiplies by (1 + scale) (Gemma) instead of scale.
      activation: gate activation, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
      attn_bias: biases on the q/k/v projections (Qwen2).
      qk_norm: RMSNorm over head_dim on queries and keys (Qwen3).
      tie_embeddings: the LM head is the transposed embedding.
      embed_scale: multiply embeddings by sqrt(d_model) (Gemma).
      dtype: compute dtype of activations and matmuls.
      param_dtype: storage dtype of parameters.
      fp32_lm_head: compute the LM head (and so the logits) in float32 whatever `dtype` is
        (ScaleRL's "FP32 head"; it keeps sampler and learner logprobs consistent in bf16).
      attention: the attention implementation of calls without a KV cache, a registered name
        (`attention.names()`: xla, dot_product, cudnn, splash); decoding with the cache runs
        `xla`. A compute setting: the model is the same under each, up to rounding.
      sliding_window: W > 0: a token attends only to the last W tokens (itself included); 0:
        to all earlier ones.
      attn_softcap: cap > 0: attention logits become cap * tanh(logits / cap) (Gemma 2); 0: off.
    """

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    norm_eps: float = 1e-6
    norm_plus_one: bool = False
    activation: str = "silu"
    attn_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    embed_scale: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    fp32_lm_head: bool = True
    attention: str = "xla"
    sliding_window: int = 0
    attn_softcap: float = 0.0

    def __post_init__(self):
        problems = []
        for name in (
            "vocab_size",
            "num_layers",
            "d_model",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "mlp_dim",
            "max_seq_len",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling not in ROPE_SCALINGS:
            problems.append(f"rope_scaling={self.rope_scaling!r} is not one of {ROPE_SCALINGS}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r} is not one of {ACTIVATIONS}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {DTYPES}")
        problems += attention_lib.problems(
            self.attention, self.sliding_window, self.attn_softcap, self.dtype
        )
        if problems:
            raise ValueError("Invalid model config: " + "; ".join(problems))

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count (matches the initialized pytree)."""
        D, H, K, E, F = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
        attn = D * H * E + 2 * D * K * E + H * E * D
        if self.attn_bias:
            attn += H * E + 2 * K * E
        if self.qk_norm:
            attn += 2 * E
        layer = attn + 3 * D * F + 2 * D
        total = self.num_layers * layer + D
        embed = self.vocab_size * D
        head = 0 if self.tie_embeddings else D * self.vocab_size
        return total + head + (embed if include_embedding else 0)


# Named architectures. Sizes used in tests and benchmarks are ours; the family-shaped ones
# copy the published shapes so HF checkpoints of those models import into them.
_PRESETS = {
    # A few hundred thousand parameters: unit tests.
    "tiny": dict(
        vocab_size=256,
        num_layers=2,
        d_model=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        max_seq_len=256,
    ),
    # ~34M parameters: CPU benchmarks and small RL runs.
    "small": dict(
        vocab_size=8192,
        num_layers=8,
        d_model=512,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        mlp_dim=1536,
        max_seq_len=1024,
    ),
    # Llama 3.2 1B (with Llama 3.1 RoPE scaling, tied embeddings).
    "llama3_1b": dict(
        vocab_size=128256,
        num_layers=16,
        d_model=2048,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        mlp_dim=8192,
        max_seq_len=131072,
        rope_theta=500_000.0,
        rope_scaling="llama3",
        rope_factor=32.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
        norm_eps=1e-5,
        tie_embeddings=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    # Llama 3.1 8B.
    "llama3_8b": dict(
        vocab_size=128256,
        num_layers=32,
        d_model=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=14336,
        max_seq_len=131072,
        rope_theta=500_000.0,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_original_max_len=8192,
        norm_eps=1e-5,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    # Qwen2.5 0.5B / 1.5B / 7B (q/k/v biases).
    "qwen2.5_0.5b": dict(
        vocab_size=151936,
        num_layers=24,
        d_model=896,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        mlp_dim=4864,
        max_seq_len=32768,
        rope_theta=1_000_000.0,
        attn_bias=True,
        tie_embeddings=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "qwen2.5_1.5b": dict(
        vocab_size=151936,
        num_layers=28,
        d_model=1536,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        mlp_dim=8960,
        max_seq_len=32768,
        rope_theta=1_000_000.0,
        attn_bias=True,
        tie_embeddings=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "qwen2.5_7b": dict(
        vocab_size=152064,
        num_layers=28,
        d_model=3584,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        mlp_dim=18944,
        max_seq_len=32768,
        rope_theta=1_000_000.0,
        attn_bias=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    # Qwen3 0.6B / 8B (QK-norm, no biases).
    "qwen3_0.6b": dict(
        vocab_size=151936,
        num_layers=28,
        d_model=1024,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=3072,
        max_seq_len=40960,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_embeddings=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    "qwen3_8b": dict(
        vocab_size=151936,
        num_layers=36,
        d_model=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=12288,
        max_seq_len=40960,
        rope_theta=1_000_000.0,
        qk_norm=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    # Gemma 2B (GeGLU, (1 + scale) norms, scaled embeddings, multi-query attention).
    "gemma_2b": dict(
        vocab_size=256000,
        num_layers=18,
        d_model=2048,
        num_heads=8,
        num_kv_heads=1,
        head_dim=256,
        mlp_dim=16384,
        max_seq_len=8192,
        norm_plus_one=True,
        activation="gelu_tanh",
        tie_embeddings=True,
        embed_scale=True,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
}
NAMES = tuple(_PRESETS)


def get(name: str, **overrides) -> ModelConfig:
    """Returns the named architecture, with any field overridden."""
    if name not in _PRESETS:
        raise ValueError(f"Unknown model {name!r}; known models: {', '.join(NAMES)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"Unknown model config field(s) {unknown}; fields: {sorted(fields)}")
    return ModelConfig(**{**_PRESETS[name], **overrides})


def as_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d) -> ModelConfig:
    """Builds a ModelConfig from a mapping (e.g. `config.model` without its `name` key)."""
    d = dict(d)
    d.pop("name", None)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"Unknown model config field(s) {unknown}; fields: {sorted(fields)}")
    return ModelConfig(**d)
