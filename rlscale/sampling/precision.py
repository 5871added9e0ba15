"""The generator's numerics (`sampling.generator_dtype`): the dtype its weights, activations
and KV cache are in, which may be lower than the learner's (a bfloat16 or float16 generator
beside float32 masters, as RL systems that sample with an inference engine run). The
generator then decodes with a `ModelConfig` derived from the policy's (`generator_model`) and
the params cast once per weight update (`cast_params`); the sampling math (temperature,
top-k/p, softmax, the sampled token's logprob) stays in float32 from its logits
(`sampler.transform_logits`). The learner's logprobs differ from the generator's by the low
precision's rounding: `train/logp_gap_abs` measures it, the off-policy corrections act on it
(docs/model_and_sampling.md#a-low-precision-generator).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rlscale.model.config import ModelConfig

# `sampling.generator_dtype`: "" keeps the learner's (`model.dtype`, `model.param_dtype`).
GENERATOR_DTYPES = ("", "float32", "bfloat16", "float16")
# Platforms without float16 arithmetic (TPUs compute in bfloat16 and float32).
NO_FLOAT16 = ("tpu",)


def problems(name, platform: str | None = None) -> list[str]:
    """What is wrong with `sampling.generator_dtype=name` on `platform` (default: JAX's
    backend here), each naming the key."""
    if name not in GENERATOR_DTYPES:
        valid = ", ".join(repr(d) for d in GENERATOR_DTYPES)
        return [f"sampling.generator_dtype={name!r} is not one of {valid} ('': the learner's)"]
    platform = platform or jax.default_backend()
    if name == "float16" and platform in NO_FLOAT16:
        return [
            f"sampling.generator_dtype='float16': this host's {platform} has no float16 "
            "arithmetic; use 'bfloat16'"
        ]
    return []


def generator_model(model_cfg: ModelConfig, name: str) -> ModelConfig:
    """The policy's architecture with the generator's numerics: params and compute (so the KV
    cache, `decoder.init_cache`) in `name`; `model_cfg` itself when `name` is "" or its own
    dtypes. The LM head keeps `model_cfg.fp32_lm_head`, and decoding with the cache runs the
    reference attention whatever `attention` names: the derived config names `xla`, which
    takes every dtype."""
    if not name or name == model_cfg.dtype == model_cfg.param_dtype:
        return model_cfg
    return dataclasses.replace(model_cfg, dtype=name, param_dtype=name, attention="xla")


@functools.partial(jax.jit, static_argnames=("dtype",))
def cast_params(params, *, dtype: str):
    """`params` with every floating leaf in `dtype` (round to nearest even), in the layout
    they came in: a new buffer each, so the learner may donate its own."""

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, params)
