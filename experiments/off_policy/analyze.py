"""The off-policy study's analysis, as protocol.md registers it: held-out pass@1 at equal
compute per arm, the primary family of Welch tests with Holm's correction, each run's fitted
sigmoid where it is identified, and the logprob gap and masked fractions per arm.

    python experiments/off_policy/analyze.py [--plot experiments/off_policy/curves.png]

Reads only the stored evidence experiments/off_policy/runs/ARM_sSEED.jsonl
(`rlscale.scaling.evidence`) and writes results.json (`--study DIR` reads another copy,
`--results PATH` writes elsewhere). With no stored run it says so and writes nothing.
"""

import math
import os
import re

import numpy as np

from rlscale.scaling import evidence, stats
from rlscale.scaling import fit as scaling_fit

HERE = os.path.dirname(os.path.abspath(__file__))
# The primary family (protocol.md): each arm against the control it differs from by one part.
FAMILY = (
    ("generator_ratio", "none"),
    ("tis", "none"),
    ("masked_is", "none"),
    ("icepop", "generator_ratio"),
    ("geometric_rejection", "generator_ratio"),
    ("k3_rejection", "generator_ratio"),
    ("m2po", "generator_ratio"),
    ("rollout_kl", "generator_ratio"),
)
ALPHA, POWER, EFFECT = 0.05, 0.8, 0.02
GAP_KEYS = ("train/logp_gap_abs", "train/trainer_logp_gap", "pipeline/staleness_mean")
MASKED = re.compile(r"train/(\w+)_masked_(tokens|seqs)")


def at_compute(run: evidence.StoredRun, budget: float) -> float:
    """pass@1 at `budget` FLOPs: linear in log FLOPs between the evaluations around it (the
    step-0 evaluation, at zero FLOPs, only when the budget is below the first other one)."""
    _, flops, _, acc = run.evals()
    c, a = np.asarray(flops, float), np.asarray(acc, float)
    if budget >= c[-1]:
        return float(a[-1])
    i = int(np.searchsorted(c, budget, side="right"))  # c[i - 1] <= budget < c[i].
    if c[i - 1] <= 0:
        return float(a[i - 1] + (a[i] - a[i - 1]) * budget / c[i])
    w = (math.log(budget) - math.log(c[i - 1])) / (math.log(c[i]) - math.log(c[i - 1]))
    return float(a[i - 1] + w * (a[i] - a[i - 1]))


def sigmoid_fit(run: evidence.StoredRun):
    """The run's sigmoid on its evaluations at FLOPs > 0 (R0: the step-0 evaluation), or the
    reason there is none."""
    _, flops, _, acc = run.evals()
    c, a = np.asarray(flops, float), np.asarray(acc, float)
    try:
        return scaling_fit.fit_sigmoid(c[c > 0], a[c > 0], r0=float(a[0])), ""
    except ValueError as e:
        return None, str(e)


def step_means(run: evidence.StoredRun) -> dict:
    """{key: mean over the run's steps} of the gap, staleness and masked-fraction keys."""
    keys = {k for line in run.lines for k in line if k in GAP_KEYS or MASKED.fullmatch(k)}
    return {k: float(np.mean(run.series(k)[1])) for k in sorted(keys)}


def tests(values: dict, numbers: dict) -> str:
    """The primary family's Welch tests, Holm-adjusted; fills `numbers`, returns the table."""
    rows = [(a, b) for a, b in FAMILY if min(len(values.get(x, ())) for x in (a, b)) >= 2]
    numbers["family.tests"] = float(len(rows))
    numbers["family.complete"] = float(len(rows) == len(FAMILY))
    lines = ["| arm | against | seeds | difference | t | df | p | Holm p |", "| --- " * 8 + "|"]
    if not rows:
        return "\n".join(lines + ["| (no pair of arms with 2 seeds each) |"])
    results = [stats.welch(values[a], values[b], names=(a, b)) for a, b in rows]
    for (a, b), w, p_holm in zip(rows, results, stats.holm([w.p for w in results])):
        key = f"test.{a}"
        numbers.update({f"{key}.diff": w.diff, f"{key}.p": w.p, f"{key}.holm": p_holm})
        lines.append(
            f"| {a} | {b} | {w.n_a} / {w.n_b} | {w.diff:+.4f} | {w.t:.2f} | {w.df:.1f} | "
            f"{w.p:.4f} | {p_holm:.4f} |"
        )
    return "\n".join(lines)


def fit_table(runs: dict, budget: float, numbers: dict):
    """(values {arm: [pass@1 at the budget]}, identified {arm: [A of fits off every bound]},
    the per-run table); fills `numbers`."""
    values, identified = {}, {}
    lines = [
        "| run | pass@1 at C* | final pass@1 | A | B | C_mid | on a bound |",
        "| --- " * 7 + "|",
    ]
    for name, run in sorted(runs.items()):
        arm = re.fullmatch(r"(.+)_s(\d+)", name).group(1)
        v, final = at_compute(run, budget), run.evals()[3][-1]
        values.setdefault(arm, []).append(v)
        identified.setdefault(arm, [])
        numbers[f"run.{name}.at_C_star"] = v
        fit, why = sigmoid_fit(run)
        if fit is None:
            lines.append(f"| {name} | {v:.4f} | {final:.4f} | no fit: {why} | | | |")
            continue
        if not fit.at_bounds:
            identified[arm].append(fit.A)
        numbers[f"run.{name}.n_at_bounds"] = float(len(fit.at_bounds))
        lines.append(
            f"| {name} | {v:.4f} | {final:.4f} | {fit.A:.3f} | {fit.B:.2f} | {fit.C_mid:.3g} | "
            f"{', '.join(fit.at_bounds) or '-'} |"
        )
    return values, identified, "\n".join(lines)


def arm_table(runs: dict, values: dict, identified: dict, numbers: dict) -> str:
    """Per arm: seeds, pass@1 at C* (mean +- se), identified fits, the gap, staleness and
    masked fractions (means over steps, then seeds); fills `numbers`."""
    per_arm = {}
    for name, run in runs.items():
        per_arm.setdefault(re.fullmatch(r"(.+)_s(\d+)", name).group(1), []).append(step_means(run))
    head = ["arm", "seeds", "pass@1 at C* (mean +- se)", "fits identified", "mean A (identified)"]
    head += ["logp gap", "trainer gap", "staleness", "masked tokens", "masked sequences"]
    lines = ["| " + " | ".join(head) + " |", "| --- " * len(head) + "|"]
    for arm, v in sorted(values.items()):
        mean = float(np.mean(v))
        se = float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
        keys = sorted({k for m in per_arm[arm] for k in m})
        means = {k: float(np.mean([m[k] for m in per_arm[arm] if k in m])) for k in keys}
        masked = [
            sum(x for k, x in means.items() if k.endswith(end))
            if any(k.endswith(end) for k in means)
            else math.nan
            for end in ("_masked_tokens", "_masked_seqs")
        ]
        ident = identified[arm]
        numbers.update({f"arm.{arm}.mean": mean, f"arm.{arm}.se": se})
        numbers[f"arm.{arm}.identified"] = float(len(ident))
        numbers.update({f"arm.{arm}.{k}": x for k, x in means.items()})
        cells = [means.get(k, math.nan) for k in GAP_KEYS] + masked
        lines.append(
            f"| {arm} | {len(v)} | {mean:.4f} +- {se:.4f} | {len(ident)} / {len(v)} | "
            f"{np.mean(ident) if ident else math.nan:.3f} | "
            + " | ".join(f"{x:.2e}" for x in cells)
            + " |"
        )
    return "\n".join(lines)


def balanced(runs: dict) -> tuple[dict, list[str]]:
    """(the runs of the seeds every stored arm has, the names left out): protocol.md's
    stopping rule keeps the arms balanced."""
    seeds = {}
    for name in runs:
        m = re.fullmatch(r"(.+)_s(\d+)", name)
        if not m:
            raise ValueError(f"run {name!r} is not named ARM_sSEED: its arm is unknown")
        seeds.setdefault(m.group(1), set()).add(m.group(2))
    common = set.intersection(*seeds.values())
    kept = {n: r for n, r in runs.items() if n.rsplit("_s", 1)[1] in common}
    return kept, sorted(set(runs) - set(kept))


def analyze(runs: dict) -> tuple[dict, dict]:
    """(numbers, tables) of the study from the stored runs {ARM_sSEED: StoredRun}."""
    runs, left_out = balanced(runs)
    if not runs:
        raise ValueError(f"no seed is complete in every arm (left out: {', '.join(left_out)})")
    finals = [r.evals()[1][-1] for r in runs.values()]
    budget = min(finals)  # C*: every run reaches it.
    numbers = {"C_star": float(budget), "flops_final_spread": float(max(finals) / budget)}
    numbers["runs_left_out"] = float(len(left_out))
    values, identified, fits = fit_table(runs, budget, numbers)
    arms = arm_table(runs, values, identified, numbers)
    table = tests(values, numbers)
    spread = {a: v for a, v in values.items() if len(v) >= 2}
    if spread:
        sd = stats.pooled_sd(spread)
        n = min(len(v) for v in spread.values())
        numbers.update({"sd_pooled": sd, "seeds_min": float(n)})
        if sd > 0:
            m = max(int(numbers["family.tests"]), 1)
            numbers["mde_holm"] = stats.minimum_detectable_effect(
                n, sd, alpha=ALPHA / m, target=POWER
            )
    tables = {"arms": arms, "tests": table, "fits": fits}
    if left_out:
        tables["left_out"] = "runs of incomplete seeds, left out: " + ", ".join(left_out)
    return numbers, tables


def main(argv=None):
    args = evidence.study_parser(HERE).parse_args(argv)
    runs = evidence.read_study(args.study)
    if not runs:
        print(f"no stored runs yet in {os.path.join(args.study, 'runs')}: nothing to analyze")
        return {"runs": {}, "numbers": {}, "tables": {}}
    numbers, tables = analyze(runs)
    for key in ("C_star", "flops_final_spread", "sd_pooled", "mde_holm"):
        if key in numbers:
            print(f"{key}: {numbers[key]:.4g}")
    results = evidence.report(args, numbers, tables)
    if args.plot:
        plot(runs, args.plot)
    return results


def plot(runs: dict, path: str) -> None:
    """Held-out pass@1 against FLOPs and the logprob gap against the step, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {}
    for name, run in sorted(runs.items()):
        arm = re.fullmatch(r"(.+)_s(\d+)", name).group(1)
        label = None if arm in colours else arm
        colour = colours.setdefault(arm, f"C{len(colours) % 10}")
        _, flops, _, acc = run.evals()
        ax0.plot(np.asarray(flops[1:], float), acc[1:], "-", color=colour, alpha=0.6, label=label)
        steps, gap = run.series("train/logp_gap_abs")
        ax1.plot(steps, gap, "-", color=colour, alpha=0.4)
    ax0.set_xscale("log")
    ax0.set_xlabel("FLOPs")
    ax0.set_ylabel("held-out pass@1")
    ax0.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean |logp - sampler logp|")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
