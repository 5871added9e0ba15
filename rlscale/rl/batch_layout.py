"""How a batch's rows are laid out for the learner's forward passes, decided on the host: the
length its completions are trimmed to (one of `learner.length_buckets`), the unpacked plan of
each micro-batch's rows (`plan`), and where each trained sequence goes in packed rows
(`pack`; the device builds them, `forward.packed_micro`).

Dimension letters: N rows, P padded prompt length, M completion length (the batch's bucket),
O optimizer steps per batch, U micro-batches, n rows per micro-batch, T tokens per forward
row.
"""

import numpy as np


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
      micro_rows: [U, n] int, the rows of each micro-batch.
      max_len: the completion budget (`sampling.max_new_tokens`).
      buckets: `learner.length_buckets`.
      shards: the batch's shard count (`sharding.batch_divisor`).

    Returns:
      (M, {"tokens", "positions", "segments": [U, n, P + M] int32, "gather": [U, n, M]
      int32}): `segments` is the attention mask and `gather[k, i, m]` the flat index, within
      row i's batch shard of the micro-batch's rows ([n / shards * (P + M)]), of the hidden
      state that predicts completion token m of row `micro_rows[k, i]`.
    """
    P = rollouts.prompt_len
    attn_NL = rollouts.attn_mask_NL.astype(np.int32)
    M = trimmed_length(rollouts, max_len, buckets)
    U, n = micro_rows.shape
    T = P + M
    rows = micro_rows.reshape(-1)
    attn = attn_NL[rows, :T]
    out = {
        "tokens": rollouts.tokens_NL[rows, :T],
        "positions": np.maximum(np.cumsum(attn, 1) - 1, 0),
        "segments": attn,
    }
    out = {k: v.reshape(U, n, T).astype(np.int32) for k, v in out.items()}
    gather_nM = (np.arange(n) % (n // shards))[:, None] * T + P - 1 + np.arange(M)
    out["gather"] = np.broadcast_to(gather_nM, (U, n, M)).astype(np.int32)
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
      step_rows: [O, n] int, each optimizer step's rows (whole groups).
      pack_length, pack_rows: `learner.pack_length`, `Learner.pack_rows`.
      shards: the batch's shard count (`sharding.batch_divisor`).
      group_size: samples per prompt (rows g * G ... g * G + G - 1 are group g).

    Returns:
      (place, count): `place` holds [O, N] int32 arrays: `micro`, row r's micro-batch in step
      s (-1: not trained in it); `row`, its packed row within its shard's rows; `offset`, the
      packed row's position of its first token. `count`: [O] int32, micro-batches per step.
    """
    T, c, G = pack_length, pack_rows, group_size
    P = rollouts.prompt_len
    attn = rollouts.attn_mask_NL.astype(bool)
    length_N = attn[:, : P + rollouts.mask_NM.shape[1]].sum(1)
    N, steps = len(length_N), len(step_rows)  # O optimizer steps.
    trained_N = rollouts.mask_NM.any(1)
    longest = length_N[trained_N].max(initial=0)
    if longest > T:
        raise ValueError(
            f"learner.pack_length={T} is shorter than a trained sequence of the batch "
            f"({int(longest)} tokens: prompt and completion)"
        )
    shard_N = np.arange(N) // (N // shards)
    place = {k: np.full((steps, N), -1 if k == "micro" else 0, np.int32) for k in PLACE}
    count = np.zeros(steps, np.int32)
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
