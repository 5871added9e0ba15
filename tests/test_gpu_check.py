"""`tools/gpu_check.py`: its `--tiny` run writes every section's figures, finite and
consistent with each other and with counts re-derived here from the model's own params; a
command it times is killed at its limit; the deadline stops a section and writes what is
done; an attention name the model lacks fails naming the field."""

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rlscale import model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_check.py")
# The figures are float64 ratios and sums of a few exact integers, computed in another order.
REL = 1e-12


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numbers(tree, where=""):
    """(path, value) of every number in a JSON tree."""
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _numbers(v, f"{where}/{k}")]
    if isinstance(tree, list):
        return [x for i, v in enumerate(tree) for x in _numbers(v, f"{where}[{i}]")]
    return [(where, tree)] if isinstance(tree, (int, float)) and not isinstance(tree, bool) else []


def _param_counts(cfg):
    """(all params, the LM head's, the embedding's), counted from an initialized model."""
    params = model.init_params(cfg, jax.random.key(0))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    sizes = {jax.tree_util.keystr(path): x.size for path, x in leaves}
    head = sum(n for k, n in sizes.items() if k.startswith("['lm_head']"))
    embed = sum(n for k, n in sizes.items() if k.startswith("['embedding']"))
    return sum(sizes.values()), head, embed


def _check_train(t, cfg, peak):
    total, head, embed = _param_counts(cfg)
    body = total - head - embed  # Untied: the head's matmul is its own V x D weight.
    N, P, M = t["rows"], t["prompt_len"], t["completion_len"]
    T = P + M
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * N * T * (T + 1) / 2
    F = 2 * body * N * T + 2 * head * N * M + attn
    assert t["model_flops_per_step"] == pytest.approx(F * (3 + t["no_grad_passes"]), rel=REL)
    assert t["tokens_per_step"] == N * T and N == t["prompts"] * t["group_size"]
    assert t["step_s"] == statistics.median(t["step_times_s"])
    assert t["tokens_per_s"] == pytest.approx(N * T / t["step_s"], rel=REL)
    assert t["model_flops_per_s"] == pytest.approx(F * (3 + t["no_grad_passes"]) / t["step_s"])
    assert t["peak_flops_per_s"] == peak
    assert t["mfu"] == pytest.approx(t["model_flops_per_s"] / peak, rel=REL)
    assert all(t["updates_applied"]) and len(t["updates_applied"]) == len(t["step_times_s"]) + 1


def _check_decode(d, cfg, peak, bandwidth):
    total, _, embed = _param_counts(cfg)
    S, C = d["slots"], d["cache_columns"]
    assert C == d["prompt_len"] + d["new_tokens"]  # One prompt bucket + the budget.
    assert d["steps"] == d["new_tokens"] and d["tokens"] == S * d["new_tokens"]
    itemsize = np.dtype(cfg.dtype).itemsize
    assert d["param_bytes"] == total * itemsize
    kv = 2 * cfg.num_layers * S * cfg.num_kv_heads * cfg.head_dim * C * itemsize
    assert d["kv_cache_bytes"] == kv and d["bytes_per_step"] == total * itemsize + kv
    assert d["step_s"] == pytest.approx(d["decode_s"] / d["steps"], rel=REL)
    assert d["decode_tokens_per_s"] == pytest.approx(d["tokens"] / d["decode_s"], rel=REL)
    assert d["bytes_per_s"] == pytest.approx(d["bytes_per_step"] / d["step_s"], rel=REL)
    assert d["hbm_bytes_per_s"] == bandwidth
    assert d["hbm_fraction"] == pytest.approx(d["bytes_per_s"] / bandwidth, rel=REL)
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * C * S  # Over every column.
    assert d["flops_per_step"] == 2 * (total - embed) * S + attn and d["peak_flops_per_s"] == peak
    bound = max(d["flops_per_step"] / peak, d["bytes_per_step"] / bandwidth)
    assert d["roofline_fraction"] == pytest.approx(bound / d["step_s"], rel=REL)


def _check_attention(a, cfg, peak):
    total, _, embed = _param_counts(cfg)
    B, T = a["batch"], a["seq_len"]
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * B * T * (T + 1) / 2
    flops = 3 * (2 * (total - embed) * B * T + attn)  # The head runs on every token here.
    assert a["model_flops_per_step"] == pytest.approx(flops, rel=REL)
    assert a["attention_flops_share"] == pytest.approx(3 * attn / flops, rel=REL)
    assert a["tokens_per_s"] == pytest.approx(B * T / a["step_s"], rel=REL)
    assert a["mfu"] == pytest.approx(flops / a["step_s"] / peak, rel=REL)


@pytest.mark.slow
def test_tiny_run_writes_consistent_figures(tmp_path):
    out, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    cmd = [sys.executable, TOOL, "--tiny", "--out", str(out), "--markdown", str(md)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    s = r["sections"]
    expected = ["machine", "ceilings", "train/tiny"]
    expected += [f"attention/{name}" for name in _tool().attention_names()]
    expected += ["decode/tiny", "engine", "paged"]  # Attention on the train section's params.
    assert list(s) == expected and all(s[k]["status"] == "ok" for k in s), s
    bad = [(k, v) for k, v in _numbers(r) if not math.isfinite(v)]
    assert not bad, bad
    cfg = model.get("tiny")
    m, c = s["machine"], s["ceilings"]
    assert m["device_kind"] == jax.devices()[0].device_kind and m["table"] is None
    peak, bandwidth = c["matmul_flops_per_s"], c["read_bytes_per_s"]  # A CPU has no row.
    _check_train(s["train/tiny"], cfg, peak)
    _check_decode(s["decode/tiny"], cfg, peak, bandwidth)
    e = s["engine"]
    assert e["engine_tokens_per_s"] == pytest.approx(e["useful_tokens"] / e["engine_s"], rel=REL)
    assert e["engine_utilization"] == pytest.approx(
        e["useful_tokens"] / e["engine_slot_steps"], rel=REL
    )
    p = s["paged"]  # Both engines drew the same tokens; the paged one holds less KV.
    assert p["paged_same_requests_fraction"] == 1.0, p
    assert p["paged_kv_bytes_per_live_token"] < p["engine_kv_bytes_per_live_token"], p
    _check_attention(s["attention/xla"], cfg, peak)
    rows = [line for line in md.read_text().splitlines() if line.startswith("| ")]
    # Header, rule; train, decode, engine, paged, one per attention implementation.
    assert len(rows) == 2 + 4 + len(_tool().attention_names()), rows
    assert "proves the command runs" in md.read_text()


def test_the_two_parts_run_every_section_each_in_one_device_call(monkeypatch):
    """`--part train` and `--part generate` together run every section of the GPU plan (the
    machine and ceilings in both), and each one's shares fit the issue's 8 minutes, inside one
    device call (600 s) with room for Python's start and the imports."""
    tool = _tool()
    monkeypatch.setattr(tool, "attention_names", lambda: ("xla", "dot_product", "cudnn"))
    sections = tool.schedule(tool.GPU, tool.Context(""), tool.GPU.quickstart, None)
    names = [n for n, _, _ in sections]
    runs = {}
    for part in ("train", "generate"):
        skip = tool.skipped(names, [], part)
        assert set(skip.values()) == {"--part"}
        runs[part] = [n for n in names if n not in skip]
        assert sum(s for n, s, _ in sections if n in runs[part]) <= 480, part  # 8 minutes
    assert set(runs["train"]) & set(runs["generate"]) == {"machine", "ceilings"}
    assert set(runs["train"]) | set(runs["generate"]) == set(names)
    assert tool.skipped(names, ["attention", "engine"], "generate")["engine"] == "--skip"


def test_the_paged_row_reports_a_smaller_pool_reserving_and_preempting():
    """The GPU plan's paged section runs both paged sides on a quarter of the dense rows'
    pool (the tiny run keeps the whole pool, to check the tokens): its row states the pool,
    each side's utilization and the samples preempted, from the section's figures."""
    tool = _tool()
    p = tool.GPU.paged
    dense = p["slots"] * (p["prompt_len"] + p["longest"]) // p["kv_block_size"]
    assert p["kv_blocks"] * 4 == dense
    r = dict(
        model="m", slots=32, requests=32, samples=8, prompt_len=128, max_new_tokens=256,
        kv_block_size=16, kv_blocks=192, paged_kv_blocks_dense=768, useful_tokens=1000,
        paged_s=2.0, engine_s=1.0, engine_tokens_per_s=1000.0, preempt_s=0.5, preempted=7,
        paged_utilization=0.25, preempt_utilization=0.5, engine_utilization=0.625,
        paged_kv_bytes_per_live_token=100.0, engine_kv_bytes_per_live_token=400.0,
    )  # fmt: skip
    from bench import gpu_report

    row = gpu_report.ROWS["paged"](r)
    assert "a pool of 192 (dense 768)" in row[2]
    assert "utilization 25.0%; preempting 2,000 tokens/s, utilization 50.0% (7 preempted)" in row[3]
    assert row[4].endswith("utilization 62.5%") and row[5] == "4.00x less KV; 0.50x the speed"


def test_a_timed_command_is_killed_at_its_limit():
    tool = _tool()
    done = tool.run_command([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], 60)
    assert done["returncode"] == 3 and done["status"] == "failed" and done["log_tail"] == ["hi"]
    t = time.perf_counter()
    slow = tool.run_command([sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
    assert slow["returncode"] is None and "timed out" in slow["error"]
    assert time.perf_counter() - t < 30


def test_the_deadline_stops_the_running_section_and_writes_what_is_done():
    tool = _tool()
    written, exits = [], []
    results = {"sections": {}}
    runner = tool.Runner(results, 1.0, lambda r: written.append(json.dumps(r)), exits.append)
    runner.start()
    runner.run("quick", 0.5, 0.1, lambda deadline: {"deadline": deadline})
    runner.run("slow", 5.0, 0.1, lambda deadline: time.sleep(3) or {})  # Past the deadline.
    assert exits == [3]  # The watchdog's exit (the tool's: os._exit).
    at_deadline = json.loads(written[1])["sections"]
    assert at_deadline["quick"]["status"] == "ok" and at_deadline["slow"]["status"] == "deadline"
    assert at_deadline["quick"]["deadline"] <= runner.deadline


def test_every_accelerator_row_has_a_device_kind():
    from rlscale.planning.report import ACCELERATORS

    tool = _tool()
    assert sorted(tool.machine.TABLE_KEYS) == sorted(ACCELERATORS)
    assert tool.machine.accelerator_key("NVIDIA H100 80GB HBM3") == "h100"
    assert tool.machine.accelerator_key("NVIDIA H100 PCIe") is None  # Not the SXM row's peaks.
    assert tool.machine.accelerator_key("NVIDIA H200") == "h200"
    assert tool.machine.accelerator_key("cpu") is None


def test_attention_sections_are_the_implementations_this_platform_runs():
    tool = _tool()
    # On the CPU: not cudnn, splash.
    assert tool.attention_names() == ("xla", "dot_product", "chunked")
    assert tool.with_attention(model.get("tiny"), "dot_product").attention == "dot_product"
    with pytest.raises(ValueError, match="attention='flash'"):
        tool.with_attention(model.get("tiny"), "flash")
