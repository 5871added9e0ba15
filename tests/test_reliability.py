"""Reliability of whole runs: exact resume after SIGKILL, SIGTERM checkpoints, damaged
checkpoints, non-finite updates, misbehaving verifiers; multi-turn episodes signalled and
killed in flight, misbehaving environments.

The runs are `configs/scalerl.py:smoke,sync` (checkpoints every 2 steps,
no-positive-resampling, zero-variance filtering, forced interruption) with an easy reward
(`reward_fixtures.digits`) so prompts do get retired and filtered. The multi-turn runs play
`env_fixtures.Calculator` with a reward half the samples earn (so every step trains); one is
killed in the recipe's pipeline mode. All run on one CPU device; the straight run's workdir
provides the others' warm start (`sft.reuse_from`).

A process start and a first trace of a run's programs cost about 10 CPU-seconds each, most of
this module's time, so a run goes to a subprocess only where the process is the point:
SIGKILL, sent to the single-turn sync run (`test_sigkill_then_resume_is_the_same_run`) and to
the multi-turn pipeline run, whose in-flight episodes must be played again; the command's
refusal of a changed config (its exit status and `error:` line). Every other run, resumes
included, runs in this process. SIGTERM is sent to this process, whose run takes it in the
handler the run installs, as a subprocess's would: the command (`rlscale.main`'s flags and
`main`) runs here and exits 143. The resume code is the same for every driver and
environment; each test compares its resumed run with a run never interrupted.
"""

import glob
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import env_fixtures
import numpy as np
import pytest
import wandb_files
from conftest import ROOT, load_config, subprocess_env

from rlscale import cli, config_lib, rl
from rlscale.data import builders, filters
from rlscale.main import train
from rlscale.rl import rollouts

STEPS = 4
# Every run's settings over `configs/scalerl.py:smoke,sync`: the same as a subprocess's flags
# and in this process (one device either way).
RUN = {
    "steps": STEPS,
    "mesh.shape": (1, 1, 1),
    "reward.fn": "reward_fixtures:digits",
    "reward.workers": 0,
}
# Wall-clock measurements differ between any two runs, resumed or not; everything else
# (rewards, losses, gradient norms, evals, FLOP counters, filter counts) must not.
TIMING = ("time/", "compute/device_seconds")


def _flags(settings):
    """The command-line overrides that make a run's config `settings` ({dotted key: value})."""
    return [f"--config.{k}={v}" for k, v in settings.items()]


def _command(workdir, settings, variant):
    config = os.path.join(ROOT, "configs", "scalerl.py") + ":" + variant
    return [
        sys.executable, "-m", "rlscale.main",
        "--config", config, "--workdir", str(workdir), *_flags(settings),
    ]  # fmt: skip


def _config_of(variant, settings):
    """`configs/scalerl.py:variant` with `settings`, as `_flags(settings)` give it a run."""
    c = load_config("scalerl", variant)
    for key, v in settings.items():
        *sections, name = key.split(".")
        node = c
        for section in sections:
            node = node[section]
        node[name] = v
    return c


def _run_here(config, workdir, allow_config_change=False):
    """Runs `config` in this process (a run resumed here is another process than the one
    killed); returns each round of samples it judged, in order: (their prompts, `Samples`)."""
    judged, judge = [], rollouts.RolloutSource.judge

    def keep(self, ids, samples):
        judged.append(([self.problems[i].prompt for i in ids], samples))
        return judge(self, ids, samples)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollouts.RolloutSource, "judge", keep)
        rl.run(rl.resolve(config), str(workdir), allow_config_change=allow_config_change)
    return judged


def _written(path):
    """The complete lines of a metrics file: a SIGKILL can cut the last one mid-write."""
    with open(path) as f:
        return [x for x in f if x.endswith("\n")]


def _lines(workdir):
    return [json.loads(x) for x in _written(os.path.join(workdir, "metrics.jsonl"))]


def _comparable(lines, timing=TIMING):
    return [{k: v for k, v in x.items() if not k.startswith(timing)} for x in lines]


def _host(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "host", "metadata")) as f:
        return json.load(f)


def _start_and_signal(workdir, sig, after_step, settings, variant="smoke,sync", saved=None):
    """Starts the run of `settings` as a subprocess, sends `sig` once `after_step` is in
    metrics.jsonl (and the checkpoint of step `saved` is written: it is saved asynchronously);
    returns the process and the last step in metrics.jsonl just after the signal (the run had
    not gone further when it came)."""
    proc = subprocess.Popen(
        _command(workdir, settings, variant),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    path = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 400
    while time.time() < deadline:
        ready = saved is None or os.path.isdir(os.path.join(workdir, "checkpoints", str(saved)))
        if ready and os.path.exists(path) and len(_written(path)) > after_step:
            break
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {after_step}: {proc.communicate()[1]}")
        time.sleep(0.2)
    proc.send_signal(sig)
    return proc, len(_written(path)) - 1


def _sigterm_here(workdir, settings, after_step=1):
    """Runs the command of `settings` (`rlscale.main`'s flags and `main`, `cli.call`) in this
    process and sends this process SIGTERM once `after_step` is in metrics.jsonl, as a
    scheduler preempting the run would; returns the command's exit status and the last step
    in metrics.jsonl just after the signal (the run had not gone further when it came). The
    run's own handler takes the signal; one that came after the run would meet a handler that
    drops it, failing the test instead of ending the session."""
    path = os.path.join(workdir, "metrics.jsonl")
    finished, signalled = threading.Event(), []

    def signal_after_step():
        while not finished.wait(0.05):
            if os.path.exists(path) and len(_written(path)) > after_step:
                os.kill(os.getpid(), signal.SIGTERM)
                signalled.append(len(_written(path)) - 1)
                return

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    sender = threading.Thread(target=signal_after_step, daemon=True)
    sender.start()
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.call(train.define_flags, train.main, _command(workdir, settings, "smoke,sync")[3:])
    finally:
        finished.set()
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    assert signalled, "the run ended before the signal"
    return exit_.value.code, signalled[0]


def _kill_then_resume_here(workdir, variant, settings, caplog, after_step=3):
    """The run of `settings` started as a subprocess, killed (SIGKILL) once `after_step` is
    in metrics.jsonl and the step-2 checkpoint written, then resumed in this process."""
    proc, _ = _start_and_signal(
        workdir, signal.SIGKILL, after_step, settings, variant=variant, saved=2
    )
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert len(_lines(workdir)) < settings["steps"] + 1  # Killed mid-run.
    with caplog.at_level(logging.INFO, logger="absl"):
        judged = _run_here(_config_of(variant, settings), workdir)
    assert any(m.startswith("resuming from the checkpoint at step") for m in caplog.messages)
    return judged


@pytest.fixture(scope="module")
def straight(shared_workdir, warm):
    """The run never killed, in this process; its workdir is the other runs' warm start."""
    settings = {**RUN, "sft.reuse_from": str(warm)}
    return shared_workdir(
        "reliability_straight", lambda w: _run_here(_config_of("smoke,sync", settings), w)
    )


def _settings(straight, **settings):
    return {**RUN, "sft.reuse_from": str(straight), **settings}


def test_straight_run_retires_and_checkpoints(straight):
    lines = _lines(straight)
    assert [x["step"] for x in lines] == list(range(STEPS + 1))
    host = _host(straight, STEPS)
    assert host["history"]["retired"], "the easy reward should retire some prompts"
    assert sorted(int(d) for d in os.listdir(straight / "checkpoints") if d.isdigit()) == [2, 4]


def test_sigkill_then_resume_is_the_same_run(straight, tmp_path, caplog):
    _kill_then_resume_here(tmp_path, "smoke,sync", _settings(straight), caplog)
    assert "reusing the SFT warm start" in caplog.text  # The workdir's cached warm start.
    assert _comparable(_lines(tmp_path)) == _comparable(_lines(straight))
    ours, theirs = _host(tmp_path, STEPS), _host(straight, STEPS)
    assert ours["stream"] == theirs["stream"]  # Data position and shuffle.
    assert ours["history"] == theirs["history"]  # Pass rates and the retired set.
    assert ours["counters"]["compute/train_flops"] == theirs["counters"]["compute/train_flops"]


def test_sigterm_saves_a_checkpoint_and_resumes(straight, tmp_path, caplog, capsys):
    _sigterm_then_resume(tmp_path, _settings(straight), STEPS, caplog, capsys)
    assert _comparable(_lines(tmp_path)) == _comparable(_lines(straight))


def _sigterm_then_resume(tmp_path, settings, steps: int, caplog, capsys):
    """The command in this process, sent SIGTERM after step 1: exit 143 and the preempted
    line, a bounded stop (the step in flight, then one save) with a checkpoint at the step it
    stopped; then the same command resumed from it to the end."""
    status, signalled = _sigterm_here(tmp_path, settings)
    err = capsys.readouterr().err
    assert status == 143, err[-3000:]
    assert "preempted (SIGTERM) after step" in err
    last = _lines(tmp_path)[-1]["step"]
    assert last <= signalled + 1 < steps
    assert os.path.isdir(tmp_path / "checkpoints" / str(last))
    with caplog.at_level(logging.INFO, logger="absl"):
        _run_here(_config_of("smoke,sync", settings), tmp_path)
    assert f"resuming from the checkpoint at step {last} in {tmp_path}" in caplog.messages


def test_damaged_checkpoint_falls_back_to_the_previous_one(warm, straight, tmp_path, caplog):
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    for path in glob.glob(
        str(workdir / "checkpoints" / str(STEPS) / "state" / "**"), recursive=True
    ):
        if os.path.isfile(path) and os.path.getsize(path) > 64:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    settings = {**RUN, "steps": STEPS + 2, "sft.reuse_from": str(warm)}  # As the straight run.
    with caplog.at_level(logging.INFO, logger="absl"):
        _run_here(_config_of("smoke,sync", settings), workdir)
    assert f"checkpoint step {STEPS} in" in caplog.text and "unreadable" in caplog.text
    assert f"resuming from the checkpoint at step {STEPS - 2}" in caplog.text
    lines = _lines(workdir)
    assert [x["step"] for x in lines] == list(range(STEPS + 3))
    # Steps after the good checkpoint were replayed exactly.
    assert _comparable(lines[: STEPS + 1]) == _comparable(_lines(straight))


def test_changed_config_is_refused_unless_allowed(warm, straight, tmp_path, monkeypatch):
    """Refused on the command line (one `error:` line, exit 1); allowed in this process, with
    its metrics copied to a Weights & Biases run too (offline; `tracking.*` changes nothing
    the run computes, so no change to allow): the resumed step's record."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    settings = {**RUN, "steps": STEPS + 1, "optim.lr": 0.01, "sft.reuse_from": str(warm)}
    out = subprocess.run(
        _command(workdir, settings, "smoke,sync"),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 1
    assert "optim.lr: 0.0001 -> 0.01" in out.stderr and "--allow_config_change" in out.stderr
    monkeypatch.setenv("WANDB_MODE", "offline")
    settings["tracking.wandb_project"] = "rlscale-test"
    _run_here(_config_of("smoke,sync", settings), workdir, allow_config_change=True)
    lines = _lines(workdir)
    assert [x["step"] for x in lines] == list(range(STEPS + 2))
    [run] = wandb_files.offline_runs(workdir)
    assert [row["_step"] for row in run["history"]] == [STEPS + 1]
    assert run["history"][0]["train/loss"] == lines[-1]["train/loss"]
    assert run["config"]["tracking"]["wandb_project"] == "rlscale-test"


# ------------------------------------------------------------------------------------------
# In-process runs: numeric faults and reward faults.
# ------------------------------------------------------------------------------------------


def _config(**overrides):
    """The in-process runs' config: `_config_of`'s, `section__key=value` overrides."""
    settings = {
        "mesh.shape": (1, 1, 1),  # One device, as the subprocess runs.
        "steps": 4,
        # The recipe's 4 optimizer steps per RL step (`:sync`), so these runs reuse the
        # straight run's programs; one step's updates skipped goes on, two steps' stop.
        "faults.max_consecutive_skips": 5,
    }
    settings.update({k.replace("__", "."): v for k, v in overrides.items()})
    return _config_of("smoke,sync", settings)


def _nan_on(monkeypatch, steps):
    """Makes the loss NaN on every optimizer step of the RL steps (their `update_step` calls)
    whose (1-based) index is in `steps`: the generator's logprobs, which the ratio reads,
    arrive NaN."""
    from rlscale import programs

    original, calls = programs.Programs.run, []

    def patched(self, name, fn, args, static=None):
        if name == "update_step":
            calls.append(None)
            if len(calls) in steps:
                state, ref_params, batch, *rest = args
                batch = {**batch, "sampler_logp": batch["sampler_logp"] * float("nan")}
                args = (state, ref_params, batch, *rest)
        return original(self, name, fn, args, static)

    monkeypatch.setattr(programs.Programs, "run", patched)


# The NaN run's RL steps whose updates are all non-finite: one step's skipped updates, a
# step that trains, then two steps' in a row (4 updates skipped at step 4, the 5th at step 5's
# first), which stop it.
NAN_STEPS = {2, 4, 5}


@pytest.fixture(scope="module")
def nan_run(shared_workdir, straight):
    """One run (in this process) with the losses of `NAN_STEPS` non-finite: its workdir and
    config, and the message of the error that stopped it (WORKDIR/error.txt). Every step
    trains (no zero-variance filter: the easy reward filters whole batches, and a batch with
    no trained token runs no micro-batch, so no loss to make non-finite)."""
    config = _config(sft__reuse_from=str(straight), reward__workers=0, filters__zero_variance=False)
    config.steps = 6

    def run(workdir):
        with pytest.MonkeyPatch.context() as patch, pytest.raises(RuntimeError) as e:
            _nan_on(patch, NAN_STEPS)
            rl.run(rl.resolve(config), str(workdir / "run"))
        (workdir / "error.txt").write_text(str(e.value))

    workdir = shared_workdir("reliability_nan", run)
    return workdir / "run", config, (workdir / "error.txt").read_text()


def test_nan_loss_skips_the_update_and_the_run_goes_on(nan_run):
    workdir, config, _ = nan_run
    skipped = [x.get("train/skipped_updates") for x in _lines(workdir)[1:]]
    per_step = config.learner.minibatches  # Optimizer updates per RL step.
    assert skipped == [0, per_step, 0, per_step]  # Step 5 stopped the run before its line.


def test_consecutive_nan_losses_stop_the_run(nan_run):
    workdir, config, error = nan_run
    assert config.learner.minibatches == 4
    # As `pytest.raises(RuntimeError, match=...)` reads the message.
    assert re.search(
        "5 consecutive non-finite updates .last at step 5.; the last good checkpoint is step 4",
        error,
    ), error
    assert os.path.isdir(workdir / "checkpoints" / "2")


def test_misbehaving_verifiers_cost_their_samples(straight, tmp_path, monkeypatch):
    config = _config(
        sft__reuse_from=str(straight),
        reward__fn="reward_fixtures:faulty",
        reward__timeout=1.0,
        reward__workers=2,
    )
    config.steps = 1
    # The first batch's prompts, as the loop's prompt stream will draw them.
    sources = builders.materialize("arithmetic", 2, 200, 40, str(straight / "data"))
    ids = filters.PromptStream(len(sources["train"]), seed=config.seed).next(8)
    prompts = [builders.decode(sources["train"][i]).prompt for i in ids]
    faults = dict(zip(prompts, ["raise", "nan", "sleep", "exit"]))
    import reward_fixtures

    with open(reward_fixtures.FAULTS_PATH, "w") as f:
        json.dump(faults, f)
    try:
        rl.run(rl.resolve(config), str(tmp_path / "run"))
    finally:
        os.remove(reward_fixtures.FAULTS_PATH)
    line = _lines(tmp_path / "run")[1]
    G = config.batch.group_size
    assert line["reward/failures_error"] == G
    assert line["reward/failures_nonfinite"] == G
    assert line["reward/failures_timeout"] == G
    assert line["reward/failures_crash"] == G
    assert line["reward/failures"] == 4 * G
    assert line["train/reward_mean"] > 0  # The other prompts were scored.


def test_config_validation_lists_every_problem():
    c = config_lib.rl_config()
    c.steps = 0
    c.checkpoint.every = -1
    c.reward.fn = "no_such_module:f"
    c.sampling.think_budget = 31
    with pytest.raises(ValueError) as e:
        rl.resolve(c)
    text = str(e.value)
    for expected in (
        "steps=0 must be an integer >= 1",
        "checkpoint.every=-1",
        "reward.fn='no_such_module:f'",
        "sampling.think_budget=31 leaves no room",
    ):
        assert expected in text, text


# ------------------------------------------------------------------------------------------
# Multi-turn episodes: exact resume with episodes in flight, environments that misbehave.
# ------------------------------------------------------------------------------------------

EPISODE_STEPS = 4
# `env_fixtures.Calculator` answers each "=" the policy writes on the smoke task's prompts; a
# reward about half the samples earn, so every step trains; time limits no call or episode
# comes near, so each episode's outcome is its sampling's alone.
EPISODES = {
    **RUN,
    "steps": EPISODE_STEPS,
    "env.name": "env_fixtures:Calculator",
    "env.call_seconds": 600.0,
    "env.episode_seconds": 3600.0,
    "reward.fn": "reward_fixtures:even_length",
    "eval.every": 100,  # At the first and last steps only.
}
# With environment calls, how many decode steps a batch takes depends on when the replies came
# back: the engine's slot utilization is a wall-clock measurement too.
EPISODE_TIMING = (*TIMING, "pipeline/slot_utilization")
# The recipe's pipeline mode, k = 8 updates (its own k) with the `:sync` runs' 4 updates per
# batch: the generator runs 2 batches ahead on the one device, and the update program is the
# sync runs' (compiled once for both).
PIPELINE = {
    "filters.retire": False,  # The stream alone then decides the prompts.
    "pipeline.max_staleness": 8,
    "learner.minibatches": 4,
}


def _episode_settings(straight, **settings):
    return {**EPISODES, "sft.reuse_from": str(straight), **settings}


@pytest.fixture(scope="module")
def straight_episodes(shared_workdir, straight):
    """The multi-turn run (sync), never killed, in this process: its workdir, and its first
    step's prompts and samples."""

    def run(workdir):
        judged = _run_here(_config_of("smoke,sync", _episode_settings(straight)), workdir)
        with open(workdir / "first_step.pkl", "wb") as f:
            pickle.dump(judged[0], f)

    workdir = shared_workdir("reliability_episodes", run)
    lines = _lines(workdir)
    assert [x["step"] for x in lines] == list(range(EPISODE_STEPS + 1))
    assert min(x["env/turns_mean"] for x in lines[1:]) > 1  # Episodes of several turns.
    with open(workdir / "first_step.pkl", "rb") as f:
        return workdir, pickle.load(f)


def test_episodes_sigterm_saves_a_checkpoint_and_resumes_the_same_run(
    straight, straight_episodes, tmp_path, caplog, capsys
):
    """Multi-turn episodes in the sync loop, sent SIGTERM after step 1: the step in flight
    (its episodes) finishes, one checkpoint is saved at the step it stopped and the command
    exits 143; the same run resumed from there is the run never signalled, line for line
    (wall-clock fields aside)."""
    _sigterm_then_resume(tmp_path, _episode_settings(straight), EPISODE_STEPS, caplog, capsys)
    want = _comparable(_lines(straight_episodes[0]), EPISODE_TIMING)
    assert _comparable(_lines(tmp_path), EPISODE_TIMING) == want


def test_pipeline_sigkill_with_episodes_in_flight_regenerates_them(straight, tmp_path, caplog):
    """Multi-turn episodes in the recipe's pipeline mode (`PIPELINE`), killed once step 2
    and its checkpoint are written, with the next batches' episodes in flight (the generator
    runs 2 batches ahead), resumed from the step-2 checkpoint: the prompts trained, step by step,
    are exactly the stream's draws (the episodes in flight at the kill were played again by
    the restored policy, none lost, none trained twice); the staleness bound holds on every
    step, the first after the restart included; the episodes had turns, with parking rows
    (`env.parked`) in the generator. (The pipeline driver resumes a single-turn run by the
    same code: `pipeline.Feed` drives the engine through `envs.episodes` either way.)"""
    workdir = tmp_path / "run"
    settings = _episode_settings(straight, **PIPELINE, **{"env.parked": 8})
    judged = _kill_then_resume_here(workdir, "smoke", settings, caplog, after_step=2)
    lines = _lines(workdir)
    assert [x["step"] for x in lines] == list(range(EPISODE_STEPS + 1))
    stream = filters.PromptStream(200, seed=0)  # The smoke task's 200 training prompts.
    draws = [stream.next(8) for _ in range(EPISODE_STEPS)]
    assert [x["data/prompt_ids"] for x in lines[1:]] == draws
    # The resumed run played the episodes of steps 3 and 4, in flight at the kill, once each:
    # every sample of their prompts, and nothing else.
    train = builders.materialize("arithmetic", 2, 200, 40, str(straight / "data"))["train"]
    want = [[builders.decode(train[i]).prompt for i in ids] for ids in draws[2:]]
    assert [prompts for prompts, _ in judged] == want
    assert [len(samples.reward_N) for _, samples in judged] == [8 * 4, 8 * 4]
    # The generator had the parking rows (how many samples it parked follows the replies'
    # timing: measured 24 here, while queued requests took their slots).
    assert all("pipeline/parked" in x for x in lines[1:])
    assert all(x["pipeline/staleness_max"] <= 8 for x in lines[1:])
    assert max(x["pipeline/staleness_max"] for x in lines[1:]) > 0  # It did run ahead.
    assert min(x["env/turns_mean"] for x in lines[1:]) > 1


def test_misbehaving_environment_costs_its_samples(straight, straight_episodes, tmp_path):
    """The first step of the multi-turn run with an environment that raises on one prompt's
    calls, hangs past `env.call_seconds` on another's and returns something not a `Reply` on
    a third's (prompts whose samples do call it), with 2 workers: the run completes (the
    hung calls' threads, left behind, do not hold the process); each sample whose call
    misbehaved ends at that turn for its reason, with reward 0; every other sample is the
    sample of the run without faults, token for token."""
    prompts, clean = straight_episodes[1]
    G, N = 4, len(clean.reward_N)
    called = [p for p, calls in zip(prompts, clean.episodes["calls"].reshape(-1, G)) if calls.any()]
    faults = dict(zip(called, env_fixtures.FAULTS))
    assert len(faults) == len(env_fixtures.FAULTS)
    settings = _episode_settings(
        straight,
        **{
            "steps": 1,
            "env.call_seconds": 2.0,
            "env.workers": 2,
            "env.kwargs": {"faults": [[p, fault, 1] for p, fault in faults.items()]},
        },
    )
    try:
        [(ran, s)] = _run_here(_config_of("smoke,sync", settings), tmp_path)
        left = [t for t in threading.enumerate() if t.name.startswith("rlscale-env")]
        assert left and all(t.daemon for t in left)  # The hung calls' threads.
    finally:
        env_fixtures.RELEASE.set()
    assert ran == prompts
    reason = {"raise": "error", "hang": "call_time", "garbage": "error"}
    ends = []
    for n in range(N):
        fault = faults.get(prompts[n // G])
        if fault is None or not clean.episodes["calls"][n]:
            for field in ("tokens_NM", "env_NM", "logprobs_NM", "lengths_N", "reward_N"):
                np.testing.assert_array_equal(getattr(s, field)[n], getattr(clean, field)[n])
            for key in ("end", "turns", "calls"):
                assert s.episodes[key][n] == clean.episodes[key][n], (n, key)
            continue
        L = s.lengths_N[n]  # Its first turn, as sampled, up to the stop: no reply after.
        np.testing.assert_array_equal(s.tokens_NM[n, :L], clean.tokens_NM[n, :L])
        assert s.texts[n].endswith(env_fixtures.STOP) and not s.env_NM[n].any()
        assert s.episodes["calls"][n] == 1 and s.reward_N[n] == 0.0
        assert s.episodes["end"][n] == reason[fault], (n, fault)
        ends.append(reason[fault])
    assert set(ends) == {"error", "call_time"}
    line = _lines(tmp_path)[1]
    assert line["env/ended_error"] == ends.count("error") / N
    assert line["env/ended_call_time"] == ends.count("call_time") / N
