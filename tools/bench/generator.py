"""The generator section: continuous batching (`generator.Generator`) against static
batching (`Sampler` on batches of as many requests as the engine has slots, in the same order)
on requests whose completion lengths are long-tailed (`completion_lengths`; no stop tokens, so
each request's budget is its length). A static batch decodes until its longest row is done,
so both sides produce the same useful tokens. Utilization = useful tokens / slot-steps;
tokens/s over wall time, prefill included, compilation excluded (an untimed first pass
compiles every program). The bound is the utilization of an ideal engine on the same
workload (`ideal_utilization`).

With `samples` = G > 1 each request is a group of G samples (G slots, the static side left
out); with `kv_block_size` > 0 the engine also runs with a paged KV cache (`sampling.paged`)
on the same requests, and both engines report their KV cache bytes held per live token (the
cache columns held, sampled after each decode call and weighted by its steps, over the
unfinished samples' prompt and completion tokens), their prefill rows per group and the
prompt KV columns a group writes."""

import heapq
import statistics
import time
from typing import NamedTuple

import jax
import numpy as np

from rlscale.sampling import generator, paged
from rlscale.sampling import sampler as sampling
from rlscale.scaling.compute import matmul_params


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


class GeneratorWorkload(NamedTuple):
    """The section's requests: their completion lengths, prompts, the static side's batches
    (slices of the requests) and their keys, and the engine's `Request`s (request i = row j
    of batch b draws with fold_in(fold_in(key_b, j), 0) on both sides)."""

    lengths: np.ndarray
    prompts: list
    batches: list
    batch_keys: list
    requests: list


def generator_workload(cfg, slots, requests, prompt_len, longest, seed=0):
    """`requests` random prompts of prompt_len / 2 to prompt_len tokens with long-tailed
    completion lengths up to `longest`, in batches of `slots`."""
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
    reqs = [
        generator.Request(i, prompts[i], jax.random.fold_in(batch_keys[i // slots], i % slots), n)
        for i, n in enumerate(lengths.tolist())
    ]
    return GeneratorWorkload(lengths, prompts, batches, batch_keys, reqs)


def sampling_config(prompt_len, max_new_tokens, samples=1, **paging):
    """Both sides' sampling settings: temperature 1, one prompt bucket, no stop tokens;
    `paging`: the paged cache's settings (`kv_block_size`, `kv_blocks`, `kv_preempt`)."""
    return sampling.SamplingConfig(
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        buckets=(prompt_len,),
        num_samples=samples,
        **paging,
    )


def run_engine(cfg, params, graphdef, work, slots, prompt_len, k, samples=1, **paging):
    """The workload through a new `Generator` of `slots` slots, `step(k)` until it is idle:
    (wall seconds, `EngineStats`, step calls, the `Completed` requests)."""
    scfg = sampling_config(prompt_len, int(work.lengths.max()), samples, **paging)
    gen = generator.Generator(graphdef, cfg, scfg, slots, prompt_len)
    gen.set_params(params, 0)
    t = time.perf_counter()
    gen.submit(work.requests)  # Timed, as the static side's checks and padding are.
    done, calls = [], 0
    while gen.busy:
        done += gen.step(k).completed
        calls += 1
    return time.perf_counter() - t, gen.stats, calls, done


def run_static(params, sampler, work, prompt_len):
    """The workload's batches through the static `sampler`, each to its longest length:
    (wall seconds, the `SampleOutput` of each batch)."""
    t = time.perf_counter()
    outs = []
    for b, key in zip(work.batches, work.batch_keys):
        scfg = sampling_config(prompt_len, int(work.lengths[b].max()))
        outs.append(sampler(params, work.prompts[b], key, scfg))
    jax.block_until_ready(outs)
    return time.perf_counter() - t, outs


def bench_generator(
    cfg, params, graphdef, slots, requests, prompt_len, longest, k, repeats, seed=0, static=True,
    samples=1, kv_block_size=0, kv_blocks=0,
):  # fmt: skip
    """The section (module docstring) on `requests` requests of `samples` samples: the engine
    with `slots` slots and `step(k)`, the best of `repeats` timed runs; without `static` (or
    with groups), the engine alone; with `kv_block_size`, a paged engine too, with a pool
    of `kv_blocks` blocks (0: as many as the dense rows take), and with a smaller pool a
    preempting one (`kv_preempt`) on the same pool. Returns its figures (the static side's,
    and the tokens both sides drew alike, with `static`)."""
    work = generator_workload(cfg, slots, requests, prompt_len, longest, seed)
    lengths = work.lengths
    useful = samples * int(lengths.sum())
    engine = lambda **paging: run_engine(  # noqa: E731
        cfg, params, graphdef, work, slots, prompt_len, k, samples, **paging
    )
    sampler = sampling.Sampler(graphdef, cfg)
    sides = {"engine": lambda: engine()}
    paging = dict(kv_block_size=kv_block_size, kv_blocks=kv_blocks)
    if kv_block_size:
        sides["paged"] = lambda: engine(**paging)
    if kv_block_size and kv_blocks:
        sides["preempt"] = lambda: engine(**paging, kv_preempt=True)
    if static and samples == 1:
        sides["static"] = lambda: run_static(params, sampler, work, prompt_len)
    # Untimed first passes compile every program: the engine's prefill sizes (its admissions
    # repeat exactly) and decode loop, and one static program per distinct batch max. Timed
    # passes alternate, so load from other processes falls on both sides alike; best of each.
    for run in sides.values():
        run()
    runs = {side: [] for side in sides}
    for _ in range(repeats):
        for side, run in sides.items():
            runs[side].append(run())
    engine_s, stats, calls, done = min(runs["engine"], key=lambda r: r[0])
    assert stats.tokens == useful, (stats.tokens, useful)
    out = {
        "slots": slots,
        "requests": requests,
        "prompt_len": prompt_len,
        "max_new_tokens": longest,
        "steps_per_call": k,
        "length_median": float(np.median(lengths)),
        "length_p90": float(np.percentile(lengths, 90)),
        "length_max": int(lengths.max()),
        "useful_tokens": useful,
        "ideal_utilization": ideal_utilization(lengths, slots // samples),
        "samples": samples,
        "engine_s": engine_s,
        "engine_decode_s": stats.decode_s,
        "engine_prefill_s": stats.prefill_s,
        "engine_steps": stats.steps,
        "engine_step_calls": calls,
        "engine_slot_steps": stats.slot_steps,
        "engine_tokens_per_s": useful / engine_s,
        "engine_utilization": stats.utilization,
        **kv_figures(cfg, "engine", stats, requests, samples, prompt_len, 0),
    }
    if kv_block_size:
        paged_s, paged, _, paged_done = min(runs["paged"], key=lambda r: r[0])
        assert paged.tokens == useful, (paged.tokens, useful)
        out.update(kv_figures(cfg, "paged", paged, requests, samples, prompt_len, kv_block_size))
        out["paged_s"], out["paged_kv_blocks_peak"] = paged_s, paged.kv_blocks_peak
        out["paged_kv_blocks_dense"] = slots * (prompt_len + longest) // kv_block_size
        out["kv_block_size"] = kv_block_size
        same = [np.array_equal(a.tokens_GM, b.tokens_GM) for a, b in zip(done, paged_done)]
        out["paged_same_requests_fraction"] = float(np.mean(same))
        out["paged_utilization"], out["kv_blocks"] = paged.utilization, kv_blocks
    if "preempt" in runs:
        pre_s, pre, _, pre_done = min(runs["preempt"], key=lambda r: r[0])
        assert pre.tokens == useful, (pre.tokens, useful)
        same = [np.array_equal(a.tokens_GM, b.tokens_GM) for a, b in zip(done, pre_done)]
        out.update(
            preempt_s=pre_s,
            preempt_utilization=pre.utilization,
            preempt_kv_blocks_peak=pre.kv_blocks_peak,
            preempted=pre.preempted,
            preempt_swap_s=pre.preempt_s,
            preempt_same_requests_fraction=float(np.mean(same)),
        )
    if "static" in runs:
        out.update(static_figures(work, slots, done, min(runs["static"], key=lambda r: r[0])))
    return out


def kv_figures(cfg, side, stats, requests, samples, prompt_len, block_size):
    """An engine's KV cache figures (module docstring): bytes held per live token, prefill
    rows per group, and the prompt KV columns a group writes (dense: one prompt per sample;
    paged: its shared blocks once and one block per sample, `sampling.paged`)."""
    column = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    column *= np.dtype(cfg.compute_dtype).itemsize
    written = samples * prompt_len
    if block_size:
        written = (paged.own_from(prompt_len, block_size) + samples) * block_size
    return {
        f"{side}_kv_bytes_per_live_token": stats.kv_columns * column / stats.live_tokens,
        f"{side}_prefill_rows_per_group": stats.prefill_rows / requests,
        f"{side}_prefills": stats.prefills,
        f"{side}_prompt_kv_columns_per_group": written,
    }


def static_figures(work, slots, done, static_run):
    """The static side's figures, and the share of the useful tokens that the engine's
    completions `done` drew alike (same keys, same policy: all of them, up to float noise)."""
    static_s, outs = static_run
    useful = int(work.lengths.sum())
    static_steps = sum(int(np.asarray(o.lengths).max()) for o in outs)
    by_id = {c.request.id: c for c in done}
    same = sum(
        int(np.sum(by_id[i].tokens_GM[0, :n] == np.asarray(outs[i // slots].tokens)[i % slots, :n]))
        for i, n in enumerate(work.lengths.tolist())
    )
    return {
        "same_tokens_fraction": same / useful,
        "static_s": static_s,
        "static_steps": static_steps,
        "static_slot_steps": slots * static_steps,
        "static_tokens_per_s": useful / static_s,
        "static_utilization": useful / (slots * static_steps),
    }


def bench_engine_decode(
    cfg, params, graphdef, slots, prompt_len, new_tokens, k, peak, bw, deadline, runs=(1, 3)
):
    """The engine decoding: `slots` requests of `prompt_len` random tokens, admitted at once,
    each decoding `new_tokens` tokens (no stops) by `step(k)`; after an untimed run that
    compiles, at least `runs[0]` and at most `runs[1]` timed runs, stopping at `deadline`
    (`time.perf_counter()`) once the least are done; the one with the least decode time
    counts (`EngineStats.decode_s`: the decode calls, waited on; the prefill apart).

    Every step reads every weight and the engine's whole KV cache (each slot attends over
    every column of its row, masked): bytes per step = the params' bytes + the cache's K and
    V. FLOPs per step = 2 x (matmul params) x slots + 4 x layers x heads x head_dim x
    columns x slots. Against `bw` (bytes/s) and `peak` (FLOP/s): the achieved bandwidth and
    the roofline fraction, max(FLOPs / peak, bytes / bw) per step / the measured step."""
    scfg = sampling_config(prompt_len, new_tokens)
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, cfg.vocab_size, (slots, prompt_len)).tolist()
    keys = [jax.random.fold_in(jax.random.key(0), i) for i in range(slots)]
    reqs = [generator.Request(i, p, key) for i, (p, key) in enumerate(zip(prompts, keys))]

    def run():
        gen = generator.Generator(graphdef, cfg, scfg, slots, prompt_len)
        gen.set_params(params, 0)
        gen.submit(reqs)
        while gen.busy:
            gen.step(k)
        return gen

    gen = run()  # Compiles.
    timed = []
    while len(timed) < runs[1] and (len(timed) < runs[0] or time.perf_counter() < deadline):
        timed.append(run().stats)
    stats = min(timed, key=lambda s: s.decode_s)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    cache_bytes = sum(x.nbytes for x in (*gen.state.cache.k, *gen.state.cache.v))
    columns = gen.state.cache.valid_BS.shape[1]
    step_bytes = param_bytes + cache_bytes
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * columns * slots
    step_flops = 2 * matmul_params(cfg) * slots + attention
    step_s = stats.decode_s / stats.steps
    return {
        "slots": slots,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "steps_per_call": k,
        "cache_columns": columns,
        "timed_runs": len(timed),
        "steps": stats.steps,
        "tokens": stats.tokens,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "decode_tokens_per_s": stats.tokens / stats.decode_s,
        "step_s": step_s,
        "param_bytes": param_bytes,
        "kv_cache_bytes": cache_bytes,
        "bytes_per_step": step_bytes,
        "flops_per_step": step_flops,
        "bytes_per_s": step_bytes / step_s,
        "hbm_bytes_per_s": bw,
        "hbm_fraction": step_bytes / step_s / bw,
        "peak_flops_per_s": peak,
        "roofline_fraction": max(step_flops / peak, step_bytes / bw) / step_s,
    }


def print_generator(g):
    """The section's table: wall time, slot-steps, tokens/s and utilization of each side,
    their ratios, and where the engine's time went."""
    print(
        f"generator S={g['slots']} requests={g['requests']} G={g['samples']} "
        f"P<={g['prompt_len']} "
        f"k={g['steps_per_call']}  completion lengths: median {g['length_median']:.0f} "
        f"p90 {g['length_p90']:.0f} max {g['length_max']}  ({g['useful_tokens']} tokens)"
    )
    print(f"{'':<16}{'wall s':>8}{'slot-steps':>12}{'tokens/s':>10}{'util':>8}")
    sides = ("engine", "static") if "static_s" in g else ("engine",)
    for side in sides:
        print(
            f"{side:<16}{g[side + '_s']:>8.1f}{g[side + '_slot_steps']:>12}"
            f"{g[side + '_tokens_per_s']:>10.0f}{g[side + '_utilization']:>8.1%}"
        )
    same = ""
    if "static_s" in g:
        ratio = g["engine_tokens_per_s"] / g["static_tokens_per_s"]
        util_ratio = g["engine_utilization"] / g["static_utilization"]
        print(f"{'engine/static':<16}{'':>20}{ratio:>9.2f}x{util_ratio:>7.2f}x")
        same = f"same tokens as static {g['same_tokens_fraction']:.1%}; "
    if "paged_s" in g:
        print_paged(g)
    host = g["engine_s"] - g["engine_decode_s"] - g["engine_prefill_s"]
    print(
        f"engine: {g['engine_steps']} steps in {g['engine_step_calls']} calls, decode "
        f"{g['engine_decode_s']:.1f} s, prefill {g['engine_prefill_s']:.1f} s, host "
        f"{host:.1f} s; ideal utilization (drain only) {g['ideal_utilization']:.1%}; "
        f"{same}section {g['section_s']:.0f} s"
    )


def print_paged(g):
    """The dense and the paged engine's KV cache figures, and their ratios."""
    print(f"{'':<16}{'KV B/live token':>16}{'prefill rows/group':>20}{'prompt KV cols/group':>22}")
    for side in ("engine", "paged"):
        print(
            f"{side:<16}{g[side + '_kv_bytes_per_live_token']:>16.0f}"
            f"{g[side + '_prefill_rows_per_group']:>20.2f}"
            f"{g[side + '_prompt_kv_columns_per_group']:>22}"
        )
    kv = g["engine_kv_bytes_per_live_token"] / g["paged_kv_bytes_per_live_token"]
    cols = g["engine_prompt_kv_columns_per_group"] / g["paged_prompt_kv_columns_per_group"]
    print(
        f"{'dense/paged':<16}{kv:>15.2f}x{'':>20}{cols:>21.2f}x   paged: block "
        f"{g['kv_block_size']}, peak {g['paged_kv_blocks_peak']} of the dense "
        f"{g['paged_kv_blocks_dense']} blocks, wall {g['paged_s']:.1f} s, "
        f"same tokens as dense in {g['paged_same_requests_fraction']:.0%} of the requests"
    )
    if "preempt_s" not in g:
        return
    print(
        f"pool of {g['kv_blocks']} blocks: reserving worst cases utilization "
        f"{g['paged_utilization']:.3f} ({g['paged_s']:.1f} s); preempting "
        f"{g['preempt_utilization']:.3f} ({g['preempt_s']:.1f} s, {g['preempted']} samples "
        f"preempted, {g['preempt_swap_s']:.2f} s swapping, peak {g['preempt_kv_blocks_peak']} "
        f"blocks, same tokens as dense in {g['preempt_same_requests_fraction']:.0%}); dense "
        f"rows {g['engine_utilization']:.3f}"
    )
