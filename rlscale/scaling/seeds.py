"""Seed-aware sigmoid fits: one fit per seed, one across seeds, and error bars from the seeds.

A bootstrap over one run's points measures how well that run pins its own curve, not how far
another seed's run would land: on the ladder, seed 2's interval on A excluded seed 0's A. The
error bar here comes from the seeds: each seed's curve is fitted alone (the seed-to-seed
spread: mean and standard deviation of A, B and log10 C_mid), the seeds' points are fitted
together (the pooled estimate), and a bootstrap over seeds (resample whole seeds with
replacement, refit the pooled points) gives a percentile interval. With k seeds there are
only C(2k - 1, k) distinct resamples (10 for 3 seeds, 126 for 5): each is fitted once and
the interval is as coarse as that. Every parameter that sits on a bound of a fit is flagged,
per seed and pooled. All fits share one R0, one `min_compute` cut (ScaleRL fits past an
initial compute, skipping the noisy early regime) and one set of bounds, so the flags mean
the same in every fit.
"""

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from rlscale.scaling import fit as fit_lib

PARAMS = ("A", "B", "log10_C_mid")


@dataclasses.dataclass(frozen=True)
class ParamSummary:
    """One parameter over the seeds.

    Attributes:
      name: "A", "B" or "log10_C_mid".
      pooled: the fit of every seed's points together.
      per_seed: each seed's own fit, in the seeds' order.
      mean, sd: mean and sample standard deviation (ddof 1) of `per_seed`.
      interval: the bootstrap-over-seeds percentile interval (`level` coverage) of the
        pooled fit.
      on_bound: the seeds (and "pooled") whose fit has this parameter on a bound.
    """

    name: str
    pooled: float
    per_seed: tuple[float, ...]
    mean: float
    sd: float
    interval: tuple[float, float]
    on_bound: tuple[str, ...]

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(per_seed=list(self.per_seed), interval=list(self.interval))
        d["on_bound"] = list(self.on_bound)
        return d


@dataclasses.dataclass(frozen=True)
class SeedFits:
    """The sigmoid fitted per seed and across seeds (see `fit_seeds`).

    Attributes:
      seeds: the seeds' labels, in input order.
      per_seed: each seed's `fit.SigmoidFit`.
      pooled: the fit of all seeds' points together.
      params: `ParamSummary` per name in `PARAMS`.
      n_resamples: distinct seed resamples the bootstrap fitted.
      level: the interval's coverage.
    """

    seeds: tuple[str, ...]
    per_seed: tuple[fit_lib.SigmoidFit, ...]
    pooled: fit_lib.SigmoidFit
    params: dict[str, ParamSummary]
    n_resamples: int
    level: float

    def flagged(self) -> list[str]:
        """Every parameter on a bound, as `"SEED: A=upper"` (pooled as `"pooled: ..."`)."""
        fits = [*zip(self.seeds, self.per_seed), ("pooled", self.pooled)]
        return [f"{label}: {flag}" for label, f in fits for flag in f.at_bounds]

    def as_dict(self) -> dict:
        return {
            "seeds": list(self.seeds),
            "per_seed": [f.as_dict() for f in self.per_seed],
            "pooled": self.pooled.as_dict(),
            "params": {k: p.as_dict() for k, p in self.params.items()},
            "n_resamples": self.n_resamples,
            "level": self.level,
            "on_bound": self.flagged(),
        }


def _values(f: fit_lib.SigmoidFit) -> tuple[float, float, float]:
    return f.A, f.B, math.log10(f.C_mid)


def _checked(curves, min_compute):
    """{label: (compute, reward)} checked, cut at `min_compute`, and the shared C_mid bounds.

    Raises:
      ValueError: fewer than 2 seeds, or a seed's curve that `fit.check_curve` refuses or
        that keeps fewer than `fit.MIN_POINTS` points past the cut (naming the seed).
    """
    if len(curves) < 2:
        raise ValueError(
            f"{len(curves)} seed(s) ({', '.join(map(str, curves)) or 'none'}): the "
            "seed-to-seed spread and the bootstrap over seeds need at least 2 seeds"
        )
    out = {}
    for label, (compute, reward) in curves.items():
        try:
            c, r = fit_lib.check_curve(compute, reward)
        except ValueError as e:
            raise ValueError(f"seed {label}: {e}") from None
        keep = c >= min_compute
        if keep.sum() < fit_lib.MIN_POINTS:
            raise ValueError(
                f"seed {label}: too few points: {int(keep.sum())} of {c.size} have compute >= "
                f"min_compute={min_compute:g}; the sigmoid's 3 parameters need at least "
                f"{fit_lib.MIN_POINTS}"
            )
        out[str(label)] = (c[keep], r[keep])
    u = np.log(np.concatenate([c for c, _ in out.values()]))
    span = max(float(u.max() - u.min()), math.log(10.0))  # As `fit.fit_sigmoid`'s default.
    c_mid_bounds = (math.exp(u.min() - span), math.exp(u.max() + span))
    return out, c_mid_bounds


def _pool(curves, labels):
    """The points of `labels` (repeats included) in compute order."""
    c = np.concatenate([curves[k][0] for k in labels])
    r = np.concatenate([curves[k][1] for k in labels])
    order = np.argsort(c, kind="stable")
    return c[order], r[order]


def fit_seeds(
    curves: Mapping[str, tuple],
    *,
    r0: float,
    min_compute: float = 0.0,
    method: str = "grid",
    n_boot: int = 200,
    level: float = 0.95,
    seed: int = 0,
    **bounds,
) -> SeedFits:
    """Fits the ScaleRL sigmoid to each seed's curve and to all of them together.

    Args:
      curves: {seed label: (compute, reward)}, each in the order the compute was spent,
        compute > 0 (the step-0 evaluation goes in `r0`), at least 2 seeds.
      r0: the reward before training, shared by the seeds (one warm start).
      min_compute: every fit uses only the points with compute >= this (ScaleRL skips the
        first ~1.5k GPU-hours of its runs: the early regime, which the curve does not model).
      method: "grid" or "lsq" for the per-seed and pooled fits (`fit.fit_sigmoid`); the
        bootstrap refits with "lsq".
      n_boot: seed resamples drawn (seeded); each distinct one is fitted once.
      level: the interval's coverage.
      seed: the bootstrap's seed.
      **bounds: `fit.fit_sigmoid`'s `a_max`, `b_bounds`, `c_mid_bounds` (default: one span
        of the seeds' log-compute, at least a decade, either side of it, shared by all
        fits).

    Returns:
      `SeedFits`.

    Raises:
      ValueError: fewer than 2 seeds, a seed whose curve cannot be fitted (named), `n_boot`
        < 1 or a `level` outside (0, 1).
    """
    if n_boot < 1 or not 0 < level < 1:
        raise ValueError(f"n_boot={n_boot} must be >= 1 and level={level} in (0, 1)")
    checked, default_c_mid = _checked(curves, min_compute)
    bounds.setdefault("c_mid_bounds", default_c_mid)
    kwargs = dict(r0=r0, min_compute=min_compute, **bounds)
    labels = tuple(checked)
    per_seed = tuple(fit_lib.fit_sigmoid(*checked[k], method=method, **kwargs) for k in labels)
    pooled = fit_lib.fit_sigmoid(*_pool(checked, labels), method=method, **kwargs)
    rng = np.random.default_rng(seed)
    draws = [tuple(sorted(rng.integers(0, len(labels), len(labels)))) for _ in range(n_boot)]
    cache = {}
    for d in draws:
        if d not in cache:
            points = _pool(checked, [labels[i] for i in d])
            cache[d] = _values(fit_lib.fit_sigmoid(*points, method="lsq", **kwargs))
    boot = np.array([cache[d] for d in draws])  # [n_boot, 3], resamples weighted as drawn.
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [tail, 1.0 - tail], axis=0)
    values = np.array([_values(f) for f in per_seed])  # [seeds, 3]
    names = {"A": "A", "B": "B", "log10_C_mid": "C_mid"}
    params = {}
    fits = [*zip(labels, per_seed), ("pooled", pooled)]
    for j, name in enumerate(PARAMS):
        prefix = names[name] + "="
        flagged = tuple(k for k, f in fits if any(b.startswith(prefix) for b in f.at_bounds))
        params[name] = ParamSummary(
            name=name,
            pooled=_values(pooled)[j],
            per_seed=tuple(float(v) for v in values[:, j]),
            mean=float(values[:, j].mean()),
            sd=float(values[:, j].std(ddof=1)),
            interval=(float(lo[j]), float(hi[j])),
            on_bound=flagged,
        )
    return SeedFits(labels, per_seed, pooled, params, len(cache), level)


def format_seed_table(fits: SeedFits) -> str:
    """A Markdown table: one row per seed and the pooled fit (A, B, C_mid, R2, on a bound),
    then one row per parameter: mean +- sd over seeds and the bootstrap-over-seeds interval."""
    lines = ["| fit | A | B | C_mid | R2 | on a bound |", "| --- | --- | --- | --- | --- | --- |"]
    for label, f in [*zip(fits.seeds, fits.per_seed), ("pooled", fits.pooled)]:
        lines.append(
            f"| {label} | {f.A:.3f} | {f.B:.3f} | {f.C_mid:.3g} | {f.r2:.3f} | "
            f"{', '.join(f.at_bounds) or '-'} |"
        )
    pct = f"{100 * fits.level:g}%"
    lines += ["", f"| parameter | pooled | mean +- sd over seeds | {pct} over seeds |"]
    lines.append("| --- | --- | --- | --- |")
    for p in fits.params.values():
        lines.append(
            f"| {p.name} | {p.pooled:.3f} | {p.mean:.3f} +- {p.sd:.3f} | "
            f"[{p.interval[0]:.3f}, {p.interval[1]:.3f}] |"
        )
    return "\n".join(lines)
