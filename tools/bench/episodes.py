"""The episodes section: multi-turn episodes (`envs.episodes.Episodes` over a `Generator`
with parking rows) on random prompts, against a synthetic tool (`SleepyTool`) that sleeps on
its worker thread and replies a few tokens. A turn ends at a stop: the tokens the random
policy samples most (`frequent_stops`). The same workload (the same keys: the same tokens,
checked) runs with no latency, with the latency, and with the latency and no parking rows.
Utilization = policy tokens / slot-steps, both `EngineStats` counters (a reply's tokens are
appended by a prefill, not decoded: they count in neither); tokens/s = policy tokens / wall
time, compilation excluded."""

import collections
import dataclasses
import time
from typing import NamedTuple

import jax
import numpy as np

from rlscale.envs import episodes, registry
from rlscale.envs.protocol import Environment, Reply
from rlscale.sampling import engine, generator
from rlscale.sampling import sampler as sampling


class IdText:
    """The episodes section's tokenizer: token ids as decimal text ("17 4 230"), so any id of
    any model's vocabulary can be a stop or a reply token, and decodes back exactly."""

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


class SleepyTool(Environment):
    """The episodes section's environment: a tool that takes `latency` seconds to answer
    each turn (sleeping on its worker thread, as a call to a remote tool waits) and replies
    `reply` (text of `IdText`)."""

    def __init__(self, stops, latency, reply):
        self.stops, self.latency, self.reply = tuple(stops), latency, reply

    def reset(self, problem):
        del problem

    def step(self, action):
        del action
        time.sleep(self.latency)
        return Reply(self.reply)


def frequent_stops(tokens, rate):
    """Token ids whose share of `tokens` adds up to about `rate` (as stops: turns of about
    1 / rate tokens): the most frequent first, each taken while the sum stays within 10% of
    `rate`. Returns (ids, their share)."""
    counts = np.bincount(np.ravel(tokens))
    share = counts / counts.sum()
    ids, total = [], 0.0
    for t in np.argsort(-counts, kind="stable"):
        if share[t] and total + share[t] <= 1.1 * rate:
            ids.append(int(t))
            total += share[t]
    if not ids:
        raise ValueError(f"no token is rarer than {1.1 * rate:.3f} of the policy's tokens")
    return ids, float(total)


def warm_engine(gen):
    """Compiles `gen`'s insert, extend and parking programs for every row count an
    admission, a batch of replies or a move can have (the powers of two up to the slots),
    on padding rows that write nothing, so no timed run compiles: which counts a run meets
    depends on its timing."""
    P, T, S = gen.cfg.bucket(gen.max_prompt_len), gen.cfg.bucket(1), gen.slots
    for R in (1 << i for i in range(S.bit_length())):
        if gen.pool is not None:
            gen.pool = gen._moved(gen.pool, gen.state, [gen.pool.limit_S.shape[0]] * R, [0] * R)
            gen.state = gen._moved(gen.state, gen.pool, [S] * R, [0] * R)
        pad = np.full((R,), S, np.int32)
        zeros = np.zeros((R, 1), np.int32)
        args = (np.zeros((R, P), np.int32), np.ones((R, P), bool), pad[:, None])
        args = gen._rows(*args, np.zeros((R, 2), np.uint32), zeros)
        gen.state = gen._run("engine_insert", engine.insert, args)
        args = gen._rows(np.zeros((R, T), np.int32), np.zeros((R, T), bool), pad, pad < 0)
        gen.state = gen._run("engine_extend", engine.extend, args)
    jax.block_until_ready(gen.state)


class EpisodesWorkload(NamedTuple):
    """The episodes section's requests, sampling settings (the stops included), tool reply
    and limits."""

    requests: list
    scfg: sampling.SamplingConfig
    stops: tuple[str, ...]
    stop_share: float
    reply: str
    env_cfg: registry.EnvConfig


def episodes_workload(
    cfg, params, graphdef, requests, prompt_len, max_new_tokens, turn_tokens, turns,
    reply_len, workers, seed=0,
):  # fmt: skip
    """Random prompts of prompt_len / 2 to prompt_len tokens; as stops the tokens the policy
    samples most, together about one in `turn_tokens` of its tokens (counted in its
    completions of the same prompts without stops); replies of `reply_len` random tokens;
    `turns` turns an episode at most."""
    rng = np.random.default_rng(seed + 1)
    prompts = [
        rng.integers(4, cfg.vocab_size, int(n)).tolist()
        for n in rng.integers(prompt_len // 2, prompt_len + 1, requests)
    ]
    keys = [jax.random.fold_in(jax.random.key(seed), i) for i in range(requests)]
    scfg = sampling.SamplingConfig(
        max_new_tokens=max_new_tokens, temperature=1.0, buckets=(prompt_len,)
    )
    free = sampling.Sampler(graphdef, cfg)(params, prompts, keys[0], scfg)
    stop_ids, stop_share = frequent_stops(np.asarray(free.tokens), 1 / turn_tokens)
    stops = tuple(map(str, stop_ids))
    # The factory is built here, not named: `env.name` stays the default, which only logs.
    env_cfg = registry.EnvConfig(
        max_turns=turns, reply_tokens=reply_len, call_seconds=60.0, episode_seconds=600.0,
        workers=workers,
    )  # fmt: skip
    factory = registry.EnvFactory(SleepyTool, {}, stops)
    ids = registry.action_stops(factory, env_cfg, IdText(), max_new_tokens)
    return EpisodesWorkload(
        requests=[generator.Request(i, p, key) for i, (p, key) in enumerate(zip(prompts, keys))],
        scfg=dataclasses.replace(scfg, action_stops=ids),
        stops=stops,
        stop_share=stop_share,
        reply=IdText().decode(rng.integers(4, cfg.vocab_size, reply_len).tolist()),
        env_cfg=env_cfg,
    )


def run_episodes(cfg, params, graphdef, work, slots, prompt_len, latency, parked, k):
    """One run of the workload to its end: (wall seconds, `EngineStats`, a copy of them at
    the step that admitted the last request, step calls, the `Episode`s in request
    order)."""
    tool = dict(stops=work.stops, latency=latency, reply=work.reply)
    gen = generator.Generator(graphdef, cfg, work.scfg, slots, prompt_len, parked=parked)
    gen.set_params(params, 0)
    factory = registry.EnvFactory(SleepyTool, tool, work.stops)
    eps = episodes.Episodes(gen, factory, IdText(), work.env_cfg)
    t = time.perf_counter()
    eps.submit(work.requests, [None] * len(work.requests))
    done, calls, queued = [], 0, None
    while eps.busy:
        done += eps.step(k).completed
        calls += 1
        if queued is None and not gen.queue:
            queued = dataclasses.replace(gen.stats)
    wall = time.perf_counter() - t
    eps.close()
    return wall, gen.stats, queued, calls, sorted(done, key=lambda e: e.request.id)


def same_tokens(base, done):
    """The fraction of `base`'s completion tokens (episodes in request order) that `done`
    has at the same place. Below 1 only by float noise: the prefill calls batch replies and
    requests as the timing falls, which moves the last bits of the logits, and a token drawn
    within that of a boundary changes (and with it the rest of its episode)."""
    same = total = 0
    for a, b in zip(base, done):
        mask = a.completed.mask_GM
        same += int(np.sum((a.completed.tokens_GM == b.completed.tokens_GM) & mask))
        total += int(mask.sum())
    return same / total


def bench_episodes(
    cfg, params, graphdef, slots, requests, prompt_len, max_new_tokens, turn_tokens, turns,
    reply_len, latency, parked, k, repeats,
):  # fmt: skip
    t = time.perf_counter()
    work = episodes_workload(
        cfg, params, graphdef, requests, prompt_len, max_new_tokens, turn_tokens, turns,
        reply_len, workers=slots + parked,  # A worker for each sample that can wait at once.
    )  # fmt: skip
    sides = {"none": (0.0, parked), "latency": (latency, parked), "unparked": (latency, 0)}

    def run(side):
        return run_episodes(cfg, params, graphdef, work, slots, prompt_len, *sides[side], k)

    # Compile every program first (an untimed run, and the row counts it may not have met);
    # timed runs alternate, so load from other processes falls on both sides alike. The
    # side without parking rows, a diagnostic, runs once.
    gen = generator.Generator(graphdef, cfg, work.scfg, slots, prompt_len, parked=parked)
    gen.set_params(params, 0)
    warm_engine(gen)
    run("none")
    warm_s = time.perf_counter() - t
    runs = {side: [] for side in sides}
    for i in range(repeats):
        for side in sides:
            if side != "unparked" or not i:
                runs[side].append(run(side))
    out = {
        "slots": slots,
        "requests": requests,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
        "steps_per_call": k,
        "max_turns": turns,
        "reply_tokens": reply_len,
        "latency_s": latency,
        "parked": parked,
        "stops": len(work.stops),
        "stop_share": work.stop_share,
        "warm_s": warm_s,
    }
    base = None
    for side in sides:
        wall, stats, queued, calls, done = min(runs[side], key=lambda r: r[0])
        ep = {key: np.concatenate([e.stats[key] for e in done]) for key in ("end", "calls")}
        ep["turns"] = np.concatenate([e.stats["turns"] for e in done])
        base = done if base is None else base
        out[side] = {
            "wall_s": wall,
            "decode_s": stats.decode_s,
            "prefill_s": stats.prefill_s,
            "reply_s": stats.reply_s,
            "move_s": stats.move_s,
            "parked": stats.parked,
            "steps": stats.steps,
            "step_calls": calls,
            "slot_steps": stats.slot_steps,
            "policy_tokens": stats.tokens,
            "env_tokens": stats.env_tokens,
            "utilization": stats.utilization,
            "utilization_runs": [r[1].utilization for r in runs[side]],
            # Until the last request was admitted: without the drain at the end.
            "utilization_queued": queued.utilization,
            "tokens_per_s": stats.tokens / wall,
            "env_calls": int(ep["calls"].sum()),
            "turns_per_episode": float(ep["turns"].mean()),
            "tokens_per_turn": stats.tokens / int(ep["turns"].sum()),
            "ends": dict(sorted(collections.Counter(ep["end"].tolist()).items())),
            "same_tokens_fraction": same_tokens(base, done),
        }
    out["utilization_ratio"] = out["latency"]["utilization"] / out["none"]["utilization"]
    out["tokens_per_s_ratio"] = out["latency"]["tokens_per_s"] / out["none"]["tokens_per_s"]
    return out


def print_episodes(e):
    print(
        f"episodes S={e['slots']} requests={e['requests']} P<={e['prompt_len']} "
        f"M={e['max_new_tokens']} k={e['steps_per_call']} parked={e['parked']}  "
        f"turns<={e['max_turns']}, replies of {e['reply_tokens']} tokens, {e['stops']} stop "
        f"ids ({e['stop_share']:.1%} of the policy's tokens): {e['none']['turns_per_episode']:.2f}"
        f" turns an episode, {e['none']['tokens_per_turn']:.1f} policy tokens a turn"
    )
    print("util = policy tokens / slot-steps (EngineStats; env tokens are appended by prefill")
    print("calls, not decode steps, and count in neither)")
    print(
        f"{'env latency':<18}{'wall s':>8}{'steps':>7}{'slot-steps':>11}{'policy tok':>11}"
        f"{'env tok':>8}{'tokens/s':>9}{'calls':>6}{'parked':>7}{'util':>7}"
    )
    ms = e["latency_s"] * 1000
    names = {"none": "0 ms", "latency": f"{ms:.0f} ms", "unparked": f"{ms:.0f} ms, parked=0"}
    for side, name in names.items():
        s = e[side]
        print(
            f"{name:<18}{s['wall_s']:>8.2f}{s['steps']:>7}{s['slot_steps']:>11}"
            f"{s['policy_tokens']:>11}{s['env_tokens']:>8}{s['tokens_per_s']:>9.0f}"
            f"{s['env_calls']:>6}{s['parked']:>7}{s['utilization']:>7.1%}"
        )
    print(
        f"{names['latency'] + ' / 0 ms':<18}{'':>45}{e['tokens_per_s_ratio']:>8.2f}x{'':>13}"
        f"{e['utilization_ratio']:>6.2f}x"
    )
    for side, name in names.items():
        s = e[side]
        host = s["wall_s"] - s["decode_s"] - s["prefill_s"] - s["reply_s"] - s["move_s"]
        runs = s["utilization_runs"]
        print(
            f"  {name}: util {min(runs):.1%}-{max(runs):.1%} over {len(runs)} run(s), "
            f"{s['utilization_queued']:.1%} until the last request was admitted; "
            f"{s['step_calls']} step calls; seconds: decode {s['decode_s']:.2f}, prefill "
            f"{s['prefill_s']:.2f}, replies {s['reply_s']:.2f}, parking {s['move_s']:.2f}, "
            f"host and waiting {host:.2f}; ends {s['ends']}; the same tokens as at 0 ms: "
            f"{s['same_tokens_fraction']:.2%}"
        )
    print(
        f"  section {e['section_s']:.0f} s, of which {e['warm_s']:.0f} s before the timed "
        "runs (choosing the stops, compiling, an untimed run)"
    )
