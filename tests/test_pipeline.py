"""The pipeline driver: with k = 0 it is the synchronous loop bit for bit; the staleness
bound holds on every trained token under a slow trainer and under a slow generator, on 4
generator + 4 trainer devices; bad pipeline settings fail at start-up naming the key. (Its
SIGKILL resume is in test_reliability.py.)"""

import numpy as np
import pytest
from conftest import golden_config, metric_lines

from rlscale import rl
from rlscale.rl import learner, pipeline
from rlscale.sampling import generator


def _config(warm, **pipeline):
    c = golden_config("quickstart")
    c.sft.reuse_from = str(warm)
    c.pipeline.update(pipeline)
    return c


def test_k0_pipeline_is_the_sync_loop(warm, tmp_path):
    """The golden quickstart run (`warm`, synchronous) again in pipeline mode with k = 0: a
    generator thread, admission control and hand-over, and every metric the same."""
    rl.run(rl.resolve(_config(warm, mode="pipeline", max_staleness=0)), str(tmp_path))
    assert metric_lines(tmp_path) == metric_lines(warm)


# How long a hand-off below may wait before the test fails: far longer than any step takes.
HANDOFF_S = 300.0


def _wait(feed, done, what):
    """Blocks (on the feed's condition variable) until `done()`, failing after HANDOFF_S."""
    with feed.cv:
        if not feed.cv.wait_for(lambda: done() or feed.error is not None, HANDOFF_S):
            raise AssertionError(f"waited {HANDOFF_S} s for {what}")


@pytest.mark.parametrize(
    "mode, slow",
    [("pipeline", "trainer"), ("pipeline", "generator"), ("async_ppo", "trainer")],
)
def test_staleness_bound_holds_on_every_trained_token(warm, tmp_path, monkeypatch, mode, slow):
    """k = 2 with one update per batch. A slow trainer lets the generator run the full k
    ahead (the bound is reached, never passed); a slow generator gets new weights mid-sequence
    (in-flight updates: versions change within a row). async_ppo samples each batch with one
    version. Checked on the learner's own inputs, not on the driver's metrics.

    "Slow" is a hand-off, not a sleep, so the schedule is the same on any machine: the slow
    trainer starts update s only once the generator has finished batch s + k (as far ahead
    as admission allows); the slow generator, once it has finished batch 1, decodes no
    further until the trainer has published the weights trained on it."""
    k = 2
    seen = []  # (trainer version, versions of the trained tokens, their rows' spread)
    feeds = []
    init, update, step = pipeline.Feed.__init__, learner.Learner.update, generator.Generator.step

    def capture(self, *args, **kwargs):
        init(self, *args, **kwargs)
        feeds.append(self)

    def recording(self, state, ref_params, rollouts, s):
        v, m = rollouts.version_NM, rollouts.mask_NM
        spread = [np.ptp(row[mask]) for row, mask in zip(v, m) if mask.any()]
        seen.append((int(state.step), v[m], max(spread)))
        target = min(s + k, feeds[0].last)
        if slow == "trainer" and target > s:
            _wait(feeds[0], lambda: target in feeds[0].ready, f"batch {target}")
        return update(self, state, ref_params, rollouts, s)

    def slow_step(self, max_steps):
        feed = feeds[0]
        if feed.taken == 0 and feed.next_batch > 1 and 1 not in feed.pending:
            _wait(feed, lambda: feed.published[3] > 0, "the weights trained on batch 1")
            return generator.Stepped([], [])  # The feed takes the new weights first.
        return step(self, max_steps)

    monkeypatch.setattr(pipeline.Feed, "__init__", capture)
    monkeypatch.setattr(learner.Learner, "update", recording)
    if slow == "generator":
        monkeypatch.setattr(generator.Generator, "step", slow_step)
    config = _config(warm, mode=mode, max_staleness=k, generator_devices=4, decode_chunk=2)
    # Three steps: the third trains the batch sampled k = 2 updates before it.
    config.mesh.shape, config.steps, config.eval.every = (-1, 1, 1), 3, 3
    config.learner.length_buckets = 1
    rl.run(rl.resolve(config), str(tmp_path))
    assert len(seen) == config.steps
    lags = np.concatenate([version - v for version, v, _ in seen])
    assert lags.min() >= 0 and lags.max() <= k
    lines = metric_lines(tmp_path)[1:]
    assert max(x["pipeline/staleness_max"] for x in lines) == lags.max()
    if slow == "trainer":
        assert lags.max() == k  # The generator ran as far ahead as allowed.
    if mode == "async_ppo":
        assert all(np.ptp(v) == 0 for _, v, _ in seen)  # One version per batch.
    elif slow == "generator":
        assert any(spread > 0 for _, _, spread in seen)  # Weights changed mid-sequence.
        assert any(x["pipeline/staleness_in_flight_mean"] > 0 for x in lines)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mode="pipeline", max_staleness=-1), "pipeline.max_staleness=-1 must be"),
        (dict(mode="streaming"), "pipeline.mode='streaming' is not one of"),
        (
            dict(mode="pipeline", generator_devices=8),
            "pipeline.generator_devices=8 leaves no device to train on: there are 8 devices",
        ),
        (
            dict(mode="async_ppo", slots=16),
            r"pipeline.slots=16 must hold batch.prompts x batch.group_size = 32",
        ),
        (
            dict(mode="pipeline", generator_devices=3, slots=32),
            r"pipeline.slots=32 does not divide the generator's batch axes \(3 devices\)",
        ),
        (dict(max_staleness=2), "pipeline.mode='sync' generates each batch"),
    ],
)
def test_bad_pipeline_settings_fail_at_start_up(overrides, message):
    config = golden_config("quickstart")
    config.mesh.shape = (-1, 1, 1)
    config.batch.prompts = 8 if overrides.get("generator_devices") != 3 else 5
    config.pipeline.update(overrides)
    with pytest.raises(ValueError, match=message):
        rl.resolve(config)


def _pipeline_sim():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "pipeline_sim.py")
    spec = importlib.util.spec_from_file_location("pipeline_sim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "times, split, k, expected",
    [
        # k = 0: nothing overlaps, the synchronous step.
        (dict(gen_s=1.0, train_s=0.5, host_s=0.2, transfer_s=0.1), (1, 0), 0, 1.8),
        # 4 + 4 of 8 devices: generation at half speed (2 s) bounds the step; training (1 s
        # at half speed) and the transfer hide behind it.
        (dict(gen_s=1.0, train_s=0.5, transfer_s=0.1), (8, 4), 4, 2.0),
        # 6 + 2: generation 1.333 s, training 2 s + 0.4 s transfer: the trainer bounds it.
        (dict(gen_s=1.0, train_s=0.5, transfer_s=0.1), (8, 6), 4, 2.4),
    ],
)
def test_pipeline_sim_steady_state_matches_hand_computed(times, split, k, expected):
    sim = _pipeline_sim()
    devices, gen = split
    got = sim.simulate(**times, devices=devices, generator_devices=gen, max_staleness=k)
    assert got == pytest.approx(expected, abs=0.01)
