"""The learner: its train state, the per-token terms an objective needs, and one compiled
update on a batch of rollouts.

Each batch is trained on its real tokens only. Completions are trimmed to the longest in the
batch, rounded up to one of `learner.length_buckets` lengths (one compiled program per
bucket), and with `learner.pack_length` the sequences that carry trained tokens are packed
into rows of that many tokens (segment ids keep them apart in attention and positions) while
rows with nothing to train are left out. The host builds this forward plan (`plan`); one
jitted function (`update_step`) then runs everything else: the trainer's old terms and the
reference's logprobs where the chain reads them, the batch-stage transforms (advantages), and
epochs x minibatches optimizer steps, each a `lax.scan` over its micro-batches' gradients.

Every jitted function is module-level and pure; the batch arrives as global arrays with rows
sharded over the mesh's batch axes (`sharding.put_batch`), so each device does its share.
Only the terms the objective's chain requires are computed (`Objective.model_terms`).

Dimension letters: N rows (prompts x group), G group size, P padded prompt length, M
completion length (the batch's bucket), S optimizer steps per batch (epochs x minibatches),
U micro-batches per step, n rows per micro-batch, R forward rows per micro-batch and T tokens
per forward row (R = n and T = P + M unpacked), d batch shards, V vocab, D model width.
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


def length_bucket(length: int, max_len: int, buckets: int) -> int:
    """The smallest of `buckets` evenly spaced lengths (max_len / buckets, ..., max_len)
    that holds `length`: what a batch's completions are trimmed to."""
    step = -(-max_len // buckets)
    return min(max_len, max(step, -(-length // step) * step))


def row_bucket(rows: int) -> int:
    """`rows` rounded up to four steps per doubling (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16,
    20, ...): at most 1/8 of the rows are padding, over few compiled shapes."""
    step = max(1, (1 << max(rows - 1, 1).bit_length()) // 8)
    return max(1, -(-rows // step) * step)


def plan(rollouts, micro_rows, *, max_len: int, buckets: int, pack_length: int, shards: int):
    """The forward plan of one batch on the host: its trimmed length M and, for each
    micro-batch k (the rows `micro_rows[k]`), the forward rows and where each completion
    token's prediction lies in them.

    Unpacked, a micro-batch's forward rows are its rows cut to P + M tokens. Packed, each
    batch shard's sequences that have trained tokens (their prompt without padding, then
    their completion) are packed first-fit-decreasing into rows of `pack_length` tokens; the
    rows per shard are rounded up by `row_bucket` (capped at the rows it would have
    unpacked), so a run compiles few shapes. Sequences stay on their batch shard: the gather
    of their hidden states needs no communication.

    Args:
      rollouts: the batch (`rollouts.Rollouts`).
      micro_rows: [K, n] int, the rows of each micro-batch (n divisible by `shards`).
      max_len: the completion budget (`sampling.max_new_tokens`).
      buckets: `learner.length_buckets`.
      pack_length: `learner.pack_length` (0: unpacked).
      shards: the batch's shard count (`sharding.batch_divisor`).

    Returns:
      (M, {"tokens", "positions", "segments": [K, R, T] int32, "gather": [K, n, M] int32}):
      `segments` is 0 on padding (unpacked: the attention mask) and `gather[k, i, m]` is the
      flat index, within row i's shard of the forward rows ([R / shards * T]), of the hidden
      state that predicts completion token m of row `micro_rows[k, i]`.
    """
    P = rollouts.prompt_len
    attn_NL = rollouts.attn_mask_NL.astype(np.int32)
    completion_N = attn_NL[:, P:].sum(1)
    M = length_bucket(int(completion_N.max(initial=1)), max_len, buckets)
    K, n = micro_rows.shape
    per = n // shards
    m_M = np.arange(M)
    if not pack_length:
        T = P + M
        rows = micro_rows.reshape(-1)
        attn = attn_NL[rows, :T]
        out = {
            "tokens": rollouts.tokens_NL[rows, :T],
            "positions": np.maximum(np.cumsum(attn, 1) - 1, 0),
            "segments": attn,
        }
        out = {k: v.reshape(K, n, T).astype(np.int32) for k, v in out.items()}
        gather_nM = (np.arange(n) % per)[:, None] * T + P - 1 + m_M
        out["gather"] = np.broadcast_to(gather_nM, (K, n, M)).astype(np.int32)
        return M, out

    T = pack_length
    prompt_N = attn_NL[:, :P].sum(1)
    length_N = prompt_N + completion_N
    if length_N.max() > T:
        raise ValueError(
            f"learner.pack_length={T} is shorter than a sequence of the batch "
            f"({int(length_N.max())} tokens: prompt and completion)"
        )
    trained_N = rollouts.mask_NM.any(1)
    # For each (micro-batch, shard): its packed rows, each a list of (position in shard, row).
    packs = []
    for k in range(K):
        for s in range(shards):
            shard_rows = micro_rows[k, s * per : (s + 1) * per]
            bins, room = [], []
            order = sorted(range(per), key=lambda i: -length_N[shard_rows[i]])
            for i in order:
                row = shard_rows[i]
                if not trained_N[row]:
                    continue
                fit = next((b for b, r in enumerate(room) if r >= length_N[row]), None)
                if fit is None:
                    bins.append([])
                    room.append(T)
                    fit = len(bins) - 1
                bins[fit].append((i, row))
                room[fit] -= length_N[row]
            packs.append(bins)
    R_shard = min(per, row_bucket(max(len(b) for b in packs)))
    R = R_shard * shards
    tokens = np.zeros((K, R, T), np.int32)
    positions = np.zeros((K, R, T), np.int32)
    segments = np.zeros((K, R, T), np.int32)
    gather = np.zeros((K, n, M), np.int32)
    for (k, s), bins in zip(np.ndindex(K, shards), packs):
        for b, members in enumerate(bins):
            r, offset = s * R_shard + b, 0
            for segment, (i, row) in enumerate(members, start=1):
                p, c = prompt_N[row], completion_N[row]
                seq = np.concatenate(
                    [rollouts.tokens_NL[row, P - p : P], rollouts.tokens_NL[row, P : P + c]]
                )
                tokens[k, r, offset : offset + p + c] = seq
                positions[k, r, offset : offset + p + c] = np.arange(p + c)
                segments[k, r, offset : offset + p + c] = segment
                start = b * T + offset + p - 1  # Predicts completion token 0.
                gather[k, s * per + i] = np.minimum(start + m_M, R_shard * T - 1)
                offset += p + c
    return M, {"tokens": tokens, "positions": positions, "segments": segments, "gather": gather}


class Spec(NamedTuple):
    """What the compiled update is specialized on (hashable: jit's static argument)."""

    graphdef: Any
    logits_cfg: SamplingConfig  # The sampler's logits transform: the distribution sampled.
    objective: Any
    optimizer: optax.GradientTransformation
    mesh: Any
    train_terms: tuple[str, ...]  # Computed with gradients.
    old_terms: tuple[str, ...]  # The trainer's terms before the update (`old_logp`, ...).
    ref: bool  # The chain reads `ref_logp`.
    packed: bool
    minibatches: int
    chunk: int  # Tokens per batch shard in each chunk of the vocabulary-sized terms.
    remat: str  # The decoder blocks' rematerialization policy (`decoder.REMAT_POLICIES`).
    offload_ref: bool  # The reference's params arrive in host memory.


def token_terms(spec: Spec, params, value_params, fwd, targets_nM, terms):
    """Per completion token, under the sampler's logits transform: `logp` of the taken token
    (`targets_nM`), `entropy`, and `value` (of the state before the token). Computes only
    `terms`. The forward rows `fwd` (one micro-batch of the plan) run through the decoder and
    each completion token's hidden state is gathered within its batch shard."""
    tokens_RT = fwd["tokens"]
    if spec.packed:
        h_RTD, _ = decoder.hidden(
            spec.graphdef,
            params,
            tokens_RT,
            fwd["positions"],
            None,
            segments_BT=fwd["segments"],
            remat=spec.remat,
        )
    else:
        h_RTD, _ = decoder.hidden(
            spec.graphdef,
            params,
            tokens_RT,
            fwd["positions"],
            fwd["segments"] > 0,
            remat=spec.remat,
        )
    R, T, D = h_RTD.shape
    n, M = targets_nM.shape
    d = sharding.batch_divisor(spec.mesh, sharding.TRAIN_RULES)
    shard = sharding.batch_sharding(spec.mesh, 3, sharding.TRAIN_RULES)
    h_dXD = jax.lax.with_sharding_constraint(h_RTD.reshape(d, R // d * T, D), shard)
    index_dX = _rows_sharded(fwd["gather"].reshape(d, n // d * M), spec.mesh)
    h_nMD = jax.vmap(lambda h, i: jnp.take(h, i, axis=0))(h_dXD, index_dX).reshape(n, M, D)
    out = {}
    vocab_terms = tuple(t for t in ("logp", "entropy") if t in terms)
    if vocab_terms:
        out.update(
            vocab_token_terms(
                spec.graphdef,
                params,
                h_nMD,
                targets_nM,
                spec.logits_cfg,
                vocab_terms,
                spec.chunk,
                shards=d,
            )
        )
    if "value" in terms:
        out["value"] = h_nMD.astype(jnp.float32) @ value_params["w"] + value_params["b"]
    return out


def vocab_token_terms(
    graphdef, params, h_nMD, targets_nM, logits_cfg, terms, chunk: int = 0, shards: int = 1
):
    """`logp` of each target token and the policy's `entropy`, from the final hidden states
    under the sampler's logits transform, `chunk` tokens per batch shard at a time.

    Unchunked (`chunk=0`) the [n, M, V] float32 log-probabilities exist at once, and the
    backward pass keeps its own copy: at a real vocabulary (152k for Qwen2.5) and long
    completions that is most of a device's memory. Chunked, each of the `shards` batch shards
    flattens its tokens, and a `lax.map` runs the LM head over `chunk` of them (per shard) at
    a time; `jax.checkpoint` makes the backward pass recompute each chunk's logits instead of
    saving them, so the vocabulary-sized temporaries per device are [chunk, V]. Values and
    gradients are the unchunked ones (the tokens are padded to whole chunks and the padding
    cut off).
    """

    def terms_of(h_XD, t_X):
        logits = transform_logits(decoder.logits(graphdef, params, h_XD), logits_cfg)
        logp_all = jax.nn.log_softmax(logits)
        out = {}
        if "logp" in terms:
            out["logp"] = jnp.take_along_axis(logp_all, t_X[..., None], axis=-1)[..., 0]
        if "entropy" in terms:
            out["entropy"] = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return out

    n, M, D = h_nMD.shape
    X = n // shards * M  # Tokens per batch shard.
    if not chunk or chunk >= X:
        return terms_of(h_nMD, targets_nM)
    K = -(-X // chunk)
    pad = K * chunk - X
    h_dXD = jnp.pad(h_nMD.reshape(shards, X, D), ((0, 0), (0, pad), (0, 0)))
    t_dX = jnp.pad(targets_nM.reshape(shards, X), ((0, 0), (0, pad)))
    h_KdCD = h_dXD.reshape(shards, K, chunk, D).swapaxes(0, 1)
    t_KdC = t_dX.reshape(shards, K, chunk).swapaxes(0, 1)
    out_KdC = jax.lax.map(lambda xs: jax.checkpoint(terms_of)(*xs), (h_KdCD, t_KdC))
    return {
        k: v.swapaxes(0, 1).reshape(shards, K * chunk)[:, :X].reshape(n, M)
        for k, v in out_KdC.items()
    }


def _rows_sharded(x, mesh):
    return jax.lax.with_sharding_constraint(
        x, sharding.batch_sharding(mesh, x.ndim, sharding.TRAIN_RULES)
    )


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


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(0,))
def update_step(state: TrainState, ref_params, batch, fwd, rows_SUn, *, spec: Spec):
    """One batch's whole update, compiled once per shape.

    1. Where the chain reads them, the trainer's old terms (`old_logp`, `old_value`) and the
       reference's `ref_logp`, with the params the update starts from, over the first epoch's
       micro-batches (which hold every row once).
    2. The batch-stage transforms (advantages) on the whole batch.
    3. S optimizer steps (`lax.scan`), each accumulating the gradient sums of its U
       micro-batches (`lax.scan`) and dividing once by their summed denominator.

    Args:
      state: the train state (donated).
      ref_params: the reference's params (unused unless `spec.ref`).
      batch: per row [N] or [N, M]: `targets` (completion tokens), `mask`, `sampler_logp`,
        `reward`, `correct`, `row_weight`.
      fwd: the forward plan (`plan`), its arrays reshaped to [S, U, ...].
      rows_SUn: the rows of each micro-batch.
      spec: the static specialization.

    Returns:
      (state, metrics): per micro-batch [S, U] `loss_sum`, `denominator`, the loss
      transforms' `metrics` and `match` (`logp_match_stats`); per step [S] `grad_norm` and
      `ok` (False where a non-finite loss or gradient skipped the step); and with `old_logp`,
      `trainer_logp_gap` (mean |old_logp - sampler_logp| over the batch's trained tokens).
    """
    N, M = batch["mask"].shape
    terms, metrics = dict(batch), {}
    if spec.ref and spec.offload_ref:  # Into device memory for this update only.
        ref_params = jax.device_put(ref_params, jax.memory.Space.Device)
    if spec.old_terms or spec.ref:
        first = jax.tree.map(lambda x: x[: spec.minibatches].reshape(-1, *x.shape[2:]), fwd)
        rows_Kn = rows_SUn[: spec.minibatches].reshape(-1, rows_SUn.shape[-1])

        def no_grad_pass(_, xs):
            f, rows = xs
            targets = _rows_sharded(batch["targets"][rows], spec.mesh)
            out = {}
            if spec.old_terms:
                t = token_terms(spec, state.params, state.value_params, f, targets, spec.old_terms)
                out.update({f"old_{k}": v for k, v in t.items()})
            if spec.ref:
                t = token_terms(spec, ref_params, state.value_params, f, targets, ("logp",))
                out["ref_logp"] = t["logp"]
            return None, out

        _, outs = jax.lax.scan(no_grad_pass, None, (first, rows_Kn))
        for k, v_KnM in outs.items():
            full = jnp.zeros((N, M), v_KnM.dtype).at[rows_Kn.reshape(-1)].set(v_KnM.reshape(-1, M))
            terms[k] = _rows_sharded(full, spec.mesh)
    if "old_logp" in terms:  # How far the sampler's numerics are from the learner's.
        mask_f = batch["mask"].astype(jnp.float32)
        metrics["trainer_logp_gap"] = jnp.sum(
            jnp.abs(terms["old_logp"] - batch["sampler_logp"]) * mask_f
        ) / jnp.maximum(jnp.sum(mask_f), 1.0)
    terms, batch_state = spec.objective.batch.update(terms, state.batch_state)
    terms.pop("metrics", None)

    def optimizer_step(train: TrainState, xs):
        fwd_U, rows_Un = xs

        def micro(carry, xs):
            grads_acc, loss_state = carry
            f, rows = xs
            mb = {k: _rows_sharded(v[rows], spec.mesh) for k, v in terms.items()}
            targets = mb.pop("targets")

            def loss_fn(params, value_params):
                t = token_terms(spec, params, value_params, f, targets, spec.train_terms)
                out, new_state = spec.objective.loss.update(
                    {**mb, **t, "update": train.step}, loss_state
                )
                match = logp_match_stats(
                    jax.lax.stop_gradient(t["logp"]), mb["sampler_logp"], mb["mask"]
                )
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
        (grads, loss_state), per_micro = jax.lax.scan(
            micro, (zeros, train.loss_state), (fwd_U, rows_Un)
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

    state, per_step = jax.lax.scan(
        optimizer_step, state._replace(batch_state=batch_state), (fwd, rows_SUn)
    )
    return state, {**per_step, **metrics}


def make_optimizer(c, params=None) -> optax.GradientTransformation:
    """AdamW with warmup, a constant or cosine schedule and global-norm clipping
    (`config.optim`). With low-precision `params` (bfloat16), it keeps float32 master weights
    and float32 moments (`master_weights`)."""
    warmup = optax.linear_schedule(0.0, c.lr, max(c.warmup_steps, 1))
    if c.schedule == "cosine":
        main = optax.cosine_decay_schedule(c.lr, max(c.decay_steps, 1), alpha=c.final_lr_frac)
    elif c.schedule == "constant":
        main = optax.constant_schedule(c.lr)
    else:
        raise ValueError(f"optim.schedule={c.schedule!r} is not 'constant' or 'cosine'")
    lr = optax.join_schedules([warmup, main], [c.warmup_steps])
    optimizer = optax.chain(
        optax.clip_by_global_norm(c.grad_clip),
        optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay),
    )
    low = [x for x in jax.tree.leaves(params) if jnp.dtype(x.dtype) != jnp.float32]
    return master_weights(optimizer) if low else optimizer


class MasterState(NamedTuple):
    master: Any  # float32 copies of the params.
    inner: Any  # The wrapped optimizer's state, over the float32 copies.


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Mixed-precision training: low-precision (bfloat16) params for the forward and backward
    passes, float32 master weights and optimizer state (Micikevicius et al. 2018, "Mixed
    Precision Training").

    The wrapped optimizer sees float32 gradients and updates the float32 masters; the update
    it returns moves each low-precision param exactly onto its master rounded to the param's
    dtype (the difference is taken in float32, where it is exact, and `optax.apply_updates`
    adds it in float32 before casting back). Small updates accumulate in the masters instead
    of vanishing in bfloat16 rounding.
    """

    def init(params):
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return MasterState(master, inner.init(master))

    def update(grads, state, params=None):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        to_master = jax.tree.map(
            lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32),
            master,
            params,
        )
        return to_master, MasterState(master, inner_state)

    return optax.GradientTransformation(init, update)


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
      max_len: the completion budget (`sampling.max_new_tokens`).
      length_buckets: how many lengths completions are trimmed to (1: always `max_len`).
      pack_length: tokens per packed row (0: unpacked).
      logprob_chunk: completion tokens per batch shard in each chunk of the logprob and
        entropy computation (`vocab_token_terms`).
      remat: the decoder blocks' rematerialization policy (`decoder.REMAT_POLICIES`).
      offload_ref: keep the reference's params in pinned host memory between updates.
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
    max_len: int
    length_buckets: int
    pack_length: int
    seed: int
    programs: Any
    logprob_chunk: int = 0
    remat: str = "none"
    offload_ref: bool = False

    def __post_init__(self):
        need = self.objective.model_terms
        old_terms = tuple(t for t in ("logp", "value") if f"old_{t}" in need)
        self.spec = Spec(
            graphdef=self.graphdef,
            logits_cfg=self.logits_cfg,
            objective=self.objective,
            optimizer=self.optimizer,
            mesh=self.mesh,
            train_terms=tuple(t for t in FORWARD_TERMS if t in need or t == "logp"),
            old_terms=old_terms,
            ref="ref_logp" in need,
            packed=bool(self.pack_length),
            minibatches=self.minibatches,
            chunk=self.logprob_chunk,
            remat=self.remat,
            offload_ref=self.offload_ref,
        )
        # No-gradient forward passes per batch: the trainer's old terms, reference logprobs.
        self.forward_passes = int(bool(old_terms)) + int(self.spec.ref)

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
        return jax.tree.unflatten(treedef, leaves)

    def micro_rows(self, num_rows: int, step: int) -> np.ndarray:
        """[S, U, n]: the rows of each optimizer step's micro-batches. Each epoch shuffles the
        groups (seeded by the step) and splits them into minibatches, then micro-batches."""
        G = self.group_size
        out = []
        for epoch in range(self.epochs):
            order = np.random.default_rng([self.seed, step, epoch]).permutation(num_rows // G)
            for mb in np.split(order, self.minibatches):
                micro = np.stack(np.split(mb, self.micro_batches))  # [U, groups]
                out.append((micro[..., None] * G + np.arange(G)).reshape(len(micro), -1))
        return np.stack(out).astype(np.int32)

    def update(self, state: TrainState, ref_params, rollouts, step: int):
        """One batch's update (`update_step`) from host rollouts, dispatched without waiting.

        Returns (state, metrics: device arrays, applied: [S] device bools, False where a
        non-finite loss or gradient skipped that optimizer step). The metrics include
        `train/logp_match_stats`: the `logp_match_stats` of the first optimizer step's
        micro-batches, which `logp_match` merges on the host. Only there is `logp` computed
        with the params the update started from: in a synchronous run, the generator's
        params, so the metrics measure the sampler's numerics alone (with asynchronous
        generation, the policy lag too).
        """
        rows_SUn = self.micro_rows(rollouts.mask_NM.shape[0], step)
        S, U, n = rows_SUn.shape
        divisor = sharding.batch_divisor(self.mesh, sharding.TRAIN_RULES)
        M, fwd = plan(
            rollouts,
            rows_SUn.reshape(S * U, n),
            max_len=self.max_len,
            buckets=self.length_buckets,
            pack_length=self.pack_length,
            shards=divisor,
        )
        # What the forward rows hold: a bucket per compiled program, and their padding.
        shape = {
            "train/length_bucket": M,
            "train/padding_frac": 1.0 - float(np.mean(fwd["segments"] > 0)),
        }
        P = rollouts.prompt_len
        host = {
            "targets": rollouts.tokens_NL[:, P : P + M],
            "mask": rollouts.mask_NM[:, :M],
            "reward": rollouts.reward_N.astype(np.float32),
            "correct": rollouts.correct_N,
            "row_weight": rollouts.row_weight_N.astype(np.float32),
            "sampler_logp": rollouts.sampler_logp_NM[:, :M],
        }
        batch = sharding.put_batch(host, self.mesh, sharding.TRAIN_RULES)
        # Forward rows sharded on R (dim 2); the micro-batches' rows are small and replicated.
        fwd = {k: v.reshape(S, U, *v.shape[1:]) for k, v in fwd.items()}
        fwd = sharding.put_batch(fwd, self.mesh, sharding.TRAIN_RULES, axis=2)
        rows = sharding.replicate(rows_SUn, self.mesh)
        args = (state, ref_params, batch, fwd, rows)
        state, out = self.programs.run("update_step", update_step, args, dict(spec=self.spec))
        metrics = {
            **shape,
            "train/loss_sum": out["loss_sum"],
            "train/denominator": out["denominator"],
            "train/grad_norm": out["grad_norm"],
            "train/logp_match_stats": out["match"],
            **{f"train/{k}": v for k, v in out["metrics"].items()},
        }
        if "trainer_logp_gap" in out:
            metrics["train/trainer_logp_gap"] = out["trainer_logp_gap"]
        return state, metrics, out["ok"]
