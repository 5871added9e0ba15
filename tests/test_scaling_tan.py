"""Tan et al.'s law over model sizes: the formula, recovery of known parameters within their
standard errors, the held-out size and within-run predictions, degenerate input, the runs'
model sizes and `tools/fit_scaling.py --law tan`.

Synthetic points follow the law at the seven Qwen2.5 sizes Tan et al. trained, 12 points per
size over two decades of X = 6 N D FLOPs (D from 1e7 to 1e9 tokens), with Gaussian noise of
SIGMA in log10 L: the fit's least squares is then the maximum-likelihood estimate, and its
Gauss-Newton standard errors (derived here from finite differences of the law, not from the
fit's own Jacobian) say how far from the truth a correct fit may land.
"""

import importlib.util
import json
import math
import os
import re

import numpy as np
import pytest

from rlscale import cli, model, scaling
from rlscale.model import hf
from rlscale.scaling import tan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRUE = dict(k_max=0.12, N0=3e9, E0_max=1.0, N1=2e9)
SIZES = np.array([0.5, 1.5, 3.0, 7.0, 14.0, 32.0, 72.0]) * 1e9
SIGMA = 0.01  # In log10 L: 2.3% of L, the binomial noise of pass@1 on ~2000 problems at 0.5.


def _points(sizes=SIZES, sigma=SIGMA, seed=0, per=12):
    """(N, X, reward, true reward) drawn from the law."""
    n = np.repeat(sizes, per)
    x = 6 * n * np.tile(np.logspace(7, 9, per), len(sizes))
    y = tan.log10_loss(n, x, **TRUE)
    noisy = y + np.random.default_rng(seed).normal(0.0, sigma, n.size)
    return n, x, 1 - 10**noisy, 1 - 10**y


def _theta(f):
    """(k_max, log N0, E0_max, log N1): the coordinates the standard errors are taken in."""
    return np.array([f["k_max"], math.log(f["N0"]), f["E0_max"], math.log(f["N1"])])


def _law(theta, n, x):
    k_max, a, e0_max, b = theta
    return tan.log10_loss(n, x, k_max, math.exp(a), e0_max, math.exp(b))


def _jacobian(n, x, h=1e-6):
    """d log10 L / d theta at the truth, by central differences."""
    t = _theta(TRUE)
    return np.stack(
        [(_law(t + h * e, n, x) - _law(t - h * e, n, x)) / (2 * h) for e in np.eye(4)], -1
    )


def _fit_tool(argv):
    """`tools/fit_scaling.py ARGV`, in-process."""
    tool = _tool()
    return cli.call(tool.define_flags, tool.main, argv)


def _tool():
    spec = importlib.util.spec_from_file_location("_tool_fit", f"{ROOT}/tools/fit_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_csv(path, n, x, r):
    lines = "".join(f"{float(a)!r},{float(b)!r},{float(c)!r}\n" for a, b, c in zip(n, x, r))
    path.write_text("model_size,compute,reward\n" + lines)


# ==========================================================================================
# The law and the joint fit.
# ==========================================================================================


def test_law_is_the_papers_formula():
    n, x = SIZES[:, None], np.logspace(16, 20, 5)[None, :]
    k = TRUE["k_max"] * n / (n + TRUE["N0"])
    e0 = TRUE["E0_max"] * n / (n + TRUE["N1"])
    expected = -k * np.log10(x) + e0
    np.testing.assert_allclose(tan.log10_loss(n, x, **TRUE), expected, rtol=1e-13)
    fit = tan.TanFit(**TRUE, r2=1.0, n_points=0, sizes=())
    np.testing.assert_allclose(fit.predict(n, x), 1 - 10**expected, rtol=1e-13)
    # k(N) saturates: half of k_max at N = N0, nearly all of it far above.
    assert fit.k(TRUE["N0"]) == pytest.approx(TRUE["k_max"] / 2)
    assert fit.k(1e6 * TRUE["N0"]) == pytest.approx(TRUE["k_max"], rel=1e-5)
    assert fit.E0(TRUE["N1"]) == pytest.approx(TRUE["E0_max"] / 2)


def test_clean_points_recovered_exactly():
    n, x, r, _ = _points(sigma=0.0)
    f = tan.fit_tan(n, x, r)
    for key, value in TRUE.items():
        assert getattr(f, key) == pytest.approx(value, rel=1e-6), key
    assert f.r2 == pytest.approx(1.0, abs=1e-12)
    assert (f.n_points, f.sizes) == (n.size, tuple(SIZES))
    assert f.as_dict() == {
        **{k: getattr(f, k) for k in (*TRUE, "r2", "n_points")},
        "at_bounds": [],
    }


def test_noisy_points_recovered_within_four_standard_errors():
    n, x, r, _ = _points()
    f = tan.fit_tan(n, x, r)
    J = _jacobian(n, x)
    se = SIGMA * np.sqrt(np.diag(np.linalg.inv(J.T @ J)))
    # The bound bites: 4 se is 8% of k_max, 9% of N0, 18% of E0_max and 19% of N1.
    assert np.all(4 * se < [0.1 * TRUE["k_max"], 0.11, 0.22 * TRUE["E0_max"], 0.22])
    deviation = np.abs(_theta(f.as_dict()) - _theta(TRUE)) / se
    # Measured over 30 seeds: at most 2.4 standard errors.
    assert np.all(deviation < 4), deviation
    # The fit's r2 is that of its own residuals in log10 L.
    y = np.log10(1 - r)
    r2 = 1 - np.sum((f.log10_loss(n, x) - y) ** 2) / np.sum((y - y.mean()) ** 2)
    assert f.r2 == pytest.approx(r2, rel=1e-12)


def test_held_out_size_predicted_within_its_noise():
    n, x, r, truth = _points()
    held = n == SIZES[-1]
    ex = tan.extrapolate_to_size(n, x, r, holdout_size=SIZES[-1])
    assert ex.fit.sizes == tuple(SIZES[:-1]) and ex.fit.n_points == int((~held).sum())
    assert (ex.holdout_size, ex.n_points) == (SIZES[-1], 12)
    pred = ex.fit.predict(SIZES[-1], x[held])
    assert ex.mae == pytest.approx(np.mean(np.abs(pred - r[held])), rel=1e-12)
    assert ex.max_abs_err == pytest.approx(np.max(np.abs(pred - r[held])), rel=1e-12)
    assert ex.as_dict() == {
        "holdout_size": ex.holdout_size,
        "mae": ex.mae,
        "max_abs_err": ex.max_abs_err,
        "n_points": 12,
    }
    # Within its noise level: no worse than twice the error of the true law itself on those
    # points (measured over 30 seeds: at most 1.34 times).
    noise_mae = np.mean(np.abs(r[held] - truth[held]))
    assert ex.mae < 2 * noise_mae
    # And within 4 standard errors of the truth, propagated from the fit on the other sizes.
    J = _jacobian(n[~held], x[~held])
    g = _jacobian(n[held], x[held])
    se = SIGMA * np.sqrt(np.einsum("ij,jk,ik->i", g, np.linalg.inv(J.T @ J), g))
    L = 1 - truth[held]
    assert np.all(np.abs(pred - truth[held]) <= L * (10 ** (4 * se) - 1))


def test_within_run_prediction_of_one_size():
    N, per = 3e9, 24
    x = 6 * N * np.logspace(7, 9, per)
    y = tan.log10_loss(N, x, **TRUE)
    k, e0 = TRUE["k_max"] / 2, TRUE["E0_max"] * 0.6  # k(N0) and E0 at N = 1.5 N1.

    clean = tan.predict_within_run(x, 1 - 10**y, fit_until_frac=0.1)
    assert (clean.k, clean.E0) == (pytest.approx(k, rel=1e-9), pytest.approx(e0, rel=1e-9))
    assert clean.mae < 1e-12 and clean.r2 == pytest.approx(1.0)
    later = x > 0.1 * x[-1]
    assert (clean.fit_until, clean.fit_n_points, clean.n_points) == (
        0.1 * x[-1],
        int((~later).sum()),
        int(later.sum()),
    )

    noisy = y + np.random.default_rng(3).normal(0.0, SIGMA, per)
    p = tan.predict_within_run(x, 1 - 10**noisy, fit_until_frac=0.1)
    pred = p.predict(x[later])
    assert p.mae == pytest.approx(np.mean(np.abs(pred - (1 - 10 ** noisy[later]))), rel=1e-12)
    # Within 4 standard errors of the truth: the straight-line fit's prediction error in
    # log10 L is SIGMA * sqrt(1/n + (u - mean u)^2 / Sxx) (ordinary least squares).
    u = np.log10(x)
    uf = u[~later]
    se = SIGMA * np.sqrt(1 / uf.size + (u[later] - uf.mean()) ** 2 / np.sum((uf - uf.mean()) ** 2))
    L = 10 ** y[later]
    assert np.all(np.abs(pred - (1 - L)) <= L * (10 ** (4 * se) - 1))


# ==========================================================================================
# Degenerate input.
# ==========================================================================================

_N = [1e9] * 4 + [2e9] * 4
_X = [1e17, 2e17, 4e17, 8e17] * 2
_R = [0.2, 0.25, 0.3, 0.35, 0.3, 0.35, 0.4, 0.45]


def _with(values, i, v):
    values = list(values)
    values[i] = v
    return values


@pytest.mark.parametrize(
    "n, x, r, match",
    [
        ([1e9] * 8, _X, _R, r"one model size only \(N=1e\+09\): the joint fit over sizes needs"),
        (
            _N,
            [1e17, 2e17, 4e17, 8e17, 1e18, 2e18, 4e18, 8e18],
            _R,
            r"sizes without compute overlap: N=1e\+09 reach compute 8e\+17, N=2e\+09 start at "
            r"1e\+18",
        ),
        (_N, _X, _with(_R, 5, np.nan), r"NaN or inf reward at row 5 \(size=2e\+09, compute=2e"),
        (_with(_N, 2, np.inf), _X, _R, r"NaN or inf size at row 2"),
        (_N, _with(_X, 0, 0.0), _R, r"non-positive compute at row 0 .* the law takes log10 X"),
        (_with(_N, 1, -1.0), _X, _R, r"non-positive size at row 1"),
        (_N, _X, _with(_R, 7, 1.0), r"reward outside \[0, 1\) at row 7 .*reward=1\)"),
        (_N, _X, _with(_R, 7, -0.1), r"reward outside \[0, 1\) at row 7"),
        (_N, [1e17] * 4 + _X[4:], _R, r"size N=1e\+09 has a single compute value 1e\+17"),
        (_N[2:6], _X[2:6], _R[2:6], r"too few points: 4; the law's 4 parameters need at least 5"),
        (_N, _X, [0.3] * 8, r"flat: the reward is 0.3 at all 8 points"),
        (_N, _X, _R[:7], r"must be 1-D and of the same length; got shapes \(8,\), \(8,\) and"),
    ],
)
def test_degenerate_input_fails_clearly(n, x, r, match):
    with pytest.raises(ValueError, match=match):
        tan.fit_tan(n, x, r)


def test_degenerate_predictions_fail_clearly():
    not_there = r"holdout size 3000000000 is not among the model sizes 1000000000, 2000000000$"
    with pytest.raises(ValueError, match=not_there):
        tan.extrapolate_to_size(_N, _X, _R, holdout_size=3e9)
    with pytest.raises(ValueError, match=r"other than 2e\+09: one model size only \(N=1e\+09\)"):
        tan.extrapolate_to_size(_N, _X, _R, holdout_size=2e9)
    with pytest.raises(ValueError, match=r"fit_until_frac=1 must be in \(0, 1\)"):
        tan.predict_within_run(_X[:4], _R[:4], fit_until_frac=1)
    with pytest.raises(ValueError, match=r"fit_until=4e\+17: too few points: 3; a fit needs"):
        tan.predict_within_run(_X[:4], _R[:4], fit_until_frac=0.5)
    x = np.logspace(16, 18, 8)
    with pytest.raises(ValueError, match=r"pass rate 1 at index 3 is outside \[0, 1\)"):
        tan.predict_within_run(x, [0.1, 0.2, 0.3, 1.0, 0.4, 0.5, 0.6, 0.7], fit_until_frac=0.5)


# ==========================================================================================
# Runs' model sizes and the tool.
# ==========================================================================================


def _write_run(workdir, compute, reward, *, preset=None, hf_dir=""):
    """A run's files as `rl` writes them: config.json, the warm start's model_config.json
    (without a Hugging Face checkpoint) and metrics.jsonl with a step-0 eval at zero compute."""
    os.makedirs(workdir)
    (workdir / "config.json").write_text(json.dumps({"init": {"hf_checkpoint": hf_dir}}))
    if not hf_dir:
        os.makedirs(workdir / "sft")
        cfg = model.as_dict(model.get(preset))
        (workdir / "sft" / "model_config.json").write_text(json.dumps(cfg))
    lines = [{"step": 0, "compute/flops": 0.0, "eval/reward_mean": 0.1}]
    lines += [{"compute/flops": c, "eval/reward_mean": r} for c, r in zip(compute, reward)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_runs_are_sized_by_their_policy(tmp_path, capsys):
    ckpt = tmp_path / "hf_qwen"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(hf.config_to_hf(model.get("qwen2.5_0.5b"))))
    x = np.logspace(17, 19, 8)
    runs = []
    for name, preset in (("r05", None), ("r15", "qwen2.5_1.5b"), ("r7", "qwen2.5_7b")):
        N = model.get(preset or "qwen2.5_0.5b").num_params()
        r = 1 - 10 ** tan.log10_loss(N, x, **TRUE)
        hf_dir = str(ckpt) if preset is None else ""
        _write_run(tmp_path / name, x, r, preset=preset, hf_dir=hf_dir)
        runs.append(str(tmp_path / name))
    expected = [494032768, 1543714304, 7615616512]
    assert [scaling.model_size(p) for p in runs] == expected
    n, xs, _ = scaling.read_sized_points([runs[0], runs[1] + "/metrics.jsonl", runs[2]])
    assert n.tolist() == np.repeat(expected, 8).tolist()  # The step-0 evaluations left out.
    assert xs.tolist() == np.tile(x, 3).tolist()

    _fit_tool(runs + ["--law", "tan", "--out", str(tmp_path / "out")])
    fits = json.loads((tmp_path / "out" / "fits.json").read_text())
    assert fits["n_points"] == 24 and fits["extrapolation"] is None
    assert fits["r2"] == pytest.approx(1.0, abs=1e-9)  # Three sizes, no noise.
    assert "\n   494032768     8 " in capsys.readouterr().out  # Exact, for --holdout-size.

    (tmp_path / "r7" / "sft" / "model_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="r7/sft/model_config.json"):
        scaling.read_sized_points(runs)
    (tmp_path / "r7" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"r7: no model size: .*config.json has no init.hf_chec"):
        scaling.read_sized_points(runs)


def test_fit_tool_tan_holdout_on_a_csv(tmp_path, capsys):
    n, x, r, _ = _points()
    csv_path = tmp_path / "sizes.csv"
    _write_csv(csv_path, n, x, r)
    out = tmp_path / "out"
    argv = [str(csv_path), "--law", "tan", "--holdout-size", "7.2e10", "--out", str(out)]
    _fit_tool(argv)
    fits = json.loads((out / "fits.json").read_text())
    keys = {"law", "k_max", "N0", "E0_max", "N1", "r2", "n_points", "at_bounds", "extrapolation"}
    assert set(fits) == keys and fits["law"] == "tan"
    assert set(fits["extrapolation"]) == {"holdout_size", "mae", "max_abs_err", "n_points"}
    ex = tan.extrapolate_to_size(n, x, r, holdout_size=7.2e10)
    assert fits["extrapolation"] == pytest.approx(ex.as_dict(), rel=1e-12)
    numbers = keys - {"law", "extrapolation", "at_bounds"}
    assert {k: fits[k] for k in numbers} == pytest.approx(
        {k: v for k, v in ex.fit.as_dict().items() if k in numbers}, rel=1e-12
    )
    assert fits["at_bounds"] == [] == list(ex.fit.at_bounds)  # Within the authors' bounds.
    assert (out / "tan.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "held out: predicted" in printed
    assert f"held-out size 72000000000: reward MAE {ex.mae:.4f}" in printed

    # --min-compute drops the points below it.
    _fit_tool(argv[:-1] + [str(tmp_path / "o2"), "--min-compute", "1e18"])
    assert json.loads((tmp_path / "o2" / "fits.json").read_text())["n_points"] == np.sum(
        (x >= 1e18) & (n != 7.2e10)
    )
    _write_csv(csv_path, n[:12], x[:12], r[:12])
    with pytest.raises(ValueError, match="one model size only"):
        _fit_tool([str(csv_path), "--law", "tan", "--out", str(tmp_path / "o3")])
    for bad, message in (
        (["--holdout-size", "1e9"], "--holdout-size"),
        (
            ["--law", "tan", "--fit-until-frac", "0.5"],
            "--fit-until-frac: sigmoid only; --law tan predicts with --holdout-size",
        ),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            _fit_tool([str(csv_path), "--out", str(tmp_path / "o4")] + bad)
