"""The IsoCompute allocation study (`scaling.allocation`, `tools/sweep.py --budgets`): the
cell grid against hand enumeration, n* of exact parabolas, the n*(C) law, record points, and
the sweep's iso-compute mode on fake finished runs (nothing is trained)."""

import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from rlscale import cli
from rlscale.scaling import allocation
from rlscale.scaling.allocation import Cell

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep():
    spec = importlib.util.spec_from_file_location("_tool_sweep", f"{ROOT}/tools/sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ==========================================================================================
# iso_cells.
# ==========================================================================================


def test_iso_cells_match_hand_enumeration():
    cells = allocation.iso_cells([48, 64], [2, 4, 8], [4], reuse=(1, 4), min_steps=2)
    assert cells == [
        Cell(48, 2, 4, 6, 1, 0),
        Cell(48, 2, 4, 6, 4, 6),  # pool 4 * 6 / 4 = 6
        Cell(48, 4, 4, 3, 1, 0),  # tau 4: pool 12 / 4 = 3 < B_p = 4, skipped
        # n = 8: 48 / 32 is not an integer, skipped
        Cell(64, 2, 4, 8, 1, 0),
        Cell(64, 2, 4, 8, 4, 8),
        Cell(64, 4, 4, 4, 1, 0),
        Cell(64, 4, 4, 4, 4, 4),  # pool 16 / 4 = 4 = B_p: one batch, kept
        Cell(64, 8, 4, 2, 1, 0),  # tau 4: pool 8 / 4 = 2 < 4, skipped
    ]
    # M = 6 >= tau = 4 but the pool 3 * 6 / 4 is not an integer.
    assert allocation.iso_cells([36], [2], [3], reuse=(1, 4)) == [Cell(36, 2, 3, 6, 1, 0)]
    # min_steps: M = 2 (n = 8) is too few at min_steps 3; M = 1 always is at 2.
    assert [c.rollouts for c in allocation.iso_cells([64], [2, 8, 16], [4], min_steps=3)] == [2]
    assert [c.steps for c in allocation.iso_cells([64], [8, 16], [4], min_steps=2)] == [2]


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (([100], [3], [4]), {}, "budget 100 has no cell: no n in [3], B_p in [4] and tau in [1]"),
        (([64], [2], [4]), {"min_steps": 9}, "budget 64 has no cell"),
        (([0], [2], [4]), {}, "budgets: 0 is not positive"),
        (([64.0], [2], [4]), {}, "budgets: 64.0 is not an integer"),
        (([64], [2, 2], [4]), {}, "rollouts: 2 appears twice"),
        (([64], [2], [True]), {}, "prompts: True is not an integer"),
        (([64], [2], [4]), {"reuse": ()}, "reuse is empty"),
        (([64], [2], [4]), {"reuse": (1, -4)}, "reuse: -4 is not positive"),
        (([64], [2], [4]), {"min_steps": 0}, "min_steps: 0 is not positive"),
    ],
)
def test_iso_cells_rejects_bad_input(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        allocation.iso_cells(*args, **kwargs)


# ==========================================================================================
# optimal_rollouts and fit_optimal_rollouts.
# ==========================================================================================


def _parabola(n, peak, vertex_log2, curvature):
    """reward = peak - curvature (log2 n - vertex)^2."""
    return peak - curvature * (np.log2(n) - vertex_log2) ** 2


def test_optimal_rollouts_recovers_the_vertex_of_an_exact_parabola():
    """Rewards on a parabola in log2 n peaking at n = 6, between the measured 4 and 8: n* is
    6, not the measured best 8. The B_p = 2 cells are worse (the best over B_p is taken) and
    the B_p = 4 cells come twice, +-0.02 (repeats are averaged)."""
    cells = allocation.iso_cells([256], [2, 4, 8, 16], [2, 4])
    good = [c for c in cells if c.prompts == 4]
    exact = {c: _parabola(c.rollouts, 0.8, math.log2(6), 0.05) for c in good}
    every, rewards = [], []
    for c in cells:
        if c.prompts == 2:
            every.append(c)
            rewards.append(_parabola(c.rollouts, 0.8, math.log2(6), 0.05) - 0.1)
        else:
            every += [c, c]
            rewards += [exact[c] + 0.02, exact[c] - 0.02]
    (opt,) = allocation.optimal_rollouts(every, rewards)
    assert opt.budget == 256 and opt.rollouts == (2, 4, 8, 16)
    np.testing.assert_allclose(opt.reward, [exact[c] for c in good], rtol=0, atol=1e-12)
    # (log2 8 - log2 6)^2 = 0.172 < (log2 4 - log2 6)^2 = 0.342: 8 is the measured best.
    assert opt.best_rollouts == 8 and opt.fallback is None
    assert opt.n_star == pytest.approx(6.0, rel=1e-9)
    assert opt.reward_star == pytest.approx(0.8, abs=1e-12)
    c2, c1, c0 = opt.parabola
    l6 = math.log2(6)
    np.testing.assert_allclose([c2, c1, c0], [-0.05, 0.1 * l6, 0.8 - 0.05 * l6**2], atol=1e-10)


def _two_budgets(spread):
    """Cells at C = 256 and 1024 on parabolas peaking at n = 6 and 12 (so b = 0.5), each
    cell twice: +- `spread`."""
    cells, rewards = [], []
    for C, peak in ((256, 6), (1024, 12)):
        for c in allocation.iso_cells([C], [2, 4, 8, 16, 32], [2]):
            exact = _parabola(c.rollouts, 0.8, math.log2(peak), 0.05)
            cells += [c, c]
            rewards += [exact + spread, exact - spread]
    return cells, rewards


def test_bootstrap_optimal_rollouts_from_the_repeats():
    """Equal repeats leave nothing to resample: the intervals are the points (n* 6 and 12,
    b 0.5). Repeats +-0.01 apart give intervals around them, wider on b than on nothing."""
    cells, rewards = _two_budgets(0.0)
    boot = allocation.bootstrap_optimal_rollouts(cells, rewards, n_boot=50)
    assert boot.budgets == (256, 1024) and boot.fallback_frac == (0.0, 0.0)
    np.testing.assert_allclose(boot.n_star_interval, [[6, 6], [12, 12]], rtol=1e-9)
    np.testing.assert_allclose(boot.b_interval, [0.5, 0.5], rtol=1e-9)
    cells, rewards = _two_budgets(0.01)
    boot = allocation.bootstrap_optimal_rollouts(cells, rewards, n_boot=200, seed=1)
    (lo6, hi6), (lo12, hi12) = boot.n_star_interval
    assert lo6 < 6 < hi6 and lo12 < 12 < hi12
    assert boot.b_interval[0] < 0.5 < boot.b_interval[1]
    assert boot.as_dict()["b_interval"] == list(boot.b_interval)


def test_bootstrap_optimal_rollouts_rejects_cells_without_repeats():
    cells, rewards = _two_budgets(0.0)
    with pytest.raises(ValueError, match="has 1 repeat: a bootstrap needs 2 seeds"):
        allocation.bootstrap_optimal_rollouts(cells[1:], rewards[1:])
    half = len(cells) // 2
    with pytest.raises(ValueError, match="1 budget"):
        allocation.bootstrap_optimal_rollouts(cells[:half], rewards[:half])
    with pytest.raises(ValueError, match="n_boot=0"):
        allocation.bootstrap_optimal_rollouts(cells, rewards, n_boot=0)


def test_optimal_rollouts_falls_back_to_the_measured_best():
    cells = allocation.iso_cells([64, 128, 256], [2, 4, 8, 16], [2])
    cells += allocation.iso_cells([1024], [2, 4], [2])
    rewards = []
    for c in cells:
        if c.budget == 64:  # Vertex at n = 64, outside [2, 16]: the best is the edge 16.
            rewards.append(_parabola(c.rollouts, 0.9, 6.0, 0.02))
        elif c.budget == 128:  # Convex: rewards 0.3144, 0.3004, 0.3064, 0.3324.
            rewards.append(0.3 + 0.01 * (math.log2(c.rollouts) - 2.2) ** 2)
        elif c.budget == 256:  # Linear in log2 n: c2 = 0 is not concave.
            rewards.append(0.1 * math.log2(c.rollouts))
        else:  # Two distinct n.
            rewards.append({2: 0.4, 4: 0.3}[c.rollouts])
    edge, convex, linear, two = allocation.optimal_rollouts(cells, rewards)
    assert (edge.best_rollouts, edge.n_star) == (16, 16.0)
    assert edge.fallback == "the vertex n=64 is outside [2, 16]"
    assert edge.reward_star == pytest.approx(0.9 - 0.02 * 4)
    assert (convex.best_rollouts, convex.n_star) == (16, 16.0)
    assert convex.fallback.startswith("the parabola in log2 n is not concave (c2=0.01)")
    # c2 is 0 up to rounding: not concave, or a vertex far outside; either way the edge.
    assert (linear.n_star, linear.fallback is not None) == (16.0, True)
    assert (two.best_rollouts, two.n_star, two.parabola) == (2, 2.0, None)
    assert two.fallback == "2 distinct n; a parabola needs 3"


def test_optimal_rollouts_rejects_bad_rewards():
    cells = allocation.iso_cells([64], [2, 4], [4])
    with pytest.raises(ValueError, match=re.escape("2 cells but rewards of shape (3,)")):
        allocation.optimal_rollouts(cells, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=re.escape("reward nan of cell 1 (Cell(budget=64")):
        allocation.optimal_rollouts(cells, [0.1, float("nan")])
    with pytest.raises(ValueError, match="no cells"):
        allocation.optimal_rollouts([], [])


def test_fit_optimal_rollouts_on_hand_made_optima():
    # n* doubles with every doubling of C: b = 1, a = 1 - 13 = -12, no saturation.
    f = allocation.fit_optimal_rollouts([8192, 16384, 32768], [2, 4, 8])
    assert (f.b, f.a) == (pytest.approx(1.0), pytest.approx(-12.0))
    assert f.growth == pytest.approx((1.0, 1.0))
    assert (f.grows, f.saturates) == (True, False)
    assert f.predict(65536) == pytest.approx(16.0)
    # 2, 8, 8, 8: growth 2, 0, 0 per doubling; over x = 0..3, y = 1, 3, 3, 3:
    # b = Sxy / Sxx = 3 / 5, a = 2.5 - 0.6 * 1.5 = 1.6 (C = 1, 2, 4, 8).
    f = allocation.fit_optimal_rollouts([8, 1, 4, 2], [8, 2, 8, 8])  # Sorted by C.
    assert f.budgets == (1.0, 2.0, 4.0, 8.0) and f.n_star == (2.0, 8.0, 8.0, 8.0)
    assert (f.b, f.a) == (pytest.approx(0.6), pytest.approx(1.6))
    assert f.growth == pytest.approx((2.0, 0.0, 0.0))
    assert (f.grows, f.saturates) == (True, True)
    # Growth 1, then 1 doubling of n* over 2 of C: exactly half, not below, not saturating.
    f = allocation.fit_optimal_rollouts([1, 2, 8], [2, 4, 8])
    assert (f.growth, f.saturates) == ((1.0, 0.5), False)
    # Two budgets: saturation is undefined; a shrinking n* does not grow nor saturate.
    f = allocation.fit_optimal_rollouts([1024, 4096], [8, 2])
    assert (f.b, f.grows, f.saturates) == (pytest.approx(-1.0), False, None)
    assert allocation.fit_optimal_rollouts([1, 2, 4], [8, 4, 4]).saturates is False


@pytest.mark.parametrize(
    "budgets, n_star, message",
    [
        ([1024], [4], "1 budget(s): the n*(C) power law needs at least 2"),
        ([1024, 2048], [4, 0], "n_star 0.0 at index 1 is not finite and > 0"),
        ([1024, -1], [4, 4], "budget -1.0 at index 1 is not finite and > 0"),
        ([1024, 1024], [4, 8], "budget 1024 appears twice"),
        ([1024, 2048], [4], "must be 1-D of one length"),
    ],
)
def test_fit_optimal_rollouts_rejects_bad_input(budgets, n_star, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        allocation.fit_optimal_rollouts(budgets, n_star)


# ==========================================================================================
# record_points and the tables.
# ==========================================================================================


def test_record_points_keep_the_best_so_far_frontier():
    """Bins of 0.1: kept are the first point of each higher bin in compute order; at equal
    compute (100) the better point (0.35, cell 1) is the one considered first."""
    points = [
        (300, 0.5, 0),
        (0, 0.1, 0),
        (0, 0.1, 1),
        (100, 0.3, 0),  # Dominated by (100, 0.35) at the same compute.
        (100, 0.35, 1),
        (200, 0.32, 1),  # Bin 3 again: no record.
        (50, 0.2, 2),
        (250, 0.12, 2),
    ]
    kept = allocation.record_points(points, bin_width=0.1)
    assert kept == [(0, 0.1, 0), (50, 0.2, 2), (100, 0.35, 1), (300, 0.5, 0)]
    assert kept[2].cell == 1
    with pytest.raises(ValueError, match="no points"):
        allocation.record_points([], bin_width=0.1)
    with pytest.raises(ValueError, match=re.escape("bin_width=0 must be > 0")):
        allocation.record_points(points, bin_width=0)
    with pytest.raises(ValueError, match="NaN or inf in reward at index 1"):
        allocation.record_points([(0, 0.1, 0), (1, float("nan"), 0)], bin_width=0.1)


def test_format_reuse_table_by_hand():
    cells = allocation.iso_cells([64], [2, 4], [4], reuse=(1, 4))
    # Cells: n2 tau1, n2 tau4, n4 tau1, n4 tau4; the n4 tau4 cell is measured twice.
    table = allocation.format_reuse_table(cells + cells[3:], [0.5, 0.4, 0.45, 0.3, 0.2])
    assert table.splitlines() == [
        "| C | n | B_p | M | tau=1 | tau=4 |",
        "|---:|---:|---:|---:|---:|---:|",
        "| 64 | 2 | 4 | 8 | 0.500 | 0.400 |",
        "| 64 | 4 | 4 | 4 | 0.450 | 0.250 |",
    ]


# ==========================================================================================
# tools/sweep.py --budgets.
# ==========================================================================================


def _iso_args(root, *extra):
    return ["--config", "c.py", "--workdir", str(root), *extra]


def test_sweep_iso_dry_run_prints_every_cell(tmp_path, capsys):
    sweep = _sweep()
    root = tmp_path / "iso"
    (root / "C64__n4__B4__M4").mkdir(parents=True)
    (root / "C64__n4__B4__M4" / "summary.json").write_text("{}")
    flags = ["--budgets", "64,96", "--rollouts", "2,4,8", "--prompts", "4", "--reuse", "1,4"]
    cli.call(sweep.define_flags, sweep.main, _iso_args(root, *flags, "--evals", "3", "--dry_run"))
    lines = capsys.readouterr().out.splitlines()
    # (name, n, M, eval.every = max(1, M // 3), prompt_pool or None).
    expected = [
        ("C64__n2__B4__M8", 2, 8, 2, None),
        ("C64__n2__B4__M8__tau4", 2, 8, 2, 8),
        ("C64__n4__B4__M4", 4, 4, 1, None),
        ("C64__n4__B4__M4__tau4", 4, 4, 1, 4),
        ("C64__n8__B4__M2", 8, 2, 1, None),  # tau 4: pool 2 < 4
        ("C96__n2__B4__M12", 2, 12, 4, None),
        ("C96__n2__B4__M12__tau4", 2, 12, 4, 12),
        ("C96__n4__B4__M6", 4, 6, 2, None),
        ("C96__n4__B4__M6__tau4", 4, 6, 2, 6),
        ("C96__n8__B4__M3", 8, 3, 1, None),  # tau 4: M = 3 < 4
    ]
    want = []
    for name, n, M, every, pool in expected:
        line = (
            f"{sys.executable} -m rlscale.main --config c.py --workdir {root}/{name} "
            f"--config.batch.group_size={n} --config.batch.prompts=4 --config.steps={M} "
            f"--config.eval.every={every} --config.checkpoint.every={M}"
        )
        line += f" --config.batch.prompt_pool={pool}" if pool else ""
        want.append(("# finished, skipped: " if name == "C64__n4__B4__M4" else "") + line)
    assert lines == ["# shard 0/1: 10 of 10 runs"] + want
    assert not (root / "iso_compute.json").exists()  # A dry run analyses nothing.

    # Crossed with a grid, sharded: shard 1/3 holds runs 1 and 4 of six.
    flags = ["--budgets", "64", "--rollouts", "2,4,8", "--prompts", "4", "--grid", "seed=0,1"]
    cli.call(sweep.define_flags, sweep.main, _iso_args(root, *flags, "--shard", "1/3", "--dry_run"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# shard 1/3: 2 of 6 runs"
    assert lines[1].endswith(
        f"--workdir {root}/C64__n2__B4__M8__seed_1 --config.batch.group_size=2 "
        "--config.batch.prompts=4 --config.steps=8 --config.eval.every=2 "
        "--config.checkpoint.every=8 --config.seed=1"
    )
    assert f"--workdir {root}/C64__n8__B4__M2__seed_0 " in lines[2]
    assert len(lines) == 3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--budgets", "64,x", "--rollouts", "2", "--prompts", "4"], "bad --budgets '64,x': 'x'"),
        (["--budgets", "64", "--rollouts", "2,0", "--prompts", "4"], "bad --rollouts '2,0': '0'"),
        (["--budgets", "64", "--rollouts", "2", "--prompts", "4", "--reuse", "1,1"], "1 appears"),
        (["--budgets", "64", "--prompts", "4"], "--budgets needs --rollouts"),
        (["--grid", "seed=0", "--rollouts", "2"], "--rollouts: only with --budgets"),
        ([], "give --grid, or --budgets with --rollouts and --prompts"),
        (["--budgets", "100", "--rollouts", "3", "--prompts", "4"], "budget 100 has no cell"),
        (
            ["--budgets", "64", "--rollouts", "2", "--prompts", "4", "--grid", "steps=4"],
            "--grid key 'steps' is set by the iso-compute cells",
        ),
        (
            ["--budgets", "64", "--rollouts", "2", "--prompts", "4", "--evals", "0"],
            "bad --evals 0: must be >= 1",
        ),
    ],
)
def test_sweep_iso_bad_flags_fail_naming_them(flags, message):
    sweep = _sweep()
    with pytest.raises(ValueError, match=re.escape(message)):
        cli.call(sweep.define_flags, sweep.main, _iso_args("/tmp/never", *flags, "--dry_run"))


def _finish(run, M, n, B_p, final, mid=None):
    """A finished run: `summary.json` and a metrics.jsonl with the step-0 eval (0.1), a train
    line, an eval at M // 2 (`mid`, default final / 2) and the last at step `M`."""
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    flops = 1000.0 * n * B_p  # Per step.
    lines = [
        {"step": 0, "compute/flops": 0.0, "eval/pass@1": 0.1},
        {"step": 1, "compute/flops": flops, "train/reward_mean": 0.2},
        {"step": M // 2, "compute/flops": flops * (M // 2), "eval/pass@1": mid or final / 2},
        {"step": M, "compute/flops": flops * M, "eval/pass@1": final},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_sweep_iso_analyses_finished_cells(tmp_path, capsys, monkeypatch):
    """Every cell finished beforehand (nothing runs). Final rewards on parabolas in log2 n,
    `peak - 0.032 (log2 n - v)^2`, with v = 2, 3, 3.25 (n* = 4, 8, 2^3.25 = 9.51) and peaks
    0.3, 0.4, 0.5 at C = 256, 512, 1024. The n*(C) law over log2 C = 8, 9, 10 and
    log2 n* = 2, 3, 3.25: b = Sxy / Sxx = 1.25 / 2 = 0.625, a = 2.75 - 0.625 * 9 = -2.875;
    growth 1 then 0.25 < 1 / 2: it saturates."""
    sweep = _sweep()
    monkeypatch.setattr(sweep.subprocess, "run", None)  # Running anything would fail.
    root = tmp_path / "iso"
    vertex = {256: (0.3, 2.0), 512: (0.4, 3.0), 1024: (0.5, 3.25)}
    for C, (peak, v) in vertex.items():
        for n in (2, 4, 8, 16):
            M = C // (4 * n)
            final = _parabola(n, peak, v, 0.032)
            _finish(root / f"C{C}__n{n}__B4__M{M}", M, n, 4, final)
    flags = ["--budgets", "256,512,1024", "--rollouts", "2,4,8,16", "--prompts", "4"]
    cli.call(sweep.define_flags, sweep.main, _iso_args(root, *flags, "--evals", "2"))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# shard 0/1: 12 of 12 runs"
    assert all(x.startswith("# finished, skipped: ") for x in out[1:13])
    assert out[13:] == [
        "| C | n=2 | n=4 | n=8 | n=16 | best n | n* |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        "| 256 | 0.268 | 0.300 | 0.268 | 0.172 | 4 | 4 |",
        "| 512 | 0.272 | 0.368 | 0.400 | 0.368 | 8 | 8 |",
        "| 1024 | 0.338 | 0.450 | 0.498 | 0.482 | 8 | 9.51 |",
        "",
        "n*(C): log2 n* = -2.875 + 0.625 log2 C; growth per doubling of C: 1.00, 0.25; "
        "grows: yes; saturates: yes",
        f"wrote {root}/iso_compute.json and {root}/iso_compute.png",
    ]
    report = json.loads((root / "iso_compute.json").read_text())
    assert [o["budget"] for o in report["optima"]] == [256, 512, 1024]
    np.testing.assert_allclose([o["n_star"] for o in report["optima"]], [4, 8, 2**3.25])
    assert [o["fallback"] for o in report["optima"]] == [None, None, None]
    fit = report["fit"]
    assert (fit["b"], fit["a"]) == (pytest.approx(0.625), pytest.approx(-2.875))
    assert fit["growth"] == pytest.approx([1.0, 0.25])
    assert (fit["grows"], fit["saturates"], report["fit_error"]) == (True, True, None)
    cell = report["cells"][6]  # C = 512, n = 8, M = 16.
    assert cell["name"] == "C512__n8__B4__M16" and cell["workdir"] == f"{root}/C512__n8__B4__M16"
    assert cell["final_reward"] == pytest.approx(0.4) and cell["final_flops"] == 16 * 32000.0
    assert cell["overrides"] == {
        "batch.group_size": "8",
        "batch.prompts": "4",
        "steps": "16",
        "eval.every": "8",
        "checkpoint.every": "16",
    }
    assert (cell["reuse"], cell["prompt_pool"], cell["error"]) == (1, 0, None)
    # Compute in rollouts (step * n * 4). Pooled: all step-0 evals (0.1) at 0; at 128 the
    # C = 256 mid evals, best 0.15 (n = 4, cell 1); at 256 the C = 256 finals, best 0.3
    # (cell 1), above the C = 512 mid evals (<= 0.2); at 512 the C = 512 finals, best 0.4
    # (n = 8, cell 6); at 1024 the C = 1024 finals, best 0.498 (n = 8, cell 10).
    points = [(p["compute"], p["reward"], p["cell"]) for p in report["records"]["points"]]
    assert [(c, i) for c, _, i in points] == [(0, 0), (128, 1), (256, 1), (512, 6), (1024, 10)]
    np.testing.assert_allclose([r for _, r, _ in points], [0.1, 0.15, 0.3, 0.4, 0.498])
    assert report["records"]["bin_width"] == 0.01
    assert (root / "iso_compute.png").stat().st_size > 0


def test_sweep_iso_independent_seeds_and_their_intervals(tmp_path, capsys, monkeypatch):
    """`--seeds 2`: every cell twice, and no seed used by two runs (cell i: seeds 2i, 2i + 1).
    Finished beforehand +-0.01 about parabolas peaking at n = 6 (C = 256) and 12 (C = 1024),
    the report adds the seed bootstrap's intervals, each around its point (b = 0.5)."""
    sweep = _sweep()
    monkeypatch.setattr(sweep.subprocess, "run", None)  # Running anything would fail.
    root = tmp_path / "iso"
    flags = ["--budgets", "256,1024", "--rollouts", "2,4,8,16,32", "--prompts", "4"]
    _, entries = sweep.iso_plan(
        "configs/ladder.py",
        str(root),
        budgets="256,1024",
        rollouts="2,4,8,16,32",
        prompts="4",
        seeds=2,
    )
    seeds = [int(dict(o)["seed"]) for *_, o in entries]
    assert seeds == list(range(20)) and entries[3][1] == "C256__n4__B4__M16__seed_3"
    for (cell, _, workdir, _), seed in zip(entries, seeds):
        peak = 6 if cell.budget == 256 else 12
        final = _parabola(cell.rollouts, 0.8, math.log2(peak), 0.05) + (0.01 if seed % 2 else -0.01)
        _finish(pathlib.Path(workdir), cell.steps, cell.rollouts, 4, final)
    cli.call(sweep.define_flags, sweep.main, _iso_args(root, *flags, "--seeds", "2"))
    out = capsys.readouterr().out
    assert "n* at C = 256: 95% [" in out and "b: 95% [" in out
    boot = json.loads((root / "iso_compute.json").read_text())["bootstrap"]
    assert boot["budgets"] == [256, 1024] and boot["n_boot"] == 2000
    (lo6, hi6), (lo12, hi12) = boot["n_star_interval"]
    assert (
        lo6 < 6 < hi6 and lo12 < 12 < hi12 and boot["b_interval"][0] < 0.5 < boot["b_interval"][1]
    )


def test_sweep_iso_reuse_table_failures_and_fallback(tmp_path, capsys, monkeypatch):
    """C = 64, n = 2, 4, 8, tau = 1, 4: the n = 4, tau = 4 cell finished with its last eval
    at step 2 of 4 (no final reward), the n = 8 one is run and fails; one budget with two
    distinct n: n* is the measured best and there is no n*(C) fit."""
    sweep = _sweep()
    root = tmp_path / "iso"
    _finish(root / "C64__n2__B4__M8", 8, 2, 4, 0.5)
    _finish(root / "C64__n2__B4__M8__tau4", 8, 2, 4, 0.4)
    _finish(root / "C64__n4__B4__M4", 4, 4, 4, 0.45)
    _finish(root / "C64__n4__B4__M4__tau4", 2, 4, 4, 0.6)  # Stopped at step 2 of 4.
    ran = []

    def fake_run(cmd):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    flags = ["--budgets", "64", "--rollouts", "2,4,8", "--prompts", "4", "--reuse", "1,4"]
    # After the report, the failure: from the command line, `error: ...` and exit status 1.
    with pytest.raises(ValueError, match=r"^1 run\(s\) failed: C64__n8__B4__M2$"):
        cli.call(sweep.define_flags, sweep.main, _iso_args(root, *flags))
    printed = capsys.readouterr()
    assert [cmd[cmd.index("--workdir") + 1] for cmd in ran] == [f"{root}/C64__n8__B4__M2"]
    assert printed.err == ""
    out = printed.out.splitlines()
    assert out[6:] == [
        "# run C64__n8__B4__M2 failed (exit status 1)",
        "# C64__n4__B4__M4__tau4: no final reward: the last eval/pass@1 is at step 2, not at "
        "the cell's M=4",
        "| C | n=2 | n=4 | best n | n* |",
        "|---:|---:|---:|---:|---:|",
        "| 64 | 0.500 | 0.450 | 2 | 2 (measured) |",
        "",
        "n*(C): no fit (1 budget(s): the n*(C) power law needs at least 2)",
        "",
        "final reward against data reuse tau:",
        "",
        "| C | n | B_p | M | tau=1 | tau=4 |",
        "|---:|---:|---:|---:|---:|---:|",
        "| 64 | 2 | 4 | 8 | 0.500 | 0.400 |",
        "| 64 | 4 | 4 | 4 | 0.450 | - |",
        f"wrote {root}/iso_compute.json and {root}/iso_compute.png",
    ]
    report = json.loads((root / "iso_compute.json").read_text())
    assert [c["final_reward"] for c in report["cells"]] == [0.5, 0.4, 0.45, None, None]
    assert [c["finished"] for c in report["cells"]] == [True, True, True, True, False]
    assert report["cells"][1]["overrides"]["batch.prompt_pool"] == "8"
    assert report["fit"] is None and "needs at least 2" in report["fit_error"]
    (opt,) = report["optima"]
    assert (opt["n_star"], opt["fallback"]) == (2.0, "2 distinct n; a parabola needs 3")
