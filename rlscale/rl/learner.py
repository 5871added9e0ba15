"""The learner: its train state, the per-token terms an objective needs, and one update on a
batch of rollouts (place, recompute the behaviour and reference terms, batch-stage
transforms, then epochs x minibatches of accumulated micro-batch gradients).

Every jitted function is module-level and pure; the batch arrives as global arrays with rows
sharded over the mesh's batch axes (`sharding.put_batch`), so each device does its share.
Only the terms the objective's chain requires are computed (`Objective.model_terms`).

Dimension letters: N rows (prompts x group), G group size, P padded prompt length,
M completion length, L = P + M, V vocab, D model width.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlscale import faults, sharding
from rlscale.model import decoder
from rlscale.sampling import SamplingConfig, transform_logits


class TrainState(NamedTuple):
    params: Any
    value_params: Any  # {"w": [D], "b": []}; trained only when the chain reads `value`.
    opt_state: Any
    loss_state: Any  # State of the objective's loss-stage transforms.
    batch_state: Any  # State of its batch-stage transforms.
    step: jax.Array  # Optimizer updates applied (a skipped update does not count).


# Terms produced by a forward pass of the policy (or the frozen reference) on sampled rows.
FORWARD_TERMS = ("logp", "entropy", "value")


def token_terms(graphdef, params, value_params, tokens_NL, attn_NL, *, P, logits_cfg, terms):
    """Per completion token, under the sampler's logits transform (temperature, top-k, top-p:
    the distribution the tokens were drawn from): `logp` of the taken token, `entropy`, and
    `value` (of the state before the token). Computes only `terms`."""
    positions = decoder.positions_from_mask(attn_NL)
    h, _ = decoder.hidden(graphdef, params, tokens_NL, positions, attn_NL)
    h_NMD = h[:, P - 1 : -1]
    out = {}
    if "logp" in terms or "entropy" in terms:
        logits = transform_logits(decoder.logits(graphdef, params, h_NMD), logits_cfg)
        logp_all = jax.nn.log_softmax(logits)
        if "logp" in terms:
            out["logp"] = jnp.take_along_axis(logp_all, tokens_NL[:, P:, None], axis=-1)[..., 0]
        if "entropy" in terms:
            out["entropy"] = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    if "value" in terms:
        out["value"] = h_NMD.astype(jnp.float32) @ value_params["w"] + value_params["b"]
    return out


@functools.partial(jax.jit, static_argnames=("graphdef", "P", "logits_cfg", "terms"))
def forward_terms(params, value_params, tokens_NL, attn_NL, *, graphdef, P, logits_cfg, terms):
    """`token_terms` without gradients: the behaviour policy's (or the reference's) terms,
    once per sampled batch."""
    return token_terms(
        graphdef, params, value_params, tokens_NL, attn_NL, P=P, logits_cfg=logits_cfg, terms=terms
    )


@functools.partial(
    jax.jit, static_argnames=("graphdef", "P", "logits_cfg", "terms", "loss_tx", "mesh")
)
def micro_grads(
    params,
    value_params,
    loss_state,
    batch,
    rows,
    update,
    *,
    graphdef,
    P,
    logits_cfg,
    terms,
    loss_tx,
    mesh,
):
    """Gradients of one micro-batch's loss_sum (the batch's `rows`), with its denominator,
    metrics and the loss transforms' new state. The rows are gathered here and kept sharded
    over the batch axes, so every device differentiates its share."""
    mb = {k: v[rows] for k, v in batch.items()}
    mb = {
        k: jax.lax.with_sharding_constraint(
            v, sharding.batch_sharding(mesh, v.ndim, sharding.TRAIN_RULES)
        )
        for k, v in mb.items()
    }

    def loss_fn(params, value_params):
        t = token_terms(
            graphdef,
            params,
            value_params,
            mb["tokens"],
            mb["attn_mask"],
            P=P,
            logits_cfg=logits_cfg,
            terms=terms,
        )
        data = {k: v for k, v in mb.items() if k not in ("tokens", "attn_mask")}
        out, new_state = loss_tx.update({**data, **t, "update": update}, loss_state)
        return out["loss_sum"], (out["denominator"], out.get("metrics", {}), new_state)

    (loss_sum, (denom, mets, new_state)), grads = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True
    )(params, value_params)
    return grads, loss_sum, denom, mets, new_state


@functools.partial(jax.jit, static_argnames=("optimizer",), donate_argnums=(0,))
def apply_grads(state: TrainState, grads, loss_sum, denom, *, optimizer):
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
    return new, {"train/grad_norm": optax.tree.norm(grads), "ok": ok}


def make_optimizer(c) -> optax.GradientTransformation:
    warmup = optax.linear_schedule(0.0, c.lr, max(c.warmup_steps, 1))
    if c.schedule == "cosine":
        main = optax.cosine_decay_schedule(c.lr, max(c.decay_steps, 1), alpha=c.final_lr_frac)
    elif c.schedule == "constant":
        main = optax.constant_schedule(c.lr)
    else:
        raise ValueError(f"optim.schedule={c.schedule!r} is not 'constant' or 'cosine'")
    lr = optax.join_schedules([warmup, main], [c.warmup_steps])
    return optax.chain(
        optax.clip_by_global_norm(c.grad_clip),
        optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay),
    )


@dataclasses.dataclass
class Learner:
    """Updates the policy (and value head) on rollouts.

    Attributes:
      graphdef: the policy's graph definition.
      objective: the built chain (`objectives.build`): batch and loss transforms, model terms.
      optimizer: the optax optimizer.
      mesh: the learner's mesh; batches are sharded over its batch axes.
      logits_cfg: the sampler's logits transform (temperature, top-k, top-p).
      epochs, minibatches, micro_batches: optimizer steps per batch and their accumulation.
      group_size: samples per prompt (minibatches hold whole groups).
      seed: seeds the minibatch order.
      programs: records each compiled program's cost.
    """

    graphdef: Any
    objective: Any
    optimizer: optax.GradientTransformation
    mesh: Any
    logits_cfg: SamplingConfig
    epochs: int
    minibatches: int
    micro_batches: int
    group_size: int
    seed: int
    programs: Any

    def __post_init__(self):
        need = self.objective.model_terms
        self.train_terms = tuple(t for t in FORWARD_TERMS if t in need or t == "logp")
        self.old_terms = tuple(t for t in ("logp", "value") if f"old_{t}" in need)
        # No-gradient forward passes per batch: behaviour terms, reference logprobs.
        self.forward_passes = int(bool(self.old_terms)) + int("ref_logp" in need)
        self._batch_update = jax.jit(self.objective.batch.update)

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
        return jax.tree.unflatten(treedef, leaves)

    def _forward(self, params, value_params, tokens, attn, P, terms):
        static = dict(graphdef=self.graphdef, P=P, logits_cfg=self.logits_cfg, terms=terms)
        args = (params, value_params, tokens, attn)
        return self.programs.run("forward_terms", forward_terms, args, static)

    def prepare(self, state: TrainState, ref_params, rollouts) -> tuple[TrainState, dict, dict]:
        """The learner batch (global arrays) from host rollouts: the behaviour and reference
        terms the chain needs, then the batch-stage transforms (advantages).

        Returns (state with the batch transforms' new state, batch, metrics).
        """
        need = self.objective.model_terms
        host = {
            "tokens": rollouts.tokens_NL,
            "attn_mask": rollouts.attn_mask_NL,
            "mask": rollouts.mask_NM,
            "reward": rollouts.reward_N.astype(np.float32),
            "correct": rollouts.correct_N,
            "row_weight": rollouts.row_weight_N.astype(np.float32),
            "sampler_logp": rollouts.sampler_logp_NM,
        }
        batch = sharding.put_batch(host, self.mesh, sharding.TRAIN_RULES)
        P = rollouts.prompt_len
        metrics = {}
        if self.old_terms:
            old = self._forward(
                state.params,
                state.value_params,
                batch["tokens"],
                batch["attn_mask"],
                P,
                self.old_terms,
            )
            batch.update({f"old_{k}": v for k, v in old.items()})
        if "logp" in self.old_terms:  # How far the sampler's numerics are from the learner's.
            mask_f = batch["mask"].astype(jnp.float32)
            metrics["train/sampler_logp_gap"] = jnp.sum(
                jnp.abs(batch["old_logp"] - batch["sampler_logp"]) * mask_f
            ) / jnp.maximum(jnp.sum(mask_f), 1.0)
        if "ref_logp" in need:
            ref = self._forward(
                ref_params, state.value_params, batch["tokens"], batch["attn_mask"], P, ("logp",)
            )
            batch["ref_logp"] = ref["logp"]
        terms, batch_state = self._batch_update(batch, state.batch_state)
        terms.pop("metrics", None)
        return state._replace(batch_state=batch_state), terms, metrics

    def update(self, state: TrainState, batch: dict, P: int, step: int):
        """`epochs` x `minibatches` optimizer steps on the batch, each accumulating
        `micro_batches` gradient sums and dividing once by their summed denominator.

        Returns (state, metrics: device scalars and lists, applied: one device bool per
        optimizer step, False where a non-finite loss or gradient skipped it).
        """
        G = self.group_size
        N = batch["mask"].shape[0]
        step_metrics, applied = {}, []
        static = dict(
            graphdef=self.graphdef,
            P=P,
            logits_cfg=self.logits_cfg,
            terms=self.train_terms,
            loss_tx=self.objective.loss,
            mesh=self.mesh,
        )
        for epoch in range(self.epochs):
            order = np.random.default_rng([self.seed, step, epoch]).permutation(N // G)
            for mb in np.array_split(order, self.minibatches):
                grads_acc, denom_acc, loss_acc = None, 0.0, 0.0
                for micro in np.array_split(mb, self.micro_batches):
                    rows = (micro[:, None] * G + np.arange(G)).reshape(-1)
                    args = (
                        state.params,
                        state.value_params,
                        state.loss_state,
                        batch,
                        rows.astype(np.int32),
                        state.step,
                    )
                    grads, loss_sum, denom, mets, loss_state = self.programs.run(
                        "micro_grads", micro_grads, args, static
                    )
                    state = state._replace(loss_state=loss_state)
                    grads_acc = (
                        grads if grads_acc is None else jax.tree.map(jnp.add, grads_acc, grads)
                    )
                    denom_acc = denom_acc + denom
                    loss_acc = loss_acc + loss_sum
                    for k, v in mets.items():
                        step_metrics.setdefault(f"train/{k}", []).append(v)
                    step_metrics.setdefault("train/loss_sum", []).append(loss_sum)
                    step_metrics.setdefault("train/denominator", []).append(denom)
                state, upd = self.programs.run(
                    "apply_grads",
                    apply_grads,
                    (state, grads_acc, loss_acc, denom_acc),
                    dict(optimizer=self.optimizer),
                )
                step_metrics.setdefault("train/grad_norm", []).append(upd["train/grad_norm"])
                applied.append(upd["ok"])
        return state, step_metrics, applied
