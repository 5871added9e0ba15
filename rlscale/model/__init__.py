"""The decoder model: config, NNX modules, pure forward functions and the KV cache."""

from rlscale.model.config import ModelConfig, as_dict, from_dict, get
from rlscale.model.decoder import (
    Decoder,
    ForwardSpec,
    KVCache,
    abstract_model,
    cache_logical_axes,
    forward,
    hidden,
    init_cache,
    init_params,
    init_sharded,
    logits,
    positions_from_mask,
)

__all__ = [
    "Decoder",
    "ForwardSpec",
    "KVCache",
    "ModelConfig",
    "abstract_model",
    "as_dict",
    "cache_logical_axes",
    "forward",
    "from_dict",
    "get",
    "hidden",
    "init_cache",
    "init_params",
    "init_sharded",
    "logits",
    "positions_from_mask",
]
