"""The GPU check: one command that measures rlscale on one GPU (an H100 or H200), in two
parts of at most 8 minutes each, and writes the figures as JSON and as Markdown rows for
docs/benchmarks.md.

    tools/gpu_check --part train --out $OUT/train.json --markdown $OUT/train.md   # GPU
    tools/gpu_check --part generate --out $OUT/gen.json --markdown $OUT/gen.md    # GPU
    python tools/gpu_check.py --tiny --out /tmp/gpu.json             # any CPU: it runs

(`tools/gpu_check` installs the wheels the device image lacks, `.whl/`, and runs this file;
`tools/gpu_check wheels` fetches them here.) Sections, in this order (the engine right after
the first model's decode, whose params and decode program it shares); each catches its own
failure and records it, and both files are rewritten after each, so a section that breaks
on a rare GPU loses no other's figures:

  machine     the device kind, JAX / jaxlib / CUDA plugin and library versions, the driver
              (`nvidia-smi`), and the device's row of the planner's accelerator table
              (`rlscale.planning.report.ACCELERATORS`: dense bf16 peak, HBM bandwidth)
  ceilings    this machine's measured bf16 matmul FLOP/s and HBM read bandwidth
              (`bench.common`), recorded beside the table's (and used where it has no row)
  quickstart  `python -m rlscale.main --config configs/quickstart.py`, wall time (a
              subprocess: compilation and the SFT warm start included) and its pass@1; first,
              since no GPU run has reached it yet
  train/M     per model M: the learner's RL update (`bench.learner`: `Learner.update` with
              the quickstart's chain) on random rollouts of 32 rows x 512 tokens; MFU = the
              model FLOPs of a step / its median time / the table's peak
  attention/A after the first model's train section, on its params, per name A of
              `attention_names()`: the model's forward + backward (`attention_side_by_side`)
  decode/M    per model: the generator engine decoding 64 slots to 256 tokens
              (`bench.generator.bench_engine_decode`); tokens/s, and bytes per step (params +
              the whole KV cache) / step time against the table's HBM bandwidth
  engine      the engine on 256 long-tailed requests (`bench.generator.bench_generator`,
              the engine side): tokens/s and slot utilization against the ideal engine's
  paged       the engine on long-tailed groups of 8 samples, its dense KV ring and its paged
              cache (`sampling.kv_block_size`) on a pool a quarter of the ring's, reserving
              worst cases and preempting (`sampling.kv_preempt`), in turn: tokens/s and
              utilization of each, KV bytes held per live token, prompt KV columns per group

Budget: the command stops itself at `--budget_s` (default: the shares of the sections it
runs): a watchdog writes both files, the running section marked "deadline", and exits
(status 3). Each section has a planned share (`GPU.budgets`: what the two H200 runs of
2026-11-27 took to compile and time it, with a margin; compiling is most of it, 45 to 100 s
for each model's programs, and 40-60 s for each model's params, which the sections of a
model share) and runs until its planned end or for its minimum, whichever is later; its
timed loop stops there once it has its fewest runs (compiling cannot be stopped, so an
overrun takes from the sections after it; one that cannot have its minimum is skipped; a
skipped section's share goes to the rest). The shares sum to 890 s, more than one device
call's 10 minutes, so the check runs in two parts (`--part`): `train` (the learner's
updates and attention, 465 s) and `generate` (decode, the engine, the paged cache and the
quickstart, 440 s), each with the machine and ceilings. Models are initialized
with random weights in bf16 (their presets); the GPU's memory is JAX's default
preallocation (75%), and the quickstart runs with none, in what is left.

`--tiny`: tiny presets and shapes, a few steps, no quickstart (`--quickstart` names a config
to run one, e.g. `configs/quickstart.py:smoke`), the peaks measured (a CPU has no table row):
a test of the command, whose figures are no result.
"""

import dataclasses
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from absl import flags

# The sections' package beside this file (a path of its own when a test loads this file).
TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS_DIR)
if TOOLS_DIR not in sys.path:
    sys.path.insert(0, TOOLS_DIR)

from bench import attention, common, generator, gpu_report, machine  # noqa: E402

from rlscale import cli, model  # noqa: E402
from rlscale.model import attention as attention_lib  # noqa: E402

# `bench.learner` and the accelerator table (`rlscale.planning.report`) are imported by the
# sections that use them: they import `rlscale.rl`, and with it the data stack
# (tensorflow_datasets and what it imports), which a device image may lack or break; the
# other sections need none of it, and go on without it.


# Attention implementations timed side by side (`ModelConfig.attention`, where it exists).
def attention_names() -> tuple[str, ...]:
    """The attention implementations the attention sections compare: every registered one
    this platform runs (`rlscale.model.attention`: on a GPU xla, dot_product and cudnn)."""
    return tuple(n for n in attention_lib.names() if not attention_lib.platform_problems(n))


class Plan(NamedTuple):
    """What the check runs: its models, each section's shapes, and each section's planned
    seconds (`budgets`, by section name; the attention sections share "attention")."""

    models: tuple[str, ...]
    learner: dict[str, dict]  # `bench.learner.LearnerShape`'s fields, per model.
    decode: dict[str, Any]  # bench_engine_decode's slots, prompt_len, new_tokens, k
    engine: dict[str, Any]  # The model and bench_generator's shape.
    paged: dict[str, Any]  # The same for groups, with the paged cache's block size.
    attention: dict[str, Any]  # The model, batch and seq_len.
    ceilings: dict[str, Any]  # Matmul sizes, calls per timing, bytes read.
    quickstart: str  # A config for `rlscale.main`; "" runs none.
    budgets: dict[str, float]


QWEN = ("qwen2.5_0.5b", "qwen2.5_1.5b")
GPU = Plan(
    models=QWEN,
    # 4 prompts x 8 samples of 128 + 384 tokens in one optimizer step, accumulated over
    # micro-batches of 16 / 8 rows; the 1.5B model's blocks keep only their matmul outputs for
    # the backward pass (`remat=dots`). `python -m rlscale.main.plan` (compiled for XLA:CPU,
    # whose temporaries are not a GPU's) gives 70 GiB and 81 GiB per device for one
    # micro-batch of 32 rows, too much for the 60 GiB JAX takes of an H100's 80; 43.9 and
    # 51.3 GiB with these.
    learner={
        QWEN[0]: dict(prompts=4, group=8, prompt_len=128, completion=384, pack_rows=16, chunk=2048),
        QWEN[1]: dict(
            prompts=4,
            group=8,
            prompt_len=128,
            completion=384,
            pack_rows=8,
            remat="dots",
            chunk=2048,
        ),
    },
    decode=dict(slots=64, prompt_len=64, new_tokens=256, k=8),
    # The decode section's engine settings (one compiled decode program for both).
    engine=dict(model=QWEN[0], slots=64, requests=256, prompt_len=64, longest=256, k=8),
    # 4 groups at a time: the workload's requests are a multiple of its slots. The paged
    # sides' pool: a quarter of the dense rows' 768 blocks (one request at its budget: 143).
    paged=dict(
        model=QWEN[0],
        slots=32,
        requests=32,
        prompt_len=128,
        longest=256,
        k=8,
        samples=8,
        kv_block_size=16,
        kv_blocks=192,
    ),
    attention=dict(model=QWEN[0], batch=2, seq_len=2048),
    ceilings=dict(sizes=(4096, 8192), calls=10, nbytes=2 << 30),
    quickstart="configs/quickstart.py",
    budgets={
        "machine": 5,
        "ceilings": 10,
        f"train/{QWEN[0]}": 130,
        f"train/{QWEN[1]}": 145,
        f"decode/{QWEN[0]}": 90,
        "engine": 35,
        "paged": 90,  # 80 s for two sides in the second run; a third side's programs.
        f"decode/{QWEN[1]}": 100,
        "quickstart": 110,
        "attention": 175,
    },
)
TINY = Plan(
    models=("tiny",),
    learner={"tiny": dict(prompts=2, group=2, prompt_len=8, completion=8)},
    decode=dict(slots=4, prompt_len=8, new_tokens=8, k=4),
    engine=dict(model="tiny", slots=4, requests=8, prompt_len=8, longest=8, k=4),
    paged=dict(
        model="tiny",
        slots=4,
        requests=4,
        prompt_len=8,
        longest=8,
        k=4,
        samples=2,
        kv_block_size=4,  # The whole pool: the same tokens as dense rows, checked.
    ),
    attention=dict(model="tiny", batch=2, seq_len=16),
    ceilings=dict(sizes=(128, 256), calls=1, nbytes=16 << 20),
    quickstart="",
    budgets={
        "machine": 5,
        "ceilings": 10,
        "train/tiny": 60,
        "decode/tiny": 30,
        "engine": 30,
        "paged": 30,
        "quickstart": 140,
        "attention": 30,
    },
)


# Which sections each `--part` runs (by kind: the name before "/"); "all" runs every one.
PARTS = {
    "all": None,
    "train": {"machine", "ceilings", "train", "attention"},
    "generate": {"machine", "ceilings", "decode", "engine", "paged", "quickstart"},
}


def skipped(names: list[str], skip: list[str], part: str) -> dict[str, str]:
    """{section name: why it does not run ("--skip" or "--part")} of `names`, for the
    sections (or kinds) in `skip` and those outside `PARTS[part]`."""
    out = {}
    for name in names:
        kind = name.split("/")[0]
        if name in skip or kind in skip:
            out[name] = "--skip"
        elif PARTS[part] is not None and kind not in PARTS[part]:
            out[name] = "--part"
    return out


def with_attention(model_cfg: model.ModelConfig, name: str) -> model.ModelConfig:
    """`model_cfg` with attention implementation `name` (its own checks apply)."""
    return dataclasses.replace(model_cfg, attention=name)


class Context:
    """What sections share: the peaks MFU and bandwidth are measured against, and the one
    model whose params are held (initializing a model's params compiles for 40-60 s on a
    GPU: a model's train, attention, decode, engine and paged sections share them)."""

    def __init__(self, accelerator: str):
        self.accelerator = accelerator  # An ACCELERATORS key, or "" (the device's row).
        self.table = None  # The accelerator's row, once the machine section has found it.
        self.table_error = ""
        self.measured = {}
        self.held = None

    def peaks(self) -> dict:
        """The peak FLOP/s and bandwidth sections compare with: the table's row, else the
        measured ceilings."""
        if self.table:
            return dict(
                flops=self.table.peak_flops,
                bytes_per_s=self.table.hbm_bandwidth,
                source=f"datasheet ({self.table.name})",
            )
        if not self.measured:
            raise RuntimeError("no peaks: the device has no table row and none was measured")
        why = self.table_error or "no table row"
        return dict(**self.measured, source=f"measured: {why}")

    def release(self) -> None:
        """Lets the held model's params go (a section that makes its own needs the memory)."""
        self.held = None
        gc.collect()

    def model(self, name: str):
        """(cfg, graphdef, params) of model `name`, random weights (in the preset's dtype),
        held until another model is asked for."""
        if self.held is None or self.held[0] != name:
            self.release()
            cfg = model.get(name)
            params = jax.jit(lambda r: model.init_params(cfg, r))(jax.random.key(0))
            self.held = (name, cfg, model.abstract_model(cfg)[0], params)
        return self.held[1:]


def _is_oom(e: Exception) -> bool:
    return any(s in str(e) for s in ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory"))


def halving_on_oom(run, size: int):
    """`run(size)`, and once more at half the size if the device runs out of memory (the
    first error recorded as `oom_retry`)."""
    try:
        return run(size)
    except Exception as e:
        if not _is_oom(e) or size < 2:
            raise
        first = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    gc.collect()
    return {**run(size // 2), "oom_retry": first}


def machine_section(ctx: Context, deadline: float) -> dict:
    del deadline
    out = machine.describe()
    key = ctx.accelerator or out["accelerator"]
    try:
        from rlscale.planning.report import ACCELERATORS
    except ImportError as e:  # The device's facts are still worth recording.
        ctx.table_error = f"the accelerator table did not load: {type(e).__name__}: {e}"
        return {**out, "accelerator": key, "table": None, "table_error": ctx.table_error}
    ctx.table = ACCELERATORS[key] if key else None
    return {**out, "accelerator": key, "table": dataclasses.asdict(ctx.table) if key else None}


def ceilings_section(ctx: Context, plan: Plan, deadline: float) -> dict:
    del deadline
    c = plan.ceilings
    dtype = jnp.dtype(model.get(plan.models[0]).dtype)
    flops = common.peak_matmul_flops(dtype, c["sizes"], c["calls"])
    bandwidth = common.memory_bandwidth(c["nbytes"], c["calls"])
    ctx.measured = dict(flops=flops, bytes_per_s=bandwidth)
    return {"matmul_dtype": str(dtype), **c, "matmul_flops_per_s": flops,
            "read_bytes_per_s": bandwidth}  # fmt: skip


def train_section(ctx: Context, plan: Plan, name: str, deadline: float) -> dict:
    from bench import learner

    peaks = ctx.peaks()
    cfg, _, params = ctx.model(name)

    def run(prompts):
        shape = learner.LearnerShape(**{**plan.learner[name], "prompts": prompts})
        return learner.bench_learner(cfg, shape, peaks["flops"], deadline, params=params)

    out = halving_on_oom(run, plan.learner[name]["prompts"])
    return {"model": name, "peak_source": peaks["source"], **out}


def decode_section(ctx: Context, plan: Plan, name: str, deadline: float) -> dict:
    peaks = ctx.peaks()
    cfg, graphdef, params = ctx.model(name)
    d = plan.decode
    out = generator.bench_engine_decode(
        cfg, params, graphdef, d["slots"], d["prompt_len"], d["new_tokens"], d["k"],
        peaks["flops"], peaks["bytes_per_s"], deadline,
    )  # fmt: skip
    return {"model": name, "peak_source": peaks["source"], **out}


def engine_section(ctx: Context, plan: Plan, deadline: float) -> dict:
    del deadline  # One untimed and one timed run of the workload.
    e = plan.engine
    cfg, graphdef, params = ctx.model(e["model"])
    out = generator.bench_generator(
        cfg, params, graphdef, e["slots"], e["requests"], e["prompt_len"], e["longest"],
        e["k"], repeats=1, static=False,
    )  # fmt: skip
    return {"model": e["model"], **out}


def paged_section(ctx: Context, plan: Plan, deadline: float) -> dict:
    del deadline  # One untimed and one timed run of each side.
    p = dict(plan.paged)
    name = p.pop("model")
    cfg, graphdef, params = ctx.model(name)
    out = generator.bench_generator(
        cfg, params, graphdef, p.pop("slots"), p.pop("requests"), p.pop("prompt_len"),
        p.pop("longest"), p.pop("k"), repeats=1, static=False, **p,
    )  # fmt: skip
    return {"model": name, **out}


def attention_side_by_side(ctx: Context, plan: Plan, name: str, deadline: float) -> dict:
    """The model's forward + backward (`bench.attention`) with attention implementation
    `name`: one section per name of `attention_names()`, so a broken one loses no other's
    figures."""
    peaks = ctx.peaks()
    a = plan.attention
    base, _, params = ctx.model(a["model"])
    cfg = with_attention(base, name)

    def run(batch):
        return attention.bench_forward_backward(
            cfg, batch, a["seq_len"], peaks["flops"], deadline, params=params
        )

    out = halving_on_oom(run, a["batch"])
    return {"model": a["model"], "attention": name, "peak_source": peaks["source"], **out}


def run_command(cmd: list[str], timeout: float, runner=None) -> dict:
    """Runs `cmd` from the repository's root in a process group of its own, with JAX's GPU
    memory allocated as it is needed (this process holds its preallocation), killed after
    `timeout` seconds; its wall time, exit status and the last lines of its output."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile("w+") as log:
        t = time.perf_counter()
        child = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if runner is not None:
            runner.child = child
        try:
            code = child.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = None
        finally:
            if runner is not None:
                runner.child = None
        wall = time.perf_counter() - t
        log.seek(0)
        tail = log.read().splitlines()[-20:]
    out = {"command": " ".join(cmd), "wall_s": wall, "returncode": code, "log_tail": tail}
    if code != 0:
        why = f"timed out after {timeout:.0f} s" if code is None else f"exited with {code}"
        out.update(status="failed", error=f"the command {why}")
    return out


def quickstart_section(spec: str, runner, deadline: float) -> dict:
    workdir = tempfile.mkdtemp(prefix="gpu_check_quickstart_")
    cmd = [sys.executable, "-m", "rlscale.main", "--config", spec, "--workdir", workdir]
    out = run_command(cmd, deadline - time.perf_counter(), runner)
    summary = os.path.join(workdir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            s = json.load(f)
        keep = ("wall_s", "start/eval_pass@1", "end/eval_pass@1", "sft/steps", "sft/pass@1")
        out["summary"] = {k: s[k] for k in keep if k in s}
    shutil.rmtree(workdir, ignore_errors=True)
    return {"config": spec, **out}


def schedule(plan: Plan, ctx: Context, quickstart: str, runner) -> list:
    """[(section name, planned seconds, function of its deadline)] in order."""
    sections = []

    def add(name, fn, seconds=None):
        sections.append((name, plan.budgets[name] if seconds is None else seconds, fn))

    add("machine", lambda d: machine_section(ctx, d))
    add("ceilings", lambda d: ceilings_section(ctx, plan, d))
    if quickstart:  # First: no GPU run has reached it yet (both ran out of time before it).
        add("quickstart", lambda d: quickstart_section(quickstart, runner, d))
    names = attention_names()
    share = plan.budgets["attention"] / len(names)
    for i, name in enumerate(plan.models):
        add(f"train/{name}", lambda d, n=name: train_section(ctx, plan, n, d))
        if i == 0:  # The attention sections share the first model's params.
            for a in names:
                add(f"attention/{a}", lambda d, a=a: attention_side_by_side(ctx, plan, a, d), share)
    for i, name in enumerate(plan.models):
        add(f"decode/{name}", lambda d, n=name: decode_section(ctx, plan, n, d))
        if i == 0:  # The engine shares the first model's params and decode program.
            add("engine", lambda d: engine_section(ctx, plan, d))
            add("paged", lambda d: paged_section(ctx, plan, d))
    return sections


class Runner:
    """Runs the sections in turn against the budget, records each (its figures, or its
    failure), rewrites the files after each, and stops the command at the deadline."""

    def __init__(self, results: dict, budget_s: float, write, exit=os._exit):
        self.results, self.write, self.exit = results, write, exit
        self.budget_s = budget_s
        self.lock = threading.Lock()
        self.current, self.child = None, None
        self.timer = threading.Timer(budget_s, self.expire)
        self.timer.daemon = True

    def start(self) -> None:
        """Starts the clock: the deadline is `budget_s` from now."""
        self.start_time = time.perf_counter()
        self.deadline = self.start_time + self.budget_s
        self.timer.start()

    def run(self, name: str, planned_end: float, minimum: float, fn) -> None:
        """Runs section `name` until `planned_end` (seconds since the start) or for
        `minimum` seconds, whichever ends later (never past the deadline)."""
        now = time.perf_counter()
        if self.deadline - now < minimum:
            entry = {"status": "skipped", "error": f"{self.deadline - now:.0f} s left"}
            return self.record(name, entry, now)
        self.current = name
        end = min(self.deadline, max(self.start_time + planned_end, now + minimum))
        try:
            entry = {"status": "ok", **fn(end)}
        except Exception as e:  # noqa: BLE001 (any failure is the section's finding)
            lines = traceback.format_exc().splitlines()
            entry = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
            entry["traceback"] = lines[-25:]
        entry["planned_end_s"] = planned_end
        self.record(name, entry, now)

    def record(self, name: str, entry: dict, started: float) -> None:
        with self.lock:
            self.current = None
            entry["seconds"] = time.perf_counter() - started
            self.results["sections"][name] = entry
            self.results["wall_s"] = time.perf_counter() - self.start_time
            self.write(self.results)

    def expire(self) -> None:
        """The deadline: the running section (and its command) stopped and marked, both
        files written, the process ended."""
        with self.lock:
            if self.child is not None:
                os.killpg(self.child.pid, signal.SIGKILL)
            if self.current is not None:
                self.results["sections"][self.current] = {
                    "status": "deadline",
                    "error": f"still running at the {self.budget_s:.0f} s deadline",
                }
            self.results["wall_s"] = time.perf_counter() - self.start_time
            self.write(self.results)
        self.exit(3)


def define_flags(fv: flags.FlagValues, argv) -> None:
    del argv
    flags.DEFINE_string("out", None, "write the results as JSON here", flag_values=fv)
    flags.DEFINE_string("markdown", None, "write Markdown rows here", flag_values=fv)
    flags.DEFINE_bool("tiny", False, "tiny models and shapes: proves it runs", flag_values=fv)
    flags.DEFINE_float(
        "budget_s", None, "stop here, whatever is running (default: the sections' shares)",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_enum(
        "part", "all", list(PARTS), "the sections to run: one part fits a device call",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_enum(
        "accelerator", "", ["", *machine.TABLE_KEYS], "table row (default: the device's)",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_list("skip", [], "sections (or their kind: train, decode, ...)", flag_values=fv)
    flags.DEFINE_string(
        "quickstart", None, "config to time (default: the quickstart; none with --tiny)",
        flag_values=fv,
    )  # fmt: skip


def main(fv: flags.FlagValues) -> None:
    if fv.budget_s is not None and fv.budget_s <= 0:
        raise ValueError(f"--budget_s={fv.budget_s} must be positive")
    plan = TINY if fv.tiny else GPU
    quickstart = plan.quickstart if fv.quickstart is None else fv.quickstart
    ctx = Context(fv.accelerator)
    sections = schedule(plan, ctx, quickstart, None)
    known = {n for n, _, _ in sections} | {n.split("/")[0] for n, _, _ in sections}
    unknown = sorted(set(fv.skip) - known)
    if unknown:
        raise ValueError(f"--skip: unknown section(s) {unknown}; known: {sorted(known)}")
    skip = skipped([n for n, _, _ in sections], fv.skip, fv.part)
    budget_s = fv.budget_s or sum(s for n, s, _ in sections if n not in skip)
    results = {
        "tool": "tools/gpu_check.py",
        "mode": "tiny" if fv.tiny else "gpu",
        "budget_s": budget_s,
        "part": fv.part,
        "commit": gpu_report.commit(ROOT),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "sections": {},
    }
    write = gpu_report.writer(fv.out, fv.markdown)
    runner = Runner(results, budget_s, write)
    sections = schedule(plan, ctx, quickstart, runner)
    runner.start()
    planned = 0.0
    for name, seconds, fn in sections:
        if name in skip:  # Its share goes to the rest.
            runner.record(name, {"status": "skipped", "error": skip[name]}, time.perf_counter())
            continue
        planned += seconds
        runner.run(name, planned, min(seconds, 0.5 * seconds + 5), fn)
    runner.timer.cancel()
    write(results)
    print(gpu_report.markdown(results))
    failed = [n for n, s in results["sections"].items() if s["status"] == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli.run_command(define_flags, main)
