"""Multi-turn generation in the engine: samples stop at action stops and wait (their slots
decode nothing while the others go on), checked against the static sampler, which ignores
action stops; the environment's replies go into the slots' caches, and every policy token's
logprob is then checked against one forward pass over the whole trajectory."""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import completed_arrays, rounding

from rlscale import model, sharding
from rlscale.sampling import Sampler, SamplingConfig, engine, transform_logits
from rlscale.sampling.generator import Generator, Request

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]
BASE = SamplingConfig(max_new_tokens=24, num_samples=2, top_k=40, buckets=(8, 16))
RNG = jax.random.key(3)
QUIET = 7  # The static row (prompt 3, sample 1) whose tokens hold no action stop.


@pytest.fixture(scope="module")
def policy():
    cfg = model.get("tiny")
    graphdef, _ = model.abstract_model(cfg)
    return cfg, graphdef, model.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def static(policy):
    """The static sampler's completions with the engine's keys, and action stops the model
    emits often: the six tokens most frequent outside row `QUIET` and absent from it, and a
    pair of tokens another row samples before any of those (so a turn ends on a pair)."""
    cfg, graphdef, params = policy
    tokens = np.asarray(Sampler(graphdef, cfg)(params, PROMPTS, RNG, BASE).tokens)
    quiet = set(tokens[QUIET].tolist())
    counts = collections.Counter(t for row in np.delete(tokens, QUIET, 0) for t in row.tolist())
    singles = [t for t, _ in counts.most_common() if t not in quiet][:6]
    pairs = [
        (int(row[i]), int(row[i + 1]))
        for row in tokens
        for i in range(len(row) - 1)
        if not set(row[: i + 2].tolist()) & set(singles) and row[i + 1] not in quiet
    ]
    stops = tuple((t,) for t in singles) + (pairs[0],)
    return tokens, dataclasses.replace(BASE, action_stops=stops)


def _first_stop(row, stops):
    """Where the first action stop in `row` ends (its length up to there), or None."""
    for n in range(1, len(row) + 1):
        if any(tuple(row[max(n - len(s), 0) : n]) == s for s in stops):
            return n
    return None


def _generator(policy, scfg, slots, shape, parked=0):
    cfg, graphdef, params = policy
    mesh = None if shape is None else sharding.make_mesh(shape)
    gen = Generator(graphdef, cfg, scfg, slots=slots, max_prompt_len=16, mesh=mesh, parked=parked)
    if mesh is not None:
        params = sharding.reshard(
            params, sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES)
        )
    gen.set_params(params, 0)
    return gen


def _requests(prompts=PROMPTS):
    return [Request(i, p, jax.random.fold_in(RNG, i)) for i, p in enumerate(prompts)]


@pytest.mark.slow
@pytest.mark.parametrize("shape", [None, (2, 1, 1)])
def test_samples_wait_at_action_stops(policy, static, shape):
    """A sample whose static completion holds an action stop samples it up to the first one
    (a pair included) and then waits (not finished, decoding nothing) while the others decode
    on: a sample without one (`QUIET` at least) samples its whole static completion. Each
    wait is reported once."""
    tokens, scfg = static
    gen = _generator(policy, scfg, slots=8, shape=shape)
    gen.submit(_requests())
    turns, slot = [], None
    G, M = scfg.num_samples, scfg.max_new_tokens
    for _ in range(40):
        stepped = gen.step(3)
        assert not stepped.completed  # Every request has a sample that waits.
        turns += stepped.waiting
        slot = slot or {r.id * G + g: s for s, (r, g) in gen.running.items()}  # All admitted.
        if not engine.live(gen.state).any():
            break
    by_row = {t.request.id * G + t.sample: t for t in turns}
    assert len(by_row) == len(turns) and len({t.handle for t in turns}) == len(turns)
    state = sharding.fetch(gen.state._replace(key_S=None))
    finished = sharding.fetch(engine.finished(gen.state))
    ends = set()
    for row in range(len(tokens)):
        n, s = _first_stop(tokens[row].tolist(), scfg.action_stops), slot[row]
        assert state.rows["length_N"][s] == (M if n is None else n)  # Waiting: stood still.
        assert state.waiting_S[s] == (n is not None) and finished[s] == (n is None)
        np.testing.assert_array_equal(state.rows["tokens_NM"][s, : n or M], tokens[row, : n or M])
        if n is not None:
            np.testing.assert_array_equal(by_row[row].tokens, tokens[row, :n])
            ends.add(tuple(tokens[row, n - 2 : n].tolist()))
    assert len(turns) == state.waiting_S.sum() >= len(tokens) // 2 and QUIET not in by_row
    assert scfg.action_stops[-1] in ends  # A turn ended on the pair.
    assert not gen.step(3).waiting  # Reported once.


def _episodes(gen, limit=200):
    """Every request to completion, the environment replying to each turn as `step` reports
    it: reply k of the run has 1 + 5k mod 11 tokens, but reply 2 has 40, more than any
    turn's room (its sample finishes, its budget spent); the episode of request 1's sample 0
    ends after its first turn. Returns the completed requests in id order, each sample's log
    of turns and replies as appended, and the sample whose reply overflowed."""
    gen.submit(_requests())
    done, log, k, overflow = [], collections.defaultdict(list), 0, None
    for _ in range(limit):
        if not gen.busy:
            break
        stepped = gen.step(3)
        done += stepped.completed
        for turn in stepped.waiting:
            key = (turn.request.id, turn.sample)
            log[key].append(turn.tokens.tolist())
            if key == (1, 0):
                gen.reply(turn.handle, end=True)
                continue
            n = 40 if k == 2 else 1 + 5 * k % 11
            overflow = key if k == 2 else overflow
            reply = [4 + (7 * k + i) % 250 for i in range(n)]
            gen.reply(turn.handle, reply)
            log[key].append(reply[: turn.room])
            k += 1
    assert not gen.busy
    return sorted(done, key=lambda c: c.request.id), log, overflow


@functools.partial(jax.jit, static_argnames=("graphdef", "scfg", "P"))
def _reference_logprobs(graphdef, params, seq, mask, scfg, P):
    """Each completion token's logprob under the sampling transform, and the magnitude its
    rounding scales with (|z| + |logsumexp(z)|), from one forward pass over the whole
    left-padded rows (prompt `P` tokens, then the completion's). One program, not one per
    op: the reference is the same arithmetic, compiled once per shape."""
    logits, _ = model.forward(graphdef, params, seq, model.positions_from_mask(mask), mask)
    z = transform_logits(logits[:, P - 1 : -1], scfg)
    lse = jax.nn.logsumexp(z, axis=-1)
    z_tok = jnp.take_along_axis(z, seq[:, P:, None], axis=-1)[..., 0]
    return z_tok - lse, jnp.abs(z_tok) + jnp.abs(lse)


def _trajectory_logprobs(policy, done, scfg):
    """`_reference_logprobs` of every completion in `done`: each left-padded prompt and its
    whole completion (policy and environment tokens)."""
    cfg, graphdef, params = policy
    P = max(map(len, PROMPTS))
    prompts = [PROMPTS[c.request.id % len(PROMPTS)] for c in done]  # Prompts may repeat.
    prompts = [[0] * (P - len(p)) + p for p in prompts]
    prompts = np.repeat(np.asarray(prompts, np.int32), scfg.num_samples, axis=0)
    seq = np.concatenate([prompts, np.concatenate([c.tokens_GM for c in done])], axis=1)
    mask = np.concatenate([prompts > 0, np.concatenate([c.mask_GM for c in done])], axis=1)
    full, scale = _reference_logprobs(graphdef, params, seq, mask, scfg, P)
    return np.asarray(full), np.asarray(scale)


def _check_trajectory_logprobs(policy, done, scfg):
    """Every environment token has logprob 0 and version -1, and every policy token the
    logprob of one forward pass over prompt, turns and replies, under the sampling
    transform."""
    cat = completed_arrays(done)
    env, policy_tokens = cat["env_GM"], cat["mask_GM"] & ~cat["env_GM"]
    assert np.all(cat["logprobs_GM"][env] == 0) and np.all(cat["versions_GM"][env] == -1)
    # Each logprob is z - logsumexp(z) of float32 results that sums of about 1,300 terms
    # compute (per layer about 500: norms, projections and the MLP over 64 and 128,
    # attention over at most 40 columns; then the head over 64 and a logsumexp over 256),
    # added in another order by the engine (cache rows, its batches) and the forward pass:
    # each moves by `rounding(2^11)` of its magnitude.
    full, scale = _trajectory_logprobs(policy, done, scfg)
    err = np.abs(cat["logprobs_GM"] - full)[policy_tokens]
    assert np.all(err <= rounding(2**11) * scale[policy_tokens]), err.max()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [pytest.param(None, marks=pytest.mark.isa_sensitive), (2, 1, 1)])
def test_multi_turn_logprobs_are_the_trajectorys(policy, static, shape, count_compiles):
    """Samples with different numbers of turns, replies of 1 to 11 tokens (buckets 8 and 16)
    and one of 40 (cut to the sample's room, in two pieces), an episode the environment
    ends, a sample that never stops, fewer slots than samples. Each completion is its turns
    and replies as they were reported and given, the replies flagged as environment tokens
    (logprob 0, version -1); every policy token's logprob is that of one forward pass over
    prompt, turns and replies, under the sampling transform. The same work again compiles
    nothing and gives the same bits."""
    tokens, scfg = static
    gen = _generator(policy, scfg, slots=4, shape=shape)
    done, log, overflow = _episodes(gen)
    G, M = scfg.num_samples, scfg.max_new_tokens
    assert [c.request.id for c in done] == list(range(len(PROMPTS)))
    cat = completed_arrays(done)
    for row in range(len(tokens)):
        pieces, n = log[divmod(row, G)], cat["lengths_G"][row]
        env = [i % 2 == 1 for i, piece in enumerate(pieces) for _ in piece]
        head = sum(pieces, [])
        assert cat["tokens_GM"][row, : len(head)].tolist() == head
        assert cat["env_GM"][row].tolist() == env + [False] * (M - len(env))
        assert n >= len(head) and cat["mask_GM"][row].tolist() == [True] * n + [False] * (M - n)
    quiet, ended, cut = QUIET, 1 * G + 0, overflow[0] * G + overflow[1]
    np.testing.assert_array_equal(cat["tokens_GM"][quiet], tokens[quiet])
    assert not log[divmod(quiet, G)] and not cat["env_GM"][quiet].any()
    assert cat["lengths_G"][ended] == len(log[(1, 0)][0]) and not cat["truncated_G"][ended]
    assert cat["lengths_G"][cut] == M and cat["truncated_G"][cut] and cat["env_GM"][cut, -1]
    turns = [len(log[divmod(row, G)][::2]) for row in range(len(tokens))]
    assert max(turns) >= 3 and len(set(turns)) >= 3, turns
    env, policy_tokens = cat["env_GM"], cat["mask_GM"] & ~cat["env_GM"]
    assert np.all(cat["versions_GM"][policy_tokens] == 0) and not cat["forced_GM"].any()
    _check_trajectory_logprobs(policy, done, scfg)
    with count_compiles() as counter:
        again, _, _ = _episodes(gen)
    assert counter.count == 0, counter.count
    for a, b in zip(done, again):
        for x, y in zip(a[1:], b[1:]):
            np.testing.assert_array_equal(x, y)
    assert gen.stats.env_tokens == 2 * int(env.sum())


def _late_episodes(gen, swap=False):
    """Three requests of each prompt to completion, each turn answered after the third
    `step` that follows the one that reported it, so samples wait while requests are
    queued: turn t of request i's sample g gets 1 + (3i + 5g + 7t) mod 9 tokens. With
    `swap`, new weights (the same values, version 1) at the first step with samples parked.
    Returns the completed requests in id order and the most samples in flight at once."""
    gen.submit(_requests(PROMPTS * 3))
    done, held, turns, most = [], [[] for _ in range(4)], collections.Counter(), 0
    for _ in range(300):
        if not gen.busy:
            break
        for turn in held.pop(0):
            key = (turn.request.id, turn.sample)
            n = 1 + (3 * key[0] + 5 * key[1] + 7 * turns[key]) % 9
            turns[key] += 1
            gen.reply(turn.handle, [4 + (11 * n + i) % 250 for i in range(n)])
        if swap and gen.parked and gen.version == 0:  # Parked under 0, back under 1.
            gen.set_params(gen.params, 1)
        stepped = gen.step(3)
        done += stepped.completed
        held.append(stepped.waiting)
        most = max(most, len(gen.running) + len(gen.parked))
    assert not gen.busy and not gen.parked and not gen.where
    return sorted(done, key=lambda c: c.request.id), most


@pytest.mark.slow
@pytest.mark.parametrize("shape, block", [(None, 0), ((2, 1, 1), 0), (None, 4)])
def test_parked_samples_go_on_where_they_stopped(policy, static, shape, block):
    """With parking rows, samples that wait while requests are queued leave their slots to
    them and come back (to whichever slot is free) once their replies are given: more
    samples are in flight than there are slots, and each completion is the one the engine
    gives without parking, token for token, every policy token's logprob that of the whole
    trajectory. A sample parked under older weights has its last token run again under the
    new ones when it comes back, as the slots' were at the swap. On one device and on a
    2-way batch split (a sample may come back on the other shard), and with a paged cache
    (`block`: its replies written into the slots' blocks, a parked sample keeping its
    blocks)."""
    tokens, scfg = static
    plain, most = _late_episodes(_generator(policy, scfg, slots=4, shape=None))
    assert most == 4
    paged = dataclasses.replace(scfg, kv_block_size=block)
    gen = _generator(policy, paged, slots=4, shape=shape, parked=4)
    ran, run = [], gen._run
    gen._run = lambda name, fn, extra: ran.append(name) or run(name, fn, extra)
    done, most = _late_episodes(gen, swap=True)
    assert most > 4 and gen.stats.parked == gen.stats.unparked > 0
    assert ran.count("engine_refresh") >= 2  # The swap, and a sample parked before it.
    for a, b in zip(plain, done):
        for f in ("tokens_GM", "env_GM", "mask_GM", "lengths_G", "truncated_G"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    versions = np.concatenate([c.versions_GM[c.mask_GM & ~c.env_GM] for c in done])
    assert set(versions.tolist()) == {0, 1}
    _check_trajectory_logprobs(policy, done, scfg)
    if block:
        assert gen.pages.taken == 0 and not gen.pages.refs.any()


def test_bad_replies_name_the_problem(policy, static):
    tokens, scfg = static
    gen = _generator(policy, scfg, slots=8, shape=None)
    gen.submit(_requests())
    turn = gen.step(M := scfg.max_new_tokens).waiting[0]
    where = rf"reply to turn {turn.handle} \(request {turn.request.id}, sample {turn.sample}\)"
    with pytest.raises(ValueError, match=rf"{where}: token id\(s\) \[256\] outside \[0, 256\)"):
        gen.reply(turn.handle, [5, 256])
    unknown = max(gen.waiting) + 1
    with pytest.raises(ValueError, match=f"turn {unknown} is not waiting for a reply$"):
        gen.reply(unknown, [5])
    gen.reply(turn.handle, [5] * M)
    with pytest.raises(ValueError, match="is not waiting for a reply \\(a reply to it is queued"):
        gen.reply(turn.handle, [5])


def test_action_stopped_matches_within_the_turn():
    """A stop matches only the end of the current turn's tokens: not earlier, not across the
    turn's start; sequences of different lengths at once."""
    stops = ((4,), (7, 8), (1, 2, 3))
    tokens = np.array(
        [
            [9, 7, 8, 0, 0],  # Ends with (7, 8).
            [7, 8, 9, 0, 0],  # (7, 8) earlier, not at the end.
            [7, 8, 0, 0, 0],  # (7, 8) straddles the turn's start (column 1).
            [1, 2, 3, 0, 0],  # (1, 2, 3) whole.
            [5, 2, 3, 0, 0],  # Only the tail of (1, 2, 3).
            [4, 0, 0, 0, 0],  # A single, at column 0.
            [0, 0, 0, 0, 0],  # Empty turn: length == turn.
        ],
        np.int32,
    )
    length = np.array([3, 3, 2, 3, 3, 1, 2], np.int32)
    turn = np.array([0, 0, 1, 0, 0, 0, 2], np.int32)
    got = engine.action_stopped(tokens, length, turn, stops)
    assert np.asarray(got).tolist() == [True, False, False, True, False, True, False]


def test_bad_action_stops_name_the_field(policy):
    cases = [
        ([(4,)], r"action_stops=\[\(4,\)\] must be a tuple of token-id tuples"),
        (((),), r"action_stops\[0\]=\(\) must be a tuple of 1 to 8 token ids"),
        (((4,), tuple(range(9))), r"action_stops\[1\]=\(0, 1, .*\) must be a tuple of 1 to 8"),
        (((4,), [5]), r"action_stops\[1\]=\[5\] must be a tuple of 1 to 8 token ids"),
        (((4, -1),), r"action_stops\[0\]=\(4, -1\) must hold non-negative integer token ids"),
        ((("a",),), r"action_stops\[0\]=\('a',\) must hold non-negative integer token ids"),
    ]
    for stops, message in cases:
        with pytest.raises(ValueError, match=message):
            SamplingConfig(action_stops=stops)
    cfg, graphdef, _ = policy
    scfg = dataclasses.replace(BASE, action_stops=((4,), (300, 5)))
    with pytest.raises(ValueError, match=r"action_stops has token id\(s\) \[300\] outside"):
        Generator(graphdef, cfg, scfg, slots=4, max_prompt_len=8)
