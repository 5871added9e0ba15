"""Benchmarks: sampler and train-step throughput against this machine's measured roofline.

    python tools/bench.py --model small [--batch 128] [--only decode,train,generator,episodes]
        [--out bench.json]

In one run it measures the peak matmul FLOP/s (large square matmuls in the model's compute
dtype) and the memory bandwidth (a large reduction: reads only, which is what decode does),
then times:
  * decode: `generate` at --batch prompts of --prompt_len tokens and --new_tokens new tokens,
    prefill timed separately and subtracted. Its roofline bound per step is
    max(FLOPs / peak, bytes / bandwidth), with FLOPs = 2 x (matmul params) x batch + attention
    over the live context, and bytes = every weight read once + the live KV cache read + the new
    K/V written. Achieved fraction = sum of bounds / measured decode time.
  * train: forward + backward of the next-token loss + AdamW, FLOPs = 6 x (matmul params) x
    tokens + 12 x layers x heads x head_dim x T per token (attention), fraction of peak.
  * generator: continuous batching (`generator.Generator`, --slots slots, `step(--steps_per_call)`)
    against static batching (`Sampler` on batches of --slots requests in the same order) on
    --requests requests whose completion lengths are long-tailed (see `completion_lengths`;
    no stop tokens, so each request's budget is its length). A static batch decodes until its
    longest row is done (max_new_tokens = that row's length), so both sides produce the same
    useful tokens. Utilization = useful tokens / slot-steps; tokens/s over wall time, prefill
    included, compilation excluded (every program is compiled by an untimed first pass). The
    bound is the utilization of an ideal engine (a slot refilled the step it frees, no host
    time) on the same workload: what the drain at the end of a finite workload leaves.
  * episodes: multi-turn episodes (`envs.episodes.Episodes` over a Generator of --ep_slots
    slots and --parked parking rows, `step(--steps_per_call)`) on --ep_requests random
    prompts, against a synthetic tool (`SleepyTool`) that sleeps --latency_ms on its worker
    thread and replies --reply_tokens tokens. A turn ends at a stop: the tokens the random
    policy samples most, together about 1 in --turn_tokens of its tokens (`frequent_stops`);
    an episode ends after --turns turns, or at --ep_tokens tokens. The same workload (the
    same keys: the same tokens, checked) runs with no latency, with the latency, and with
    the latency and no parking rows. Utilization = policy tokens / slot-steps, both
    `EngineStats` counters (a reply's tokens are appended by a prefill, not decoded: they
    count in neither); tokens/s = policy tokens / wall time, compilation excluded.
Prints a table; `--out` writes the same numbers as JSON.
"""

import collections
import dataclasses
import heapq
import json
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from rlscale import cli, model, next_token, optim, supervised
from rlscale.envs import episodes, registry
from rlscale.envs.protocol import Environment, Reply
from rlscale.sampling import engine, generator
from rlscale.sampling import sampler as sampling
from rlscale.scaling.compute import matmul_params


def _time(fn, repeats):
    fn()  # Compile and warm up.
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def peak_matmul_flops(dtype, sizes=(1024, 2048, 3072)):
    best = 0.0
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), dtype)
        f = jax.jit(lambda a, b: a @ b)
        best = max(best, 2 * n**3 / _time(lambda f=f, a=a, b=b: f(a, b).block_until_ready(), 5))
    return best


def memory_bandwidth(nbytes=512 << 20):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    return nbytes / _time(lambda: f(x).block_until_ready(), 5)


def bench_decode(cfg, params, graphdef, batch, prompt_len, new_tokens, phases, peak, bw, repeats):
    itemsize = jnp.dtype(cfg.dtype).itemsize
    scfg = sampling.SamplingConfig(
        max_new_tokens=new_tokens, temperature=1.0, buckets=(prompt_len,), decode_phases=phases
    )
    tokens = np.asarray(
        jax.random.randint(jax.random.key(1), (batch, prompt_len), 4, cfg.vocab_size), np.int32
    )
    mask = np.ones_like(tokens, bool)
    rng = jax.random.key(2)

    def run():
        out = sampling.generate(
            params, tokens, mask, rng, graphdef=graphdef, model_cfg=cfg, cfg=scfg
        )
        jax.block_until_ready(out)
        return out

    @jax.jit
    def prefill(params, tokens, mask):
        cache = model.init_cache(cfg, batch, prompt_len + -(-new_tokens // phases))
        h, cache = model.hidden(
            graphdef, params, tokens, model.positions_from_mask(mask), mask, cache
        )
        return model.logits(graphdef, params, h[:, -1:]), cache

    total = _time(run, repeats)
    pre = _time(lambda: jax.block_until_ready(prefill(params, tokens, mask)), repeats)
    steps = int(run()[3].max())  # The loop exits early only if every row stops.
    decode = total - pre
    n_mm = matmul_params(cfg)
    weight_bytes = cfg.num_params() * jnp.dtype(cfg.param_dtype).itemsize
    kv_per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    bound = flops = nbytes = 0.0
    for i in range(steps):
        ctx = prompt_len + i + 1
        f = 2 * n_mm * batch + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx * batch
        b = weight_bytes + kv_per_slot * batch * (ctx + 1)
        flops, nbytes, bound = flops + f, nbytes + b, bound + max(f / peak, b / bw)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": steps,
        "decode_phases": phases,
        "prefill_s": pre,
        "decode_s": decode,
        "decode_tokens_per_s": batch * steps / decode,
        "decode_flops_per_s": flops / decode,
        "decode_bytes_per_s": nbytes / decode,
        "decode_arith_intensity": flops / nbytes,
        "decode_roofline_fraction": bound / decode,
    }


def bench_train(cfg, params, graphdef, batch, seq_len, peak, repeats):
    fit = supervised.Fit(
        next_token.batch_loss, graphdef, optim.OptimConfig(lr=1e-4, weight_decay=1e-4)
    )
    # The step donates its state, as training does; a copy keeps the caller's `params` alive
    # for the sections that run after this one.
    state = supervised.init_state(fit, jax.tree.map(jnp.copy, params))
    tokens = jax.random.randint(jax.random.key(3), (batch, seq_len), 4, cfg.vocab_size)
    data = next_token.Batch(tokens, jnp.ones((batch, seq_len), bool))
    holder = [state]

    def run():
        holder[0], metrics = supervised.train_step(fit, holder[0], data)
        jax.block_until_ready(metrics)

    dt = _time(run, repeats)
    n_tok = batch * seq_len
    flops = 6 * matmul_params(cfg) * n_tok + (
        12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len * n_tok
    )
    return {
        "batch": batch,
        "seq_len": seq_len,
        "step_s": dt,
        "tokens_per_s": n_tok / dt,
        "flops_per_s": flops / dt,
        "peak_fraction": flops / dt / peak,
    }


def completion_lengths(n, longest, seed):
    """n long-tailed completion lengths: the n quantiles (i + 1/2) / n of a log-normal with
    median longest / 8 whose top quantile is `longest` (so the longest is exactly 8x the
    median, for any n), in an order shuffled with `seed`."""
    z = np.array([statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    x = longest / 8 * np.exp(np.log(8) / z[-1] * z)
    return np.random.default_rng(seed).permutation(np.maximum(np.round(x), 1).astype(int))


def ideal_utilization(lengths, slots):
    """Utilization of FIFO continuous batching that refills a slot the step it frees, with no
    host time: below 1 only by the drain (slots idle while the last requests finish)."""
    free = [0] * slots
    end = 0
    for n in lengths:
        start = heapq.heappop(free)
        heapq.heappush(free, start + int(n))
        end = max(end, start + int(n))
    return int(np.sum(lengths)) / (slots * end)


def bench_generator(
    cfg, params, graphdef, slots, requests, prompt_len, longest, k, repeats, seed=0
):
    if requests % slots:
        raise ValueError(f"--requests={requests} must be a multiple of --slots={slots}")
    lengths = completion_lengths(requests, longest, seed)
    rng = np.random.default_rng(seed + 1)
    prompts = [
        rng.integers(4, cfg.vocab_size, int(n)).tolist()
        for n in rng.integers(prompt_len // 2, prompt_len + 1, requests)
    ]
    batches = [slice(i, i + slots) for i in range(0, requests, slots)]
    batch_keys = [jax.random.fold_in(jax.random.key(seed), b) for b in range(len(batches))]
    useful = int(lengths.sum())

    def scfg(max_new_tokens):
        return sampling.SamplingConfig(
            max_new_tokens=max_new_tokens, temperature=1.0, buckets=(prompt_len,)
        )

    # Request i = row j of batch b draws with fold_in(fold_in(key_b, j), 0) on both sides.
    reqs = [
        generator.Request(i, prompts[i], jax.random.fold_in(batch_keys[i // slots], i % slots), n)
        for i, n in enumerate(lengths.tolist())
    ]

    def run_engine():
        gen = generator.Generator(graphdef, cfg, scfg(longest), slots, prompt_len)
        gen.set_params(params, 0)
        t = time.perf_counter()
        gen.submit(reqs)  # Timed, as the static side's checks and padding are.
        done, calls = [], 0
        while gen.busy:
            done += gen.step(k).completed
            calls += 1
        return time.perf_counter() - t, gen.stats, calls, done

    sampler = sampling.Sampler(graphdef, cfg)

    def run_static():
        t = time.perf_counter()
        outs = [
            sampler(params, prompts[b], key, scfg(int(lengths[b].max())))
            for b, key in zip(batches, batch_keys)
        ]
        jax.block_until_ready(outs)
        return time.perf_counter() - t, outs

    # Untimed first passes compile every program: the engine's prefill sizes (its admissions
    # repeat exactly) and decode loop, and one static program per distinct batch max. Timed
    # passes alternate, so load from other processes falls on both sides alike; best of each.
    run_engine()
    run_static()
    engine_runs, static_runs = [], []
    for _ in range(repeats):
        engine_runs.append(run_engine())
        static_runs.append(run_static())
    engine_s, stats, calls, done = min(engine_runs, key=lambda r: r[0])
    static_s, outs = min(static_runs, key=lambda r: r[0])
    assert stats.tokens == useful, (stats.tokens, useful)
    static_steps = sum(int(np.asarray(o.lengths).max()) for o in outs)
    # Same keys, same policy: the two sides should draw the same tokens (up to float noise).
    by_id = {c.request.id: c for c in done}
    same = sum(
        int(np.sum(by_id[i].tokens_GM[0, :n] == np.asarray(outs[i // slots].tokens)[i % slots, :n]))
        for i, n in enumerate(lengths.tolist())
    )
    return {
        "slots": slots,
        "requests": requests,
        "prompt_len": prompt_len,
        "max_new_tokens": longest,
        "steps_per_call": k,
        "length_median": float(np.median(lengths)),
        "length_p90": float(np.percentile(lengths, 90)),
        "length_max": int(lengths.max()),
        "useful_tokens": useful,
        "same_tokens_fraction": same / useful,
        "ideal_utilization": ideal_utilization(lengths, slots),
        "engine_s": engine_s,
        "engine_decode_s": stats.decode_s,
        "engine_prefill_s": stats.prefill_s,
        "engine_steps": stats.steps,
        "engine_step_calls": calls,
        "engine_slot_steps": stats.slot_steps,
        "engine_tokens_per_s": useful / engine_s,
        "engine_utilization": stats.utilization,
        "static_s": static_s,
        "static_steps": static_steps,
        "static_slot_steps": slots * static_steps,
        "static_tokens_per_s": useful / static_s,
        "static_utilization": useful / (slots * static_steps),
    }


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


PARTS = ("decode", "train", "generator", "episodes")


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_enum("model", "small", list(model.config.NAMES), "the model", flag_values=fv)
    flags.DEFINE_integer("batch", 128, "decode batch", flag_values=fv)
    flags.DEFINE_integer("prompt_len", 64, "decode: prompt tokens", flag_values=fv)
    flags.DEFINE_integer("new_tokens", 192, "decode: new tokens", flag_values=fv)
    flags.DEFINE_integer("decode_phases", 8, "SamplingConfig.decode_phases", flag_values=fv)
    flags.DEFINE_integer("train_batch", 8, "train: batch", flag_values=fv)
    flags.DEFINE_integer("seq_len", 512, "train: sequence length", flag_values=fv)
    flags.DEFINE_string("dtype", None, "override the model's compute/param dtype", flag_values=fv)
    # 16 requests per slot: with fewer, the drain at the end (slots idle while the longest
    # requests finish) caps any FIFO engine's utilization below 0.9 (`ideal_utilization`).
    flags.DEFINE_integer("slots", 4, "generator: engine slots = static batch", flag_values=fv)
    flags.DEFINE_integer("requests", 64, "generator: a multiple of --slots", flag_values=fv)
    flags.DEFINE_integer("gen_tokens", 192, "generator: longest completion", flag_values=fv)
    flags.DEFINE_integer("steps_per_call", 4, "generator: Generator.step(k)", flag_values=fv)
    flags.DEFINE_integer("gen_prompt_len", 16, "generator: longest prompt", flag_values=fv)
    flags.DEFINE_integer("ep_slots", 8, "episodes: engine slots", flag_values=fv)
    # 16 requests per slot: with fewer, the drain at the end (the last episodes' turns and
    # tool calls, with fewer samples ready than slots) weighs more than the run.
    flags.DEFINE_integer("ep_requests", 128, "episodes: requests (episodes)", flag_values=fv)
    flags.DEFINE_integer("ep_tokens", 192, "episodes: max_new_tokens", flag_values=fv)
    flags.DEFINE_integer("turn_tokens", 24, "episodes: ~policy tokens a turn", flag_values=fv)
    flags.DEFINE_integer("turns", 4, "episodes: env.max_turns", flag_values=fv)
    flags.DEFINE_integer("reply_tokens", 4, "episodes: tokens of each reply", flag_values=fv)
    flags.DEFINE_float("latency_ms", 50.0, "episodes: each env call's latency", flag_values=fv)
    flags.DEFINE_integer("parked", 56, "episodes: Generator(parked=...)", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed repeats (the best counts)", flag_values=fv)
    flags.DEFINE_list("only", list(PARTS), "comma list of parts to run", flag_values=fv)
    flags.DEFINE_list("skip", [], "comma list of parts to skip", flag_values=fv)
    flags.DEFINE_string("out", None, "write the results as JSON here", flag_values=fv)


def main(fv: flags.FlagValues) -> None:
    args = fv  # The flags, read below as `args`.
    parts = set(filter(None, args.only)) - set(filter(None, args.skip))
    unknown = parts - set(PARTS)
    if unknown:
        raise ValueError(f"unknown part(s) {sorted(unknown)}; known: {', '.join(PARTS)}")

    overrides = {}
    if args.dtype:
        overrides = dict(dtype=args.dtype, param_dtype=args.dtype)
    cfg = model.get(args.model, **overrides)
    cfg = model.get(
        args.model,
        **overrides,
        max_seq_len=max(
            cfg.max_seq_len,
            args.prompt_len + args.new_tokens,
            args.gen_prompt_len + args.gen_tokens,
            args.seq_len,
        ),
    )
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    results = {
        "device": str(jax.devices()[0].device_kind),
        "num_devices": jax.device_count(),
        "model": args.model,
        "params": cfg.num_params(),
        "dtype": cfg.dtype,
    }
    if parts & {"decode", "train"}:  # Their rooflines; the generator section needs neither.
        peak = peak_matmul_flops(jnp.dtype(cfg.dtype))
        bw = memory_bandwidth()
        results["peak_matmul_flops_per_s"] = peak
        results["memory_bandwidth_bytes_per_s"] = bw
    if "decode" in parts:
        results["decode"] = bench_decode(
            cfg,
            params,
            graphdef,
            args.batch,
            args.prompt_len,
            args.new_tokens,
            args.decode_phases,
            peak,
            bw,
            args.repeats,
        )
    if "train" in parts:
        results["train"] = bench_train(
            cfg, params, graphdef, args.train_batch, args.seq_len, peak, args.repeats
        )
    if "generator" in parts:
        t = time.perf_counter()
        results["generator"] = bench_generator(
            cfg,
            params,
            graphdef,
            args.slots,
            args.requests,
            args.gen_prompt_len,
            args.gen_tokens,
            args.steps_per_call,
            args.repeats,
        )
        results["generator"]["section_s"] = time.perf_counter() - t
    if "episodes" in parts:
        t = time.perf_counter()
        results["episodes"] = bench_episodes(
            cfg,
            params,
            graphdef,
            args.ep_slots,
            args.ep_requests,
            args.gen_prompt_len,
            args.ep_tokens,
            args.turn_tokens,
            args.turns,
            args.reply_tokens,
            args.latency_ms / 1000,
            args.parked,
            args.steps_per_call,
            args.repeats,
        )
        results["episodes"]["section_s"] = time.perf_counter() - t

    print(
        f"device {results['device']} x{results['num_devices']}  model {args.model} "
        f"({cfg.num_params() / 1e6:.1f}M params, {cfg.dtype})"
    )
    if parts & {"decode", "train"}:
        print(f"peak matmul {peak / 1e9:8.1f} GFLOP/s   memory bandwidth {bw / 1e9:6.1f} GB/s")
        print(f"{'part':<8}{'shape':<22}{'tokens/s':>12}{'GFLOP/s':>10}{'roofline':>10}")
    if "decode" in results:
        d = results["decode"]
        shape = f"B={d['batch']} P={d['prompt_len']} M={d['new_tokens']}/{d['decode_phases']}ph"
        print(
            f"{'decode':<8}{shape:<22}"
            f"{d['decode_tokens_per_s']:>12.0f}{d['decode_flops_per_s'] / 1e9:>10.1f}"
            f"{d['decode_roofline_fraction']:>10.1%}"
        )
    if "train" in results:
        t = results["train"]
        shape = f"B={t['batch']} T={t['seq_len']}"
        print(
            f"{'train':<8}{shape:<22}{t['tokens_per_s']:>12.0f}"
            f"{t['flops_per_s'] / 1e9:>10.1f}{t['peak_fraction']:>10.1%}"
        )
    if "generator" in results:
        g = results["generator"]
        print(
            f"generator S={g['slots']} requests={g['requests']} P<={g['prompt_len']} "
            f"k={g['steps_per_call']}  completion lengths: median {g['length_median']:.0f} "
            f"p90 {g['length_p90']:.0f} max {g['length_max']}  ({g['useful_tokens']} tokens)"
        )
        print(f"{'':<16}{'wall s':>8}{'slot-steps':>12}{'tokens/s':>10}{'util':>8}")
        for side in ("engine", "static"):
            print(
                f"{side:<16}{g[side + '_s']:>8.1f}{g[side + '_slot_steps']:>12}"
                f"{g[side + '_tokens_per_s']:>10.0f}{g[side + '_utilization']:>8.1%}"
            )
        ratio = g["engine_tokens_per_s"] / g["static_tokens_per_s"]
        util_ratio = g["engine_utilization"] / g["static_utilization"]
        print(f"{'engine/static':<16}{'':>20}{ratio:>9.2f}x{util_ratio:>7.2f}x")
        host = g["engine_s"] - g["engine_decode_s"] - g["engine_prefill_s"]
        print(
            f"engine: {g['engine_steps']} steps in {g['engine_step_calls']} calls, decode "
            f"{g['engine_decode_s']:.1f} s, prefill {g['engine_prefill_s']:.1f} s, host "
            f"{host:.1f} s; ideal utilization (drain only) {g['ideal_utilization']:.1%}; "
            f"same tokens as static {g['same_tokens_fraction']:.1%}; section "
            f"{g['section_s']:.0f} s"
        )
    if "episodes" in results:
        print_episodes(results["episodes"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    cli.run_command(define_flags, main)
