"""Model FLOPs accounting, so reward can be plotted against compute.

Conventions (Kaplan et al. 2020; PaLM's MFU): a forward pass costs 2 FLOPs per matmul
parameter per token plus 4 * layers * heads * head_dim per token per attended position; a
backward pass costs twice the forward. A mixture of experts counts the parameters a token
reads (`moe.active_params`: the router and its c of the e experts in each sparse layer).
"""

from rlscale.model import moe
from rlscale.model.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters used in matmuls per token (the embedding lookup is a gather; a mixture of
    experts' idle experts are not used)."""
    tied_head = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0
    return moe.active_params(cfg) - cfg.vocab_size * cfg.d_model + tied_head


def forward_flops(cfg: ModelConfig, tokens: float, context: float) -> float:
    """FLOPs of a forward pass over `tokens` tokens attending to `context` positions each."""
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return float(tokens) * (2 * matmul_params(cfg) + attn)


def train_flops(cfg: ModelConfig, tokens: float, context: float) -> float:
    """Forward + backward."""
    return 3 * forward_flops(cfg, tokens, context)
