"""The distillation teacher: a frozen policy that scores the student's sampled tokens, once
per batch, in the rollout stage (on-policy distillation; `objectives.distill`).

`Teacher(rollouts)` is the batch's `teacher_logp` [N, M], from one compiled forward pass
(`teacher_logp`) that runs the learner's own logprob code (`batch_layout.plan`,
`forward.token_terms`) on the teacher's params. `setup.make_teacher` builds it from
`config.teacher`; `checks` compares its tokenizer with the run's at start-up.

Dimension letters: N rows, U micro-batches of n rows, P padded prompt length, M completion
tokens (the batch's length bucket).
"""

import functools

import jax
import numpy as np

from rlscale import sharding
from rlscale.rl import batch_layout, forward
from rlscale.rl.rollouts import Rollouts
from rlscale.sampling import SamplingConfig
from rlscale.scaling import compute


@functools.partial(jax.jit, static_argnames=("spec",))
def teacher_logp(params, fwd, targets_UnM, *, spec: forward.ForwardSpec):
    """[U, n, M]: the logprob under `params` of each completion token of U micro-batches of n
    rows (`batch_layout.plan`'s forward rows `fwd`, [U, n, ...], and their completion tokens),
    computed by the learner's own code (`forward.token_terms`) under `spec.logits_cfg`, one
    micro-batch at a time. No gradient: the teacher is data to the student."""

    def one(_, x):
        fwd_k, targets_nM = x
        return None, forward.token_terms(spec, params, None, fwd_k, targets_nM, ("logp",))["logp"]

    return jax.lax.scan(one, None, (fwd, targets_UnM))[1]


class Teacher:
    """A frozen policy that scores the student's sampled tokens (on-policy distillation):
    `teacher(rollouts)` is the `teacher_logp` [N, M] of a batch, from one compiled forward
    pass (`teacher_logp`) on the trainer's mesh, the teacher's params in the training layout.

    The logprobs are at the sampling temperature, as the generator's `sampler_logp` are, but
    without top-k or top-p: a token outside the teacher's nucleus would have logprob -inf.
    The batch's completions are trimmed to its length bucket (`batch_layout.plan`: one program
    per prompt bucket and length bucket), and the rows are taken `micro_batches` at a time (the
    learner's micro-batch, whose size its checks fit to the mesh).
    """

    def __init__(
        self,
        graphdef,
        params,
        *,
        model_cfg,
        mesh,
        temperature: float,
        micro_batches: int,
        max_len: int,
        length_buckets: int,
        logprob_chunk: int,
        programs,
    ):
        self.params, self.programs, self.model_cfg = params, programs, model_cfg
        self.micro_batches, self.max_len = micro_batches, max_len
        self.length_buckets = length_buckets
        self.spec = forward.ForwardSpec(
            graphdef=graphdef,
            logits_cfg=SamplingConfig(temperature=temperature),
            mesh=mesh,
            pack_length=0,
            pack_rows=0,
            chunk=logprob_chunk,
            remat="none",
        )

    def flops(self, rollouts: Rollouts, max_new_tokens: int) -> float:
        """The FLOPs of `__call__` on the batch: one forward pass over its sequences' tokens,
        at the context `report.Compute` counts the learner's passes at."""
        ctx = rollouts.prompt_len + max_new_tokens / 2
        return compute.forward_flops(self.model_cfg, float(rollouts.attn_mask_NL.sum()), ctx)

    def __call__(self, rollouts: Rollouts) -> np.ndarray:
        mesh = self.spec.mesh
        N, P = rollouts.mask_NM.shape[0], rollouts.prompt_len
        rows_Un = np.arange(N).reshape(self.micro_batches, -1)
        U, n = rows_Un.shape
        shards = sharding.batch_divisor(mesh, sharding.TRAIN_RULES)
        M, fwd = batch_layout.plan(
            rollouts, rows_Un, max_len=self.max_len, buckets=self.length_buckets, shards=shards
        )
        targets_UnM = rollouts.tokens_NL[:, P : P + M].reshape(U, n, M).astype(np.int32)
        fwd, targets_UnM = sharding.put_batch((fwd, targets_UnM), mesh, sharding.TRAIN_RULES, 1)
        logp_UnM = self.programs.run(
            "teacher_logp", teacher_logp, (self.params, fwd, targets_UnM), {"spec": self.spec}
        )
        out_NM = np.zeros(rollouts.mask_NM.shape, np.float32)
        completion_NM = rollouts.attn_mask_NL[:, P : P + M].astype(bool)
        out_NM[:, :M] = np.where(completion_NM, sharding.fetch(logp_UnM).reshape(N, M), 0.0)
        return out_NM
