"""`tools/bench.py`: one invocation runs its sections (the package `tools/bench/`) in turn
on the same params."""

import os
import sys

import jax
import numpy as np
import pytest

from rlscale import model

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

from bench import episodes, train  # noqa: E402


@pytest.mark.slow
def test_train_section_leaves_the_params_to_the_sections_after_it():
    """The train step donates its state; the params the generator section reads after it
    must still hold their values (a deleted buffer raises on the read)."""
    cfg = model.get("tiny")
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    before = jax.tree.map(np.array, params)
    train.bench_train(cfg, params, graphdef, 2, 16, peak=1.0, repeats=1)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), before)


@pytest.mark.slow
def test_episodes_section_runs_one_workload_and_compiles_before_timing(
    tiny_cfg, tiny_model, count_compiles, monkeypatch, capsys
):
    """The episodes section on a small workload (2 slots, 6 requests, a 10 ms tool): every
    side runs the same requests (the same tokens but for float noise: another workload
    would share about 1 / 256 of them), utilization is the engine's policy tokens /
    slot-steps, the side without parking rows parks nothing, and once the section has
    compiled (`warm_engine`, an untimed run) its timed runs compile nothing."""
    graphdef, params = tiny_model
    compiled, run = [], episodes.run_episodes

    def counted(*args):
        with count_compiles() as counter:
            out = run(*args)
        compiled.append(counter.count)
        return out

    monkeypatch.setattr(episodes, "run_episodes", counted)
    out = episodes.bench_episodes(
        tiny_cfg, params, graphdef, slots=2, requests=6, prompt_len=8, max_new_tokens=32,
        turn_tokens=6, turns=2, reply_len=2, latency=0.01, parked=4, k=4, repeats=1,
    )  # fmt: skip
    assert len(compiled) == 4 and compiled[1:] == [0, 0, 0], compiled
    sides = [out[side] for side in ("none", "latency", "unparked")]
    for s in sides:
        assert s["same_tokens_fraction"] > 0.5
        assert s["utilization"] == s["policy_tokens"] / s["slot_steps"]
    assert sides[0]["env_calls"] > 0 and sides[2]["parked"] == 0
    out["section_s"] = 0.0
    episodes.print_episodes(out)
    assert "10 ms, parked=0" in capsys.readouterr().out
