"""The distillation teacher: a frozen policy that scores the student's sampled tokens, once
per batch, in the rollout stage (on-policy distillation; `objectives.distill`).

`Teacher(rollouts)` is the batch's `teacher_logp` [N, M], from one compiled forward pass
(`teacher_logp`) that runs the learner's own logprob code (`batch_layout.plan`,
`forward.no_grad_terms`) on the teacher's params. `setup.make_teacher` builds it from
`config.teacher`; `checks` compares its tokenizer with the run's at start-up.

Dimension letters: N rows, L tokens of a batch row, P padded prompt length, M completion tokens
(the batch's length bucket).
"""

import functools

import jax
import numpy as np

from rlscale import sharding
from rlscale.model import decoder
from rlscale.rl import batch_layout, forward
from rlscale.rl.rollouts import Rollouts
from rlscale.sampling import SamplingConfig
from rlscale.scaling import compute


@functools.partial(jax.jit, static_argnames=("spec",))
def teacher_logp(params, batch, place, count, *, spec: decoder.ForwardSpec):
    """[N, M]: the logprob under `params` of each completion token of the batch's rows
    (`batch`: `tokens`, `attn` [N, L] and `mask` [N, M]; `place` and `count`, one step of
    `batch_layout.pack`), computed by the learner's own code (`forward.no_grad_terms`) under
    `spec.logits_cfg`, one micro-batch at a time. No gradient: the teacher is data to the
    student."""
    return forward.no_grad_terms(spec, params, None, batch, place, count, ("logp",))["logp"]


class Teacher:
    """A frozen policy that scores the student's sampled tokens (on-policy distillation):
    `teacher(rollouts)` is the `teacher_logp` [N, M] of a batch, from one compiled forward
    pass (`teacher_logp`) on the trainer's mesh, the teacher's params in the training layout.

    The logprobs are at the sampling temperature, as the generator's `sampler_logp` are, but
    without top-k or top-p: a token outside the teacher's nucleus would have logprob -inf.
    The batch is laid out as the learner lays it out (`layout`: its completions trimmed to
    their length bucket, every sequence packed into the learner's micro-batches of forward
    rows), so its programs follow the learner's.
    """

    def __init__(
        self,
        graphdef,
        params,
        *,
        model_cfg,
        mesh,
        temperature: float,
        layout: batch_layout.Layout,
        logprob_chunk: int,
        programs,
    ):
        self.params, self.programs, self.model_cfg = params, programs, model_cfg
        self.layout = layout
        self.spec = decoder.ForwardSpec(
            graphdef=graphdef,
            logits_cfg=SamplingConfig(temperature=temperature),
            mesh=mesh,
            pack_length=0,  # Set per batch (`batch_layout.Plan`).
            pack_rows=0,
            chunk=logprob_chunk,
            remat="none",
            shared_prefix=layout.shared_prefix,
        )

    def flops(self, rollouts: Rollouts, max_new_tokens: int) -> float:
        """The FLOPs of `__call__` on the batch: one forward pass over its sequences' tokens,
        at the context `report.Compute` counts the learner's passes at."""
        ctx = rollouts.prompt_len + max_new_tokens / 2
        return compute.forward_flops(self.model_cfg, float(rollouts.attn_mask_NL.sum()), ctx)

    def __call__(self, rollouts: Rollouts) -> np.ndarray:
        mesh = self.spec.mesh
        N, P = rollouts.mask_NM.shape[0], rollouts.prompt_len
        shards = sharding.batch_divisor(mesh, sharding.TRAIN_RULES)
        completion_NM = rollouts.attn_mask_NL[:, P:].astype(bool)
        # Every sequence with completion tokens, in one step of every row.
        plan = batch_layout.plan(
            rollouts, np.arange(N)[None], self.layout, shards=shards, placed_N=completion_NM.any(1)
        )
        M = plan.M
        batch = {"tokens": plan.tokens_NL, "attn": plan.attn_NL, "mask": completion_NM[:, :M]}
        put = functools.partial(sharding.put_batch, mesh=mesh, rules=sharding.TRAIN_RULES)
        args = (self.params, put(batch), put(plan.place, axis=1))
        args += (sharding.replicate(plan.count, mesh),)
        spec = self.spec._replace(pack_length=plan.T, pack_rows=plan.pack_rows)
        logp_NM = self.programs.run("teacher_logp", teacher_logp, args, {"spec": spec})
        out_NM = np.zeros(rollouts.mask_NM.shape, np.float32)
        out_NM[:, :M] = np.where(completion_NM[:, :M], sharding.fetch(logp_NM), 0.0)
        return out_NM
