"""Multi-turn generation in the engine: samples stop at action stops and wait (their slots
decode nothing while the others go on), checked against the static sampler, which ignores
action stops and so samples each turn's tokens and what would have followed."""

import collections
import dataclasses

import jax
import numpy as np
import pytest

from rlscale import model, sharding
from rlscale.sampling import Sampler, SamplingConfig, engine
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


def _generator(policy, scfg, slots, shape):
    cfg, graphdef, params = policy
    mesh = None if shape is None else sharding.make_mesh(shape)
    gen = Generator(graphdef, cfg, scfg, slots=slots, max_prompt_len=16, mesh=mesh)
    if mesh is not None:
        params = sharding.reshard(
            params, sharding.param_shardings(params, mesh, sharding.SAMPLE_RULES)
        )
    gen.set_params(params, 0)
    return gen


def _requests(prompts=PROMPTS):
    return [Request(i, p, jax.random.fold_in(RNG, i)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("shape", [None, (2, 1, 1)])
def test_samples_wait_at_action_stops(policy, static, shape):
    """A sample whose static completion holds an action stop samples it up to the first one
    (a pair included) and then waits (not finished, decoding nothing) while the others decode
    on: a sample without one (`QUIET` at least) samples its whole static completion. Each
    wait is reported once."""
    tokens, scfg = static
    gen = _generator(policy, scfg, slots=8, shape=shape)
    gen.submit(_requests())
    turns = []
    for _ in range(20):
        stepped = gen.step(3)
        assert not stepped.completed  # Every request has a sample that waits.
        turns += stepped.waiting
        if not engine.live(gen.state).any():
            break
    G, M = scfg.num_samples, scfg.max_new_tokens
    by_row = {t.request.id * G + t.sample: t for t in turns}
    assert len(by_row) == len(turns) and len({t.slot for t in turns}) == len(turns)
    slot = {own[g]: r.id * G + g for r, own in gen.running.values() for g in range(G)}
    slot = {row: s for s, row in slot.items()}
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
