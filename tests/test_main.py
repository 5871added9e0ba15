"""End-to-end tests of the entry point and the config plumbing."""

import json
import logging
import os
import re
import subprocess
import sys

import pytest
from conftest import load_config, subprocess_env

from rlscale import config_lib, stage_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(*args, timeout=300):
    env = subprocess_env()
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _run(*args, workdir):
    return _command("-m", "rlscale.main", "--workdir", str(workdir), *args)


def one_error_line(r, *expected: str):
    """The command failed with exactly one `error:` line holding `expected`, no traceback."""
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-2000:]
    output = r.stdout + r.stderr
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert all(text in errors[0] for text in expected), errors


@pytest.mark.slow
def test_demo_run_with_override(tmp_path):
    r = _run(
        "--config",
        "configs/quickstart.py:demo,smoke",
        "--config.sampling.max_new_tokens=5",
        workdir=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["sampling"]["max_new_tokens"] == 5
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == config["num_prompts"] * config["sampling"]["num_samples"]
    assert all(1 <= len(row["completion"]) <= 5 for row in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["max_logprob_error_vs_forward"] < 1e-4


@pytest.mark.slow
def test_mistyped_key_fails_naming_it(tmp_path):
    r = _run(
        "--config",
        "configs/quickstart.py:demo,smoke",
        "--config.sampling.temprature=0.5",
        workdir=tmp_path,
    )
    one_error_line(r, "no such config key 'temprature'", "did you mean 'temperature'?")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "command, expected",
    [
        pytest.param(
            ("-m", "rlscale.main", "--config", "configs/quickstart.py:smoke", "--workdir", "{f}/w"),
            ("--workdir={f}/w", "cannot create the directory"),
            id="unwritable_workdir",  # Under a file: even root cannot create it.
        ),
        pytest.param(
            ("-m", "rlscale.main", "--config", "configs/nosuch.py", "--workdir", "{d}/w"),
            ("--config=configs/nosuch.py", "no such file"),
            id="missing_config",
        ),
        pytest.param(  # The tools share the guard; this one starts fast.
            ("tools/pipeline_sim.py", "--from_run", "{d}/nosuch"),
            ("{d}/nosuch/metrics.jsonl", "No such file or directory"),
            id="tool_missing_run",
        ),
        pytest.param(  # absl's own error, as one line.
            ("tools/pipeline_sim.py", "--devices", "x"),
            ("flag --devices=x: invalid literal for int()",),
            id="tool_bad_argument",
        ),
        pytest.param(  # The tool's own check, raised from its main.
            ("tools/pipeline_sim.py", "--gen_s", "1"),
            ("give --gen_s and --train_s, or --from_run",),
            id="tool_bad_arguments",
        ),
        pytest.param(  # A tool's failure after its report: still one line, exit status 1.
            ("tools/fit_scaling.py", "{f}", "--out", "{d}/fits"),
            ("no input could be fitted",),
            id="tool_nothing_fitted",
        ),
        pytest.param(  # An absl tool whose config flag has a default.
            ("tools/rl_sanity.py", "--workdir", "{d}/w", "--config.nokey=1"),
            ("--config.nokey=1: no such config key 'nokey'",),
            id="tool_bad_config_key",
        ),
    ],
)
def test_a_users_mistake_is_one_error_line_naming_it(tmp_path, command, expected):
    (tmp_path / "file").write_text("")
    paths = dict(f=tmp_path / "file", d=tmp_path)
    r = _command(*[a.format(**paths) for a in command], timeout=120)
    one_error_line(r, *[e.format(**paths) for e in expected])


def test_guard_tells_a_users_mistake_from_a_bug(tmp_path, capsys):
    """`cli.guard`: the command's own ValueError and a file error are one `error:` line; a
    ValueError from inside a library (a bug in how rlscale calls it) keeps its traceback."""
    import numpy as np

    from rlscale import cli

    def bad_value():
        raise ValueError("task.files.train: no such file")

    def missing_file():
        open(tmp_path / "nosuch.jsonl")

    def bug():
        np.reshape(np.arange(3), (2, 2))

    for main, expected in (
        (bad_value, "error: task.files.train: no such file\n"),
        (missing_file, f"error: {tmp_path / 'nosuch.jsonl'}: No such file or directory\n"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.guard(main)()
        assert e.value.code == 1 and capsys.readouterr().err == expected
    with pytest.raises(ValueError, match="cannot reshape array of size 3"):
        cli.guard(bug)()
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_unknown_variant_fails_naming_it(tmp_path):
    r = _run("--config", "configs/quickstart.py:smok", workdir=tmp_path)
    assert r.returncode != 0
    assert "unknown config variant 'smok'" in r.stderr


def test_scalerl_testbeds():
    """`:testbed=SIZE` is the ladder's, `:testbed=long_SIZE` the long-completion testbed,
    each with the thinking budget short of the generation budget by the answer's room."""
    ladder, long = load_config("scalerl", "testbed=l"), load_config("scalerl", "testbed=long_m")
    assert (ladder.task.name, ladder.model.d_model, ladder.eval.every) == ("arithmetic", 192, 20)
    assert (long.task.name, long.model.d_model, long.eval.every) == ("long_arithmetic", 128, 25)
    assert long.sampling.max_new_tokens - long.sampling.think_budget == 16
    assert long.model.max_seq_len == long.learner.pack_length == 352
    with pytest.raises(ValueError, match="testbed='wide_l' is not SIZE or long_SIZE"):
        load_config("scalerl", "testbed=wide_l")
    with pytest.raises(ValueError, match="size='q' is not one of"):
        load_config("scalerl", "testbed=long_q")
    short = load_config("scalerl", "testbed=long_m,budget=160")  # The generation-length arm.
    assert (short.sampling.max_new_tokens, short.sampling.think_budget) == (160, 144)
    with pytest.raises(ValueError, match="budget=160 needs a testbed="):
        load_config("scalerl", "budget=160")


def test_scalerl_gspo_clip_sweep():
    """`:gspo_eps=E` sets GSPO's sequence clip to E and 4E/3; the default keeps its chain."""
    chain = load_config("scalerl", "loss=gspo").objective.chain
    assert "sequence_ratio | ppo_clip(eps_low=3e-4, eps_high=4e-4)" in chain
    chain = load_config("scalerl", "loss=gspo,gspo_eps=0.003").objective.chain
    assert "ppo_clip(eps_low=3e-3, eps_high=4e-3)" in chain
    with pytest.raises(ValueError, match="gspo_eps=0.003 needs loss=gspo"):
        load_config("scalerl", "gspo_eps=0.003")


def test_parse_arg_types_and_errors():
    c = config_lib.parse_arg(
        "model=small,smoke,steps=7,lr=0.5", smoke=False, model="tiny", steps=1, lr=1.0
    )
    assert (c.model, c.smoke, c.steps, c.lr) == ("small", True, 7, 0.5)
    assert config_lib.parse_arg(None, smoke=False).smoke is False
    assert config_lib.parse_arg("smoke=false", smoke=True).smoke is False
    with pytest.raises(ValueError, match="unknown config variant 'modle'"):
        config_lib.parse_arg("modle=x", model="tiny")
    with pytest.raises(ValueError, match="steps='x': expected int"):
        config_lib.parse_arg("steps=x", steps=1)
    with pytest.raises(ValueError, match="'steps' needs a value"):
        config_lib.parse_arg("steps", steps=1)


def test_rl_smoke_run_writes_metrics_and_summary_on_a_quiet_console(warm):
    """The quickstart's `:smoke` from scratch (tokenizer, data, SFT, RL) as a user runs it:
    the golden run (`warm`, `conftest.WARM_COMMAND`), whose console the fixture kept."""
    lines = [json.loads(x) for x in (warm / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    # Cumulative counters: every step samples and trains, so each adds to both.
    for a, b in zip(lines, lines[1:]):
        assert b["compute/flops"] > a["compute/flops"], (a, b)
        assert b["compute/device_seconds"] > a["compute/device_seconds"], (a, b)
    train = [x for x in lines if "train/reward_mean" in x]
    assert {
        "train/loss",
        "train/response_length",
        "train/filtered_prompts",
        "train/clip_frac",
        "time/tokens_per_s",
    } <= set(train[0])
    assert "eval/pass@1" in lines[0] and "eval/reward_mean" in lines[-1]
    flops = [x["compute/flops"] for x in lines]
    assert flops == sorted(flops) and flops[-1] > 0
    summary = json.loads((warm / "summary.json").read_text())
    assert summary["end/eval_pass@1"] == lines[-1]["eval/pass@1"]
    assert stage_cache.record(str(warm), stage_cache.WARM_START) is not None

    # The console: whole lines (no carriage returns), one per RL step with what it measured,
    # the SFT progress and the summary; no library INFO logs or warnings (absl's "I1123
    # 16:52:46.513 ..." or "W1123 ..." prefix), no orbax or TFDS chatter, no progress bars.
    text = (warm / "console.txt").read_text()
    console = text.splitlines()
    assert len(console) <= 150 and "\r" not in text, console
    library = ("orbax", "tensorflow_datasets", "Downloading and preparing", "Generating ")
    noise = [x for x in console if re.match(r"[IW]\d{4} ", x) or any(w in x for w in library)]
    assert not noise, noise
    steps = [x for x in console if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["0/3", "1/3", "2/3", "3/3"], console
    for step, record in zip(steps[1:], train):
        assert f"reward {record['train/reward_mean']:.3f}" in step
        assert f"loss {record['train/loss']:.4f}" in step and " tok/s " in step
        assert re.search(r"\d\d:\d\d elapsed, ETA \d\d:\d\d$", step), step
    assert f"pass@1 {lines[0]['eval/pass@1']:.3f}" in steps[0] and steps[0].endswith("ETA ?")
    assert sum(x.startswith("sft step ") for x in console) == 2  # 20 steps, shown every 10.
    assert "rlscale run finished" in console
    # One line per summary key, and the run's scaling fit.
    assert sum(x.startswith("  ") for x in console) == len(summary) + 1
    assert console[-1].startswith("  scaling fit: ")


def test_console_shows_library_logs_only_when_asked():
    """`console.configure`: libraries' INFO records pass only at verbosity 1; rlscale's own
    INFO records and everyone's warnings always do, rlscale's as bare messages."""
    from absl import logging as absl_logging
    from tensorflow_datasets.core.utils import tqdm_utils

    from rlscale import console

    handler = absl_logging.get_absl_handler().python_handler
    saved = absl_logging.get_verbosity(), handler.formatter, list(handler.filters)
    ours = os.path.join(os.path.dirname(console.__file__), "rl", "loop.py")
    theirs = "/site-packages/orbax/checkpoint/checkpointer.py"

    def passes(level, path):
        record = logging.LogRecord("absl", level, path, 1, "saved %s", ("x",), None)
        return bool(handler.filter(record)), handler.format(record)

    try:
        console.configure(0)
        assert passes(logging.INFO, theirs)[0] is False
        assert passes(logging.INFO, ours) == (True, "saved x")
        shown, text = passes(logging.WARNING, theirs)
        assert shown and text.startswith("W") and text.endswith("checkpointer.py:1] saved x")
        assert tqdm_utils._active is False  # TFDS's progress bars.
        console.configure(1)
        assert passes(logging.INFO, theirs)[0] is True
        assert absl_logging.get_verbosity() == absl_logging.INFO and tqdm_utils._active
    finally:
        absl_logging.set_verbosity(saved[0])
        handler.setFormatter(saved[1])
        handler.filters[:] = saved[2]
        tqdm_utils.display_progress_bar(True)


def test_step_lines_eta_from_the_smoothed_step_rate(monkeypatch, capsys):
    """`console.StepLines` against a hand-computed ETA: tqdm's rate is an exponential moving
    average (weight 0.3, bias-corrected) of the seconds per step, so the first step's
    compilation fades out of it."""
    import time

    import tqdm.std

    from rlscale import console

    clock = [100.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    lines = console.StepLines(total=10)
    records = {
        0: {"eval/pass@1": 0.25},
        1: {"train/reward_mean": 0.5, "train/loss": 0.12345, "time/tokens_per_s": 1234.0},
        2: {"train/reward_mean": 0.625, "time/tokens_per_s": 56.0},
    }
    for step, at in ((0, 102.0), (1, 112.0), (2, 114.0)):
        clock[0] = at
        lines.write(step, records[step])
    lines.close()
    # Seconds per step: 12 (from the clock's start), then 2.
    ema = [0.3 * 12, 0.3 * 2 + 0.7 * 0.3 * 12]
    eta_2 = 8 * ema[1] / (1 - 0.7**2)  # 8 steps left at the smoothed seconds per step: 48.9 s.
    assert capsys.readouterr().err.splitlines() == [
        "step 0/10  pass@1 0.250  00:02 elapsed, ETA ?",
        "step 1/10  reward 0.500  loss 0.1235  tok/s 1.23k  00:12 elapsed, ETA 01:48",  # 9 x 12 s
        f"step 2/10  reward 0.625  tok/s 56.0  00:14 elapsed, ETA 00:{round(eta_2):02d}",
    ]


def test_compilation_cache_persists_programs_unless_turned_off(tmp_path):
    """`--compilation_cache` (distributed.use_compilation_cache): a compiled program lands in the
    directory; '' leaves the cache off; JAX_COMPILATION_CACHE_DIR takes precedence."""
    code = (
        "import os, sys, jax, jax.numpy as jnp\n"
        "from rlscale import distributed\n"
        "distributed.use_compilation_cache(sys.argv[1])\n"
        "jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}

    def run(directory, **extra):
        subprocess.run([sys.executable, "-c", code, directory], env={**env, **extra}, check=True)

    run(str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache")
    run("")  # Off: nothing written anywhere.
    run(
        str(tmp_path / "unused"),
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    assert not os.path.exists(tmp_path / "unused") and os.listdir(tmp_path / "env")
