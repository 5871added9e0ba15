"""Episodes: the generator engine driven through environments (`rlscale.envs.episodes`) on
the tiny random model, whose frequent tokens are the environment's stops. Each turn reaches
its environment as the text of its exact token ids, on a worker thread; the replies join the
completion out of the loss; every limit ends an episode with its recorded reason; a
single-turn run is the engine's own; bad settings fail at start-up naming their key."""

import collections
import dataclasses
import threading
import time

import jax
import numpy as np
import pytest
from conftest import load_config

from rlscale import sections
from rlscale.data import filters
from rlscale.data.tasks import Problem
from rlscale.envs import episodes as episodes_lib
from rlscale.envs import registry
from rlscale.envs.protocol import Environment, Reply
from rlscale.rl import report, rollouts, run_config
from rlscale.sampling import Sampler, SamplingConfig, scoring
from rlscale.sampling.generator import Generator, Request

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]
BASE = SamplingConfig(max_new_tokens=24, num_samples=2, top_k=40, buckets=(8, 16))
RNG = jax.random.key(3)
G, M = BASE.num_samples, BASE.max_new_tokens


class _Bytes:
    """A tokenizer of characters 2..255 as their code points (one id each; any other
    character is UNK, id 1); pad 0, no BOS and no EOS."""

    vocab_size, bos_id, eos_id, pad_id, padding_id = 256, -1, -1, 0, 0

    def encode(self, text, *, add_bos=False, add_eos=False):
        assert not (add_bos or add_eos)
        return [ord(c) if 1 < ord(c) < 256 else 1 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != 0)


TOK = _Bytes()
PROBLEMS = [Problem("".join(map(chr, p)), mode, "") for p, mode in zip(PROMPTS, "abcd")]
# What each environment saw: (its problem's prompt, the actions it was given, its threads).
SEEN = []
RELEASE = threading.Event()  # Lets the environments that sleep go (at the module's end).


class Toy(Environment):
    """Behaves by its problem's answer: "a" replies "<a>" and ends the episode at its second
    call with reward 1; "b" raises; "c" replies 40 characters; "d" replies nothing; "z"
    waits (up to 5 s) for `RELEASE`. Each reply counts a `tool_calls`; with `delay`, call k
    of an episode first sleeps 0, 1 or 2 times `delay` seconds (by k and the prompt)."""

    def __init__(self, stops=(), sleep_all=False, delay=0.0):
        self.stops, self.sleep_all, self.delay = tuple(stops), sleep_all, delay

    def reset(self, problem):
        self.mode = "z" if self.sleep_all else problem.answer
        self.seen = (problem.prompt, [], {threading.get_ident()})
        SEEN.append(self.seen)

    def step(self, action):
        self.seen[1].append(action)
        self.seen[2].add(threading.get_ident())
        time.sleep(self.delay * ((len(self.seen[0]) + len(self.seen[1])) % 3))
        info = {"tool_calls": 1}
        if self.mode == "a":
            done = len(self.seen[1]) == 2
            return Reply("<a>", done=done, reward=1.0 if done else None, info=info)
        if self.mode == "b":
            raise RuntimeError("the tool broke")
        if self.mode == "z":
            RELEASE.wait(5.0)
        return Reply("~" * 40 if self.mode == "c" else "", info=info)


class NotAnEnv:
    stops = ("x",)

    def reset(self, problem):
        pass

    def step(self, action):
        return Reply()


class NoStep(Environment):
    def reset(self, problem):
        pass


@pytest.fixture(scope="module", autouse=True)
def _release():
    yield
    RELEASE.set()


@pytest.fixture(scope="module")
def static(tiny_cfg, tiny_model):
    """The static sampler's completions with the engine's keys, and as stops the six
    characters the model samples most often outside one row (so that row has no turn)."""
    graphdef, params = tiny_model
    tokens = np.asarray(Sampler(graphdef, tiny_cfg)(params, PROMPTS, RNG, BASE).tokens)
    quiet = set(tokens[7].tolist()) | {0, 1}
    counts = collections.Counter(t for row in tokens[:7] for t in row.tolist())
    return tokens, tuple(chr(t) for t, _ in counts.most_common() if t not in quiet)[:6]


@pytest.fixture(scope="module")
def gen(tiny_cfg, tiny_model, static):
    graphdef, params = tiny_model
    stops = registry.action_stops(_factory(static[1]), registry.EnvConfig(), TOK, M)
    scfg = dataclasses.replace(BASE, action_stops=stops)
    g = Generator(graphdef, tiny_cfg, scfg, slots=8, max_prompt_len=16)
    g.set_params(params, 3)
    return g


def _factory(stops, **kwargs):
    cfg = registry.EnvConfig(name="test_episodes:Toy", kwargs=dict(stops=stops, **kwargs))
    return registry.make_factory(cfg)


def _episodes(gen, static, **limits):
    kwargs = {k: limits.pop(k) for k in ("sleep_all", "delay") if k in limits}
    cfg = registry.EnvConfig(name="test_episodes:Toy", **limits)
    return episodes_lib.Episodes(gen, _factory(static[1], **kwargs), TOK, cfg)


def _turns(row, stops, calls):
    """The first `calls` turns of a row's policy tokens: each up to a stop, included."""
    out, start = [], 0
    for i, t in enumerate(row):
        if len(out) < calls and chr(t) in stops:
            out.append(row[start : i + 1])
            start = i + 1
    return out, row[start:]


def _pieces(row, env):
    """The row's runs of policy and of environment tokens: [(tokens, is_env)]."""
    cuts = np.flatnonzero(np.diff(env.astype(int))) + 1
    return [(r.tolist(), bool(e[0])) for r, e in zip(np.split(row, cuts), np.split(env, cuts))]


def test_episodes_reply_and_train_on_the_policys_tokens_only(gen, static, tiny_model):
    """Through the rollout source, with `max_turns=2`, `reply_tokens=3`: each environment
    reads its turns' text (of their exact ids: the first turn is the static sampler's), on a
    worker thread; each reply is its text's tokens cut to 3; an empty reply resumes the
    sample as if it had never stopped; the verifier reads the policy's text only; the
    environment's reward (or an error's 0) replaces the verifier's; each episode ends for its
    reason; the learner's mask leaves the replies out (version -1, logprob 0); the step's
    `env/` metrics count what happened."""
    tokens, stops = static
    SEEN.clear()
    eps = _episodes(gen, static, max_turns=2, reply_tokens=3)
    batch = rollouts.BatchConfig(prompts=4, group_size=G, samples_per_prompt=G)
    scorer = scoring.Scorer(lambda text, problem: 0.25)
    source = rollouts.RolloutSource(
        batch, filters.FilterConfig(), 3, eps, gen.cfg, TOK, PROBLEMS, scorer,
        filters.PromptStream(4), filters.PassRateHistory(),
    )  # fmt: skip
    ids = [0, 1, 2, 3]
    s = source.sample(tiny_model[1], ids, RNG, version=3)
    roll, stats = source.rollouts([source.judge(ids, s)])
    eps.close()
    ep = s.episodes
    assert len(SEEN) == len(tokens)
    assert all(threads and threading.get_ident() not in threads for _, _, threads in SEEN)
    seen = collections.defaultdict(list)
    for prompt, actions, _ in SEEN:
        seen[prompt].append(actions)
    for n in range(len(tokens)):
        mode, L, calls, end = PROBLEMS[n // G].answer, s.lengths_N[n], ep["calls"][n], ep["end"][n]
        env, row = s.env_NM[n, :L], s.tokens_NM[n, :L]
        policy = row[~env].tolist()
        turns, tail = _turns(policy, stops, calls)
        assert [TOK.decode(t) for t in turns] in seen[PROBLEMS[n // G].prompt]
        first = turns[0] if turns else policy
        assert first == tokens[n, : len(first)].tolist()
        assert s.texts[n] == TOK.decode(policy)
        replies = [piece for piece, is_env in _pieces(row, env) if is_env]
        assert len(replies) == (min(calls, 1) if mode in "ac" else 0)
        for reply in replies:  # Cut to reply_tokens, or shorter at the end of the budget.
            assert reply == TOK.encode({"a": "<a>", "c": "~~~"}[mode])[: len(reply)]
            assert len(reply) == 3 or L == M
        if mode == "d":  # Nothing appended: the static sampler's completion.
            assert row.tolist() == tokens[n, :L].tolist()
        if mode == "b" and calls:
            assert end == "error" and s.reward_N[n] == 0.0
        elif calls == 2:
            assert end == ("env" if mode == "a" else "turns")
            assert s.reward_N[n] == (1.0 if mode == "a" else 0.25)
        else:
            assert end == "length" and s.reward_N[n] == 0.25
        assert ep["turns"][n] == len(turns) + bool(tail)
        assert not tail or end == "length"
    assert set(ep["end"]) == {"env", "error", "turns", "length"}, ep["end"]
    # The learner's batch: the replies are context, out of the loss.
    assert (roll.env_NM == s.env_NM).all() and roll.env_NM.any()
    np.testing.assert_array_equal(roll.mask_NM, s.mask_NM & ~s.env_NM)
    assert (roll.version_NM[roll.mask_NM] == 3).all() and (roll.version_NM[s.env_NM] == -1).all()
    assert (roll.sampler_logp_NM[s.env_NM] == 0).all()
    assert roll.reward_N.tolist() == s.reward_N.tolist()
    assert stats["env_tokens"] == s.env_NM.sum()
    assert stats["lengths"].sum() == s.mask_NM.sum() - s.env_NM.sum()
    record = report.samples_record(stats)
    for reason in episodes_lib.END_REASONS:
        assert record[f"env/ended_{reason}"] == np.mean(ep["end"] == reason)
    assert record["env/tool_calls"] == ep["calls"].sum() - np.sum(ep["end"] == "error")
    assert record["env/calls_per_episode"] == ep["calls"].mean()
    assert record["env/episodes_with_calls"] == np.mean(ep["calls"] > 0)
    assert record["env/turns_mean"] == ep["turns"].mean()


def _run(eps, problems=PROBLEMS):
    """Every request to the end: the finished `Episode`s, in request order."""
    eps.submit([Request(i, p, jax.random.fold_in(RNG, i)) for i, p in enumerate(PROMPTS)], problems)
    done = []
    for _ in range(500):
        if not eps.busy:
            break
        done += eps.step(3).completed
    eps.close()
    assert not eps.busy and not eps.calls and not eps.samples
    return sorted(done, key=lambda e: e.request.id)


@pytest.mark.parametrize(
    "limits,reason",
    [
        (dict(call_seconds=0.2), "call_time"),  # Each call waits seconds for `RELEASE`.
        (dict(episode_seconds=0.2), "episode_time"),
    ],
)
def test_time_limits_end_episodes_with_their_reason(gen, static, limits, reason):
    """Environments that never answer in time: every sample that stopped at a turn ends
    there for the limit's reason and scores 0 (the calls' threads are left behind); the
    others run to their budget."""
    done = _run(_episodes(gen, static, sleep_all=True, **limits))
    stats = {k: np.concatenate([e.stats[k] for e in done]) for k in done[0].stats}
    lengths = np.concatenate([e.completed.lengths_G for e in done])
    ended = stats["end"] == reason
    assert ended.sum() >= len(PROMPTS) and set(stats["end"][~ended]) == {"length"}
    assert (lengths[~ended] == M).all() and (lengths[ended] < M).all()
    assert (stats["turns"][ended] == 1).all() and (stats["fixed_reward"][ended] == 0).all()
    assert reason != "call_time" or (stats["calls"][ended] == 1).all()
    assert not np.concatenate([e.completed.env_GM for e in done]).any()


def test_samples_do_not_depend_on_when_the_environment_answers(gen, static):
    """The same episodes with every environment answering at once and with calls delayed by
    0 to 40 ms, so the replies come back at other decode steps and with other replies: the
    same completions, bit for bit (each reply is appended by a call of its own, since a
    prefill's rounding depends on the rows it runs with), and the same episodes."""
    at_once = _run(_episodes(gen, static, max_turns=3))
    later = _run(_episodes(gen, static, max_turns=3, delay=0.02))
    assert sum(e.stats["calls"].sum() for e in later) >= len(PROMPTS)  # Replies to time.
    for a, b in zip(at_once, later, strict=True):
        for x, y in zip(a.completed[1:], b.completed[1:], strict=True):
            np.testing.assert_array_equal(x, y)
        for key in set(a.stats) - {"seconds"}:  # Wall-clock: the seconds in calls.
            np.testing.assert_array_equal(a.stats[key], b.stats[key])


def test_workers_put_a_thread_in_the_place_of_one_left_behind():
    """A job abandoned while it runs keeps its thread, and another takes its place (the job
    queued behind runs); the thread left behind ends when its job returns; a job abandoned
    before it starts never runs; the threads are daemons (none holds the process's exit)."""
    pool, gate = episodes_lib.Workers(1, "test-workers"), threading.Event()
    stuck = pool.submit(gate.wait, 30.0)
    queued, skipped = pool.submit(lambda: "ran"), pool.submit(lambda: "skipped")
    while not stuck.running():
        time.sleep(0.01)
    pool.abandon(skipped)
    pool.abandon(stuck)
    assert queued.result(timeout=30) == "ran" and skipped.cancelled()
    threads = {t.name: t for t in threading.enumerate() if t.name.startswith("test-workers")}
    assert sorted(threads) == ["test-workers_1", "test-workers_2"]
    assert all(t.daemon for t in threads.values())
    gate.set()
    assert stuck.result(timeout=30) is True
    threads["test-workers_1"].join(30.0)
    assert not threads["test-workers_1"].is_alive() and threads["test-workers_2"].is_alive()
    pool.close()
    threads["test-workers_2"].join(30.0)
    assert not threads["test-workers_2"].is_alive()


def test_single_turn_is_the_engines_own(tiny_cfg, tiny_model):
    """A single-turn environment passes the engine's completions through untouched (and
    makes no environment at all)."""
    graphdef, params = tiny_model
    reqs = [Request(i, p, jax.random.fold_in(RNG, i)) for i, p in enumerate(PROMPTS)]
    bare = Generator(graphdef, tiny_cfg, BASE, slots=4, max_prompt_len=16)
    bare.set_params(params, 0)
    bare.submit(reqs)
    want = []
    while bare.busy:
        want += bare.step(5).completed
    cfg = registry.EnvConfig()
    eps = episodes_lib.Episodes(bare, registry.make_factory(cfg), TOK, cfg)
    got = _run(eps, [None] * len(PROMPTS))
    assert eps.pool is None and [e.stats for e in got] == [None] * len(PROMPTS)
    for a, b in zip(sorted(want, key=lambda c: c.request.id), got):
        for x, y in zip(a[1:], b.completed[1:]):
            np.testing.assert_array_equal(x, y)


def test_bad_environments_fail_at_start_up_naming_the_key():
    key = "env.name='test_episodes:NotAnEnv'"
    with pytest.raises(sections.InvalidConfigError, match=f"{key} is not a subclass of"):
        registry.EnvConfig(name="test_episodes:NotAnEnv")
    with pytest.raises(sections.InvalidConfigError, match="NoStep' does not implement the "):
        registry.EnvConfig(name="test_episodes:NoStep")
    with pytest.raises(sections.InvalidConfigError, match="'single_tur' is not a registered "):
        registry.EnvConfig(name="single_tur")  # ... did you mean 'single_turn'?
    bad = registry.EnvConfig(name="test_episodes:Toy", kwargs={"colour": 1})
    with pytest.raises(ValueError, match=r"env.kwargs=\{'colour': 1\} do not construct env"):
        registry.make_factory(bad)
    cfg = registry.EnvConfig(name="test_episodes:Toy")
    for stop in ("\u2603", "abcdefghi"):  # UNK; 9 ids.
        with pytest.raises(ValueError, match=f"Toy': the stop '{stop}' is not producible by the "):
            registry.action_stops(_factory((stop,)), cfg, TOK, 32)
    with pytest.raises(ValueError, match="sampling.max_new_tokens=3 cannot hold one turn of env"):
        registry.action_stops(_factory(("ab",)), cfg, TOK, 3)
    assert registry.action_stops(_factory(("ab",)), cfg, TOK, 4) == ((97, 98),)
    c = load_config("quickstart")
    c.env.max_turns, c.env.reply_tokens, c.env.call_seconds = 0, 0, -1.0
    with pytest.raises(sections.InvalidConfigError) as e:
        run_config.resolve(c)
    for problem in (
        "env.max_turns=0 must be an integer >= 1",
        "env.reply_tokens=0 must be an integer >= 1",
        "env.call_seconds=-1.0 must be a number of seconds > 0",
    ):
        assert problem in e.value.problems
    c = load_config("quickstart")
    c.env.parked = 4  # The single-turn environment's samples never wait.
    with pytest.raises(sections.InvalidConfigError, match="env.parked=4 parks samples waiting"):
        run_config.resolve(c)
    c.env.name = "test_episodes:Toy"  # On 8 devices: the generator's slots split 8 ways.
    with pytest.raises(ValueError, match=r"env.parked=4 does not divide the generator's batch"):
        run_config.resolve(c)
