"""Test setup: eight CPU devices, so sharding tests can build a 2x2x2 mesh."""

import os
import shutil
import subprocess
import sys
import threading

# The caller's XLA flags (.ci/run's `--xla_cpu_max_isa=AVX2`) reach every test and every run a
# test starts, with two that make compiling cheaper: the tests' programs are tiny and run for
# milliseconds, so compiling them is most of the suite's time. XLA's LLVM backend at -O0 took
# tests/test_sampler.py from 93 s to 58 s, and the classic fusion code generation (not the
# MLIR fusion emitters) halves what compiling is left (three of its tests: 24 s -> 11 s). The
# HLO passes (fusion, layout, sharding) are the production ones; the code that runs the fused
# loops differs, which moves the last bits of some float32 sums, as another machine's vector
# instructions do, and the tolerances between machines allow for that. One LLVM module per
# program, not one split into parts compiled on threads: the workers already fill the cores,
# and for the tests' small programs the split's overhead cost 10-15% of compiling.
XLA_FLAGS = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_parallel_codegen_split_count=1",
    ]
).strip()


# A tiny Hugging Face decoder's config fields (transformers' names) for the parity tests;
# initializer_range large enough that attention is far from uniform.
HF_TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
)


# jaxlib 0.10.2's XLA:CPU miscompiles a YNNPACK fusion that multiplies an operand of rank >= 2,
# broadcast over a new leading axis, into a reduction: what `jax.vmap` makes of a backward pass
# (`jax.jacrev`, per-row Jacobians), whose unbatched operands are broadcast over the batch axis.
# tests/test_numerics.py reproduces it in a few lines. The test oracles that take Jacobians
# compile without those fusions (`jit_without_ynn`); the quickstart's programs hold none of
# them (docs/reliability.md, "Numeric faults").
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def jit_without_ynn(fn, static_argnums=()):
    """`jax.jit(fn)` compiled with `NO_YNN`, once per static arguments and argument shapes."""
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    jitted, compiled = jax.jit(fn, static_argnums=static), {}

    def call(*args):
        dynamic = [a for i, a in enumerate(args) if i not in static]
        leaves, tree = jax.tree.flatten(dynamic)
        key = (
            tuple(args[i] for i in static),
            tree,
            tuple((np.shape(x), getattr(x, "dtype", None) or np.result_type(x)) for x in leaves),
        )
        if key not in compiled:
            compiled[key] = jitted.lower(*args).compile(compiler_options=NO_YNN)
        return compiled[key](*dynamic)

    return call


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process with `devices` CPU devices."""
    return f"{XLA_FLAGS} --xla_force_host_platform_device_count={devices}"


os.environ["XLA_FLAGS"] = xla_flags(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import filelock  # noqa: E402
import jax  # noqa: E402  (must come after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory, worker_id):
    """One persistent compilation cache for the session: the xdist workers and the runs they
    start as subprocesses (kill/resume, the CLI, several processes) compile a program the
    first time any of them needs it, and load it after. A program loaded from the cache is
    still a new program to the process that loads it: `CompileCounter` counts both."""
    path = str(_shared_root(tmp_path_factory, worker_id) / "jax_cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture(scope="session")
def tiny_cfg():
    from rlscale import model

    return model.get("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg):
    from rlscale import model

    params = model.init_params(tiny_cfg, jax.random.key(0))
    graphdef, _ = model.abstract_model(tiny_cfg)
    return graphdef, params


class CompileCounter:
    """Counts the programs this process compiles or loads from the persistent compilation
    cache while active (a jit cache hit does neither)."""

    COMPILED = "/jax/core/compile/backend_compile_duration"
    LOADED = "/jax/compilation_cache/cache_hits"

    def __init__(self):
        self.count = 0

    def _compiled(self, event, duration_secs, **kwargs):
        del duration_secs, kwargs
        self.count += event == self.COMPILED

    def _loaded(self, event, **kwargs):
        del kwargs
        self.count += event == self.LOADED

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._compiled)
        jax.monitoring.register_event_listener(self._loaded)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._compiled)
        jax.monitoring.unregister_event_listener(self._loaded)


@pytest.fixture
def count_compiles():
    return CompileCounter


# float32's unit roundoff, and the confidence parameter of `rounding`'s probabilistic bound.
U = 2.0**-24
LAMBDA = 7.0


def rounding(n_terms: int) -> float:
    """How far a float32 sum of `n_terms` terms may move, as a fraction of the sum of their
    magnitudes, when another machine (other vector instructions) or another layout adds them
    in another order: LAMBDA sqrt(n) u. With rounding errors independent and zero-mean this
    holds with probability at least 1 - 2 n exp(-LAMBDA^2 / 2), 1 - 3e-6 for n = 2^16 (Higham
    and Mary 2019, "A new approach to probabilistic rounding error analysis", Theorem 3.1);
    the worst case, n u, needs every error to have one sign. For tolerances between machines:
    derived, not measured."""
    return LAMBDA * n_terms**0.5 * U


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_env(devices: int = 1, **extra) -> dict:
    """The environment of a run a test starts: the repository and tests/ importable, on
    `devices` CPU devices (one by default: faster, and as on a laptop), with the suite's
    XLA flags."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices), **extra)
    return env


GOLDEN = os.path.join(ROOT, "tests", "golden")
# Wall-clock fields differ between any two runs; everything else in metrics.jsonl must not.
TIMING = ("time/", "compute/device_seconds")


def load_config(name, arg="smoke"):
    """`configs/NAME.py`'s get_config(arg)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def metric_lines(workdir_or_file, timing=False):
    """metrics.jsonl as dicts, without the timing fields unless `timing`."""
    import json

    path = str(workdir_or_file)
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        lines = [json.loads(x) for x in f]
    return [{k: v for k, v in x.items() if timing or not k.startswith(TIMING)} for x in lines]


def golden_config(name):
    """The golden runs' settings: a recipe's smoke config on one device, with a reward about
    half the samples earn (`reward_fixtures.even_length`), scored in-process."""
    c = load_config(name)
    c.mesh.shape = (1, 1, 1)
    c.reward.fn = "reward_fixtures:even_length"
    c.reward.workers = 0
    return c


# `golden_config("quickstart")` as the command line gives it.
WARM_COMMAND = (
    "-m",
    "rlscale.main",
    "--config",
    "configs/quickstart.py:smoke",
    "--config.mesh.shape=(1,1,1)",
    "--config.reward.fn=reward_fixtures:even_length",
    "--config.reward.workers=0",
)


def _warm_run(workdir):
    """The golden quickstart smoke run, as a user starts it (`python -m rlscale.main`); its
    console is kept in WORKDIR/console.txt (stderr, then stdout) for the test that reads it."""
    env = subprocess_env(devices=8)
    r = subprocess.run(
        [sys.executable, *WARM_COMMAND, "--workdir", str(workdir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (workdir / "console.txt").write_text(r.stderr + r.stdout)


def _shared_root(tmp_path_factory, worker_id):
    """The directory this session's processes share: the basetemp, or under pytest-xdist its
    parent (the workers' basetemps are its children)."""
    root = tmp_path_factory.getbasetemp()
    return root if worker_id == "master" else root.parent


def _made_once(root, name, make):
    """ROOT/NAME, made by `make(workdir)` once by whichever process asks first; the others wait
    on ROOT/NAME.lock and then read it. A workdir whose making failed is made again."""
    workdir = root / name
    with filelock.FileLock(str(root / f"{name}.lock")):
        if not (root / f"{name}.made").exists():
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir()
            make(workdir)
            (root / f"{name}.made").touch()
    return workdir


@pytest.fixture(scope="session")
def shared_workdir(tmp_path_factory, worker_id):
    """`shared_workdir(name, make)`: a workdir made once in the session (`make(workdir)`) and
    read by every test and xdist worker that asks for it, so an expensive run that tests in
    several workers read (a module fixture's run, under `--dist worksteal`) runs once, not once
    per worker. Its makers must be deterministic in `name` and only read it after."""
    root = _shared_root(tmp_path_factory, worker_id)
    return lambda name, make: _made_once(root, name, make)


@pytest.fixture(scope="session")
def warm(shared_workdir):
    """The golden quickstart smoke run's workdir: its data, tokenizer and SFT warm start are
    the one warm start every RL test reuses (`sft.reuse_from`; tests only read it), made by the
    first worker that needs it or started ahead by the controller (`pytest_configure`)."""
    return shared_workdir("warm", _warm_run)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores, as memory allows (about 5 GiB a worker at
    its peak). A worker waits on the subprocess runs it starts (kill and resume, the CLI,
    several processes) and on locks (`shared_workdir`); the extra worker fills those waits: the
    whole suite took 14 min 3 s with 2 workers on 2 cores and 11 min 53 s with 3."""
    del config
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(len(os.sched_getaffinity(0)) + 1, int(memory_gib // 6)))


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """The whole suite under pytest-xdist: the controller starts the warm run at once, in a
    thread, so the workers find it made (or nearly) when their first RL test asks, instead of
    one of them making it while the other waits idle. (A run of chosen files makes it on
    demand.)"""
    xdist_controller = not hasattr(config, "workerinput") and config.getoption("numprocesses", None)
    if xdist_controller and config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        root = config._tmp_path_factory.getbasetemp()  # The workers' basetemps' parent.
        config.warm_head_start = threading.Thread(
            target=_head_start, args=(root,), name="warm", daemon=True
        )
        config.warm_head_start.start()


def _head_start(root):
    try:
        _made_once(root, "warm", _warm_run)
    except AssertionError:
        pass  # The workers' `warm` tries again and fails with the run's error.


def pytest_unconfigure(config):
    head_start = getattr(config, "warm_head_start", None)
    if head_start is not None:
        head_start.join()


def completed_arrays(done) -> dict:
    """The generator's `Completed` records' array fields, each concatenated over the records
    (a dense model's `experts_GLlc`, None, left out)."""
    fields = [f for f in done[0]._fields[1:] if getattr(done[0], f) is not None]
    return {f: np.concatenate([getattr(c, f) for c in done]) for f in fields}


def random_decoder_params(model_cfg, seed: int):
    """Decoder params drawn in NumPy (no init program to compile): N(0, 1 / fan_in) weights,
    unit norm scales."""
    from flax import nnx

    from rlscale.model import decoder

    _, abstract = decoder.abstract_model(model_cfg)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(x.shape, np.float32)
        fan_in = x.shape[1] if "embedding" in name else x.shape[0]
        fan_in *= x.shape[1] if "['o']" in name else 1  # [H, E, D]: H * E inputs.
        return (rng.standard_normal(x.shape) / np.sqrt(fan_in)).astype(np.float32)

    pure = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(abstract))
    nnx.replace_by_pure_dict(abstract, pure)
    return abstract


def untrained_prm(warm, path: str, seq_len: int) -> str:
    """A process reward model directory at `path`: the warm start's decoder with a new head
    (`scalar_head.init`), steps at the arithmetic task's "=", untrained: its scores mean
    nothing, its shapes and plumbing are what tests read. Returns `path`."""
    import jax

    from rlscale import tokenizers as tokenizer_lib
    from rlscale.reward_models import prm, scalar_head, step_labels

    tok = tokenizer_lib.load(str(warm / "tokenizer.model"))
    model_cfg, _, params = scalar_head.init(str(warm / "sft"), jax.random.key(0))
    cfg = prm.PRMConfig(delimiter=step_labels.ARITHMETIC_DELIMITER, seq_len=seq_len)
    prm.save(path, model_cfg, params, tok, cfg)
    return path


def random_policy(path, model_cfg, tokenizer):
    """A policy checkpoint at `path` (a Path) with random params
    (`random_decoder_params(model_cfg, 1)`) and its SentencePiece tokenizer beside them, as a
    run's checkpoint carries it. Returns `path`."""
    from rlscale import checkpoint

    checkpoint.save_params(str(path), model_cfg, random_decoder_params(model_cfg, 1))
    (path / "tokenizer.model").write_bytes(tokenizer.serialized)
    return path


# Fixtures that make whole RL runs (the shared warm start, the golden and recipe runs): a test
# that uses one is `slow`, out of the quick loop (`pytest -m "not slow"`).
SLOW_FIXTURES = {"warm", "golden_runs", "recipe_runs"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
