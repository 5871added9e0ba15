"""Comparisons between arms of seeds: Welch's t-test, Holm's correction across a table, and the
seeds per arm a comparison needs.

An arm is a recipe run with several seeds; a comparison asks whether two arms' means differ
by more than their seed-to-seed noise. Welch's test does not assume equal variances; its
p-values come from scipy's t distribution. A table of comparisons is corrected with Holm's
step-down procedure (family-wise error at alpha, uniformly more powerful than Bonferroni).
The power calculation is exact: the two-sided two-sample t-test's power from the noncentral
t distribution (equal seeds per arm and equal sd, where Welch's df equal the pooled test's),
the smallest n per arm reaching the target power. scipy is imported where a p-value or a power
is computed: a command that imports the package (every run does) does not pay its second.
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Welch:
    """Welch's two-sample t-test of `mean(a) - mean(b)`.

    Attributes:
      n_a, n_b: seeds per arm.
      mean_a, mean_b: the arms' means.
      se_a, se_b: their standard errors, `s / sqrt(n)` (sample sd, ddof 1).
      diff: `mean_a - mean_b`.
      se: `sqrt(se_a^2 + se_b^2)`.
      t: `diff / se`.
      df: the Welch-Satterthwaite degrees of freedom.
      p: the two-sided p-value.
    """

    n_a: int
    n_b: int
    mean_a: float
    mean_b: float
    se_a: float
    se_b: float
    diff: float
    se: float
    t: float
    df: float
    p: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _arm(name: str, values) -> np.ndarray:
    """`values` as a 1-D float64 array of at least 2 finite values.

    Raises:
      ValueError: naming the arm: fewer than 2 values (one seed has no spread), or a
        NaN/inf.
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size < 2:
        raise ValueError(
            f"arm {name!r} has {v.size} seed(s): a comparison needs at least 2 per arm (one "
            "seed has no seed-to-seed spread to compare against)"
        )
    if not np.all(np.isfinite(v)):
        raise ValueError(f"arm {name!r} has a NaN or inf value: {v.tolist()}")
    return v


def welch(a, b, *, names: tuple[str, str] = ("a", "b")) -> Welch:
    """Welch's unequal-variance t-test of two arms' means.

    Args:
      a, b: the arms' values, one per seed.
      names: the arms' names, for error messages.

    Returns:
      `Welch`.

    Raises:
      ValueError: an arm with fewer than 2 seeds or a non-finite value (named), or both
        arms without any spread (the test is undefined).
    """
    from scipy import stats as sp_stats

    a, b = _arm(names[0], a), _arm(names[1], b)
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    diff = float(a.mean() - b.mean())
    if se == 0:
        raise ValueError(
            f"arms {names[0]!r} and {names[1]!r} have no seed-to-seed spread at all (every "
            "value equal within each arm): the t statistic is undefined"
        )
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    t = diff / se
    return Welch(
        n_a=int(a.size),
        n_b=int(b.size),
        mean_a=float(a.mean()),
        mean_b=float(b.mean()),
        se_a=math.sqrt(va),
        se_b=math.sqrt(vb),
        diff=diff,
        se=se,
        t=t,
        df=float(df),
        p=float(2.0 * sp_stats.t.sf(abs(t), df)),
    )


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input order.

    Sorted ascending, the i-th smallest (0-based) of m is multiplied by `m - i`, the running
    maximum taken so the adjusted values keep the order, and capped at 1. Rejecting every
    hypothesis whose adjusted p is <= alpha controls the family-wise error rate at alpha.

    Raises:
      ValueError: an empty list or a p-value outside [0, 1] (naming its index).
    """
    p = np.asarray(p_values, dtype=np.float64)
    if p.size == 0:
        raise ValueError("no p-values to correct")
    bad = np.flatnonzero(~((p >= 0) & (p <= 1)))
    if bad.size:
        raise ValueError(f"p-value {p[bad[0]]} at index {bad[0]} is outside [0, 1]")
    order = np.argsort(p, kind="stable")
    m = p.size
    adjusted = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.minimum(adjusted, 1.0)
    return out.tolist()


def power(n: int, effect: float, sd: float, *, alpha: float = 0.05) -> float:
    """The power of the two-sided two-sample t-test with `n` seeds per arm.

    Exact for normal values with equal sd in both arms: the statistic follows a noncentral
    t with `2n - 2` degrees of freedom and noncentrality `(effect / sd) sqrt(n / 2)`; power
    is the probability it falls outside the central t's `1 - alpha / 2` quantiles.

    Raises:
      ValueError: see `seeds_per_arm`.
    """
    _check_power_args(effect, sd, alpha, 0.5)
    if n < 2:
        raise ValueError(f"n={n} seeds per arm: the t-test needs at least 2")
    df = 2 * n - 2
    nc = abs(effect) / sd * math.sqrt(n / 2.0)
    from scipy import stats as sp_stats

    crit = sp_stats.t.ppf(1.0 - alpha / 2.0, df)
    # The far tail's probability: scipy's noncentral t returns NaN where it underflows (below
    # 1e-15 at the neighbouring arguments, e.g. df 4, nc 8.4, crit 5.3), which is 0 here.
    far = float(np.nan_to_num(sp_stats.nct.cdf(-crit, df, nc), nan=0.0))
    return float(sp_stats.nct.sf(crit, df, nc)) + far


def seeds_per_arm(
    effect: float, sd: float, *, alpha: float = 0.05, target: float = 0.8, n_max: int = 100_000
) -> int:
    """The fewest seeds per arm for which the two-sided t-test detects `effect` with power
    >= `target` (see `power`): e.g. Cohen's d = effect / sd = 0.5 needs 64 per arm at
    alpha 0.05 and power 0.8, d = 0.8 needs 26, d = 1 needs 17.

    Args:
      effect: the difference of means to detect (reward units), != 0.
      sd: the measured run-to-run standard deviation (the same units), > 0.
      alpha: the two-sided significance level, in (0, 1) (Holm: the level the smallest p
        of a table of m tests faces is alpha / m).
      target: the power, in (0, 1).
      n_max: give up above this many seeds.

    Raises:
      ValueError: a zero effect, a non-positive sd, alpha or target outside (0, 1), or no
        n up to `n_max` reaching the target (naming the power there).
    """
    _check_power_args(effect, sd, alpha, target)
    lo, hi = 1, 2  # Doubling keeps the noncentrality moderate (scipy's nct loses it far out).
    while power(hi, effect, sd, alpha=alpha) < target:
        if hi >= n_max:
            raise ValueError(
                f"effect {effect:g} with sd {sd:g} needs more than n_max={n_max} seeds per arm"
            )
        lo, hi = hi, min(2 * hi, n_max)
    while hi - lo > 1:  # power(lo) < target <= power(hi); power grows with n.
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if power(mid, effect, sd, alpha=alpha) >= target else (mid, hi)
    return hi


def minimum_detectable_effect(
    n: int, sd: float, *, alpha: float = 0.05, target: float = 0.8
) -> float:
    """The smallest difference of means the two-sided t-test with `n` seeds per arm detects
    with power `target` at `alpha` (`power` is increasing in the effect: bisection to 2^-60
    of 20 sd)."""
    lo, hi = 0.0, 20.0 * sd
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if power(n, mid, sd, alpha=alpha) >= target else (mid, hi)
    return hi


def seed_table(sd: float, effects, *, alpha: float = 0.05, family: int = 1) -> dict:
    """{effect: (seeds per arm at `alpha`, at `alpha / family`)}: a study's design table
    (`seeds_per_arm` at power 0.8; Holm's smallest p of `family` tests faces alpha / family)."""
    return {
        e: tuple(seeds_per_arm(e, sd, alpha=a) for a in (alpha, alpha / family)) for e in effects
    }


def _check_power_args(effect, sd, alpha, target):
    problems = []
    if not (math.isfinite(effect) and effect != 0):
        problems.append(f"effect={effect} must be finite and non-zero")
    if not (math.isfinite(sd) and sd > 0):
        problems.append(f"sd={sd} must be finite and > 0 (the measured run-to-run spread)")
    if not 0 < alpha < 1:
        problems.append(f"alpha={alpha} must be in (0, 1)")
    if not 0 < target < 1:
        problems.append(f"power target={target} must be in (0, 1)")
    if problems:
        raise ValueError("; ".join(problems))


def pooled_sd(arms: Mapping[str, Sequence[float]]) -> float:
    """The run-to-run sd pooled over arms: `sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1))`.

    Raises:
      ValueError: an arm with fewer than 2 seeds or a non-finite value (named).
    """
    checked = [_arm(name, v) for name, v in arms.items()]
    if not checked:
        raise ValueError("no arms: the pooled sd needs at least one arm of 2 seeds")
    ss = sum(float(((v - v.mean()) ** 2).sum()) for v in checked)
    return math.sqrt(ss / sum(v.size - 1 for v in checked))


def compare_to_baseline(arms: Mapping[str, Sequence[float]], baseline: str) -> dict:
    """Welch's test of every arm against `baseline`, Holm-adjusted across the table.

    Returns:
      {arm: (`Welch` of arm - baseline, Holm-adjusted p)} for every arm but the baseline,
      in the input order.

    Raises:
      ValueError: an unknown baseline (naming the arms), fewer than 2 arms, or an arm that
        `welch` refuses (named).
    """
    if baseline not in arms:
        raise ValueError(f"baseline {baseline!r} is not an arm; the arms: {', '.join(arms)}")
    if len(arms) < 2:
        raise ValueError(f"one arm only ({baseline!r}): nothing to compare it with")
    tests = {
        name: welch(v, arms[baseline], names=(name, baseline))
        for name, v in arms.items()
        if name != baseline
    }
    adjusted = holm([w.p for w in tests.values()])
    return {name: (w, p) for (name, w), p in zip(tests.items(), adjusted)}


def format_comparison(
    arms: Mapping[str, Sequence[float]],
    baseline: str,
    *,
    effect: float | None = None,
    alpha: float = 0.05,
    target: float = 0.8,
) -> str:
    """A Markdown table of every arm against `baseline` (seeds, mean +- se, difference, t, df,
    Welch's p, Holm's p across the table), then the power calculation: the pooled run-to-run
    sd and, for `effect`, the seeds per arm at `alpha` and at Holm's strictest level
    `alpha / m` (m comparisons).

    Raises:
      ValueError: as `compare_to_baseline` and `seeds_per_arm`.
    """
    table = compare_to_baseline(arms, baseline)
    base = np.asarray(arms[baseline], dtype=np.float64)
    lines = [
        "| arm | seeds | mean +- se | minus baseline | t | df | p | Holm p |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {baseline} (baseline) | {base.size} | {base.mean():.4f} +- "
        f"{base.std(ddof=1) / math.sqrt(base.size):.4f} | - | - | - | - | - |",
    ]
    for name, (w, p_holm) in table.items():
        lines.append(
            f"| {name} | {w.n_a} | {w.mean_a:.4f} +- {w.se_a:.4f} | {w.diff:+.4f} | "
            f"{w.t:.2f} | {w.df:.1f} | {w.p:.4f} | {p_holm:.4f} |"
        )
    sd = pooled_sd(arms)
    lines.append(f"\nrun-to-run sd pooled over {len(arms)} arms: {sd:.4f}")
    if effect is not None:
        m = len(table)
        n, n_holm = (seeds_per_arm(effect, sd, alpha=a, target=target) for a in (alpha, alpha / m))
        lines.append(
            f"seeds per arm to detect {effect:g} with power {target:g}: {n} at alpha {alpha:g}, "
            f"{n_holm} at alpha / {m} = {alpha / m:.4g} (Holm's smallest p faces it)"
        )
    return "\n".join(lines)
