"""The learner: its train state and one compiled update per shape on a batch's real tokens
(packed into forward rows: `batch_layout`), from the per-token terms of its forward passes
(`forward`). See docs/learner.md.

Dimension letters: N rows, G group size, M completion length, O optimizer steps per batch, U
micro-batches per step, d batch shards, D model width.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rlscale import faults, sharding
from rlscale.model import lora as lora_lib
from rlscale.model.decoder import ForwardSpec
from rlscale.objectives.aggregate import group_terms
from rlscale.rl import batch_layout
from rlscale.rl import rollouts as rollouts_lib
from rlscale.rl.forward import no_grad_terms, packed_micro, token_terms
from rlscale.rl.logp_match import logp_match_stats
from rlscale.sampling import SamplingConfig


class TrainState(NamedTuple):
    params: Any
    value_params: Any  # {"w": [D], "b": []}; trained only when the chain reads `value`.
    opt_state: Any
    loss_state: Any  # State of the objective's loss-stage transforms.
    batch_state: Any  # State of its batch-stage transforms.
    step: jax.Array  # Optimizer updates applied (a skipped update does not count).


# Terms produced by a forward pass of the policy (or the frozen reference) on sampled rows.
FORWARD_TERMS = ("logp", "entropy", "value")
# `learner.router_replay`: a mixture of experts' routing in the learner's forward passes (the
# policy's, its old terms' and the reference's): its own top-k ("off"), or the experts the
# generator recorded for each token ("generator"). docs/model_and_sampling.md#router-replay.
ROUTER_REPLAY = ("off", "generator")


class Spec(NamedTuple):
    """What the compiled update is specialized on (hashable: jit's static argument): its
    forward passes' `ForwardSpec` (the batch's forward rows), and the objective and optimizer
    it applies."""

    forward: ForwardSpec
    objective: Any
    optimizer: optax.GradientTransformation
    train_terms: tuple[str, ...]  # Computed with gradients.
    old_terms: tuple[str, ...]  # The trainer's terms before the update (`old_logp`, ...).
    ref: bool  # The chain reads `ref_logp`.
    # The most packed micro-batches an optimizer step can need: its groups, or its rows where
    # a micro-batch may hold part of a group (`split_group_size`).
    max_micro: int
    minibatches: int
    offload_ref: bool  # The reference's params arrive in host memory.
    replay_probe: bool = False  # Also the logprob gap under the other routing (`_probe`).
    # LoRA (`lora_lib.LoraConfig`; None: full fine-tuning): the trained params are adapters
    # and the reference's params the frozen base, which the policy's forward merges them into.
    lora: Any = None
    # The group size where a micro-batch may hold part of a group (`Layout.split_groups`):
    # the aggregation then reads each row's group terms over the step (`group_terms`); else 0.
    split_group_size: int = 0


def _policy(spec: Spec, params, ref_params):
    """The policy's params from the trained ones: with LoRA the base (`ref_params`) with the
    adapters merged in (`lora_lib.merge`, as the generator receives them), else themselves."""
    if spec.lora is None:
        return params
    return lora_lib.merge(ref_params, params, spec.lora.scale)


def _apply_grads(state: TrainState, grads, loss_sum, denom, optimizer):
    """One optimizer step on the accumulated gradient sums; skipped (state unchanged, bit for
    bit) when the loss or the gradient norm is not finite."""
    grads = jax.tree.map(lambda g: g / jnp.maximum(denom, 1.0), grads)

    def apply(grads, s):
        params, value_params, opt_state = s
        updates, opt_state = optimizer.update(grads, opt_state, (params, value_params))
        params, value_params = optax.apply_updates((params, value_params), updates)
        return params, value_params, opt_state

    old = (state.params, state.value_params, state.opt_state)
    (params, value_params, opt_state), ok = faults.guarded_update(grads, loss_sum, apply, old)
    new = state._replace(
        params=params,
        value_params=value_params,
        opt_state=opt_state,
        step=state.step + ok.astype(state.step.dtype),
    )
    return new, optax.tree.norm(grads), ok


def _micro_loop(f, carry, count, length: int):
    """`f(carry, u) -> (carry, out)` over micro-batches u < `count` (traced: it follows the
    batch) as a `fori_loop`, the outputs stacked [length] with zeros past `count`.

    `f` (a forward and backward pass) is traced once: its jaxpr gives the outputs' shapes
    and is what the loop body evaluates (measured: the update's tracing 10% shorter than
    with a second trace for the body)."""
    u0 = jnp.zeros((), jnp.int32)
    closed, (_, shapes) = jax.make_jaxpr(f, return_shape=True)(carry, u0)
    out_tree = jax.tree.structure((carry, shapes))
    outs = jax.tree.map(lambda x: jnp.zeros((length, *x.shape), x.dtype), shapes)

    def body(u, c):
        carry, outs = c
        flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves((carry, u)))
        carry, out = jax.tree.unflatten(out_tree, flat)
        return carry, jax.tree.map(lambda b, o: b.at[u].set(o), outs, out)

    return jax.lax.fori_loop(0, count, body, (carry, outs))


def _no_grad_terms(spec: Spec, state: TrainState, ref_params, batch, place, count):
    """The trainer's old terms (`old_logp`, `old_value`) and the reference's `ref_logp` where
    the chain reads them, with the params the update starts from, over the first epoch's
    micro-batches (which hold every trained row once): [N, M] each."""
    first = jax.tree.map(lambda x: x[: spec.minibatches], (place, count))  # Every row once.
    out = {}
    if spec.old_terms:
        policy = _policy(spec, state.params, ref_params)
        t = no_grad_terms(spec.forward, policy, state.value_params, batch, *first, spec.old_terms)
        out.update({f"old_{k}": v for k, v in t.items()})
    if spec.ref:
        t = no_grad_terms(spec.forward, ref_params, state.value_params, batch, *first, ("logp",))
        out["ref_logp"] = t["logp"]
    return out


def _probe(spec: Spec, state: TrainState, ref_params, batch, place, count):
    """The logprob gap (mean |logp - sampler_logp|) over the first optimizer step's trained
    tokens (those of `logp_match`) with the other routing than the learner's (replay on:
    the policy's own top-k; off: the generator's recorded experts): one more forward pass
    without gradient over that step's micro-batches."""
    other = spec.forward._replace(router_replay=not spec.forward.router_replay)
    first = jax.tree.map(lambda x: x[:1], (place, count))
    policy = _policy(spec, state.params, ref_params)
    logp = no_grad_terms(other, policy, state.value_params, batch, *first, ("logp",))
    in_NM = (batch["mask"] & (place["micro"][0] >= 0)[:, None]).astype(jnp.float32)
    gap, n = jnp.sum(jnp.abs(logp["logp"] - batch["sampler_logp"]) * in_NM), jnp.sum(in_NM)
    return jnp.where(n > 0, gap / jnp.maximum(n, 1.0), jnp.nan)  # NaN: no token (null).


def _optimizer_step(spec: Spec, batch, terms, ref_params, train: TrainState, step):
    """One optimizer step (`step`: its `place` [N] arrays and micro-batch count): the
    gradient sums of its micro-batches (each sees every row, the others out of its mask; the
    loss transforms' state carried through), divided once by their summed denominator and
    applied (`_apply_grads`); returns the state and the per-micro-batch and per-step
    metrics."""
    place, count = step

    def micro(carry, u):
        grads_acc, loss_state = carry
        fwd, in_N = packed_micro(spec.forward, batch, place, u)
        mb = {**terms, "mask": terms["mask"] * in_N[:, None].astype(terms["mask"].dtype)}

        def loss_fn(params, value_params):
            policy = _policy(spec, params, ref_params)
            t = token_terms(spec.forward, policy, value_params, fwd, spec.train_terms)
            mismatch = t.pop("routing_mismatch", None)  # A metric, not a term of the loss.
            out, new_state = spec.objective.loss.update(
                {**mb, **t, "update": train.step}, loss_state
            )
            match = logp_match_stats(
                jax.lax.stop_gradient(t["logp"]), mb["sampler_logp"], mb["mask"]
            )
            if mismatch is not None:  # Summed over the trained tokens (`logp_match`).
                match["routing_diff"] = jnp.sum(jnp.where(mb["mask"] > 0, mismatch, 0.0))
            aux = (out["denominator"], out.get("metrics", {}), new_state, match)
            return out["loss_sum"], aux

        (loss_sum, (denom, mets, loss_state, match)), grads = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True
        )(train.params, train.value_params)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)
        out = {"loss_sum": loss_sum, "denominator": denom, "metrics": mets, "match": match}
        return (grads_acc, loss_state), out

    # Summed in float32 whatever the params' dtype.
    zeros = jax.tree.map(
        lambda x: jnp.zeros(x.shape, jnp.float32), (train.params, train.value_params)
    )
    (grads, loss_state), per_micro = _micro_loop(
        micro, (zeros, train.loss_state), count, spec.max_micro
    )
    train = train._replace(loss_state=loss_state)
    train, grad_norm, ok = _apply_grads(
        train,
        grads,
        jnp.sum(per_micro["loss_sum"]),
        jnp.sum(per_micro["denominator"]),
        spec.optimizer,
    )
    return train, {**per_micro, "grad_norm": grad_norm, "ok": ok}


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(0,))
def update_step(state: TrainState, ref_params, batch, place, count, *, spec: Spec):
    """One batch's whole update, compiled once per shape (with a `pack_length` and one
    completion length, once per run, whatever the number of micro-batches a batch fills).

    1. Where the chain reads them, the trainer's old terms (`old_logp`, `old_value`) and the
       reference's `ref_logp`, with the params the update starts from, over the first epoch's
       micro-batches (which hold every trained row once).
    2. The batch-stage transforms (advantages) on the whole batch; where a micro-batch may
       hold part of a group, each row's group terms (`group_terms`).
    3. O optimizer steps (`lax.scan`), each accumulating the gradient sums of its
       micro-batches (a `fori_loop` over as many as it fills) and dividing once by their
       summed denominator.

    Args:
      state: the train state (donated).
      ref_params: the reference's params (unused unless `spec.ref` or `spec.lora`: then the
        frozen base the adapters merge into).
      batch: per row [N] or [N, M]: `mask`, `sampler_logp`, `reward`, `correct`,
        `row_weight`, and `teacher_logp`, `step_reward` and `step_mask` where the chain
        reads them; `tokens` and `attn` [N, L] (`batch_layout.Plan`: the rows, completions
        in the last M tokens).
      place: [O, N] arrays of `batch_layout.pack`: where each row goes in each step.
      count: [O] micro-batches per optimizer step.
      spec: the static specialization.

    Returns:
      (state, metrics): per micro-batch [O, U] `loss_sum`, `denominator`, the loss
      transforms' `metrics` and `match` (`logp_match_stats`), zeros past a step's count (U:
      `spec.max_micro`); per step [O] `grad_norm` and `ok` (False where a non-finite loss or
      gradient skipped the step); `batch`, the batch-stage transforms' metrics (scalars);
      with `old_logp`, `trainer_logp_gap` (mean |old_logp - sampler_logp| over the batch's
      trained tokens); with `spec.replay_probe`, `logp_gap_other` (`_probe`).
    """
    terms = {k: v for k, v in batch.items() if k not in ("tokens", "attn")}
    metrics = {}
    if spec.ref and spec.offload_ref:  # Into device memory for this update only.
        ref_params = jax.device_put(ref_params, jax.memory.Space.Device)
    if spec.old_terms or spec.ref:
        terms.update(_no_grad_terms(spec, state, ref_params, batch, place, count))
    if spec.replay_probe:
        metrics["logp_gap_other"] = _probe(spec, state, ref_params, batch, place, count)
    if "old_logp" in terms:  # How far the sampler's numerics are from the learner's.
        mask_f = batch["mask"].astype(jnp.float32)
        metrics["trainer_logp_gap"] = jnp.sum(
            jnp.abs(terms["old_logp"] - batch["sampler_logp"]) * mask_f
        ) / jnp.maximum(jnp.sum(mask_f), 1.0)
    terms, batch_state = spec.objective.batch.update(terms, state.batch_state)
    metrics["batch"] = terms.pop("metrics", {})  # The batch-stage transforms' own.
    if spec.split_group_size:  # Each group's count over its step, whatever micro-batches hold.
        terms.update(group_terms(terms["mask"], spec.split_group_size))

    optimizer_step = functools.partial(_optimizer_step, spec, batch, terms, ref_params)
    state, per_step = jax.lax.scan(
        optimizer_step, state._replace(batch_state=batch_state), (place, count)
    )
    return state, {**per_step, **metrics}


def routing_lc(graphdef, params) -> tuple:
    """A mixture of experts' (sparse layers, experts per token); () for a dense policy."""
    cfg = nnx.merge(graphdef, params).cfg
    return (len(cfg.moe_layers), cfg.experts_per_token) if cfg.num_experts else ()


@dataclasses.dataclass
class Learner:
    """Updates the policy (and value head) on rollouts.

    Attributes:
      graphdef: the policy's graph definition.
      objective: the built chain (`objectives.build`): batch and loss transforms, model terms.
      optimizer: the optax optimizer.
      mesh: the learner's mesh; batches are sharded over its batch axes.
      logits_cfg: the sampler's logits transform (temperature, top-k, top-p).
      epochs: passes over each batch; each splits it into `layout.minibatches` optimizer
        steps of whole groups.
      layout: how a batch is laid out in forward rows (`batch_layout.Layout`: packing, the
        completion's length buckets, group size, minibatches).
      logprob_chunk: completion tokens per batch shard in each chunk of the logprob and
        entropy computation (`vocab_token_terms`).
      remat: the decoder blocks' rematerialization policy (`decoder.REMAT_POLICIES`).
      offload_ref: keep the reference's params in pinned host memory between updates.
      lora: LoRA's settings (None: full fine-tuning): the train state's params are adapters,
        `update`'s `ref_params` the frozen base (`Spec.lora`).
      seed: seeds the minibatch order.
      programs: records each compiled program's cost.
      router_replay: one of `ROUTER_REPLAY`: "generator" runs a mixture of experts' forward
        passes (the policy's, its old terms', the reference's) on the experts the generator
        recorded for each token (`Rollouts.experts_NLlc`).
      replay_probe: also measure the logprob gap under the other routing (`_probe`).
      routing_lc: a mixture of experts' (sparse layers, experts per token), () for a dense
        policy: the recorded routing's shape in `precompile`'s batch.
    """

    graphdef: Any
    objective: Any
    optimizer: optax.GradientTransformation
    mesh: Any
    logits_cfg: SamplingConfig
    epochs: int
    layout: batch_layout.Layout
    seed: int
    programs: Any
    logprob_chunk: int = 0
    remat: str = "none"
    offload_ref: bool = False
    lora: lora_lib.LoraConfig | None = None
    router_replay: str = "off"
    replay_probe: bool = False
    routing_lc: tuple = ()

    def __post_init__(self):
        need = self.objective.model_terms
        old_terms = tuple(t for t in ("logp", "value") if f"old_{t}" in need)
        forward = ForwardSpec(
            graphdef=self.graphdef,
            logits_cfg=self.logits_cfg,
            mesh=self.mesh,
            pack_length=0,  # Set per batch (`batch_layout.Plan`) by `_inputs`.
            pack_rows=0,
            chunk=self.logprob_chunk,
            remat=self.remat,
            router_replay=self.router_replay == "generator",
            shared_prefix=self.layout.shared_prefix,
        )
        self.spec = Spec(
            forward=forward,
            objective=self.objective,
            optimizer=self.optimizer,
            train_terms=tuple(t for t in FORWARD_TERMS if t in need or t == "logp"),
            old_terms=old_terms,
            ref="ref_logp" in need,
            max_micro=0,  # Set per batch size by `_inputs`.
            minibatches=self.layout.minibatches,
            offload_ref=self.offload_ref,
            lora=self.lora,
            replay_probe=self.replay_probe,
            split_group_size=self.layout.group_size if self.layout.split_groups else 0,
        )
        # No-gradient forward passes per batch: the trainer's old terms, reference logprobs,
        # and the replay probe's over the first of the `epochs` x `minibatches` steps.
        steps = self.epochs * self.layout.minibatches
        probe = self.replay_probe / steps if self.replay_probe else 0
        self.forward_passes = int(bool(old_terms)) + int(self.spec.ref) + probe

    def reference(self, params):
        """The frozen reference: a copy of `params` (the train state's buffers are donated to
        each update), in pinned host memory with `offload_ref` (each update brings it into
        device memory, so between updates it takes none)."""
        ref = jax.tree.map(jnp.copy, params)
        if not self.offload_ref:
            return ref
        return jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), ref
        )

    def init(self, params, value_params) -> TrainState:
        state = TrainState(
            params,
            value_params,
            self.optimizer.init((params, value_params)),
            self.objective.loss.init(),
            self.objective.batch.init(),
            jnp.zeros((), jnp.int32),
        )

        # Leaves created off the mesh (optimizer counts, transform states) are replicated
        # over it, so every update sees the layout it produces: one compiled program.
        def on_mesh(x):
            return isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)

        leaves, treedef = jax.tree.flatten(state)
        off = [i for i, x in enumerate(leaves) if not on_mesh(x)]
        for i, x in zip(off, sharding.replicate([leaves[i] for i in off], self.mesh)):
            leaves[i] = x
        return sharding.distinct_buffers(jax.tree.unflatten(treedef, leaves))  # Donated.

    def step_rows(self, num_rows: int, step: int) -> np.ndarray:
        """[O, rows per step]: the rows of each optimizer step. Each epoch shuffles the
        groups (seeded by the step) and splits them into minibatches."""
        G = self.layout.group_size
        out = []
        for epoch in range(self.epochs):
            order = np.random.default_rng([self.seed, step, epoch]).permutation(num_rows // G)
            for mb in np.split(order, self.layout.minibatches):
                out.append((mb[:, None] * G + np.arange(G)).reshape(-1))
        return np.stack(out).astype(np.int32)

    def update(self, state: TrainState, ref_params, rollouts, step: int):
        """One batch's update (`update_step`) from host rollouts, dispatched without waiting.

        Returns (state, metrics: device arrays, applied: [O] device bools, False where a
        non-finite loss or gradient skipped that optimizer step). The metrics include
        `train/logp_match_stats`: the `logp_match_stats` of the first optimizer step's
        micro-batches, which `logp_match` merges on the host. Only there is `logp` computed
        with the params the update started from: in a synchronous run, the generator's
        params, so the metrics measure the sampler's numerics alone (with asynchronous
        generation, the policy lag too).
        """
        args, static, shape = self._inputs(state, ref_params, rollouts, step)
        state, out = self.programs.run("update_step", update_step, args, static)
        metrics = {
            **shape,
            "train/loss_sum": out["loss_sum"],
            "train/denominator": out["denominator"],
            "train/grad_norm": out["grad_norm"],
            "train/logp_match_stats": out["match"],
            **{f"train/{k}": v for k, v in out["metrics"].items()},
            **{f"train/{k}": v for k, v in out["batch"].items()},
        }
        if "trainer_logp_gap" in out:
            metrics["train/trainer_logp_gap"] = out["trainer_logp_gap"]
        if "logp_gap_other" in out:  # The gap had the learner routed the other way.
            other = "without" if self.spec.forward.router_replay else "with"
            metrics[f"train/logp_gap_abs_{other}_replay"] = out["logp_gap_other"]
        return state, metrics, out["ok"]

    def precompile(self, state: TrainState, ref_params, rows: int) -> bool:
        """Starts compiling the update of every batch of `rows` rows in the background
        (`Programs.prefetch`), where one program serves them all: with a `pack_length` and
        one completion length. A run calls it before its first evaluation, which the
        compilation then overlaps. Returns whether it started."""
        if not self.layout.pack_length or self.layout.length_buckets != 1:
            return False
        batch = rollouts_lib.full_length(rows, 1, self.layout.max_len, self.routing_lc)
        args, static, _ = self._inputs(state, ref_params, batch, step=0)
        self.programs.prefetch("update_step", update_step, args, static)
        return True

    def _inputs(self, state: TrainState, ref_params, rollouts, step: int):
        """`update_step`'s arguments and static arguments for a batch, on the mesh, and the
        metrics of its layout (what the forward rows hold: a bucket per compiled program,
        their padding, the micro-batches each step runs)."""
        step_rows = self.step_rows(rollouts.mask_NM.shape[0], step)
        divisor = sharding.batch_divisor(self.mesh, sharding.TRAIN_RULES)
        plan = batch_layout.plan(
            rollouts, step_rows, self.layout, shards=divisor, placed_N=rollouts.mask_NM.any(1)
        )
        M = plan.M
        host = {
            "tokens": plan.tokens_NL,
            "attn": plan.attn_NL,
            "mask": rollouts.mask_NM[:, :M].astype(bool),
            "reward": rollouts.reward_N.astype(np.float32),
            "correct": rollouts.correct_N.astype(bool),
            "row_weight": rollouts.row_weight_N.astype(np.float32),
            "sampler_logp": rollouts.sampler_logp_NM[:, :M].astype(np.float32),
        }
        if plan.experts_NLlc is not None:  # A mixture of experts' recorded routing.
            host["experts"] = plan.experts_NLlc
        elif self.spec.forward.router_replay or self.replay_probe:
            raise ValueError(
                f"learner.router_replay={self.router_replay!r} (or learner.replay_probe) needs "
                "the generator's recorded routing, which this batch lacks (a dense policy's, "
                "or rows no generator sampled)"
            )
        if "teacher_logp" in self.objective.model_terms:  # The rollout stage's teacher pass.
            if rollouts.teacher_logp_NM is None:
                raise ValueError("the objective reads teacher_logp, which the rollouts lack")
            host["teacher_logp"] = rollouts.teacher_logp_NM[:, :M].astype(np.float32)
        if "step_reward" in self.objective.reads:  # The rollout stage's PRM pass.
            if rollouts.step_reward_NM is None:
                raise ValueError("the objective reads step_reward, which the rollouts lack")
            host["step_reward"] = rollouts.step_reward_NM[:, :M].astype(np.float32)
            host["step_mask"] = rollouts.step_mask_NM[:, :M].astype(bool)
        forward = self.spec.forward._replace(pack_length=plan.T, pack_rows=plan.pack_rows)
        # At most one micro-batch per group of a step (per row where groups split).
        max_micro = step_rows.shape[1] // (
            1 if self.layout.split_groups else self.layout.group_size
        )
        spec = self.spec._replace(forward=forward, max_micro=max_micro)
        shape = {
            "train/length_bucket": M,
            "train/padding_frac": plan.padding_frac,
            # Per micro-batch metrics past a step's count are zeros.
            "train/micro_ran": np.arange(max_micro) < plan.count[:, None],
        }
        put = functools.partial(sharding.put_batch, mesh=self.mesh, rules=sharding.TRAIN_RULES)
        place, count = put(plan.place, axis=1), sharding.replicate(plan.count, self.mesh)
        return (state, ref_params, put(host), place, count), {"spec": spec}, shape
