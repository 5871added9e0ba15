"""Statistics for comparisons and predictions: Welch's t against scipy's, Holm's correction
and the power calculation against hand-computed and published values, the prediction
baselines by hand, bound flags, seed-aware fits re-derived, Tan's law under its authors'
bounds and two compute units, the pre-registration check on a scratch git repository, and
`tools/compare_runs.py`. Bad input (one seed, too few points, a protocol after its results)
is refused naming it.
"""

import importlib.util
import json
import math
import os
import subprocess

import numpy as np
import pytest
from scipy import stats as sp_stats

from rlscale import cli
from rlscale.scaling import baselines, evidence, fit, seeds, stats, tan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ==========================================================================================
# Welch, Holm, power.
# ==========================================================================================


def test_welch_matches_scipy():
    a, b = [0.61, 0.64, 0.58, 0.66], [0.55, 0.60, 0.52, 0.57, 0.49]
    w = stats.welch(a, b)
    ref = sp_stats.ttest_ind(a, b, equal_var=False)
    assert (w.t, w.p, w.df) == pytest.approx((ref.statistic, ref.pvalue, ref.df), rel=1e-12)
    assert w.diff == pytest.approx(np.mean(a) - np.mean(b), rel=1e-12)
    assert w.se_a == pytest.approx(np.std(a, ddof=1) / 2, rel=1e-12)


@pytest.mark.parametrize(
    "a, b, match",
    [
        ([0.5], [0.4, 0.45], r"arm 'gspo' has 1 seed\(s\): a comparison needs at least 2"),
        ([0.5, 0.6], [], r"arm 'cispo' has 0 seed\(s\)"),
        ([0.5, np.nan], [0.4, 0.45], r"arm 'gspo' has a NaN or inf value"),
        ([0.5, 0.5], [0.4, 0.4], r"no seed-to-seed spread at all"),
    ],
)
def test_welch_refuses_bad_arms(a, b, match):
    with pytest.raises(ValueError, match=match):
        stats.welch(a, b, names=("gspo", "cispo"))


def test_holm_by_hand():
    # Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04; the running
    # maximum makes the last 0.06.
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # Capped at 1.
    with pytest.raises(ValueError, match=r"p-value 1.5 at index 1 is outside \[0, 1\]"):
        stats.holm([0.1, 1.5])


def test_seeds_per_arm_matches_published_values():
    # Exact two-sided two-sample t-test, alpha 0.05, power 0.8 (G*Power's values; Cohen's
    # 1988 Table 2.4.1 gives 393, 64, 26 from a normal approximation).
    assert [stats.seeds_per_arm(d, 1.0) for d in (0.2, 0.5, 0.8, 1.0)] == [394, 64, 26, 17]
    # Scale-free: effect 0.02 with sd 0.04 is d = 0.5.
    assert stats.seeds_per_arm(0.02, 0.04) == 64
    # G*Power: n = 10 per arm, d = 1: power 0.5620.
    assert stats.power(10, 1.0, 1.0) == pytest.approx(0.5620, abs=5e-4)
    assert stats.power(64, 0.5, 1.0) >= 0.8 > stats.power(63, 0.5, 1.0)


def test_power_is_finite_and_seeds_fall_as_the_effect_grows():
    """Large effects at a Holm-corrected alpha, where scipy's noncentral t underflows to NaN
    in the far tail (df 4, nc 8.4): power stays a probability, seeds per arm never rise."""
    assert 0.9 < stats.power(3, 0.05, 0.0073, alpha=0.05 / 8) <= 1.0
    seeds = [stats.seeds_per_arm(e / 100, 0.0073, alpha=0.05 / 7) for e in range(2, 11)]
    assert seeds == sorted(seeds, reverse=True) and min(seeds) >= 2
    # The smallest effect 6 seeds detect at Holm's alpha / 8: power 0.8 there, less below.
    mde = stats.minimum_detectable_effect(6, 0.0073, alpha=0.05 / 8)
    assert stats.power(6, mde, 0.0073, alpha=0.05 / 8) >= 0.8
    assert stats.power(6, 0.99 * mde, 0.0073, alpha=0.05 / 8) < 0.8
    # The design table: both levels, Holm's smallest p facing alpha / family.
    table = stats.seed_table(0.0073, (0.02,), family=8)
    assert table == {0.02: (stats.seeds_per_arm(0.02, 0.0073), 6)}


def test_power_refuses_bad_input():
    with pytest.raises(ValueError, match=r"effect=0 must be finite and non-zero; sd=0 must"):
        stats.seeds_per_arm(0, 0)
    with pytest.raises(ValueError, match=r"alpha=1.5 must be in \(0, 1\)"):
        stats.seeds_per_arm(0.1, 1.0, alpha=1.5)
    with pytest.raises(ValueError, match=r"needs more than n_max=50 seeds"):
        stats.seeds_per_arm(0.1, 1.0, n_max=50)


def test_comparison_table_holm_adjusts_across_arms():
    arms = {"full": [0.70, 0.72, 0.71], "gspo": [0.66, 0.67, 0.69], "no_filter": [0.70, 0.73]}
    table = stats.compare_to_baseline(arms, "full")
    p = [stats.welch(arms[k], arms["full"]).p for k in ("gspo", "no_filter")]
    assert [table[k][1] for k in ("gspo", "no_filter")] == pytest.approx(stats.holm(p))
    ss = sum(((np.array(v) - np.mean(v)) ** 2).sum() for v in arms.values())
    assert stats.pooled_sd(arms) == pytest.approx(math.sqrt(ss / 5), rel=1e-12)
    text = stats.format_comparison(arms, "full", effect=0.02)
    n = stats.seeds_per_arm(0.02, stats.pooled_sd(arms), alpha=0.025)
    assert f"{n} at alpha / 2 = 0.025" in text and "| gspo | 3 |" in text
    with pytest.raises(ValueError, match=r"baseline 'base' is not an arm; the arms: full, gspo"):
        stats.compare_to_baseline(arms, "base")


# ==========================================================================================
# Baselines and bound flags.
# ==========================================================================================


def test_baselines_by_hand():
    # Fitted points on reward = 0.1 + 0.1 ln C exactly: the line extrapolates it.
    c = np.exp([1.0, 2.0, 3.0])
    later_c, later_r = np.exp([4.0, 5.0]), np.array([0.5, 0.5])
    b = baselines.baseline_errors(c, 0.1 + 0.1 * np.log(c), later_c, later_r)
    assert (b.flat_mae, b.flat_max) == pytest.approx((0.1, 0.1))  # 0.4 held vs 0.5.
    assert (b.line_mae, b.line_max) == pytest.approx((0.05, 0.1))  # 0.5, 0.6 vs 0.5.
    assert baselines.beats_baselines(0.01, b, noise=0.03)  # 0.04 better than the line.
    assert not baselines.beats_baselines(0.03, b, noise=0.03)
    assert baselines.binomial_se(0.5, 400) == pytest.approx(0.025)
    with pytest.raises(ValueError, match=r"noise=-1 must be finite and >= 0"):
        baselines.beats_baselines(0.01, b, noise=-1)


def test_extrapolation_reports_its_baselines():
    c = np.logspace(1, 4, 12)
    r = fit.sigmoid(c, A=0.8, B=1.0, C_mid=100.0, R0=0.0)
    ex = fit.extrapolation_check(c, r, fit_until=c[7], r0=0.0, method="lsq")
    ref = baselines.baseline_errors(c[:8], r[:8], c[8:], r[8:])
    assert ex.baselines == ref and ex.as_dict()["flat_mae"] == ref.flat_mae
    assert ex.mae < 1e-6 < min(ref.line_mae, ref.flat_mae)  # The law wins on its own curve.


def test_every_parameter_on_a_bound_is_flagged():
    c = np.logspace(10, 12, 10)
    clean = fit.fit_sigmoid(c, fit.sigmoid(c, 0.7, 1.5, 1e11, 0.1), r0=0.1, method="lsq")
    assert clean.at_bounds == ()
    # A straight rise in log C that has not bent: the fit pushes A to 1 and C_mid out.
    line = 0.1 + 0.05 * np.log10(c / 1e9)
    f = fit.fit_sigmoid(c, line, r0=0.1, a_max=0.3, method="lsq")
    assert "A=upper" in f.at_bounds and f.A == pytest.approx(0.3)
    assert f.as_dict()["at_bounds"] == list(f.at_bounds)
    assert fit.on_bound(0.0, 0.0, 1.0) == "lower" and fit.on_bound(0.5, 0.0, 1.0) is None


# ==========================================================================================
# Seed-aware fits.
# ==========================================================================================


def _seed_curves(k=3, noise=0.01):
    c = np.logspace(10, 13, 16)
    truth = fit.sigmoid(c, 0.75, 1.2, 3e11, 0.2)
    rng = np.random.default_rng(0)
    return {f"s{i}": (c, truth + rng.normal(0, noise, c.size)) for i in range(k)}


def test_seed_fits_rederived():
    curves = _seed_curves()
    f = seeds.fit_seeds(curves, r0=0.2, method="lsq", n_boot=200, min_compute=2e10)
    kw = dict(r0=0.2, method="lsq", min_compute=2e10)
    kept = {k: (c[c >= 2e10], r[c >= 2e10]) for k, (c, r) in curves.items()}
    u = np.log(np.concatenate([c for c, _ in kept.values()]))
    span = max(u.max() - u.min(), math.log(10))
    kw["c_mid_bounds"] = (math.exp(u.min() - span), math.exp(u.max() + span))
    for label, one in zip(f.seeds, f.per_seed):
        assert one == fit.fit_sigmoid(*kept[label], **kw)
    a = [one.A for one in f.per_seed]
    assert (f.params["A"].mean, f.params["A"].sd) == pytest.approx(
        (np.mean(a), np.std(a, ddof=1)), rel=1e-12
    )
    pooled_c = np.concatenate([c for c, _ in kept.values()])
    order = np.argsort(pooled_c, kind="stable")
    pooled_r = np.concatenate([r for _, r in kept.values()])[order]
    assert f.pooled.A == pytest.approx(fit.fit_sigmoid(pooled_c[order], pooled_r, **kw).A)
    assert f.n_resamples == 10  # C(5, 3): every multiset of 3 seeds, each fitted once.
    lo, hi = f.params["A"].interval
    assert lo <= f.pooled.A <= hi and abs(f.pooled.A - 0.75) < 0.05
    assert "| pooled |" in seeds.format_seed_table(f)


def test_seed_fits_flag_every_bound_and_refuse_bad_input():
    curves = _seed_curves()
    c = curves["s0"][0]
    curves["s2"] = (c, 0.2 + 0.25 * np.log10(c / 1e10))  # Not bent: A runs into its bound 1.
    f = seeds.fit_seeds(curves, r0=0.2, method="lsq", n_boot=20)
    flagged = {k.split(": ")[0] for k in f.flagged()}
    assert "s2" in flagged and not flagged & {"s0", "s1"}, f.flagged()
    for p in f.params.values():  # Each parameter lists the fits that left it on a bound.
        name = "C_mid" if p.name == "log10_C_mid" else p.name
        assert set(p.on_bound) == {k.split(": ")[0] for k in f.flagged() if f": {name}=" in k}
    with pytest.raises(ValueError, match=r"1 seed\(s\) \(s0\): the seed-to-seed spread"):
        seeds.fit_seeds({"s0": curves["s0"]}, r0=0.2)
    short = {"s0": curves["s0"], "s1": (c[:3], curves["s1"][1][:3])}
    with pytest.raises(ValueError, match=r"seed s1: too few points: 3 of 3 .* at least 4"):
        seeds.fit_seeds(short, r0=0.2)


# ==========================================================================================
# Tan's law: the authors' bounds, two compute units.
# ==========================================================================================

TRUE = dict(k_max=0.12, N0=3e9, E0_max=0.1, N1=2e9)
SIZES = np.array([0.5, 1.5, 3.0, 7.0, 14.0, 32.0]) * 1e9


def test_tan_bounded_under_two_compute_units():
    """Drawn from the law in samples D (Tan et al.'s data axis); FLOPs = 6 N T D with T
    tokens per sample depend on N, so in FLOPs the same points follow the law only up to a
    size-dependent shift: the fit stays within the bounds and says what it leaves on them."""
    n = np.repeat(SIZES, 10)
    samples = np.tile(np.logspace(3, 5, 10), SIZES.size)
    y = tan.log10_loss(n, samples, **TRUE) + np.random.default_rng(1).normal(0, 0.005, n.size)
    r = 1 - 10**y
    by_samples = tan.fit_tan(n, samples, r)
    assert by_samples.at_bounds == ()
    assert by_samples.k_max == pytest.approx(TRUE["k_max"], rel=0.1)
    by_flops = tan.fit_tan(n, 6 * n * 200 * samples, r)
    lo, hi = np.array([0, SIZES[0], -10, SIZES[0]]), np.array([2, SIZES[-1], 10, SIZES[-1]])
    got = np.array([by_flops.k_max, by_flops.N0, by_flops.E0_max, by_flops.N1])
    assert np.all((lo * (1 - 1e-9) <= got) & (got <= hi * (1 + 1e-9)))
    flagged = {f.split("=")[0] for f in by_flops.at_bounds}
    logs = np.array([False, True, False, True])  # N0 and N1 are bounded as logs.
    v, a, b = (np.where(logs, np.log(np.where(logs, z, 1.0)), z) for z in (got, lo, hi))
    on = {k for k, vi, ai, bi in zip(TRUE, v, a, b) if fit.on_bound(vi, ai, bi)}
    assert flagged == on


def test_tan_parameter_outside_the_sizes_is_flagged():
    # N0 = 1e12, far above the sizes: k(N) is still linear in N there, N0 not identified.
    n = np.repeat(SIZES, 8)
    x = np.tile(np.logspace(17, 19, 8), SIZES.size)
    r = 1 - 10 ** tan.log10_loss(n, x, k_max=1.5, N0=1e12, E0_max=-0.2, N1=2e9)
    f = tan.fit_tan(n, x, r)
    assert "N0=upper" in f.at_bounds and f.N0 == pytest.approx(SIZES[-1])
    with pytest.raises(ValueError, match=r"k_max_bounds=\(2, 0\) must satisfy low < high"):
        tan.fit_tan(n, x, r, k_max_bounds=(2, 0))


# ==========================================================================================
# Pre-registration and the comparison tool.
# ==========================================================================================


def _git(repo, *args, when):
    env = dict(os.environ, GIT_AUTHOR_DATE=f"@{when} +0000", GIT_COMMITTER_DATE=f"@{when} +0000")
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t")
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)


def _commit(repo, name, when):
    (repo / name).write_text(name)
    _git(repo, "add", name, when=when)
    _git(repo, "commit", "-qm", name, when=when)


def test_preregistration_refuses_a_protocol_after_its_results(tmp_path):
    _git(tmp_path, "init", "-q", when=0)
    _commit(tmp_path, "protocol.md", 1_700_000_000)
    _commit(tmp_path, "a_s0.jsonl", 1_700_003_600)
    ok = evidence.check_preregistered(str(tmp_path / "protocol.md"), [str(tmp_path / "a_s0.jsonl")])
    assert (ok["protocol_time"], ok["first_result_time"]) == (1_700_000_000, 1_700_003_600)
    _commit(tmp_path, "late.md", 1_700_007_200)
    late = str(tmp_path / "late.md")
    with pytest.raises(ValueError, match=r"protocol .*late.md \(committed 2023-11-15 00:13 UTC, "):
        evidence.check_preregistered(late, [str(tmp_path / "a_s0.jsonl")])
    with pytest.raises(ValueError, match=r"result .*a_s0.jsonl \(committed 2023-11-14 23:13 UTC"):
        evidence.check_preregistered(late, [str(tmp_path / "a_s0.jsonl")])
    (tmp_path / "draft.md").write_text("x")
    with pytest.raises(ValueError, match=r"protocol .*draft.md is not committed"):
        evidence.check_preregistered(str(tmp_path / "draft.md"), [])


def _compare(argv):
    spec = importlib.util.spec_from_file_location("_compare", f"{ROOT}/tools/compare_runs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return cli.call(tool.define_flags, tool.main, argv)


def test_compare_runs_tool(tmp_path, capsys):
    csv_path = tmp_path / "v.csv"
    csv_path.write_text("arm,seed,value\nfull,0,0.70\nfull,1,0.72\ngspo,0,0.66\ngspo,1,0.69\n")
    _compare([str(csv_path), "--baseline", "full", "--effect", "0.02"])
    out = capsys.readouterr().out
    w = stats.welch([0.66, 0.69], [0.70, 0.72])
    assert f"| gspo | 2 | 0.6750 +- {w.se_a:.4f} | -0.0350 | {w.t:.2f} | {w.df:.1f} | " in out
    assert "seeds per arm to detect 0.02 with power 0.8:" in out
    csv_path.write_text("arm,seed,value\nfull,0,0.70\nfull,1,0.72\ngspo,0,0.66\n")
    with pytest.raises(ValueError, match=r"arm 'gspo' has 1 seed\(s\)"):
        _compare([str(csv_path), "--baseline", "full"])
    runs = os.path.join(ROOT, "experiments", "tool_rl")
    _compare([runs, "--baseline", "notool", "--last", "2"])
    assert "| tool | 2 | 0.9703 +- " in capsys.readouterr().out


def test_fit_tool_seeds(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("_fit", f"{ROOT}/tools/fit_scaling.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    paths = []
    for label, (c, r) in _seed_curves().items():
        paths.append(str(tmp_path / f"{label}.csv"))
        rows = "".join(f"{float(a)!r},{float(b)!r}\n" for a, b in zip(c, r))
        (tmp_path / f"{label}.csv").write_text("compute,reward\n0,0.2\n" + rows)
    argv = [*paths, "--seeds", "--method", "lsq", "--n-boot", "50", "--out", str(tmp_path)]
    cli.call(tool.define_flags, tool.main, argv)
    saved = json.loads((tmp_path / "seeds.json").read_text())
    ref = seeds.fit_seeds(_seed_curves(), r0=0.2, method="lsq", n_boot=50)
    assert saved["params"]["A"]["pooled"] == pytest.approx(ref.params["A"].pooled, rel=1e-12)
    assert saved["seeds"] == ["s0", "s1", "s2"] and "on a bound: none" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"1 seed\(s\) \(s0\)"):
        cli.call(tool.define_flags, tool.main, [paths[0], "--seeds", "--out", str(tmp_path)])
