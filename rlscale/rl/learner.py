"""The learner: its train state, the per-token terms an objective needs, and one compiled update per
shape on a batch's real tokens (trimmed to a length bucket, or packed). See docs/learner.md.

Dimension letters: N rows, G group size, P padded prompt length, M completion length, S optimizer
steps per batch, U micro-batches per step, n rows per micro-batch, R forward rows and T tokens per
forward row, d batch shards, V vocab, D model width.
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
from rlscale.rl import rollouts as rollouts_lib
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


def plan(rollouts, micro_rows, *, max_len: int, buckets: int, shards: int):
    """The unpacked forward plan of one batch on the host: its trimmed length M and, for each
    micro-batch k (the rows `micro_rows[k]`), its rows cut to P + M tokens and where each
    completion token's prediction lies in them.

    Args:
      rollouts: the batch (`rollouts.Rollouts`).
      micro_rows: [K, n] int, the rows of each micro-batch.
      max_len: the completion budget (`sampling.max_new_tokens`).
      buckets: `learner.length_buckets`.
      shards: the batch's shard count (`sharding.batch_divisor`).

    Returns:
      (M, {"tokens", "positions", "segments": [K, n, P + M] int32, "gather": [K, n, M]
      int32}): `segments` is the attention mask and `gather[k, i, m]` the flat index, within
      row i's batch shard of the micro-batch's rows ([n / shards * (P + M)]), of the hidden
      state that predicts completion token m of row `micro_rows[k, i]`.
    """
    P = rollouts.prompt_len
    attn_NL = rollouts.attn_mask_NL.astype(np.int32)
    M = trimmed_length(rollouts, max_len, buckets)
    K, n = micro_rows.shape
    T = P + M
    rows = micro_rows.reshape(-1)
    attn = attn_NL[rows, :T]
    out = {
        "tokens": rollouts.tokens_NL[rows, :T],
        "positions": np.maximum(np.cumsum(attn, 1) - 1, 0),
        "segments": attn,
    }
    out = {k: v.reshape(K, n, T).astype(np.int32) for k, v in out.items()}
    gather_nM = (np.arange(n) % (n // shards))[:, None] * T + P - 1 + np.arange(M)
    out["gather"] = np.broadcast_to(gather_nM, (K, n, M)).astype(np.int32)
    return M, out


def trimmed_length(rollouts, max_len: int, buckets: int) -> int:
    """The length a batch's completions are trimmed to: its longest, rounded up to a bucket."""
    completion_N = rollouts.attn_mask_NL[:, rollouts.prompt_len :].sum(1)
    return length_bucket(int(completion_N.max(initial=1)), max_len, buckets)


def pack(rollouts, step_rows, *, pack_length: int, pack_rows: int, shards: int, group_size: int):
    """Where each trained sequence goes in the packed micro-batches of each optimizer step,
    on the host (`packed_micro` builds the rows on the device).

    A sequence is its prompt without padding, then its completion. It stays on the batch
    shard that holds its row, and goes first-fit into one of that shard's `pack_rows` rows of
    `pack_length` tokens in its micro-batch. Each step's groups with trained tokens are taken
    largest first, each into the first micro-batch with room for all its sequences: a group's
    samples share a micro-batch, as an aggregation over a prompt's samples needs. A step
    runs as many micro-batches as its sequences fill, from one compiled program.

    Args:
      rollouts: the batch (`rollouts.Rollouts`), N rows.
      step_rows: [S, n] int, each optimizer step's rows (whole groups).
      pack_length, pack_rows: `learner.pack_length`, `Learner.pack_rows`.
      shards: the batch's shard count (`sharding.batch_divisor`).
      group_size: samples per prompt (rows g * G ... g * G + G - 1 are group g).

    Returns:
      (place, count): `place` holds [S, N] int32 arrays: `micro`, row r's micro-batch in step
      s (-1: not trained in it); `row`, its packed row within its shard's rows; `offset`, the
      packed row's position of its first token. `count`: [S] int32, micro-batches per step.
    """
    T, c, G = pack_length, pack_rows, group_size
    P = rollouts.prompt_len
    attn = rollouts.attn_mask_NL.astype(bool)
    length_N = attn[:, : P + rollouts.mask_NM.shape[1]].sum(1)
    N, S = len(length_N), len(step_rows)
    trained_N = rollouts.mask_NM.any(1)
    longest = length_N[trained_N].max(initial=0)
    if longest > T:
        raise ValueError(
            f"learner.pack_length={T} is shorter than a trained sequence of the batch "
            f"({int(longest)} tokens: prompt and completion)"
        )
    shard_N = np.arange(N) // (N // shards)
    place = {k: np.full((S, N), -1 if k == "micro" else 0, np.int32) for k in PLACE}
    count = np.zeros(S, np.int32)
    for s, rows in enumerate(step_rows):
        groups = [[r for r in rows[i : i + G] if trained_N[r]] for i in range(0, len(rows), G)]
        groups = sorted((g for g in groups if g), key=lambda g: -sum(length_N[g]))
        rooms = []  # Per micro-batch, per shard: the room left in each of its packed rows.
        for group in groups:
            seqs = sorted(group, key=lambda r: -length_N[r])
            u, fits = _place_group(rooms, seqs, length_N, shard_N, T, c, shards)
            for r, (row, offset) in zip(seqs, fits):
                place["micro"][s, r], place["row"][s, r], place["offset"][s, r] = u, row, offset
        count[s] = len(rooms)
    return place, count


PLACE = ("micro", "row", "offset")


def _place_group(rooms, seqs, length_N, shard_N, T, c, shards):
    """(micro-batch, each sequence's (row, offset)) for a group's sequences `seqs`: the first
    micro-batch of `rooms` they all fit in, else a new one (appended to `rooms`)."""
    for u, micro in enumerate(rooms):
        fits = _first_fit(micro, seqs, length_N, shard_N, T, c)
        if fits is not None:
            return u, fits
    micro = [[] for _ in range(shards)]
    fits = _first_fit(micro, seqs, length_N, shard_N, T, c)
    if fits is None:
        raise ValueError(
            f"learner.pack_rows={c} rows of learner.pack_length={T} tokens per batch shard "
            f"cannot hold one group's sequences (lengths {[int(length_N[r]) for r in seqs]}): "
            "raise learner.pack_rows"
        )
    rooms.append(micro)
    return len(rooms) - 1, fits


def _first_fit(rooms, seqs, length_N, shard_N, T, c):
    """Places `seqs` first-fit into a micro-batch's packed rows (`rooms[shard]`: room left per
    row; at most `c` rows per shard), updating `rooms`; their (row, offset), or None (and
    `rooms` unchanged) if one does not fit."""
    trial = [list(r) for r in rooms]
    out = []
    for r in seqs:
        shard, n = trial[shard_N[r]], length_N[r]
        row = next((i for i, room in enumerate(shard) if room >= n), None)
        if row is None:
            if len(shard) == c:
                return None
            shard.append(T)
            row = len(shard) - 1
        out.append((row, T - shard[row]))
        shard[row] -= n
    rooms[:] = trial
    return out


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
    pack_length: int  # Tokens per packed row (0: unpacked).
    pack_rows: int  # Packed rows per batch shard in a micro-batch.
    max_micro: int  # The most packed micro-batches an optimizer step can need (its groups).
    minibatches: int
    chunk: int  # Tokens per batch shard in each chunk of the vocabulary-sized terms.
    remat: str  # The decoder blocks' rematerialization policy (`decoder.REMAT_POLICIES`).
    offload_ref: bool  # The reference's params arrive in host memory.


def token_terms(spec: Spec, params, value_params, fwd, targets, terms):
    """Per completion token, under the sampler's logits transform: `logp` of the taken token,
    `entropy`, and `value` (of the state before the token). Computes only `terms`.

    Unpacked, `fwd` is one micro-batch of the plan (`plan`) and `targets` its rows'
    completion tokens [n, M]: each completion token's hidden state is gathered within its
    batch shard, then the vocabulary-sized terms computed on those alone. Packed, `fwd` is a
    micro-batch's packed rows (`packed_micro`) with `targets` at every position: the terms
    are computed at every position of the rows, then each completion token's is gathered
    into its batch row ([N, M]).
    """
    h_RTD, _ = decoder.hidden(
        spec.graphdef,
        params,
        fwd["tokens"],
        fwd["positions"],
        None if spec.pack_length else fwd["segments"] > 0,
        segments_BT=fwd["segments"] if spec.pack_length else None,
        remat=spec.remat,
    )
    R, T, D = h_RTD.shape
    d = sharding.batch_divisor(spec.mesh, sharding.TRAIN_RULES)
    h = h_RTD  # Packed: the state at every position of the rows.
    if not spec.pack_length:  # Each completion token's state, gathered: [n, M, D].
        n, M = targets.shape
        shard = sharding.batch_sharding(spec.mesh, 3, sharding.TRAIN_RULES)
        h_dXD = jax.lax.with_sharding_constraint(h_RTD.reshape(d, R // d * T, D), shard)
        index_dX = _rows_sharded(fwd["gather"].reshape(d, n // d * M), spec.mesh)
        h = jax.vmap(lambda x, i: jnp.take(x, i, axis=0))(h_dXD, index_dX).reshape(n, M, D)
    out = {}
    vocab_terms = tuple(t for t in ("logp", "entropy") if t in terms)
    if vocab_terms:
        out.update(
            vocab_token_terms(
                spec.graphdef,
                params,
                h,
                targets,
                spec.logits_cfg,
                vocab_terms,
                spec.chunk,
                shards=d,
            )
        )
    if "value" in terms:
        out["value"] = h.astype(jnp.float32) @ value_params["w"] + value_params["b"]
    if spec.pack_length:  # From the packed rows' positions to the batch rows' tokens.
        N, M = fwd["gather"].shape
        index_dX = _rows_sharded(fwd["gather"].reshape(d, N // d * M), spec.mesh)
        out = {
            k: jax.vmap(jnp.take)(
                _rows_sharded(v.reshape(d, R // d * T), spec.mesh), index_dX
            ).reshape(N, M)
            for k, v in out.items()
        }
    return out


def packed_micro(spec: Spec, batch, place, u):
    """Micro-batch `u` of an optimizer step, packed on the device from the batch's rows
    (`batch["tokens"]`, `batch["attn"]`: [N, W], completions in the last M) by the step's
    `place` (`pack`, [N] each): each batch shard writes its rows' sequences into its own
    `pack_rows` rows (a scatter, no communication).

    Returns (fwd, in_N): the forward rows `tokens`, `positions`, `segments` (0 on padding,
    else the sequence's row within its shard plus 1) and `targets` (the next token where it
    is a completion token), [d * pack_rows, pack_length] each; `gather` [N, M], the flat
    index within row r's shard of the packed rows of the position predicting its completion
    token m; and `in_N`, the rows in the micro-batch.
    """
    tokens_NL, attn_NL = batch["tokens"], batch["attn"]
    N, L = tokens_NL.shape
    M = batch["mask"].shape[1]
    P = L - M
    d = sharding.batch_divisor(spec.mesh, sharding.TRAIN_RULES)
    T, c = spec.pack_length, spec.pack_rows
    in_N = place["micro"] == u
    start_N = place["row"] * T + place["offset"]
    pos_NL = jnp.maximum(jnp.cumsum(attn_NL, axis=1) - 1, 0)
    dest_NL = jnp.where(attn_NL & in_N[:, None], start_N[:, None] + pos_NL, c * T)
    prompt_N = jnp.sum(attn_NL[:, :P], axis=1)
    gather_NM = jnp.minimum(start_N[:, None] + prompt_N[:, None] - 1 + jnp.arange(M), c * T - 1)
    into_NM = jnp.where(attn_NL[:, P:] & in_N[:, None], gather_NM, c * T)

    def scatter(dest, values):  # Per batch shard: [N / d, ...] values -> [c * T].
        dest, values = (_rows_sharded(x.reshape(d, -1), spec.mesh) for x in (dest, values))
        rows = jax.vmap(lambda i, v: jnp.zeros(c * T, jnp.int32).at[i].set(v, mode="drop"))
        return _rows_sharded(rows(dest, values.astype(jnp.int32)), spec.mesh).reshape(d * c, T)

    segment_N = jnp.arange(N) % (N // d) + 1
    fwd = {
        "tokens": scatter(dest_NL, tokens_NL),
        "positions": scatter(dest_NL, pos_NL),
        "segments": scatter(dest_NL, jnp.broadcast_to(segment_N[:, None], (N, L))),
        "targets": scatter(into_NM, tokens_NL[:, P:]),  # At the position predicting each.
        "gather": gather_NM,
    }
    return fwd, in_N


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


class Micro(NamedTuple):
    """One micro-batch, as the update's loops see it: its forward rows (`token_terms`'s
    `fwd`) and its completion tokens, how its terms are taken from the whole batch's
    (`select`: unpacked, its rows; packed, every row, the others out of the mask), and how
    per-token terms computed on it go back into [N, M] arrays (`merge`)."""

    fwd: dict
    targets: jax.Array
    select: Any
    merge: Any


def _micro(spec: Spec, batch, step_inputs, u) -> Micro:
    """Micro-batch `u` of an optimizer step (`step_inputs`: its slice of the update's `fwd`
    and `rows` arguments)."""
    if spec.pack_length:
        fwd, in_N = packed_micro(spec, batch, step_inputs["place"], u)

        def select(terms):
            return {**terms, "mask": terms["mask"] * in_N[:, None].astype(terms["mask"].dtype)}

        return Micro(
            fwd,
            fwd["targets"],
            select,
            lambda acc, v: _rows_sharded(jnp.where(in_N[:, None], v, acc), spec.mesh),
        )
    fwd = jax.tree.map(lambda x: x[u], step_inputs["fwd"])
    rows = step_inputs["rows"][u]
    return Micro(
        fwd,
        _rows_sharded(batch["targets"][rows], spec.mesh),
        lambda terms: {k: _rows_sharded(v[rows], spec.mesh) for k, v in terms.items()},
        lambda acc, v: _rows_sharded(acc.at[rows].set(v), spec.mesh),
    )


def _micro_loop(f, carry, count, length: int):
    """`f(carry, u) -> (carry, out)` over micro-batches u < `count`, the outputs stacked
    [length]. A static `count` (unpacked) is a `lax.scan`; a traced one (packed: it follows
    the batch) a `fori_loop` that leaves zeros past `count`."""
    if isinstance(count, int):
        return jax.lax.scan(f, carry, jnp.arange(length))
    shapes = jax.eval_shape(lambda c: f(c, 0)[1], carry)
    outs = jax.tree.map(lambda x: jnp.zeros((length, *x.shape), x.dtype), shapes)

    def body(u, c):
        carry, outs = c
        carry, out = f(carry, u)
        return carry, jax.tree.map(lambda b, o: b.at[u].set(o), outs, out)

    return jax.lax.fori_loop(0, count, body, (carry, outs))


def _scan_steps(f, carry, steps, count):
    """`lax.scan` of `f(carry, step_inputs, count) -> (carry, out)` over optimizer steps:
    `count` is a step's micro-batches, [S] when packed, one int for all steps unpacked."""
    if isinstance(count, int):
        return jax.lax.scan(lambda c, x: f(c, x, count), carry, steps)
    return jax.lax.scan(lambda c, x: f(c, *x), carry, (steps, count))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnums=(0,))
def update_step(state: TrainState, ref_params, batch, fwd, rows_SUn, *, spec: Spec):
    """One batch's whole update, compiled once per shape (packed: once per trimmed length,
    whatever the number of micro-batches the batch fills).

    1. Where the chain reads them, the trainer's old terms (`old_logp`, `old_value`) and the
       reference's `ref_logp`, with the params the update starts from, over the first epoch's
       micro-batches (which hold every row once).
    2. The batch-stage transforms (advantages) on the whole batch.
    3. S optimizer steps (`lax.scan`), each accumulating the gradient sums of its
       micro-batches and dividing once by their summed denominator.

    Args:
      state: the train state (donated).
      ref_params: the reference's params (unused unless `spec.ref`).
      batch: per row [N] or [N, M]: `targets` (completion tokens), `mask`, `sampler_logp`,
        `reward`, `correct`, `row_weight`, and `teacher_logp`, `step_reward` and
        `step_mask` where the chain reads them;
        packed, also `tokens` and `attn` [N, W] (prompts left-padded to W - M tokens).
      fwd: unpacked, the forward plan (`plan`), its arrays reshaped to [S, U, ...]; packed,
        `place` ([S, N] arrays of `pack`) and `count` [S].
      rows_SUn: the rows of each micro-batch (unpacked).
      spec: the static specialization.

    Returns:
      (state, metrics): per micro-batch [S, U] `loss_sum`, `denominator`, the loss
      transforms' `metrics` and `match` (`logp_match_stats`), zeros past a step's count when
      packed (U: `spec.max_micro`); per step [S] `grad_norm` and `ok` (False where a
      non-finite loss or gradient skipped the step); `batch`, the batch-stage transforms'
      metrics (scalars); and with `old_logp`,
      `trainer_logp_gap` (mean |old_logp - sampler_logp| over the batch's trained tokens).
    """
    N, M = batch["mask"].shape
    terms = {k: v for k, v in batch.items() if k not in ("tokens", "attn")}
    metrics = {}
    if spec.pack_length:
        steps, count, length = {"place": fwd["place"]}, fwd["count"], spec.max_micro
    else:
        U = rows_SUn.shape[1]
        steps, count, length = {"fwd": fwd, "rows": rows_SUn}, U, U
    if spec.ref and spec.offload_ref:  # Into device memory for this update only.
        ref_params = jax.device_put(ref_params, jax.memory.Space.Device)
    if spec.old_terms or spec.ref:
        names = [f"old_{t}" for t in spec.old_terms] + ["ref_logp"] * spec.ref
        full = {k: _rows_sharded(jnp.zeros((N, M), jnp.float32), spec.mesh) for k in names}

        def no_grad_pass(acc, step_inputs, count):
            def one(acc, u):
                m = _micro(spec, batch, step_inputs, u)
                out = {}
                if spec.old_terms:
                    t = token_terms(
                        spec, state.params, state.value_params, m.fwd, m.targets, spec.old_terms
                    )
                    out.update({f"old_{k}": v for k, v in t.items()})
                if spec.ref:
                    t = token_terms(
                        spec, ref_params, state.value_params, m.fwd, m.targets, ("logp",)
                    )
                    out["ref_logp"] = t["logp"]
                return {k: m.merge(acc[k], out[k]) for k in acc}, None

            return _micro_loop(one, acc, count, length)

        first = jax.tree.map(lambda x: x[: spec.minibatches], steps)  # Every row once.
        first_count = count if isinstance(count, int) else count[: spec.minibatches]
        full, _ = _scan_steps(no_grad_pass, full, first, first_count)
        terms.update(full)
    if "old_logp" in terms:  # How far the sampler's numerics are from the learner's.
        mask_f = batch["mask"].astype(jnp.float32)
        metrics["trainer_logp_gap"] = jnp.sum(
            jnp.abs(terms["old_logp"] - batch["sampler_logp"]) * mask_f
        ) / jnp.maximum(jnp.sum(mask_f), 1.0)
    terms, batch_state = spec.objective.batch.update(terms, state.batch_state)
    metrics["batch"] = terms.pop("metrics", {})  # The batch-stage transforms' own.
    terms.pop("targets")

    def optimizer_step(train: TrainState, step_inputs, count):
        def micro(carry, u):
            grads_acc, loss_state = carry
            m = _micro(spec, batch, step_inputs, u)
            mb = m.select(terms)

            def loss_fn(params, value_params):
                t = token_terms(spec, params, value_params, m.fwd, m.targets, spec.train_terms)
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
        (grads, loss_state), per_micro = _micro_loop(
            micro, (zeros, train.loss_state), count, length
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

    state, per_step = _scan_steps(
        optimizer_step, state._replace(batch_state=batch_state), steps, count
    )
    return state, {**per_step, **metrics}


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
      pack_rows: packed rows per batch shard in a micro-batch (0: `group_size`, which holds
        any group).
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
    pack_rows: int = 0
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
            pack_length=self.pack_length,
            pack_rows=self.pack_rows or self.group_size,
            max_micro=0,  # Set per batch size by `update`.
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
        return state, metrics, out["ok"]

    def precompile(self, state: TrainState, ref_params, rows: int) -> bool:
        """Starts compiling the update of every batch of `rows` rows in the background
        (`Programs.prefetch`), where one program serves them all: packed, with one completion
        length. A run calls it before its first evaluation, which the compilation then
        overlaps. Returns whether it started."""
        if not self.pack_length or self.length_buckets != 1:
            return False
        batch = rollouts_lib.full_length(rows, 1, self.max_len)  # Any prompt length will do.
        args, static, _ = self._inputs(state, ref_params, batch, step=0)
        self.programs.prefetch("update_step", update_step, args, static)
        return True

    def _inputs(self, state: TrainState, ref_params, rollouts, step: int):
        """`update_step`'s arguments and static arguments for a batch, on the mesh, and the
        metrics of its layout (what the forward rows hold: a bucket per compiled program,
        and their padding)."""
        rows_SUn = self.micro_rows(rollouts.mask_NM.shape[0], step)
        S, U, n = rows_SUn.shape
        divisor = sharding.batch_divisor(self.mesh, sharding.TRAIN_RULES)
        M = trimmed_length(rollouts, self.max_len, self.length_buckets)
        P = rollouts.prompt_len
        host = {
            "targets": rollouts.tokens_NL[:, P : P + M].astype(np.int32),
            "mask": rollouts.mask_NM[:, :M].astype(bool),
            "reward": rollouts.reward_N.astype(np.float32),
            "correct": rollouts.correct_N.astype(bool),
            "row_weight": rollouts.row_weight_N.astype(np.float32),
            "sampler_logp": rollouts.sampler_logp_NM[:, :M].astype(np.float32),
        }
        if "teacher_logp" in self.objective.model_terms:  # The rollout stage's teacher pass.
            if rollouts.teacher_logp_NM is None:
                raise ValueError("the objective reads teacher_logp, which the rollouts lack")
            host["teacher_logp"] = rollouts.teacher_logp_NM[:, :M].astype(np.float32)
        if "step_reward" in self.objective.reads:  # The rollout stage's PRM pass.
            if rollouts.step_reward_NM is None:
                raise ValueError("the objective reads step_reward, which the rollouts lack")
            host["step_reward"] = rollouts.step_reward_NM[:, :M].astype(np.float32)
            host["step_mask"] = rollouts.step_mask_NM[:, :M].astype(bool)
        spec = self.spec
        put = functools.partial(sharding.put_batch, mesh=self.mesh, rules=sharding.TRAIN_RULES)
        if self.pack_length:
            # The rows, their prompts left-padded or cut to pack_length - 1 tokens (which hold
            # any packed sequence's): the program's shapes do not depend on the prompt bucket.
            W, keep = self.pack_length - 1 + M, min(P, self.pack_length - 1)
            host["tokens"] = np.zeros((len(host["mask"]), W), np.int32)
            host["attn"] = np.zeros((len(host["mask"]), W), bool)
            host["tokens"][:, W - M - keep :] = rollouts.tokens_NL[:, P - keep : P + M]
            host["attn"][:, W - M - keep :] = rollouts.attn_mask_NL[:, P - keep : P + M]
            place, count = pack(
                rollouts,
                rows_SUn.reshape(S, U * n),
                pack_length=self.pack_length,
                pack_rows=spec.pack_rows,
                shards=divisor,
                group_size=self.group_size,
            )
            spec = spec._replace(max_micro=U * n // self.group_size)
            trained = np.where(place["micro"] >= 0, host["attn"].sum(1), 0).sum()
            run = int(count.sum()) * spec.pack_rows * divisor * self.pack_length
            shape = {
                "train/padding_frac": 1.0 - trained / max(run, 1),
                # Per micro-batch metrics past a step's count are zeros.
                "train/micro_ran": np.arange(spec.max_micro) < count[:, None],
            }
            fwd = {"place": put(place, axis=1), "count": sharding.replicate(count, self.mesh)}
        else:
            _, fwd = plan(
                rollouts,
                rows_SUn.reshape(S * U, n),
                max_len=self.max_len,
                buckets=self.length_buckets,
                shards=divisor,
            )
            shape = {"train/padding_frac": 1.0 - float(np.mean(fwd["segments"] > 0))}
            # Forward rows sharded on their rows (dim 2); micro-batches' rows replicated.
            fwd = put({k: v.reshape(S, U, *v.shape[1:]) for k, v in fwd.items()}, axis=2)
        args = (state, ref_params, put(host), fwd, sharding.replicate(rows_SUn, self.mesh))
        return args, {"spec": spec}, {"train/length_bucket": M, **shape}
