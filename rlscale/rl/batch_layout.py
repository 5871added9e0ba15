"""How a batch's rows are laid out for the forward passes of the learner, its reference and a
distillation teacher, decided on the host: the length its completions are trimmed to (one of
`learner.length_buckets`), and where each sequence goes in the packed forward rows (`pack`;
the device builds them, `forward.packed_micro`). There is one layout: packing. With
`learner.pack_length` = 0 each forward row holds one sequence and is the batch's P + M tokens
long; otherwise sequences are packed first-fit into rows of `pack_length` tokens. With
`learner.shared_prefix` a group's samples share their prompt: a row holds it once, then each
sample's own tokens (`pack`; docs/learner.md#shared-prefix).

Dimension letters: N rows, P padded prompt length, M completion length (the batch's bucket), L
the tokens of a batch row as the device receives it (its prompt re-padded), O optimizer steps
per batch, T tokens per forward row, d batch shards.
"""

from typing import NamedTuple

import numpy as np


class Layout(NamedTuple):
    """The `learner.*` settings that lay a batch out in forward rows, and what they depend on.

    Attributes:
      pack_length: tokens per forward row (0: the batch's P + M, one sequence per row).
      pack_rows: forward rows per batch shard in a micro-batch (0: `group_size` rows with a
        `pack_length`; else a minibatch's rows per batch shard, at least a group's). Below
        `group_size` a micro-batch may hold part of a group (`split_groups`).
      group_size: samples per prompt.
      minibatches: optimizer steps per epoch.
      max_len: the completion budget (`sampling.max_new_tokens`).
      length_buckets: how many lengths completions are trimmed to (1: always `max_len`).
      shared_prefix: a group's prompt once per packed row, before its samples' own tokens
        (needs a `pack_length`).
    """

    pack_length: int
    pack_rows: int
    group_size: int
    minibatches: int
    max_len: int
    length_buckets: int
    shared_prefix: bool = False

    @property
    def split_groups(self) -> bool:
        """Whether a micro-batch may hold part of a group: `pack_rows` is set below
        `group_size`, so a group of full-length samples need not fit one. At or above it (or
        derived) a group's samples always fit a micro-batch's rows, and each micro-batch holds
        whole groups; below it `pack` splits a group that fits none, and the learner gives
        the aggregation each row's group token count over the optimizer step
        (`group_terms`), which keeps `prompt_mean` additive over any split."""
        return 0 < self.pack_rows < self.group_size

    def rows(self, num_rows: int, prompt_len: int, M: int, shards: int) -> tuple[int, int]:
        """(T, c): tokens per forward row and forward rows per batch shard in a micro-batch,
        for a batch of `num_rows` rows with `prompt_len`-token prompts and completions
        trimmed to M tokens."""
        if self.pack_length:
            return self.pack_length, self.pack_rows or self.group_size
        step = num_rows // self.minibatches  # A minibatch's rows, whole on a balanced batch.
        group = min(self.group_size, num_rows // shards)  # A group's rows on one shard.
        return prompt_len + M, self.pack_rows or max(-(-step // shards), group)


class Plan(NamedTuple):
    """A batch's forward layout (`plan`)."""

    M: int  # The completions' trimmed length.
    T: int  # Tokens per forward row.
    pack_rows: int  # Forward rows per batch shard in a micro-batch.
    tokens_NL: np.ndarray  # The batch rows, prompts re-padded to L - M tokens.
    attn_NL: np.ndarray
    place: dict  # `pack`'s [O, N] arrays.
    count: np.ndarray  # [O] micro-batches per optimizer step.
    padding_frac: float  # The share of the forward rows' tokens that are padding.
    experts_NLlc: np.ndarray | None = None  # A MoE's recorded routing, re-padded as `tokens_NL`.


def plan(rollouts, step_rows, layout: Layout, *, shards: int, placed_N) -> Plan:
    """The forward layout of one batch on the host: its completions trimmed to their length
    bucket, its rows with their prompts re-padded (left-padded or cut to `pack_length` - 1
    tokens, which hold any packed sequence's, so that the program's shapes do not depend on
    the prompt bucket; with derived rows, kept at P), and where the sequences of the rows
    `placed_N` go in each optimizer step's micro-batches (`pack`).

    Args:
      rollouts: the batch (`rollouts.Rollouts`), N rows.
      step_rows: [O, rows per step] int, each optimizer step's rows (whole groups).
      layout: the `learner.*` settings.
      shards: the batch's shard count (`sharding.batch_divisor`).
      placed_N: [N] bool, the rows whose sequences are run (the others get no terms).
    """
    P = rollouts.prompt_len
    M = trimmed_length(rollouts, layout.max_len, layout.length_buckets)
    N = len(rollouts.mask_NM)
    T, c = layout.rows(N, P, M, shards)
    width = T - 1 if layout.pack_length else P
    keep = min(P, width)
    tokens = np.zeros((N, width + M), np.int32)
    attn = np.zeros((N, width + M), bool)
    tokens[:, width - keep :] = rollouts.tokens_NL[:, P - keep : P + M]
    attn[:, width - keep :] = rollouts.attn_mask_NL[:, P - keep : P + M]
    experts = getattr(rollouts, "experts_NLlc", None)  # Any batch with the Rollouts fields.
    if experts is not None:  # Each token's recorded experts go where the token goes.
        ids = experts
        experts = np.zeros((N, width + M, *ids.shape[2:]), ids.dtype)
        experts[:, width - keep :] = ids[:, P - keep : P + M]
    length_N = rollouts.attn_mask_NL[:, : P + M].astype(bool).sum(1)
    prefix_N = None
    if layout.shared_prefix:
        prefix_N = shared_lengths(rollouts.tokens_NL[:, :P], rollouts.attn_mask_NL[:, :P], layout)
    place, count = pack(
        length_N,
        np.asarray(placed_N, bool),
        step_rows,
        pack_length=T,
        pack_rows=c,
        shards=shards,
        group_size=layout.group_size,
        one_per_row=not layout.pack_length,
        prefix_N=prefix_N,
        split=layout.split_groups,
    )
    run = int(count.sum()) * c * shards * T
    written_ON = np.broadcast_to(length_N, place["micro"].shape)
    if prefix_N is not None:  # A sample that does not lead its row's prefix writes less.
        led_ON = place["lead"] == np.arange(N)
        written_ON = np.where(led_ON, written_ON, written_ON - place["shared"])
    placed = np.where(place["micro"] >= 0, written_ON, 0).sum()
    return Plan(M, T, c, tokens, attn, place, count, 1.0 - placed / max(run, 1), experts)


def shared_lengths(prompt_NP, attn_NP, layout: Layout) -> np.ndarray:
    """[N] int: how many leading tokens each row shares with its group's other rows in a
    packed row (`pack`'s `prefix_N`): its prompt but the last token, where every row of the
    group holds the same prompt (else 0: the group is packed as without `shared_prefix`).

    The prompt's last token stays each sample's own (a copy per sample): the position that
    predicts a sample's first completion token is then its own, so every packed position has
    one target and the gathers of the plain layout serve unchanged, for one token per sample.
    """
    G, N = layout.group_size, len(prompt_NP)
    if N % G:  # Not whole groups (none of the learner's batches): nothing shared.
        return np.zeros(N, np.int32)
    prompt_BGP = np.where(attn_NP, prompt_NP, -1).reshape(-1, G, prompt_NP.shape[1])
    same_B = (prompt_BGP == prompt_BGP[:, :1]).all(axis=(1, 2))
    prompt_N = attn_NP.astype(bool).sum(1)
    return np.where(np.repeat(same_B, G), np.maximum(prompt_N - 1, 0), 0).astype(np.int32)


def forward_tokens(rollouts, layout: Layout) -> int:
    """The tokens of a batch's sequences as the learner's forward rows hold them (what its
    FLOPs count: `report.Compute`): every row's prompt and completion tokens, less, with
    `shared_prefix`, the prefix each group's later samples share with its first
    (`shared_lengths`): a group's prompt once, as a row that holds the whole group holds it
    (a group split over rows writes it once per row)."""
    P = rollouts.prompt_len
    total = int(rollouts.attn_mask_NL.sum())
    if not layout.shared_prefix:
        return total
    prefix_N = shared_lengths(rollouts.tokens_NL[:, :P], rollouts.attn_mask_NL[:, :P], layout)
    later_N = np.arange(len(prefix_N)) % layout.group_size > 0
    return total - int(prefix_N[later_N].sum())


def length_bucket(length: int, max_len: int, buckets: int) -> int:
    """The smallest of `buckets` evenly spaced lengths (max_len / buckets, ..., max_len)
    that holds `length`: what a batch's completions are trimmed to."""
    step = -(-max_len // buckets)
    return min(max_len, max(step, -(-length // step) * step))


def trimmed_length(rollouts, max_len: int, buckets: int) -> int:
    """The length a batch's completions are trimmed to: its longest, rounded up to a bucket."""
    completion_N = rollouts.attn_mask_NL[:, rollouts.prompt_len :].sum(1)
    return length_bucket(int(completion_N.max(initial=1)), max_len, buckets)


def pack(
    length_N,
    placed_N,
    step_rows,
    *,
    pack_length: int,
    pack_rows: int,
    shards: int,
    group_size: int,
    one_per_row: bool = False,
    prefix_N=None,
    split: bool = False,
):
    """Where each placed sequence goes in the packed micro-batches of each optimizer step,
    on the host (`forward.packed_micro` builds the rows on the device).

    A sequence is its prompt without padding, then its completion. It stays on the batch
    shard that holds its row, and goes first-fit into one of that shard's `pack_rows` rows of
    `pack_length` tokens in its micro-batch (with `one_per_row`, into a row of its own). Each
    step's groups with placed sequences are taken largest first, each into the first
    micro-batch with room for all its sequences: a group's samples share a micro-batch, as an
    aggregation over a prompt's samples needs. With `split`, a group that fits no micro-batch,
    not even an empty one, is split: its sequences go (longest first) into the first
    micro-batches with room for them, as many into each as fit, new ones last. A step runs as
    many micro-batches as its sequences fill, from one compiled program.

    Shared prefixes (`prefix_N`): a sample's first `prefix_N` tokens are its group's, written
    once per packed row by the first of the group's samples there (its lead), the others
    writing only their own tokens after them; a sample goes first into a row that already
    holds its group's prefix, else first-fit into a row with room for its whole sequence,
    where it leads. A group longer than a row is thus split over rows, its prompt once in
    each: it falls back towards one sequence per prefix instead of being refused, so any
    batch the plain layout packs packs here too (a row still needs room for one sequence).

    Args:
      length_N: [N] int, each row's sequence length (prompt and completion tokens).
      placed_N: [N] bool, the rows to place (the learner's: those with trained tokens).
      step_rows: [O, rows per step] int, each optimizer step's rows (whole groups).
      pack_length, pack_rows: tokens per row and rows per batch shard (`Layout.rows`).
      shards: the batch's shard count (`sharding.batch_divisor`).
      group_size: samples per prompt (rows g * G ... g * G + G - 1 are group g).
      one_per_row: each sequence in a row of its own.
      prefix_N: [N] int, the leading tokens each row shares with its group (`shared_lengths`);
        None: none shared.
      split: split a group that no micro-batch can hold (`Layout.split_groups`); else that
        is an error.

    Returns:
      (place, count): `place` holds [O, N] int32 arrays: `micro`, row r's micro-batch in step
      s (-1: not placed in it); `row`, its packed row within its shard's rows; `offset`, the
      packed row's position of its first own token; with `prefix_N`, also `prefix`, the
      position of the first token of its group's prefix in that row, `lead`, the row (of the
      batch) that writes that prefix, and `shared`, `prefix_N`. `count`: [O] int32,
      micro-batches per step.
    """
    T, c, G = pack_length, pack_rows, group_size
    N, steps = len(length_N), len(step_rows)  # O optimizer steps.
    _check_pack(length_N[placed_N], T, one_per_row and prefix_N is not None)
    shard_N = np.arange(N) // (N // shards)
    keys = PLACE if prefix_N is None else PLACE + SHARED_PLACE
    place = {k: np.full((steps, N), -1 if k == "micro" else 0, np.int32) for k in keys}
    if prefix_N is not None:  # Unplaced rows lead themselves and share nothing.
        place["lead"][:] = np.arange(N)
    count = np.zeros(steps, np.int32)
    fit = _Fit(length_N, shard_N, T, c, one_per_row, prefix_N, split)
    for s, rows in enumerate(step_rows):
        groups = [[r for r in rows[i : i + G] if placed_N[r]] for i in range(0, len(rows), G)]
        groups = sorted((g for g in groups if g), key=lambda g: -sum(length_N[g]))
        rooms = []  # Per micro-batch, per shard: the room left in each of its packed rows.
        for group in groups:
            seqs = sorted(group, key=lambda r: -length_N[r])
            for u, r, spot in fit.group(rooms, seqs, shards):
                place["micro"][s, r] = u
                for k, v in zip(keys[1:], spot):
                    place[k][s, r] = v
        count[s] = len(rooms)
    return place, count


def _check_pack(lengths, T: int, shared_one_per_row: bool):
    """ValueError naming the key: a trained sequence (of `lengths`) longer than the rows, or
    shared prefixes without packed rows."""
    longest = lengths.max(initial=0)
    if longest > T:
        raise ValueError(
            f"learner.pack_length={T} is shorter than a trained sequence of the batch "
            f"({int(longest)} tokens: prompt and completion)"
        )
    if shared_one_per_row:
        raise ValueError("learner.shared_prefix=True needs learner.pack_length > 0")


PLACE = ("micro", "row", "offset")
SHARED_PLACE = ("prefix", "lead", "shared")  # With shared prefixes (`pack`'s `prefix_N`).


class _Fit(NamedTuple):
    """First-fit of sequences (lengths `length_N`, on shards `shard_N`) into micro-batches of
    `c` rows of T tokens per shard; with `one_per_row`, a row holds one sequence; with
    `prefix_N`, a group's samples share their first `prefix_N` tokens within a row; with
    `split`, a group no micro-batch holds is split over several."""

    length_N: np.ndarray
    shard_N: np.ndarray
    T: int
    c: int
    one_per_row: bool
    prefix_N: np.ndarray | None = None
    split: bool = False

    def group(self, rooms, seqs, shards):
        """[(micro-batch, sequence, its spot: (row, offset), and with `prefix_N` (prefix,
        lead, shared))] for a group's sequences `seqs`: the first micro-batch of `rooms` they
        all fit in, else a new one (appended to `rooms`); with `split`, a group that fits
        not even an empty one goes, as many sequences at a time as fit, into the first
        micro-batches with room, then new ones."""
        for u, micro in enumerate(rooms):
            fits = self.first_fit(micro, seqs)
            if fits is not None:
                return [(u, r, spot) for r, spot in zip(seqs, fits)]
        micro = [[] for _ in range(shards)]
        fits = self.first_fit(micro, seqs)
        if fits is not None:
            rooms.append(micro)
            return [(len(rooms) - 1, r, spot) for r, spot in zip(seqs, fits)]
        if not self.split:
            raise ValueError(
                f"learner.pack_rows={self.c} rows of {self.T} tokens per batch shard cannot "
                f"hold one group's sequences (lengths {[int(self.length_N[r]) for r in seqs]}): "
                "raise learner.pack_rows"
            )
        out, left, u = [], list(seqs), 0
        while left:  # Each new micro-batch takes at least one: a sequence fits an empty row.
            if u == len(rooms):
                rooms.append([[] for _ in range(shards)])
            fits = self.first_fit(rooms[u], left, some=True)
            out += [(u, r, spot) for r, spot in zip(left, fits) if spot is not None]
            left = [r for r, spot in zip(left, fits) if spot is None]
            u += 1
        return out

    def first_fit(self, rooms, seqs, some: bool = False):
        """Places `seqs` first-fit into a micro-batch's packed rows (`rooms[shard]`: room left
        per row; at most `c` rows per shard), updating `rooms`; their spots, or None (and
        `rooms` unchanged) if one does not fit. With `some`, those that fit are placed and
        the others' spots are None."""
        trial = [list(r) for r in rooms]
        heads = {}  # (shard, row) -> (prefix position, lead) of this group's prefix there.
        out = []
        for r in seqs:
            d, n = self.shard_N[r], self.length_N[r]
            shard = trial[d]
            shared = 0 if self.prefix_N is None else int(self.prefix_N[r])
            own = (i for i, room in enumerate(shard) if (d, i) in heads and room >= n - shared)
            row = next(own, None)  # Never without a prefix: `heads` stays empty.
            if row is not None:  # Behind the group's prefix already in this row.
                head, lead = heads[d, row]
                out.append((row, self.T - shard[row], head, lead, shared))
                shard[row] -= n - shared
                continue
            row = next((i for i, room in enumerate(shard) if room >= n), None)
            if row is None:
                if len(shard) == self.c and not some:
                    return None
                if len(shard) == self.c:
                    out.append(None)
                    continue
                shard.append(self.T)
                row = len(shard) - 1
            head = self.T - shard[row]
            if self.prefix_N is None:
                out.append((row, head))
            else:  # It leads: the prefix (if any), then its own tokens.
                if shared:
                    heads[d, row] = (head, r)
                out.append((row, head + shared, head, r, shared))
            shard[row] = 0 if self.one_per_row else shard[row] - n
        rooms[:] = trial
        return out
