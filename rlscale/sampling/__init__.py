"""Sampling: prefill + while_loop decode with a KV cache, and the sampling transforms."""

from rlscale.sampling.sampler import (
    SampleOutput,
    Sampler,
    SamplingConfig,
    generate,
    sample_tokens,
    transform_logits,
)

__all__ = [
    "SampleOutput",
    "Sampler",
    "SamplingConfig",
    "generate",
    "sample_tokens",
    "transform_logits",
]
