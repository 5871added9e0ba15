"""`tools/gpu_check.py`'s files: its results as JSON, and as Markdown (a machine line and
table rows, ready for docs/benchmarks.md), both rewritten after every section."""

import json
import os
import subprocess


def commit(root: str) -> str | None:
    """The checkout's short commit ("-dirty" with uncommitted changes), or None (a copy of
    the tree without its git directory)."""

    def git(*args):
        return subprocess.run(
            ["git", "-C", root, *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def writer(out: str | None, md: str | None):
    """A function that writes the results to `out` (JSON) and `md` (Markdown), each
    replaced whole (a reader never sees half a file)."""

    def put(path, text):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def write(results):
        if out:
            put(out, json.dumps(results, indent=2, default=str) + "\n")
        if md:
            put(md, markdown(results))

    return write


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def machine_line(results: dict) -> str:
    """The machine the figures are from: device, table row, versions, measured ceilings."""
    s = results["sections"]
    m = s.get("machine", {})
    if m.get("status") != "ok":
        return f"**Machine**: unknown (the machine section: {m.get('error', 'not run')})"
    v, cuda, smi = m["versions"], m["cuda"], m["nvidia_smi"]
    parts = [f"{m['device_kind']} x{m['device_count']}"]
    if m["table"]:
        t = m["table"]
        parts.append(
            f"table row `{m['accelerator']}`: {_si(t['peak_flops'], 'FLOP/s')} dense bf16, "
            f"{_si(t['hbm_bandwidth'], 'B/s')} HBM"
        )
    if m.get("table_error"):
        parts.append(m["table_error"].splitlines()[0])
    if smi.get("driver_version"):
        parts.append(f"driver {smi['driver_version']}")
    if cuda:
        parts.append("CUDA " + ", ".join(f"{k} {val}" for k, val in sorted(cuda.items())))
    plugins = ", ".join(f"{k} {val}" for k, val in v.items() if k.startswith("jax-cuda"))
    jax_line = f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}"
    parts.append(jax_line + (f", {plugins}" if plugins else ""))
    parts.append(f"Python {m['python']}")
    c = s.get("ceilings", {})
    if c.get("status") == "ok":
        parts.append(
            f"measured: {c['matmul_dtype']} matmul {_si(c['matmul_flops_per_s'], 'FLOP/s')}, "
            f"read bandwidth {_si(c['read_bytes_per_s'], 'B/s')}"
        )
    head = f"commit `{results['commit']}`, " if results.get("commit") else ""
    wall = f"{results.get('wall_s', 0):.0f} s of {results['budget_s']:.0f}"
    return f"**Machine**: {'; '.join(parts)}. {head}`tools/gpu_check` ({results['mode']}) {wall}."


def _train_row(r):
    shape = (
        f"{r['rows']} rows x {r['prompt_len'] + r['completion_len']} tokens ({r['prompts']} "
        f"prompts x {r['group_size']}, P={r['prompt_len']}, M={r['completion_len']}), "
        f"remat {r['remat']}"
    )
    figure = (
        f"{r['tokens_per_s']:,.0f} tokens/s, {_si(r['model_flops_per_s'], 'FLOP/s')} "
        f"(step {r['step_s']:.3f} s)"
    )
    peak = f"{_si(r['peak_flops_per_s'], 'FLOP/s')} ({r['peak_source']})"
    return ["train step (learner update)", r["model"], shape, figure, peak, f"MFU {r['mfu']:.1%}"]


def _decode_row(r):
    shape = (
        f"S={r['slots']}, P={r['prompt_len']}, M={r['new_tokens']}, step({r['steps_per_call']}), "
        f"{r['cache_columns']} cache columns"
    )
    figure = (
        f"{r['decode_tokens_per_s']:,.0f} tokens/s, {_si(r['bytes_per_step'], 'B')}/step at "
        f"{_si(r['bytes_per_s'], 'B/s')}"
    )
    against = f"{_si(r['hbm_bytes_per_s'], 'B/s')} HBM ({r['peak_source']})"
    fraction = f"{r['hbm_fraction']:.1%} of HBM; roofline {r['roofline_fraction']:.1%}"
    return ["decode (engine)", r["model"], shape, figure, against, fraction]


def _engine_row(r):
    shape = (
        f"S={r['slots']}, {r['requests']} long-tailed requests, M<={r['max_new_tokens']}, "
        f"step({r['steps_per_call']})"
    )
    figure = f"{r['engine_tokens_per_s']:,.0f} tokens/s ({r['useful_tokens']:,} tokens)"
    against = f"ideal utilization {r['ideal_utilization']:.1%}"
    return ["engine, long-tailed", r["model"], shape, figure, against,
            f"utilization {r['engine_utilization']:.1%}"]  # fmt: skip


def _paged_row(r):
    shape = (
        f"S={r['slots']}, {r['requests']} groups of {r['samples']}, P={r['prompt_len']}, "
        f"M<={r['max_new_tokens']}, blocks of {r['kv_block_size']}"
    )
    figure = (
        f"paged {r['useful_tokens'] / r['paged_s']:,.0f} tokens/s, "
        f"{_si(r['paged_kv_bytes_per_live_token'], 'B')} KV per live token"
    )
    against = (
        f"dense {r['engine_tokens_per_s']:,.0f} tokens/s, "
        f"{_si(r['engine_kv_bytes_per_live_token'], 'B')} per live token"
    )
    ratio = r["engine_kv_bytes_per_live_token"] / r["paged_kv_bytes_per_live_token"]
    speed = r["engine_s"] / r["paged_s"]
    if "preempt_s" in r:  # Both paged sides on a pool smaller than the dense rows'.
        shape += f", a pool of {r['kv_blocks']} (dense {r['paged_kv_blocks_dense']})"
        figure += (
            f", utilization {r['paged_utilization']:.1%}; preempting "
            f"{r['useful_tokens'] / r['preempt_s']:,.0f} tokens/s, utilization "
            f"{r['preempt_utilization']:.1%} ({r['preempted']} preempted)"
        )
        against += f", utilization {r['engine_utilization']:.1%}"
    return ["engine, paged vs dense", r["model"], shape, figure, against,
            f"{ratio:.2f}x less KV; {speed:.2f}x the speed"]  # fmt: skip


def _attention_row(r):
    figure = (
        f"{r['tokens_per_s']:,.0f} tokens/s, {_si(r['model_flops_per_s'], 'FLOP/s')} "
        f"(attention {r['attention_flops_share']:.0%} of the FLOPs)"
    )
    peak = f"{_si(r['peak_flops_per_s'], 'FLOP/s')} ({r['peak_source']})"
    return [f"forward + backward, attention `{r['attention']}`", r["model"],
            f"B={r['batch']}, T={r['seq_len']}", figure, peak, f"MFU {r['mfu']:.1%}"]  # fmt: skip


def _quickstart_row(r):
    s = r.get("summary", {})
    figure = f"{r['wall_s']:.1f} s wall"
    if "end/eval_pass@1" in s:
        figure += f"; pass@1 {s['start/eval_pass@1']:.3f} -> {s['end/eval_pass@1']:.3f}"
    return ["quickstart", "the config's", f"`--config {r['config']}`", figure, "", ""]


ROWS = {
    "train": _train_row,
    "decode": _decode_row,
    "engine": _engine_row,
    "paged": _paged_row,
    "attention": _attention_row,
    "quickstart": _quickstart_row,
}


def markdown(results: dict) -> str:
    """The machine line, a table row per section with figures, and a line per section that
    failed, was skipped or ran out of time."""
    lines = [machine_line(results), ""]
    lines.append("| section | model | shape | figure | against | fraction |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    notes = []
    for name, r in results["sections"].items():
        kind = name.split("/")[0]
        if r.get("error") == "--part":  # Another part's: not this run's to report.
            continue
        if r["status"] != "ok":
            notes.append(f"* `{name}` {r['status']}: {r.get('error', '')}".splitlines()[0])
        elif kind in ROWS:
            lines.append("| " + " | ".join(ROWS[kind](r)) + " |")
    if results["mode"] == "tiny":
        notes.append("* `--tiny`: tiny models on this machine; proves the command runs, no result.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
