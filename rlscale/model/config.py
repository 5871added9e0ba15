"""Model configuration: one frozen dataclass and the named architectures and sizes.

A `ModelConfig` is static (hashable), so it can be closed over by jitted functions. Configs in
`configs/` hold it as a ConfigDict (`model_config_dict`) so every field is overridable from the
command line with `--config.model.<field>=value`.
"""

import dataclasses

import jax.numpy as jnp

from rlscale.model import attention as attention_lib
from rlscale.model import moe as moe_lib

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
        (`attention.names()`: xla, dot_product, cudnn, chunked, splash); decoding with the
        cache runs `xla`. A compute setting: the model is the same under each, up to rounding.
      sliding_window: W > 0: a token attends only to the last W tokens (itself included); 0:
        to all earlier ones.
      attn_softcap: cap > 0: attention logits become cap * tanh(logits / cap) (Gemma 2); 0: off.
      num_experts: E > 0: the MLP of each sparse layer is a mixture of E experts
        (`rlscale.model.moe`, Qwen3-MoE); 0: every layer has the dense MLP.
      experts_per_token: k, the experts each token is routed to (top-k of the router).
      moe_intermediate_size: each expert's gated-MLP hidden width.
      norm_topk_prob: renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE).
      decoder_sparse_step: layer i is sparse when (i + 1) is a multiple of this (Qwen3-MoE).
      mlp_only_layers: layers that keep the dense MLP (`mlp_dim`) whatever the step.
      expert_dispatch: how a sparse layer reaches the experts on other devices of the
        `expert` mesh axis, a registered name (`moe.dispatch_names()`): "all_gather" (each
        device gathers every token, drops none) or "all_to_all" (each routed row goes to its
        expert's device, at most `expert_capacity_factor` x an even share per expert). A
        compute setting: the parameters are the same under each.
      expert_capacity_factor: the all-to-all dispatch's capacity per (device, expert), in
        units of an even share of the device's routed rows (`moe.capacity`).
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
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    expert_dispatch: str = "all_gather"
    expert_capacity_factor: float = 1.25

    def __post_init__(self):
        # A list from a ConfigDict or config.json: a tuple keeps the config hashable.
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
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
        problems += self._moe_problems()
        problems += moe_lib.dispatch_problems(self.expert_dispatch, self.expert_capacity_factor)
        if problems:
            raise ValueError("Invalid model config: " + "; ".join(problems))

    def _moe_problems(self) -> list[str]:
        E, k = self.num_experts, self.experts_per_token
        if E < 0:
            return [f"num_experts={E} must be 0 (dense) or positive"]
        if E == 0:
            return [f"experts_per_token={k} needs num_experts > 0"] if k else []
        problems = []
        if not 1 <= k <= E:
            problems.append(f"experts_per_token={k} must be in [1, num_experts={E}]")
        if self.moe_intermediate_size <= 0:
            problems.append(f"moe_intermediate_size={self.moe_intermediate_size} must be positive")
        if self.decoder_sparse_step < 1:
            problems.append(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            problems.append(f"mlp_only_layers {bad} are not layers of num_layers={self.num_layers}")
        return problems

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the mixture of experts (Qwen3-MoE's rule)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The sparse layers, in order: the l of the routers' outputs [l, B, T, c]."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

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
        moe = D * self.num_experts + 3 * self.num_experts * D * self.moe_intermediate_size
        moe_layers = len(self.moe_layers)
        dense_layers = self.num_layers - moe_layers
        total = self.num_layers * (attn + 2 * D) + dense_layers * 3 * D * F + moe_layers * moe + D
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
    # A tiny Qwen3-MoE: 8 experts (one per device of an 8-way expert mesh), top-2; unit tests.
    "tiny_moe": dict(
        vocab_size=256,
        num_layers=2,
        d_model=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        max_seq_len=256,
        qk_norm=True,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=32,
    ),
    # Qwen3-30B-A3B: 128 experts, top-8, every layer sparse (~3.3B active parameters).
    "qwen3_30b_a3b": dict(
        vocab_size=151936,
        num_layers=48,
        d_model=2048,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        mlp_dim=6144,
        max_seq_len=40960,
        rope_theta=1_000_000.0,
        qk_norm=True,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
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
