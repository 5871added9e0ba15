"""Every number of the corrections to the experiment READMEs (issue 31), recomputed from the
files committed in experiments/.

    python experiments/corrections.py [--results experiments/corrections.json]

Reads only committed files: `paradigms/paradigms.json` (each row's end pass@1 as mean, min
and max of 3 seeds, which determine all three), `scalerl_ablations/fits_first_half.json`,
`scalerl_ablations/testbed_seeds.json` and `ladder/probe3_curves.json` (per-seed values and
curves transcribed from those READMEs' tables: their runs were not stored),
`iso_compute/iso_compute.json`, `ladder/fits_tan.json` and `ladder/prediction_xl.json`.
Prints the tables and writes `corrections.json` (`numbers`, `tables`), which the READMEs
quote as `NUMBER<!--=key-->` and `<!-- begin results: NAME -->` blocks
(`tests/test_experiments.py` checks them against a fresh run of this script).

Comparisons are Welch's t-test over seeds with Holm's correction across each table
(`rlscale.scaling.stats`); the power figures are the seeds per arm that detect the observed
difference with power 0.8 at alpha 0.05, at the observed run-to-run sd (pooled over the
table's arms). Predictions are scored beside the flat and log-linear baselines
(`rlscale.scaling.baselines`).
"""

import argparse
import json
import math
import os

import numpy as np
from scipy import stats as sp_stats

from rlscale.scaling import allocation, baselines, stats, tan
from rlscale.scaling import fit as fit_lib

HERE = os.path.dirname(os.path.abspath(__file__))
ISO_NOISE = 0.011  # One evaluation of 500 problems x 4 samples at pass@1 ~0.45 (binomial).
ISO_DRAWS = 2000
THRESHOLD_SE = 2.0  # The READMEs' old "beyond 2 standard errors" rule.
# Tan et al.'s bounds (docs/scaling.md): k_max in [0, 2], |E0_max| <= 10, N0, N1 within the
# fitted sizes' range; the ladder's xs..l sizes (experiments/ladder: 0.14M to 1.84M).
TAN_K_MAX, TAN_E0_MAX, LADDER_SIZES = (0.0, 2.0), 10.0, (0.14e6, 1836480.0)


def load(*parts):
    with open(os.path.join(HERE, *parts)) as f:
        return json.load(f)


def comparison_table(arms, baseline, numbers, prefix, digits=4):
    """Welch + Holm of every arm against `baseline`; fills `numbers[prefix.ARM.*]`. The seeds
    per arm are for the observed difference at the two arms' pooled sd."""
    table = stats.compare_to_baseline(arms, baseline)
    rows = [
        "| arm | seeds | mean | minus baseline | Welch t | df | p | Holm p | seeds per arm for "
        "this difference |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {baseline} | {len(arms[baseline])} | {np.mean(arms[baseline]):.{digits}f} | - | - | - "
        "| - | - | - |",
    ]
    for name, (w, p_holm) in table.items():
        sd = stats.pooled_sd({name: arms[name], baseline: arms[baseline]})
        n = stats.seeds_per_arm(w.diff, sd)
        numbers[f"{prefix}.{name}.sd"] = sd
        for key, v in (("diff", w.diff), ("t", w.t), ("p", w.p), ("holm", p_holm)):
            numbers[f"{prefix}.{name}.{key}"] = v
        numbers[f"{prefix}.{name}.seeds_needed"] = n
        rows.append(
            f"| {name} | {w.n_a} | {w.mean_a:.{digits}f} | {w.diff:+.{digits}f} | {w.t:.2f} | "
            f"{w.df:.1f} | {w.p:.3f} | {p_holm:.3f} | {n} |"
        )
    return "\n".join(rows)


def expected_false_positives(dfs):
    """How many of the tests would pass |t| > 2 by chance: sum of P(|t_df| > 2)."""
    return float(sum(2 * sp_stats.t.sf(THRESHOLD_SE, df) for df in dfs))


def paradigms(numbers, tables):
    rows = load("paradigms", "paradigms.json")["rows"]
    ends = {}
    for name, r in rows.items():
        mean, lo, hi = r["end"]
        assert r["seeds"] == 3, name  # Mean, min and max then give every seed.
        ends[name] = [lo, 3 * mean - lo - hi, hi]
    tables["paradigms_end"] = comparison_table(ends, "online", numbers, "paradigms.end")
    online, idpo = rows["online"], rows["iterative_dpo"]
    numbers["paradigms.idpo_compute_share"] = idpo["flops_end"] / online["flops_end"]
    numbers["paradigms.idpo_speedup_0.6"] = online["flops_to_0.6"][0] / idpo["flops_to_0.6"][0]
    numbers["paradigms.idpo_speedup_0.7"] = online["flops_to_0.7"][0] / idpo["flops_to_0.7"][0]
    numbers["paradigms.distill_cost_0.6"] = (
        rows["distill"]["flops_to_0.6"][0] / online["flops_to_0.6"][0] - 1.0
    )
    # Online RL's end against iterative DPO's after 2.3x the compute: not a ceiling.
    for name in ("online", "iterative_dpo"):
        lo, hi = rows[name]["fit"]["A_interval"]
        numbers[f"paradigms.{name}.A_width"] = hi - lo


def scalerl_quickstart(numbers):
    """The quickstart-task ablations: where each half-fit's cut lies against its C_mid."""
    fits = {f["name"]: f for f in load("scalerl_ablations", "fits_first_half.json")}
    ratios = {name: f["fit_until"] / f["full"]["C_mid"] for name, f in fits.items()}
    for seed in (0, 1):
        numbers[f"scalerl.quickstart.gspo_s{seed}.cut_over_cmid"] = ratios[f"loss_gspo_s{seed}"]
    others = [v for k, v in ratios.items() if not k.startswith("loss_gspo")]
    numbers["scalerl.quickstart.others.cut_over_cmid_min"] = min(others)
    numbers["scalerl.quickstart.others.cut_over_cmid_max"] = max(others)
    a, b = (
        [math.log10(fits[f"{arm}_s{s}"]["full"]["C_mid"]) for s in (0, 1)]
        for arm in ("loss_gspo", "full")
    )
    w = stats.welch(a, b, names=("loss_gspo", "full"))
    numbers["scalerl.quickstart.gspo_log10_cmid.diff"] = w.diff
    numbers["scalerl.quickstart.gspo_log10_cmid.p"] = w.p
    maes = [f["extrapolation"]["mae"] for k, f in fits.items() if not k.startswith("loss_gspo")]
    numbers["scalerl.quickstart.others.mae_min"] = min(maes)
    numbers["scalerl.quickstart.others.mae_max"] = max(maes)


def scalerl_testbed(numbers, tables):
    data = load("scalerl_ablations", "testbed_seeds.json")
    arms = data["arms"]
    tests, dfs = [], []
    rows = [
        "| variant | end: diff, p | A: diff, p | B: diff, p | log10 C_mid: diff, p |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, arm in arms.items():
        if name == "full":
            continue
        cells = []
        for key in ("end", "A", "B", "C_mid"):
            tr = math.log10 if key == "C_mid" else float
            a = [tr(v) for v in arm[key]]
            b = [tr(v) for v in arms["full"][key]]
            w = stats.welch(a, b, names=(name, "full"))
            tests.append((name, key, w))
            dfs.append(w.df)
        rows.append(f"| {name} |")
    holm = stats.holm([w.p for _, _, w in tests])
    for (name, key, w), p_holm in zip(tests, holm):
        numbers[f"scalerl.testbed3.{name}.{key}.p"] = w.p
        numbers[f"scalerl.testbed3.{name}.{key}.holm"] = p_holm
        numbers[f"scalerl.testbed3.{name}.{key}.se_units"] = w.t
    for i, name in enumerate(n for n in arms if n != "full"):
        cells = []
        for key in ("end", "A", "B", "C_mid"):
            w = next(w for n, k, w in tests if n == name and k == key)
            p_holm = numbers[f"scalerl.testbed3.{name}.{key}.holm"]
            cells.append(f"{w.diff:+.3g}, {w.p:.3f} (Holm {p_holm:.2f})")
        rows[2 + i] = f"| {name} | " + " | ".join(cells) + " |"
    tables["scalerl_testbed3"] = "\n".join(rows)
    numbers["scalerl.testbed3.n_tests"] = len(tests)
    numbers["scalerl.testbed3.beyond_2se"] = sum(abs(w.t) > THRESHOLD_SE for *_, w in tests)
    numbers["scalerl.testbed3.expected_false"] = expected_false_positives(dfs)
    numbers["scalerl.testbed3.min_holm"] = min(holm)
    p_lo, p_hi = (2 * sp_stats.t.sf(THRESHOLD_SE, df) for df in (4.0, 2.0))
    numbers["scalerl.p_at_2se.df4"], numbers["scalerl.p_at_2se.df2"] = p_lo, p_hi
    ends = {k: list(v["end"]) + data["fresh_end"].get(k, []) for k, v in arms.items()}
    five = {k: v for k, v in ends.items() if len(v) == 5}
    tables["scalerl_testbed5"] = comparison_table(five, "full", numbers, "scalerl.testbed5")
    fresh = data["fresh_end"]
    for name in ("loss_gspo", "minus_zero_variance", "minus_batch_std"):
        diff = np.mean(fresh[name]) - np.mean(fresh["full"])
        numbers[f"scalerl.fresh.{name}.diff"] = float(diff)
        numbers[f"scalerl.fresh.{name}.below"] = int(
            sum(x < f for x, f in zip(fresh[name], fresh["full"]))
        )
    # Power for the 3-seed effect GSPO was selected on, at the 5-seed sd.
    sel = np.mean(arms["loss_gspo"]["end"]) - np.mean(arms["full"]["end"])
    numbers["scalerl.gspo.selection_diff"] = float(sel)
    sd = numbers["scalerl.testbed5.loss_gspo.sd"]
    numbers["scalerl.gspo.power_at_5"] = stats.power(5, sel, sd)
    fresh_diff = numbers["scalerl.fresh.loss_gspo.diff"]
    numbers["scalerl.gspo.seeds_for_fresh_diff"] = stats.seeds_per_arm(fresh_diff, sd)


def iso_compute(numbers, tables, seed=0):
    """n* and its exponent b, with a parametric bootstrap over the evaluation noise: every
    cell's final pass@1 redrawn with sd `ISO_NOISE`, n* and b refitted."""
    data = load("iso_compute", "iso_compute.json")
    keys = ("budget", "rollouts", "prompts", "steps", "reuse", "prompt_pool")
    cells = [allocation.Cell(*(c[k] for k in keys)) for c in data["cells"]]
    rewards = np.array([c["final_reward"] for c in data["cells"]])
    optima = allocation.optimal_rollouts(cells, rewards)
    for o in optima:
        numbers[f"iso.C{o.budget}.best_n"] = o.best_rollouts
        numbers[f"iso.C{o.budget}.n_star"] = o.n_star
    b = allocation.fit_optimal_rollouts([o.budget for o in optima], [o.n_star for o in optima]).b
    numbers["iso.b"] = b
    rng = np.random.default_rng(seed)
    bs, fallbacks = [], 0
    for _ in range(ISO_DRAWS):
        drawn = allocation.optimal_rollouts(cells, rewards + rng.normal(0, ISO_NOISE, rewards.size))
        fallbacks += any(o.fallback for o in drawn)
        bs.append(
            allocation.fit_optimal_rollouts([o.budget for o in drawn], [o.n_star for o in drawn]).b
        )
    lo, hi = np.percentile(bs, [2.5, 97.5])
    numbers["iso.b_lo"], numbers["iso.b_hi"] = float(lo), float(hi)
    numbers["iso.b_draws_le0"] = float(np.mean(np.array(bs) <= 0))
    numbers["iso.fallback_share"] = fallbacks / ISO_DRAWS
    best = [o.best_rollouts for o in optima]
    numbers["iso.best_n_b"] = allocation.fit_optimal_rollouts([o.budget for o in optima], best).b


def ladder(numbers, tables):
    """Tan's law as fitted (unbounded) against its authors' bounds; the probe-3 curves'
    first-half predictions beside the baselines."""
    for label, rec in (("fit", load("ladder", "fits_tan.json")),
                       ("prediction", load("ladder", "prediction_xl.json")["fit"])):  # fmt: skip
        numbers[f"ladder.tan_{label}.k_max"] = rec["k_max"]
        numbers[f"ladder.tan_{label}.E0_max"] = rec["E0_max"]
        numbers[f"ladder.tan_{label}.N0"] = rec["N0"]
        numbers[f"ladder.tan_{label}.N1"] = rec["N1"]
        outside = []
        if not TAN_K_MAX[0] <= rec["k_max"] <= TAN_K_MAX[1]:
            outside.append("k_max")
        if abs(rec["E0_max"]) > TAN_E0_MAX:
            outside.append("E0_max")
        outside += [k for k in ("N0", "N1") if not LADDER_SIZES[0] <= rec[k] <= LADDER_SIZES[1]]
        numbers[f"ladder.tan_{label}.n_outside_bounds"] = len(outside)
        tables[f"ladder_tan_{label}_outside"] = ", ".join(outside)
    data = load("ladder", "probe3_curves.json")
    steps = np.array(data["steps"], float)
    noise = []
    rows = [
        "| size | sigmoid, first half: 2nd-half MAE | Tan line | flat | log-linear |",
        "| --- | --- | --- | --- | --- |",
    ]
    maes = {k: [] for k in ("sigmoid", "tan", "flat", "line")}
    for size, curve in data["curves"].items():
        r = np.array(curve)
        c, y = steps[1:], r[1:]  # Compute proportional to steps; step 0 is R0.
        ext = fit_lib.extrapolation_check(c, y, fit_until=100.0, r0=float(r[0]))
        line = tan.predict_within_run(c, y, fit_until_frac=0.5)
        base = ext.baselines
        row = {"sigmoid": ext.mae, "tan": line.mae, "flat": base.flat_mae, "line": base.line_mae}
        for k, v in row.items():
            maes[k].append(v)
            numbers[f"ladder.probe3.{size}.{k}"] = v
        noise.append(baselines.binomial_se(float(y[c > 100].mean()), data["eval_samples"]))
        rows.append(f"| {size} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |")
    for k, v in maes.items():
        numbers[f"ladder.probe3.mean.{k}"] = float(np.mean(v))
    numbers["ladder.probe3.noise_max"] = max(noise)
    tables["ladder_probe3"] = "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=os.path.join(HERE, "corrections.json"))
    a = p.parse_args(argv)
    numbers, tables = {}, {}
    paradigms(numbers, tables)
    scalerl_quickstart(numbers)
    scalerl_testbed(numbers, tables)
    iso_compute(numbers, tables)
    ladder(numbers, tables)
    for name, table in tables.items():
        print(f"\n{name}:\n{table}")
    print()
    for k in sorted(numbers):
        print(f"{k} = {numbers[k]}")
    results = {"numbers": numbers, "tables": tables}
    if a.results:
        with open(a.results, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
            f.write("\n")
    return results


if __name__ == "__main__":
    main()
