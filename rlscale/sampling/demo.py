"""The sampling demo (`--config configs/quickstart.py:demo`): a check of the sampler.

It initializes the configured model (random weights) on a mesh, samples completions for random
prompts with the jitted sampler, checks that the sampler's logprobs equal a full forward pass
over prompt + completion under the same sampling transform, and reports throughput.
Writes `WORKDIR/config.json` and `WORKDIR/samples.jsonl`.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlscale import model, sharding
from rlscale.sampling import Sampler, SamplingConfig, transform_logits


def recompute_logprobs(graphdef, params, prompt_NP, prompt_mask_NP, out, cfg: SamplingConfig):
    """Logprobs of the sampled tokens from one full forward pass, under the sampling transform.

    `prompt_NP` holds each sampled row's (left-padded) prompt: the N rows of `out`.
    """
    tokens = jnp.concatenate([prompt_NP, out.tokens], axis=1)
    mask = jnp.concatenate([prompt_mask_NP, out.mask], axis=1)
    logits, _ = model.forward(graphdef, params, tokens, model.positions_from_mask(mask), mask)
    P = prompt_NP.shape[1]
    logits = logits[:, P - 1 : -1]
    logp = jax.nn.log_softmax(transform_logits(logits, cfg), axis=-1)
    lp = jnp.take_along_axis(logp, out.tokens[..., None], axis=-1)[..., 0]
    return jnp.where(out.mask, lp, 0.0)


def run(config, workdir: str):
    model_cfg = model.from_dict(config.model)
    scfg = SamplingConfig(
        **{
            k: (tuple(v) if isinstance(v, list) else v)
            for k, v in config.sampling.to_dict().items()
        }
    )
    mesh = sharding.make_mesh(tuple(config.mesh.shape))
    logging.info("mesh %s", dict(mesh.shape))
    rng = jax.random.key(config.seed)
    init_rng, prompt_rng, sample_rng = jax.random.split(rng, 3)
    graphdef, params = model.init_sharded(model_cfg, init_rng, mesh, sharding.TRAIN_RULES)
    # Train layout -> sample layout: the same reshard the RL loop does before each rollout.
    params = sharding.reshard(params, sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES))
    sampler = Sampler(graphdef, model_cfg, mesh)

    lengths = np.asarray(
        jax.random.randint(
            prompt_rng, (config.num_prompts,), config.min_prompt_len, config.max_prompt_len + 1
        )
    )
    ids = np.asarray(
        jax.random.randint(prompt_rng, (config.num_prompts, lengths.max()), 4, model_cfg.vocab_size)
    )
    prompts = [ids[i, : lengths[i]].tolist() for i in range(config.num_prompts)]

    t0 = time.perf_counter()
    out = jax.block_until_ready(sampler(params, prompts, sample_rng, scfg))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(sampler(params, prompts, jax.random.fold_in(sample_rng, 1), scfg))
    second = time.perf_counter() - t0
    n_tokens = int(out.lengths.sum())

    prompt_BP, prompt_mask_BP = sampler.prepare(prompts, scfg)
    rep = np.repeat(np.arange(len(prompts)), scfg.num_samples)
    check = jax.jit(recompute_logprobs, static_argnums=(0, 5))
    ref = check(graphdef, params, prompt_BP[rep], prompt_mask_BP[rep], out, scfg)
    max_err = float(jnp.max(jnp.abs(ref - out.logprobs)))

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "samples.jsonl"), "w") as f:
        for i in range(out.tokens.shape[0]):
            n = int(out.lengths[i])
            f.write(
                json.dumps(
                    {
                        "prompt": prompts[int(out.prompt_index[i])],
                        "completion": np.asarray(out.tokens[i, :n]).tolist(),
                        "logprobs": np.asarray(out.logprobs[i, :n]).round(5).tolist(),
                        "truncated": bool(out.truncated[i]),
                    }
                )
                + "\n"
            )
    summary = {
        "model": config.model.name,
        "params": model_cfg.num_params(),
        "rows": int(out.tokens.shape[0]),
        "tokens": n_tokens,
        "first_call_s": round(first, 3),
        "second_call_s": round(second, 3),
        "tokens_per_s": round(n_tokens / second, 1),
        "truncated_fraction": float(np.mean(out.truncated)),
        "max_logprob_error_vs_forward": max_err,
    }
    print("rlscale sampling demo (random weights)")
    for k, v in summary.items():
        print(f"  {k:<30} {v}")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
