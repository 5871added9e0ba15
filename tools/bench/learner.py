"""The learner section: the RL update a run compiles (`rl.learner.Learner.update`: the
quickstart's chain, AdamW with float32 master weights for bfloat16 params, one optimizer
step per batch) on random rollouts of full-length rows, timed step by step; its model FLOPs
per step against a peak FLOP/s (MFU).

Model FLOPs of one forward pass over N rows of T = P + M tokens, M of them completion tokens
(the learner runs the LM head over the completion tokens only; causal attention attends to
t + 1 positions at position t):

    F = 2 x body x N x T + 2 x V x D x N x M + 4 x layers x heads x head_dim x N x T (T + 1) / 2

with `body` the parameters of the blocks and the final norm (`layer_params`). A step runs
the training pass forward and backward (3F) and the learner's no-gradient passes
(`Learner.forward_passes`: the trainer's old logprobs, the reference's) once each (F each).
Recomputation (`remat`) is not counted: MFU counts the model's FLOPs, not the hardware's.
"""

import dataclasses
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlscale import config_lib, model, objectives, optim, programs, sharding
from rlscale.rl import batch_layout, learner, rollouts
from rlscale.sampling import SamplingConfig


class LearnerShape(NamedTuple):
    """A batch of `prompts` x `group` rows of `prompt_len` + `completion` tokens, and the
    learner's memory knobs: rows per micro-batch (`pack_rows`; 0: the whole batch at once),
    its `remat` policy and `logprob_chunk`."""

    prompts: int
    group: int
    prompt_len: int
    completion: int
    pack_rows: int = 0
    remat: str = "none"
    chunk: int = 0

    @property
    def rows(self) -> int:
        return self.prompts * self.group

    @property
    def tokens(self) -> int:
        return self.rows * (self.prompt_len + self.completion)


def layer_params(cfg: model.ModelConfig) -> int:
    """Parameters of the blocks and the final norm: every matmul weight but the LM head's."""
    untied_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return cfg.num_params(include_embedding=False) - untied_head


def forward_flops(cfg: model.ModelConfig, shape: LearnerShape) -> float:
    """F of the module docstring: one forward pass of the learner over the batch."""
    N, T, M = shape.rows, shape.prompt_len + shape.completion, shape.completion
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * N * T * (T + 1) / 2
    head = 2 * cfg.vocab_size * cfg.d_model * N * M
    return 2 * layer_params(cfg) * N * T + head + attention


def random_rollouts(cfg: model.ModelConfig, shape: LearnerShape, seed: int = 0):
    """A full-length batch (`rollouts.full_length`) with random tokens, rewards (0 or 1, so
    the groups' advantages are not all 0) and sampler logprobs."""
    rng = np.random.default_rng(seed)
    batch = rollouts.full_length(shape.rows, shape.prompt_len, shape.completion)
    N, M = batch.mask_NM.shape
    return dataclasses.replace(
        batch,
        tokens_NL=rng.integers(4, cfg.vocab_size, batch.tokens_NL.shape).astype(np.int32),
        reward_N=rng.integers(0, 2, N).astype(np.float32),
        correct_N=rng.integers(0, 2, N).astype(bool),
        sampler_logp_NM=-rng.exponential(5.0, (N, M)).astype(np.float32),
    )


def make_learner(cfg: model.ModelConfig, shape: LearnerShape, mesh, params):
    """The learner a run with this batch would build (`rl.setup.make_learner`'s settings)."""
    G, M = shape.group, shape.completion
    layout = batch_layout.Layout(
        pack_length=0,
        pack_rows=shape.pack_rows,
        group_size=G,
        minibatches=1,
        max_len=M,
        length_buckets=1,
    )
    return learner.Learner(
        graphdef=model.abstract_model(cfg)[0],
        objective=objectives.build(config_lib.QUICKSTART_CHAIN, group_size=G, max_len=M),
        optimizer=optim.make_optimizer(optim.OptimConfig(lr=1e-6), params),
        mesh=mesh,
        logits_cfg=SamplingConfig(temperature=1.0),
        epochs=1,
        layout=layout,
        seed=0,
        programs=programs.Programs(mesh),
        logprob_chunk=shape.chunk,
        remat=shape.remat,
    )


def bench_learner(
    cfg, shape: LearnerShape, peak_flops: float, deadline: float, steps=(2, 8), params=None
):
    """Compiles the update (its first call), then times one update after another, each
    waited on, at least `steps[0]` and at most `steps[1]` of them, stopping at `deadline`
    (`time.perf_counter()`) once the least are done. Returns the median step time and what
    follows from it: tokens/s, model FLOP/s and MFU against `peak_flops`. `params`: the
    model's (one device; not donated: the state holds float32 copies), else random ones."""
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    if params is None:
        _, params = model.init_sharded(cfg, jax.random.key(0), mesh)
    learn = make_learner(cfg, shape, mesh, params)
    value_params = sharding.replicate({"w": jnp.zeros((cfg.d_model,)), "b": jnp.zeros(())}, mesh)
    state = learn.init(params, value_params)
    batch = random_rollouts(cfg, shape)
    t = time.perf_counter()
    state, _, ok = learn.update(state, None, batch, step=0)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t
    times, applied = [], [bool(np.all(ok))]
    while len(times) < steps[1] and (len(times) < steps[0] or time.perf_counter() < deadline):
        t = time.perf_counter()
        state, _, ok = learn.update(state, None, batch, step=len(times) + 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
        applied.append(bool(np.all(ok)))
    step_s = statistics.median(times)
    flops = forward_flops(cfg, shape) * (3 + learn.forward_passes)
    return {
        "rows": shape.rows,
        "prompts": shape.prompts,
        "group_size": shape.group,
        "prompt_len": shape.prompt_len,
        "completion_len": shape.completion,
        "pack_rows": shape.pack_rows,
        "remat": shape.remat,
        "logprob_chunk": shape.chunk,
        "chain": config_lib.QUICKSTART_CHAIN,
        "no_grad_passes": learn.forward_passes,
        "tokens_per_step": shape.tokens,
        "model_flops_per_step": flops,
        "first_step_s": compile_s,
        "step_times_s": times,
        "step_s": step_s,
        "tokens_per_s": shape.tokens / step_s,
        "model_flops_per_s": flops / step_s,
        "peak_flops_per_s": peak_flops,
        "mfu": flops / step_s / peak_flops,
        "updates_applied": applied,
    }
