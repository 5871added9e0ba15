"""The learner: its train state, the per-token terms an objective needs, and one update on a
batch of rollouts (place, compute the trainer's old terms and the reference terms where the
chain reads them, batch-stage transforms, then epochs x minibatches of accumulated
micro-batch gradients), with how far the trainer's logprobs are from the generator's.

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
    """`token_terms` without gradients: the trainer's terms at the start of the update
    (`old_logp`, `old_value`) or the reference's, once per sampled batch."""
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
        match = logp_match_stats(jax.lax.stop_gradient(t["logp"]), mb["sampler_logp"], mb["mask"])
        return out["loss_sum"], (out["denominator"], out.get("metrics", {}), new_state, match)

    (loss_sum, (denom, mets, new_state, match)), grads = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True
    )(params, value_params)
    return grads, loss_sum, denom, mets, new_state, match


def logp_match_stats(logp, sampler_logp, mask) -> dict:
    """One chunk's (a micro-batch's) statistics of its masked tokens, from which `logp_match`
    computes how far the trainer's logprobs are from the generator's over any number of
    chunks: the count n, the means of x = exp(logp) and y = exp(sampler_logp), the centred
    sums M2x = sum (x - mean x)^2, M2y = sum (y - mean y)^2, Cxy = sum (x - mean x)(y - mean y),
    and sum |logp - sampler_logp|. Centred within the chunk, not raw sums of x^2: probabilities
    near 1 would lose the variance to float32 cancellation (a Pearson r of 1.000002)."""
    m = mask > 0
    n = jnp.sum(m.astype(jnp.int32))
    x, y = jnp.exp(logp), jnp.exp(sampler_logp)
    mean_x = jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(n, 1)
    mean_y = jnp.sum(jnp.where(m, y, 0.0)) / jnp.maximum(n, 1)
    dx, dy = jnp.where(m, x - mean_x, 0.0), jnp.where(m, y - mean_y, 0.0)
    return {
        "n": n,
        "mean_x": mean_x,
        "mean_y": mean_y,
        "m2_x": jnp.sum(dx * dx),
        "m2_y": jnp.sum(dy * dy),
        "c_xy": jnp.sum(dx * dy),
        "abs_gap": jnp.sum(jnp.where(m, jnp.abs(logp - sampler_logp), 0.0)),
    }


def logp_match(chunks: list[dict]) -> dict[str, float]:
    """The trainer-vs-generator metrics over the tokens of all `chunks` (`logp_match_stats`
    of each), merged on the host in float64 with the exact pairwise update of Chan, Golub and
    LeVeque (1979): for chunks a, b with d = mean_b - mean_a, M2 = M2_a + M2_b + d^2 n_a n_b / n
    and C = C_a + C_b + d_x d_y n_a n_b / n. Any split gives the value of the whole, up to
    float32 rounding within each chunk.

      train/logp_gap_abs   mean_t |logp_t - sampler_logp_t|
      train/prob_pearson   Pearson r between exp(logp_t) and exp(sampler_logp_t):
                           Cxy / sqrt(M2x M2y)

    NaN (null in metrics.jsonl) where undefined: no tokens, or r of a constant.
    """
    n = mean_x = mean_y = m2_x = m2_y = c_xy = abs_gap = 0.0
    for c in chunks:
        c = {k: float(v) for k, v in c.items()}
        total = n + c["n"]
        if c["n"] > 0:
            d_x, d_y, w = c["mean_x"] - mean_x, c["mean_y"] - mean_y, n * c["n"] / total
            m2_x += c["m2_x"] + d_x * d_x * w
            m2_y += c["m2_y"] + d_y * d_y * w
            c_xy += c["c_xy"] + d_x * d_y * w
            mean_x += d_x * c["n"] / total
            mean_y += d_y * c["n"] / total
        n, abs_gap = total, abs_gap + c["abs_gap"]
    return {
        "train/logp_gap_abs": abs_gap / n if n > 0 else float("nan"),
        "train/prob_pearson": c_xy / np.sqrt(m2_x * m2_y)
        if m2_x > 0 and m2_y > 0
        else float("nan"),
    }


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
        # No-gradient forward passes per batch: the trainer's old terms, reference logprobs.
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
        """The learner batch (global arrays) from host rollouts: the trainer's old terms and
        the reference terms the chain needs, then the batch-stage transforms (advantages).
        Where the chain reads `old_logp`, also `train/trainer_logp_gap`: the mean over the
        batch's masked tokens of |old_logp - sampler_logp|.

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
            metrics["train/trainer_logp_gap"] = jnp.sum(
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

        The metrics include `train/logp_match_stats`: the `logp_match_stats` of the
        micro-batches of the first minibatch of the first epoch, which `logp_match` merges on
        the host. Only there is `logp` computed with the params the update started from,
        before any optimizer step on this batch: in a synchronous run, the generator's
        params, so the metrics measure the sampler's numerics alone (with asynchronous
        generation, the policy lag too).

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
            for i, mb in enumerate(np.array_split(order, self.minibatches)):
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
                    grads, loss_sum, denom, mets, loss_state, match = self.programs.run(
                        "micro_grads", micro_grads, args, static
                    )
                    if epoch == 0 and i == 0:  # The on-policy view: no update applied yet.
                        step_metrics.setdefault("train/logp_match_stats", []).append(match)
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
