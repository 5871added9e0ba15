"""`tools/peers.py`'s numbers from step records, against values worked out by hand."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("_tool_peers", f"{ROOT}/tools/peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(times, evals):
    """metrics.jsonl's shape: step 0 holds only an evaluation; step k its time, and an
    evaluation where `evals` has one."""
    out = [{"step": 0, "eval/pass@1": evals[0]}]
    for k, t in enumerate(times, start=1):
        out.append(
            {"step": k, "time/step_s": t, **({"eval/pass@1": evals[k]} if k in evals else {})}
        )
    return out


def test_summary_of_a_run(peers):
    # Step 1 compiles (30 s); steps 2-24 take 1 s except steps 6 and 7 (2 s and 4 s).
    times = [30.0] + [1.0] * 23
    times[5], times[6] = 2.0, 4.0
    evals = {0: 0.2, 5: 0.45, 10: 0.5, 15: 0.69, 20: 0.72, 24: 0.7}
    got = peers.summarize(_records(times, evals))
    # Median of steps 5-20: fourteen 1 s steps, one 2 s, one 4 s.
    assert got["seconds_per_step"] == 1.0
    # pass@1 first reaches 0.5 at step 10 (equality counts): 30 + 7 x 1 + 2 + 4 = 43 s.
    assert got["time_to_0.5_s"] == 43.0
    # 0.7 first at step 20: 43 + 10 s.
    assert got["time_to_0.7_s"] == 53.0
    assert (got["steps_to_0.5"], got["steps_to_0.7"]) == (10, 20)
    assert got["final_pass@1"] == 0.7 and got["steps"] == 24
    # Never reached: None, which makes the mean over seeds None too.
    slow = peers.summarize(_records(times, {0: 0.2, 24: 0.45}))
    assert slow["time_to_0.5_s"] is None and slow["time_to_0.7_s"] is None
    mean = peers.mean_over_seeds({"0": got, "1": slow})
    assert mean["time_to_0.5_s"] is None and mean["final_pass@1"] == pytest.approx(0.575)


def test_ratios_are_trl_over_rlscale(peers):
    ours = {"seconds_per_step": 1.0, "time_to_0.5_s": 40.0, "time_to_0.7_s": None}
    theirs = {"seconds_per_step": 3.0, "time_to_0.5_s": 100.0, "time_to_0.7_s": 200.0}
    got = peers.ratios({**ours, "final_pass@1": 0.78}, {**theirs, "final_pass@1": 0.75})
    assert got["seconds_per_step"] == 3.0 and got["time_to_0.5_s"] == 2.5
    assert got["time_to_0.7_s"] is None
    assert got["final_pass@1_diff"] == pytest.approx(0.03)
