"""Jitted sampling: one prefill, then one `lax.while_loop` of single-token decode steps.

The KV cache is preallocated for `bucket + max_new_tokens` slots and written in place; the loop
carries it, so XLA aliases the buffers and no step copies the cache. Prompts are left-padded
to the smallest length bucket that holds them, so a new prompt length inside a bucket reuses
the compiled program. Each sampled token comes with its logprob under the distribution it was
actually drawn from (after temperature, top-k and top-p): what importance-sampling corrections
against the sampler need.

Dimension letters: B prompts, G samples per prompt (`num_samples`), N = B * G rows, P padded
prompt length, M max new tokens, S cache slots, V vocab (Y, k: chunks of the vocab and ids
within a chunk, in `categorical`).
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlscale import sharding
from rlscale.model import decoder
from rlscale.model.config import ModelConfig


def think_budget_problems(
    think_budget: int, interrupt_tokens: int, max_new_tokens: int, prefix: str = ""
) -> list[str]:
    """The forced-interruption rule: the budget plus the written phrase must leave at least
    one token to answer in. `prefix` names the config section in the message."""
    if think_budget and think_budget + interrupt_tokens >= max_new_tokens:
        return [
            f"{prefix}think_budget={think_budget} leaves no room to answer within "
            f"{prefix}max_new_tokens={max_new_tokens} (after {interrupt_tokens} interruption "
            "token(s))"
        ]
    return []


MAX_ACTION_STOP = 8  # The longest action stop sequence (the engine compares this many tokens).


def action_stop_problems(action_stops) -> list[str]:
    """`SamplingConfig.action_stops` must be a tuple of tuples of 1 to `MAX_ACTION_STOP`
    non-negative integer ids (tuples: the config is hashed as a jit static argument)."""
    if not isinstance(action_stops, tuple):
        return [f"action_stops={action_stops!r} must be a tuple of token-id tuples"]
    problems = []
    for i, seq in enumerate(action_stops):
        where = f"action_stops[{i}]={seq!r}"
        if not isinstance(seq, tuple) or not 1 <= len(seq) <= MAX_ACTION_STOP:
            problems.append(f"{where} must be a tuple of 1 to {MAX_ACTION_STOP} token ids")
        elif not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in seq
        ):
            problems.append(f"{where} must hold non-negative integer token ids")
    return problems


PAGED_OFF = {"kv_block_size": "a dense cache row per slot", "kv_blocks": "derived"}


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings (a change recompiles; values inside them do not vary per call).

    Attributes:
      max_new_tokens: completion budget M.
      temperature: softmax temperature; 0 means greedy (argmax, logprob 0).
      top_k: keep the k most likely tokens; 0 keeps all.
      top_p: nucleus sampling, keep the smallest set with probability >= top_p; 1.0 keeps all.
      num_samples: completions per prompt; the prompt is prefilled once and its cache tiled.
      stop_tokens: ids that end a completion (EOS and any other stop token); the stop token is
        part of the completion.
      pad_id: id written after a completion ends and used to left-pad prompts.
      buckets: allowed padded prompt lengths, ascending.
      decode_phases: the decode loop runs in this many phases with a KV cache that grows
        between them (bucket + max_new_tokens * j / phases slots in phase j), so early steps
        attend over a shorter buffer. Each phase is a separately compiled loop and each growth
        copies the cache once; worth it for long generations.
      think_budget: forced interruption (ScaleRL, Khatri et al. 2025): a completion that has
        generated this many tokens without sampling one of `think_end_tokens` gets
        `interrupt_ids` written next (not sampled; flagged in `SampleOutput.forced`), then
        sampling resumes so the model can answer within the rest of `max_new_tokens`. 0: off.
      interrupt_ids: the end-of-thinking phrase's ids.
      think_end_tokens: ids that close the thinking; a row that samples one is never
        interrupted.
      action_stops: token-id sequences (each 1 to `MAX_ACTION_STOP` ids) that end a turn of a
        multi-turn episode in the generator engine: a sample whose tokens of the current turn
        end with one (its last token sampled, not forced) stops and waits for the
        environment's reply (`generator.Generator.step`). The static sampler ignores them.
      kv_block_size: the generator engine's KV cache in blocks of this many columns, shared
        by a request's samples where they hold its prompt (`sampling.paged`); 0: a dense row
        per slot. The static sampler ignores it (and `kv_blocks`).
      kv_blocks: the paged cache's pool of blocks (0: as many as dense rows would take).
      kv_preempt: the paged cache admits a request on the blocks its prompt takes, not its
        worst case, and a decode call that would run out preempts the latest-admitted samples
        (their blocks swapped to the host, brought back before any new request): more
        samples live in the same pool when completions are long-tailed (`Generator`).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    num_samples: int = 1
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0
    buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    decode_phases: int = 1
    think_budget: int = 0
    interrupt_ids: tuple[int, ...] = ()
    think_end_tokens: tuple[int, ...] = ()
    action_stops: tuple[tuple[int, ...], ...] = ()
    kv_block_size: int = 0
    kv_blocks: int = 0
    kv_preempt: bool = False

    def __post_init__(self):
        problems = action_stop_problems(self.action_stops)
        for name in ("kv_block_size", "kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                problems.append(f"{name}={value!r} must be an integer >= 0 (0: {PAGED_OFF[name]})")
        if not isinstance(self.kv_preempt, (bool, np.bool_)):
            problems.append(f"kv_preempt={self.kv_preempt!r} must be True or False")
        elif self.kv_preempt and not self.kv_block_size:
            problems.append("kv_preempt=True needs a paged cache (kv_block_size > 0)")
        elif self.kv_preempt and self.action_stops:
            problems.append(
                "kv_preempt=True with multi-turn episodes (action_stops): not built (a sample "
                "waiting for its environment holds its blocks); use kv_preempt=False"
            )
        if self.think_budget < 0:
            problems.append(f"think_budget={self.think_budget} must be >= 0 (0 disables it)")
        if self.think_budget and not (self.interrupt_ids and self.think_end_tokens):
            problems.append("think_budget > 0 needs interrupt_ids and think_end_tokens")
        problems += think_budget_problems(
            self.think_budget, len(self.interrupt_ids), self.max_new_tokens
        )
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if not 1 <= self.decode_phases <= self.max_new_tokens:
            problems.append(f"decode_phases={self.decode_phases} must be in [1, max_new_tokens]")
        if self.num_samples < 1:
            problems.append(f"num_samples={self.num_samples} must be >= 1")
        if (
            not self.buckets
            or list(self.buckets) != sorted(set(self.buckets))
            or self.buckets[0] < 1
        ):
            problems.append(f"buckets={self.buckets} must be positive and strictly ascending")
        if problems:
            raise ValueError("Invalid sampling config: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def bucket(self, length: int) -> int:
        """The padded length of a prompt of `length` tokens: the smallest bucket that holds it."""
        for b in self.buckets:
            if b >= length:
                return b
        raise ValueError(
            f"a prompt of {length} tokens is longer than the largest bucket "
            f"{self.buckets[-1]} (SamplingConfig.buckets={self.buckets})"
        )


class SampleOutput(NamedTuple):
    """What the sampler returns; rows are prompt-major (row = prompt * num_samples + sample).

    Attributes:
      tokens: [N, M] completion tokens, `pad_id` after the end.
      mask: [N, M] True on completion tokens (the stop token included).
      logprobs: [N, M] float32 logprob of each token under the transformed distribution it was
        sampled from; 0 where `mask` is False, and 0 for greedy decoding.
      lengths: [N] completion lengths.
      truncated: [N] True when the completion hit `max_new_tokens` without a stop token.
      forced: [N, M] True on tokens written by forced interruption rather than sampled
        (logprob 0; a learner masks them out of the loss).
      interrupted: [N] True when the completion was interrupted.
      prompt_index: [N] which prompt each row continues.
      prompt_BP, prompt_mask_BP: the prompts as the sampler padded them (host arrays).
      experts: [N, P + M, l, c] a mixture of experts' routing of each row's prompt (left-padded
        as `prompt_BP`) and completion tokens: the c experts each token went to in each of
        the l sparse layers, what router replay forces (`recorded`); None for a dense model.
    """

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    forced: jax.Array
    interrupted: jax.Array
    prompt_index: np.ndarray
    prompt_BP: np.ndarray | None = None
    prompt_mask_BP: np.ndarray | None = None
    experts: jax.Array | None = None


def transform_logits(logits, cfg: SamplingConfig):
    """Temperature, then top-k, then top-p (the usual order) on [..., V] logits; removed tokens
    get -inf.

    `jax.nn.log_softmax` of the result is the distribution `sample_tokens` draws from, so the
    trainer can recompute sampler logprobs exactly.
    """
    logits = logits.astype(jnp.float32)
    if cfg.greedy:
        return logits
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    neg_inf = jnp.finfo(jnp.float32).min
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg_inf, logits)
    if cfg.top_p < 1.0:
        sorted_desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Smallest kept logit: the last one whose preceding mass is still below top_p.
        keep = mass_before < cfg.top_p
        threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, neg_inf, logits)
    return logits


def _last_positive(x):
    """[rows, n] -> [rows]: the index of each row's last positive entry."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax((x > 0)[:, ::-1], axis=-1)


def categorical(u_N, probs_NV, chunk: int = 128):
    """Draws one index per row from unnormalized probabilities, by inverse CDF in two levels.

    One uniform per row (`u_N` in [0, 1)) picks a chunk of `chunk` ids from the chunks'
    cumulative mass, then an id inside it. Compared with `jax.random.categorical` (Gumbel noise
    for all N x V logits) this draws N random numbers instead of N x V and avoids a full-vocab
    cumsum, which XLA:CPU runs slowly. Ids with zero probability are never drawn: an id is
    chosen only where the cumulative sum strictly increases, and clamping to the last positive
    id guards the top edge against rounding.
    """
    N, V = probs_NV.shape
    Y = -(-V // chunk)
    p_NYk = jnp.pad(probs_NV, ((0, 0), (0, Y * chunk - V))).reshape(N, Y, chunk)
    mass_NY = jnp.sum(p_NYk, axis=-1)
    cum_NY = jnp.cumsum(mass_NY, axis=-1)
    u_N = u_N * cum_NY[:, -1]
    c_N = jnp.minimum(jnp.sum(cum_NY <= u_N[:, None], axis=-1), _last_positive(mass_NY))
    before_N = jnp.where(c_N > 0, jnp.take_along_axis(cum_NY, c_N[:, None] - 1, -1)[:, 0], 0.0)
    p_Nk = jnp.take_along_axis(p_NYk, c_N[:, None, None], axis=1)[:, 0]
    cum_Nk = jnp.cumsum(p_Nk, axis=-1)
    j_N = jnp.sum(cum_Nk <= (u_N - before_N)[:, None], axis=-1)
    j_N = jnp.minimum(j_N, _last_positive(p_Nk))
    return (c_N * chunk + j_N).astype(jnp.int32)


def row_uniforms(key_N, step_N):
    """One uniform per row from the row's own key and its token index: a completion's draws
    depend only on its key, not on the batch or slot it is decoded in."""
    return jax.vmap(lambda k, i: jax.random.uniform(jax.random.fold_in(k, i), ()))(key_N, step_N)


def row_keys(rng, num_prompts: int, num_samples: int):
    """[N] keys, row = prompt * num_samples + sample: fold_in(fold_in(rng, prompt), sample)."""
    b = jnp.repeat(jnp.arange(num_prompts), num_samples)
    g = jnp.tile(jnp.arange(num_samples), num_prompts)
    return jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(rng, i), j))(b, g)


def sample_tokens(logits_NV, u_N, cfg: SamplingConfig):
    """Draws one token per row with the rows' uniforms; returns (tokens [N], logprobs [N])."""
    if cfg.greedy:
        greedy_N = jnp.argmax(logits_NV, axis=-1).astype(jnp.int32)
        return greedy_N, jnp.zeros(logits_NV.shape[:1], jnp.float32)
    logits = transform_logits(logits_NV, cfg)
    # One exp pass serves both the draw and the logprob.
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(shifted)
    tokens = categorical(u_N, probs)
    log_z = jnp.log(jnp.sum(probs, axis=-1))
    logp = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - log_z
    return tokens, logp


class _Layout(NamedTuple):
    mesh: Mesh
    rules: sharding.Rules


def _constrain(tree, logical, layout):
    if layout is None:
        return tree
    return jax.lax.with_sharding_constraint(
        tree, sharding.tree_shardings(tree, logical, layout.mesh, layout.rules)
    )


def grow_cache(cache: decoder.KVCache, size: int) -> decoder.KVCache:
    """Copies the cache into a buffer of `size` slots (the new slots empty)."""
    extra = size - cache.valid_BS.shape[1]
    return cache._replace(
        k=tuple(jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, extra))) for k in cache.k),
        v=tuple(jnp.pad(v, ((0, 0), (0, 0), (0, extra), (0, 0))) for v in cache.v),
        valid_BS=jnp.pad(cache.valid_BS, ((0, 0), (0, extra))),
    )


def empty_rows(N: int, M: int, pad_id: int) -> dict:
    """The per-row decode state of N rows before their first token (see `decode_step`)."""
    return {
        "done_N": jnp.zeros((N,), bool),
        "thought_N": jnp.zeros((N,), bool),
        "interrupted_N": jnp.zeros((N,), bool),
        "length_N": jnp.zeros((N,), jnp.int32),
        "tokens_NM": jnp.full((N, M), pad_id, jnp.int32),
        "logprobs_NM": jnp.zeros((N, M), jnp.float32),
        "forced_NM": jnp.zeros((N, M), bool),
    }


def expert_ids_dtype(num_experts: int):
    """The dtype recorded expert ids are kept in: one byte each where they fit."""
    return jnp.uint8 if num_experts <= 256 else jnp.int32


def recorded(routing) -> jax.Array:
    """A mixture of experts' routing as the sampler and the engine record it (router replay):
    each token's experts [B, T, l, c] (`routing.expert_ids_lBTc` with the layers after the
    tokens), in `expert_ids_dtype`."""
    ids_BTlc = jnp.moveaxis(routing.expert_ids_lBTc, 0, 2)
    return ids_BTlc.astype(expert_ids_dtype(routing.counts_le.shape[-1]))


def decode_step(graphdef, params, c: dict, key_N, live_N, cfg: SamplingConfig) -> dict:
    """One token for every live row: the decode step of both the static sampler and the
    generator engine.

    `c` holds `logits_NV` (the next token's logits), `cache`, `pos_N` (the next token's
    position) and the per-row state of `empty_rows`. Row n draws its token from
    `logits_NV[n]` with `row_uniforms(key_N, length_N)`, writes it at column `length_N[n]`,
    and runs it through the model (cache slot `cache.index_B[n]`) for the next logits. Rows
    that are not live write nothing to the completion and do not advance; what they write to
    the cache is the caller's (the static sampler's rows keep one shared index, the engine
    points a row that is not live past the cache's end). A mixture of experts also returns
    `experts_Nlc`, the experts each row's token went to (`recorded`), for the caller to keep.
    """
    i_N = c["length_N"]
    token_N, logp_N = sample_tokens(c["logits_NV"], row_uniforms(key_N, i_N), cfg)
    interrupted_N, forced_N = c["interrupted_N"], jnp.zeros_like(live_N)
    budget, L = cfg.think_budget, len(cfg.interrupt_ids)
    if budget:  # Forced interruption: rows still thinking at the budget get the phrase.
        phrase = jnp.asarray(cfg.interrupt_ids, jnp.int32)
        interrupted_N = interrupted_N | ((i_N == budget) & live_N & ~c["thought_N"])
        forced_N = interrupted_N & (i_N >= budget) & (i_N < budget + L) & live_N
        token_N = jnp.where(forced_N, phrase[jnp.clip(i_N - budget, 0, L - 1)], token_N)
        logp_N = jnp.where(forced_N, 0.0, logp_N)
    token_N = jnp.where(live_N, token_N, cfg.pad_id)
    logp_N = jnp.where(live_N, logp_N, 0.0)
    h_N1D, cache, routing = decoder.routed_hidden(
        graphdef, params, token_N[:, None], c["pos_N"][:, None], live_N[:, None], c["cache"]
    )
    logits_N1V = decoder.logits(graphdef, params, h_N1D)
    stop = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)
    think_end = jnp.asarray(cfg.think_end_tokens or (-1,), jnp.int32)
    rows = jnp.arange(token_N.shape[0])

    def put(buf_NM, x_N):  # Column i_N of live rows; others (and i_N = M) write nothing.
        return buf_NM.at[rows, jnp.where(live_N, i_N, buf_NM.shape[1])].set(x_N, mode="drop")

    routed = {} if routing is None else {"experts_Nlc": recorded(routing)[:, 0]}
    return {
        **c,
        **routed,  # A mixture of experts: the experts each row's token went to (not carried).
        "logits_NV": logits_N1V[:, 0],
        "cache": cache,
        "pos_N": c["pos_N"] + live_N,
        # A forced phrase never ends a completion, even if it holds a stop token.
        "done_N": c["done_N"] | (jnp.isin(token_N, stop) & ~forced_N & live_N),
        "thought_N": c["thought_N"] | (jnp.isin(token_N, think_end) & live_N),
        "interrupted_N": interrupted_N,
        "length_N": i_N + live_N,
        "tokens_NM": put(c["tokens_NM"], token_N),
        "logprobs_NM": put(c["logprobs_NM"], logp_N),
        "forced_NM": put(c["forced_NM"], forced_N),
    }


@functools.partial(jax.jit, static_argnames=("graphdef", "model_cfg", "cfg", "layout"))
def generate(
    params,
    tokens_BP,
    mask_BP,
    rng,
    *,
    graphdef,
    model_cfg: ModelConfig,
    cfg: SamplingConfig,
    layout: _Layout | None = None,
):
    """The jitted sampler on left-padded prompts; see `Sampler` for the checked entry point.

    Row (prompt b, sample g) draws with key fold_in(fold_in(rng, b), g) (`row_keys`), so it
    samples the same completion as the generator engine given that request key.
    """
    B, P = tokens_BP.shape
    M, n = cfg.max_new_tokens, cfg.num_samples
    cache_axes = decoder.cache_logical_axes(model_cfg)

    # Cache size of each decode phase; step i writes slot P + i.
    sizes = [P + -(-M * (j + 1) // cfg.decode_phases) for j in range(cfg.decode_phases)]

    # Prefill once per prompt; only the last position's logits are needed.
    cache = _constrain(decoder.init_cache(model_cfg, B, sizes[0]), cache_axes, layout)
    positions_BP = decoder.positions_from_mask(mask_BP)
    h, cache, routing = decoder.routed_hidden(
        graphdef, params, tokens_BP, positions_BP, mask_BP, cache
    )
    logits_BV = decoder.logits(graphdef, params, h[:, -1:])[:, 0]
    pos_B = positions_BP[:, -1] + 1

    # n samples per prompt share the prefill: tile the cache along the batch.
    tile = functools.partial(jnp.repeat, repeats=n, axis=0)
    if n > 1:
        cache = decoder.KVCache(*jax.tree.map(tile, tuple(cache)))
        logits_BV, pos_B = tile(logits_BV), tile(pos_B)
    cache = _constrain(cache, cache_axes, layout)
    key_N = row_keys(rng, B, n)

    def cond(carry, end):
        return (carry["i"] < end) & ~jnp.all(carry["done_N"])

    def body(c):
        d = decode_step(graphdef, params, c, key_N, ~c["done_N"], cfg)
        if routing is not None:  # The sampled token's experts at its column.
            col_N = jnp.where(~c["done_N"], c["length_N"], M)
            at = (jnp.arange(B * n), col_N)
            d["experts_NMlc"] = c["experts_NMlc"].at[at].set(d.pop("experts_Nlc"), mode="drop")
        return {**d, "i": c["i"] + 1}

    carry = {
        "i": jnp.zeros((), jnp.int32),
        "logits_NV": logits_BV,
        "cache": cache,
        "pos_N": pos_B,
        **empty_rows(B * n, M, cfg.pad_id),
    }
    if routing is not None:  # A mixture of experts: the prompt's experts, then each token's.
        prompt_NPlc = tile(recorded(routing))
        carry["experts_NMlc"] = jnp.zeros((B * n, M, *prompt_NPlc.shape[2:]), prompt_NPlc.dtype)
    for j, size in enumerate(sizes):
        if j:
            carry["cache"] = _constrain(grow_cache(carry["cache"], size), cache_axes, layout)
        carry = jax.lax.while_loop(functools.partial(cond, end=size - P), body, carry)
    length_N = carry["length_N"]
    mask_NM = jnp.arange(M)[None, :] < length_N[:, None]
    return (
        carry["tokens_NM"],
        mask_NM,
        carry["logprobs_NM"],
        length_N,
        ~carry["done_N"],
        carry["forced_NM"],
        carry["interrupted_N"],
        None if routing is None else jnp.concatenate([prompt_NPlc, carry["experts_NMlc"]], 1),
    )


class Sampler:
    """Checks and pads prompts on the host, then calls the jitted `generate`.

    Every bad input fails here, before anything is compiled.
    """

    def __init__(
        self,
        graphdef,
        model_cfg: ModelConfig,
        mesh: Mesh | None = None,
        rules: sharding.Rules = sharding.SAMPLE_RULES,
        programs=None,
    ):
        self.graphdef = graphdef
        self.model_cfg = model_cfg
        self.layout = None if mesh is None else _Layout(mesh, rules)
        self.programs = programs  # A `programs.Programs` recording the compiled sampler.

    def prepare(self, prompts: Sequence[Sequence[int]], cfg: SamplingConfig):
        """Validates prompts and left-pads them to their bucket: (tokens_BP, mask_BP) NumPy."""
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        V = self.model_cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            bad = [t for t in p if not 0 <= int(t) < V]
            if bad:
                raise ValueError(f"prompt {i} has token id(s) {bad[:5]} outside [0, {V})")
        longest = max(len(p) for p in prompts)
        if longest > cfg.buckets[-1]:
            i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
            raise ValueError(
                f"prompt {i} has {longest} tokens, longer than the largest bucket "
                f"{cfg.buckets[-1]} (SamplingConfig.buckets={cfg.buckets})"
            )
        P = cfg.bucket(longest)
        if P + cfg.max_new_tokens > self.model_cfg.max_seq_len:
            raise ValueError(
                f"max_new_tokens={cfg.max_new_tokens} does not fit the KV cache: prompt bucket "
                f"{P} + {cfg.max_new_tokens} = {P + cfg.max_new_tokens} slots > the model's "
                f"max_seq_len={self.model_cfg.max_seq_len}"
            )
        if self.layout is not None:
            div = sharding.batch_divisor(self.layout.mesh, self.layout.rules)
            if len(prompts) % div:
                raise ValueError(
                    f"batch of {len(prompts)} prompts does not divide the mesh's batch axes "
                    f"({dict(self.layout.mesh.shape)}: batch split {div} ways); use a multiple "
                    f"of {div}"
                )
        tokens = np.full((len(prompts), P), cfg.pad_id, np.int32)
        mask = np.zeros((len(prompts), P), bool)
        for i, p in enumerate(prompts):
            tokens[i, P - len(p) :] = p
            mask[i, P - len(p) :] = True
        return tokens, mask

    def __call__(
        self, params, prompts: Sequence[Sequence[int]], rng, cfg: SamplingConfig
    ) -> SampleOutput:
        prompt_BP, prompt_mask_BP = self.prepare(prompts, cfg)
        tokens, mask = prompt_BP, prompt_mask_BP
        if self.layout is not None:
            tokens, mask = sharding.put_batch((tokens, mask), self.layout.mesh, self.layout.rules)
        static = dict(graphdef=self.graphdef, model_cfg=self.model_cfg, cfg=cfg, layout=self.layout)
        if self.programs is not None:
            out = self.programs.run("sampler", generate, (params, tokens, mask, rng), static)
        else:
            out = generate(params, tokens, mask, rng, **static)
        prompt_index = np.repeat(np.arange(len(prompts)), cfg.num_samples)
        return SampleOutput(*out[:7], prompt_index, prompt_BP, prompt_mask_BP, experts=out[7])
