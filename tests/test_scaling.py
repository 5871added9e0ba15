"""Scaling fits: the sigmoid and power law against known curves, record points, the
extrapolation check, degenerate inputs, `fit_run`, the main.py hook and the fit/sweep tools."""

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import subprocess_env

from rlscale import cli, scaling
from rlscale.scaling import allocation, fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRUE = dict(A=0.72, B=1.3, C_mid=3e14, R0=0.15)
C = np.logspace(13, 16, 24)


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", f"{ROOT}/tools/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_metrics(workdir, compute, reward, r0=0.2):
    """A metrics.jsonl as rl.py writes it: a step-0 eval at zero compute, train lines
    without eval keys between the eval lines."""
    os.makedirs(workdir, exist_ok=True)
    lines = [{"step": 0, "compute/flops": 0.0, "eval/reward_mean": r0, "eval/pass@1": r0}]
    for i, (c, r) in enumerate(zip(compute, reward), 1):
        lines.append({"step": 2 * i - 1, "compute/flops": c / 2, "train/reward_mean": 0.1})
        lines.append({"step": 2 * i, "compute/flops": c, "eval/reward_mean": r})
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


# ==========================================================================================
# The sigmoid.
# ==========================================================================================


def test_sigmoid_is_the_papers_formula():
    A, B, C_mid, R0 = TRUE.values()
    expected = R0 + (A - R0) / (1 + (C_mid / C) ** B)
    np.testing.assert_allclose(fit.sigmoid(C, **TRUE), expected, rtol=1e-12)
    assert fit.sigmoid(0.0, **TRUE) == R0
    assert fit.sigmoid(C_mid, **TRUE) == pytest.approx((A + R0) / 2)


@pytest.mark.parametrize("method", ["grid", "lsq"])
def test_clean_curve_recovered(method):
    f = fit.fit_sigmoid(C, fit.sigmoid(C, **TRUE), r0=TRUE["R0"], method=method)
    assert abs(f.A - TRUE["A"]) < 0.01
    assert abs(f.A - TRUE["A"]) < 1e-4  # Both resolve far better than the 0.01.
    assert f.B == pytest.approx(TRUE["B"], rel=1e-3)
    assert f.C_mid == pytest.approx(TRUE["C_mid"], rel=1e-3)
    assert (f.R0, f.n_points, f.method, f.A_interval) == (0.15, 24, method, None)
    assert f.r2 > 0.99999


def test_noisy_curve_methods_agree():
    rng = np.random.default_rng(0)
    r = fit.sigmoid(C, **TRUE) + rng.normal(0.0, 0.02, C.shape)
    grid = fit.fit_sigmoid(C, r, r0=0.15, method="grid")
    lsq = fit.fit_sigmoid(C, r, r0=0.15, method="lsq")
    assert abs(grid.A - lsq.A) < 1e-3
    assert grid.B == pytest.approx(lsq.B, rel=1e-2)
    assert grid.C_mid == pytest.approx(lsq.C_mid, rel=1e-2)
    assert grid.sse == pytest.approx(lsq.sse, rel=1e-4)
    assert lsq.r2 == pytest.approx(1 - lsq.sse / np.sum((r - r.mean()) ** 2))


def test_noisy_curves_true_a_within_the_interval():
    """The 95% bootstrap interval covers the true A on (nearly) every noisy curve."""
    covered = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        r = fit.sigmoid(C, **TRUE) + rng.normal(0.0, 0.02, C.shape)
        f = fit.fit_sigmoid(C, r, r0=0.15, method="lsq", n_boot=50, seed=seed)
        lo, hi = f.A_interval
        assert lo <= f.A <= hi and hi - lo < 0.1
        covered += lo <= TRUE["A"] <= hi
    # Percentile bootstrap over 24 points: ~92% coverage measured over 60 curves.
    assert covered >= 8
    # Seeded: the same interval again.
    assert fit.fit_sigmoid(C, r, r0=0.15, method="lsq", n_boot=50, seed=9).A_interval == (lo, hi)


def test_min_compute_cut_and_default_r0():
    c = np.concatenate([[1e9], C])
    r = fit.sigmoid(c, **TRUE)
    r[1:4] += np.array([0.3, -0.1, 0.2])  # Early noise, below the cut.
    f = fit.fit_sigmoid(c, r, min_compute=C[3], method="lsq")
    assert f.R0 == r[0]  # The first point, before the cut.
    assert f.n_points == C.size - 3
    assert abs(f.A - TRUE["A"]) < 1e-3


def test_upper_bound_on_a():
    c = np.logspace(12, 14, 10)  # Far before C_mid: the asymptote is not identifiable.
    r = fit.sigmoid(c, A=0.9, B=1.0, C_mid=1e16, R0=0.1)
    assert fit.fit_sigmoid(c, r, a_max=0.5, method="lsq").A <= 0.5


# ==========================================================================================
# Power law, record-breaking points, extrapolation.
# ==========================================================================================


def test_power_law_recovers_parameters():
    x = np.logspace(12, 16, 10)
    k, E = 0.08, -0.4
    p = 1 - np.exp(E) * x ** (-k)
    pl = fit.fit_power_law(x, p)
    assert pl.k == pytest.approx(k, rel=1e-9)
    assert pl.E == pytest.approx(E, rel=1e-9)
    assert pl.r2 == pytest.approx(1.0)
    np.testing.assert_allclose(pl.predict(x), p, rtol=1e-9)
    assert fit.fit_power_law(x, p, min_compute=x[5]).n_points == 5


def test_record_breaking_hand_made():
    reward = [0.10, 0.12, 0.25, 0.05, 0.31, 0.38, 0.45, 0.59, 0.58, 0.61]
    compute = np.arange(1, 11)
    # bins of 0.1: 1 1 2 0 3 3 4 5 5 6 -> first entries of bins 1, 2, 3, 4, 5, 6.
    assert allocation.record_breaking(compute, reward, bin_width=0.1).tolist() == [0, 2, 4, 6, 7, 9]
    # bins of 0.2: 0 0 1 0 1 1 2 2 2 3.
    assert allocation.record_breaking(compute, reward, bin_width=0.2).tolist() == [0, 2, 6, 9]
    # A value on a bin edge is in the bin above it: 0.3 / 0.1 is 2.999... in floating point.
    assert allocation.record_breaking([1, 2], [0.25, 0.3], bin_width=0.1).tolist() == [0, 1]


def test_extrapolation_hand_verifiable():
    truth = dict(A=0.8, B=1.0, C_mid=100.0, R0=0.0)
    c = np.array([10, 30, 100, 300, 1000, 3000, 10000], dtype=float)
    r = fit.sigmoid(c, **truth)
    # R(3000) = 0.8 / (1 + 1/30), R(10000) = 0.8 / 1.01; later points off by +0.01, -0.03.
    assert r[5:] == pytest.approx([0.8 / (1 + 1 / 30), 0.8 / 1.01])
    r[5:] += [0.01, -0.03]
    ex = fit.extrapolation_check(c, r, fit_until=1000, r0=0.0, method="lsq")
    assert ex.n_points == 2 and ex.fit.n_points == 5 and ex.fit.R0 == 0.0
    assert ex.mae == pytest.approx(0.02, abs=1e-6)
    assert ex.max_abs_err == pytest.approx(0.03, abs=1e-6)
    assert ex.as_dict() == {
        "mae": ex.mae,
        "max_abs_err": ex.max_abs_err,
        "n_points": 2,
        **ex.baselines.as_dict(),
    }


# ==========================================================================================
# Degenerate input.
# ==========================================================================================

_C6 = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
_R6 = [0.1, 0.2, 0.3, 0.4, 0.45, 0.5]


@pytest.mark.parametrize(
    "compute, reward, kwargs, match",
    [
        (_C6[:3], _R6[:3], {}, r"too few points: 3; a fit needs at least 4"),
        (_C6, _R6, dict(min_compute=5.0), r"too few points: 3 of 6 have compute >= min_"),
        (_C6, [0.3] * 6, {}, r"flat curve: the reward is 0.3 at all 6"),
        ([1, 2, 4, 3, 8, 16], _R6, {}, r"compute decreases at index 3 \(4 -> 3\)"),
        (_C6, [0.1, 0.2, np.nan, 0.4, 0.45, 0.5], {}, r"NaN or inf in reward at index 2"),
        ([1, 2, np.inf, 8, 16, 32], _R6, {}, r"NaN or inf in compute at index 2"),
        ([0, 2, 4, 8, 16, 32], _R6, {}, r"non-positive compute 0 at index 0"),
        ([-1, 2, 4, 8, 16, 32], _R6, {}, r"non-positive compute -1 at index 0"),
        (_C6, _R6, dict(method="adam"), r"unknown fit method 'adam'"),
        (_C6, _R6, dict(a_max=0.05), r"a_max=0.05 must exceed"),
    ],
)
def test_degenerate_sigmoid_input_fails_clearly(compute, reward, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit.fit_sigmoid(compute, reward, **kwargs)


def test_degenerate_power_law_and_extrapolation():
    with pytest.raises(ValueError, match=r"pass rate 1 at index 5 is outside \[0, 1\)"):
        fit.fit_power_law(_C6, [0.1, 0.2, 0.3, 0.4, 0.5, 1.0])
    with pytest.raises(ValueError, match="flat curve"):
        fit.fit_power_law(_C6, [0.2] * 6)
    with pytest.raises(ValueError, match="no points after fit_until=32"):
        fit.extrapolation_check(_C6, _R6, fit_until=32)
    with pytest.raises(ValueError, match="fitting compute <= fit_until=4: too few points: 3;"):
        fit.extrapolation_check(_C6, _R6, fit_until=4)
    with pytest.raises(ValueError, match="bin_width=0 must be > 0"):
        allocation.record_breaking(_C6, _R6, bin_width=0)


# ==========================================================================================
# Runs: reading, fit_run, the main.py hook.
# ==========================================================================================


def test_fit_run_on_a_short_run_returns_the_error(tmp_path):
    _write_metrics(tmp_path, [1e12], [0.3])  # Two eval points: step 0 and one more.
    record = scaling.fit_run(str(tmp_path))
    assert "too few points: 1; a fit needs at least 4" in record["error"] and record["A"] is None
    saved = json.loads((tmp_path / "scaling" / "fit.json").read_text())
    assert saved["error"] == record["error"]
    assert not (tmp_path / "scaling" / "curve.png").exists()
    assert scaling.describe(record).startswith("scaling fit: none (too few points")
    missing = scaling.fit_run(str(tmp_path / "nothing_here"))
    assert "nothing_here/metrics.jsonl" in missing["error"]
    assert not (tmp_path / "nothing_here").exists()


def test_fit_run_reads_r0_from_the_step0_eval(tmp_path):
    r = fit.sigmoid(C, **{**TRUE, "R0": 0.2})
    _write_metrics(tmp_path, C, r, r0=0.2)
    record = scaling.fit_run(str(tmp_path), n_boot=20)
    assert record["error"] is None
    assert (record["R0"], record["n_points"]) == (0.2, C.size)
    assert abs(record["A"] - TRUE["A"]) < 1e-3
    assert (tmp_path / "scaling" / "curve.png").stat().st_size > 0
    assert "A=0.72" in scaling.describe(record)
    # The run's own check: fitted on its first 12 of 24 evaluations, scored on the other 12
    # (noise-free points: the prediction is the curve).
    pred = json.loads((tmp_path / "scaling" / "fit.json").read_text())["prediction"]
    assert pred["fit_until"] == C[(C.size - 1) // 2] and pred["error"] is None
    assert pred["extrapolation"]["n_points"] == C.size - (C.size - 1) // 2 - 1
    assert pred["extrapolation"]["mae"] < 1e-3 and abs(pred["A"] - TRUE["A"]) < 1e-2
    assert "first half predicts the second: MAE 0.000" in scaling.describe(record)


def test_read_metrics_errors_name_the_problem(tmp_path):
    _write_metrics(tmp_path, C[:5], C[:5] * 0)
    with pytest.raises(ValueError, match=r"no line of .* has 'eval/typo' \(keys like it: "):
        scaling.read_metrics(str(tmp_path), y_key="eval/typo")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1 has 'eval/reward_mean' but no 'x'"):
        scaling.read_metrics(str(tmp_path), x_key="x")


def test_samples_axis_counts_every_prompt_drawn_times_the_group(tmp_path):
    """X = data: samples up to each evaluation = sum of len(data/prompt_ids) x group_size; a
    step logged twice (a resume) counts once; a run without config.json is named."""
    lines = [
        {"step": 0, "eval/pass@1": 0.1},
        {"step": 1, "data/prompt_ids": [3, 4]},
        {"step": 2, "data/prompt_ids": [5, 6, 7], "eval/pass@1": 0.2},  # 2 rounds: 3 ids.
        {"step": 3, "data/prompt_ids": [8, 9]},
        {"step": 3, "data/prompt_ids": [8, 9]},  # Replayed after a resume.
        {"step": 4, "data/prompt_ids": [1, 2], "eval/pass@1": 0.3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError, match=r"config.json has no batch.group_size"):
        scaling.read_metrics(str(tmp_path), x_key="data/samples", y_key="eval/pass@1")
    (tmp_path / "config.json").write_text(json.dumps({"batch": {"group_size": 4}}))
    curve = scaling.read_metrics(str(tmp_path), x_key="data/samples", y_key="eval/pass@1")
    assert curve.r0 == 0.1
    assert curve.compute.tolist() == [20.0, 36.0] and curve.reward.tolist() == [0.2, 0.3]


@pytest.mark.slow
def test_main_prints_the_fit_after_an_rl_run(tmp_path):
    """`python -m rlscale.main` with rl.run replaced by a fake that writes a metrics file."""
    code = f"""
import sys
from rlscale import cli, rl
from rlscale.main import train

def fake_run(config, workdir, **kwargs):
    with open(workdir + "/metrics.jsonl", "w") as f:
        f.write('{{"compute/flops": 0.0, "eval/reward_mean": 0.2}}\\n')
        f.write('{{"compute/flops": 1e12, "eval/reward_mean": 0.3}}\\n')
    return {{"end/eval_pass@1": 0.3}}

rl.run = fake_run
sys.argv = ["main", "--config", "configs/quickstart.py:smoke", "--workdir", {str(tmp_path)!r}]
cli.run_command(train.define_flags, train.main)
"""
    env = subprocess_env()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "scaling fit: none (too few points: 1;" in out.stdout
    assert (tmp_path / "scaling" / "fit.json").exists()


# ==========================================================================================
# Tools.
# ==========================================================================================


def test_fit_tool_end_to_end(tmp_path, capsys):
    rng = np.random.default_rng(1)
    csv_path = tmp_path / "recipe_a.csv"
    r_a = fit.sigmoid(C, A=0.6, B=1.0, C_mid=1e14, R0=0.1) + rng.normal(0, 0.01, C.shape)
    csv_path.write_text("compute,reward\n" + "".join(f"{c},{r}\n" for c, r in zip(C, r_a)))
    run_b = tmp_path / "recipe_b"
    _write_metrics(run_b, C, fit.sigmoid(C, **{**TRUE, "R0": 0.2}), r0=0.2)
    short = tmp_path / "short"
    _write_metrics(short, [1e12, 2e12], [0.3, 0.31])

    tool = _tool("fit_scaling")
    out = tmp_path / "out"
    args = [str(csv_path), str(run_b), str(short), "--out", str(out), "--n-boot", "50"]
    cli.call(tool.define_flags, tool.main, args + ["--fit-until-frac", "0.5", "--method", "lsq"])
    printed = capsys.readouterr()
    assert "skipped short: fitting compute <= fit_until=1e+12: too few points: 1;" in printed.err
    table = printed.out.splitlines()
    assert table.index(next(x for x in table if x.startswith("recipe_b"))) < table.index(
        next(x for x in table if x.startswith("recipe_a"))
    )

    fits = json.loads((out / "fits.json").read_text())
    assert [f["name"] for f in fits] == ["recipe_b", "recipe_a", "short"]  # By A; failure last.
    b, a, bad = fits
    for key in ("name", "A", "B", "C_mid", "R0", "r2", "n_points", "A_interval", "extrapolation"):
        assert key in b
    assert b["R0"] == 0.2 and a["R0"] == r_a[0]
    n_fit = int(np.sum(C <= 0.5 * C[-1]))
    assert b["n_points"] == n_fit and b["extrapolation"]["n_points"] == C.size - n_fit
    assert b["extrapolation"]["max_abs_err"] < 1e-3  # Clean data extrapolates exactly.
    assert b["fit_until"] == pytest.approx(0.5 * C[-1])
    assert b["full"]["n_points"] == C.size
    lo, hi = a["A_interval"]
    assert lo < a["A"] < hi
    assert bad["A"] is None and "too few points" in bad["error"]
    for png in ("curves.png", "curve_recipe_a.png", "curve_recipe_b.png"):
        assert (out / png).stat().st_size > 0

    # No cut: no extrapolation; nothing fits: an error (exit status 1 from the command line).
    fit_tool = functools.partial(cli.call, tool.define_flags, tool.main)
    fit_tool([str(csv_path), "--out", str(tmp_path / "o2"), "--n-boot", "0"])
    assert json.loads((tmp_path / "o2" / "fits.json").read_text())[0]["extrapolation"] is None
    with pytest.raises(ValueError, match="^no input could be fitted$"):
        fit_tool([str(short), "--out", str(tmp_path / "o3")])
    with pytest.raises(ValueError, match="--fit-until and --fit-until-frac"):
        fit_tool([str(csv_path), "--out", "x", "--fit-until", "1", "--fit-until-frac", "0.5"])
    with pytest.raises(ValueError, match="flag --n-boot=x: invalid literal"):
        fit_tool([str(csv_path), "--out", "x", "--n-boot", "x"])
    with pytest.raises(ValueError, match="give at least one INPUT"):
        fit_tool(["--out", "x"])


def test_sweep_dry_run_commands_and_shards(tmp_path, capsys):
    sweep = _tool("sweep")
    root = str(tmp_path / "sweep")
    grid = "optim.lr=1e-4,3e-4;seed=0,1,2"
    base = ["--config", "configs/quickstart.py:smoke", "--grid", grid, "--workdir", root]
    os.makedirs(f"{root}/optim.lr_3e-4__seed_2")
    open(f"{root}/optim.lr_3e-4__seed_2/summary.json", "w").close()

    cli.call(sweep.define_flags, sweep.main, base + ["--dry_run"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# shard 0/1: 6 of 6 runs"
    commands = [x for x in lines[1:] if not x.startswith("#")]
    assert len(commands) == 5
    assert commands[0] == (
        f"{sys.executable} -m rlscale.main --config configs/quickstart.py:smoke --workdir "
        f"{root}/optim.lr_1e-4__seed_0 --config.optim.lr=1e-4 --config.seed=0"
    )
    assert lines[-1].startswith("# finished, skipped: ") and "seed_2 --config" in lines[-1]
    assert not os.path.exists(f"{root}/fits.json")  # A dry run fits nothing.
    # --set: the same override for every run, outside the names.
    cli.call(
        sweep.define_flags,
        sweep.main,
        base + ["--dry-run", "--set", "sft.reuse_from=/w", "--set", "steps=9"],
    )
    commands = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("#")]
    assert commands[0].endswith(
        "__seed_0 --config.optim.lr=1e-4 --config.seed=0 "
        "--config.sft.reuse_from=/w --config.steps=9"
    )
    with pytest.raises(ValueError, match="--set steps=9,10: one value per key"):
        cli.call(sweep.define_flags, sweep.main, base + ["--dry_run", "--set", "steps=9,10"])

    shards = [sweep.plan("c.py", grid, root, f"{i}/4")[0] for i in range(4)]
    names = [name for shard in shards for name, _, _ in shard]
    assert sorted(names) == sorted(n for n, _, _ in sweep.plan("c.py", grid, root)[0])
    assert len(names) == len(set(names)) == 6
    assert [len(s) for s in shards] == [2, 2, 1, 1]


@pytest.mark.parametrize(
    "grid, message",
    [
        ("optim.lr", "bad --grid item 'optim.lr': no '='"),
        ("optim.lr=1e-4,,3e-4", "bad --grid item 'optim.lr=1e-4,,3e-4': an empty value"),
        ("seed=0;seed=1", "--grid key 'seed' appears twice"),
        ("9lr=1", "bad --grid key '9lr'"),
        (";", "empty --grid ';'"),
    ],
)
def test_sweep_bad_grid_fails_clearly(grid, message):
    sweep = _tool("sweep")
    with pytest.raises(ValueError, match=re.escape(message)):
        sweep.parse_grid(grid)
    args = ["--config", "c.py", "--grid", grid, "--workdir", "/tmp/x", "--dry_run"]
    with pytest.raises(ValueError, match=re.escape(message)):
        cli.call(sweep.define_flags, sweep.main, args)
    with pytest.raises(ValueError, match="bad --shard '2/2'"):
        sweep.parse_shard("2/2")


def test_sweep_fits_finished_runs(tmp_path, capsys):
    sweep = _tool("sweep")
    root = tmp_path / "sweep"
    for seed, A in (("0", 0.7), ("1", 0.5)):
        run = root / f"seed_{seed}"
        _write_metrics(run, C, fit.sigmoid(C, A=A, B=1.2, C_mid=2e14, R0=0.2))
        (run / "summary.json").write_text("{}")
    args = ["--config", "c.py", "--grid", "seed=0,1", "--workdir", str(root), "--method", "lsq"]
    cli.call(sweep.define_flags, sweep.main, args)  # Both finished: nothing runs, both fitted.
    fits = json.loads((root / "fits.json").read_text())
    assert [f["name"] for f in fits] == ["seed_0", "seed_1"]
    assert [round(f["A"], 3) for f in fits] == [0.7, 0.5]
    assert (root / "curves.png").stat().st_size > 0


def test_the_ladder_spans_five_sizes():
    """configs/ladder.py: five policies, each larger than the last (0.13M to 4.9M
    parameters at the tokenizer's 320 tokens), a variant that names an unknown size fails."""
    from conftest import load_config

    from rlscale import model

    sizes = []
    for name in ("xs", "s", "m", "l", "xl"):
        c = load_config("ladder", f"size={name}")
        fields = {k: v for k, v in c.model.items() if k != "name"}
        sizes.append(model.get("tiny", **{**fields, "vocab_size": 320}).num_params())
    assert sizes == sorted(sizes) and sizes[-1] > 30 * sizes[0], sizes
    with pytest.raises(ValueError, match="size='xxl' is not one of"):
        load_config("ladder", "size=xxl")
