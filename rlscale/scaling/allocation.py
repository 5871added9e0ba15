"""Compute-optimal allocation of RL compute (the IsoCompute playbook): the grid of budget splits
C = n x B_p x M and its analysis (n* per budget, n*(C), record points), on plain numbers.

Letters: C the budget in rollouts, n rollouts per prompt, B_p prompts per batch, M steps, tau the
reuse factor, n* the compute-optimal n.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from rlscale.scaling import fit as fit_lib


@dataclasses.dataclass(frozen=True)
class Cell:
    """One split of a budget: `budget = rollouts * prompts * steps`, all in rollouts.

    Attributes:
      budget: C, rollouts sampled over the whole run.
      rollouts: n, rollouts per prompt (`batch.group_size`).
      prompts: B_p, prompts per batch (`batch.prompts`).
      steps: M = C / (n B_p), optimizer steps (`steps`).
      reuse: tau, how many times the training prompts are reused.
      prompt_pool: `B_p M / tau` distinct training prompts (`batch.prompt_pool`); 0 when
        `tau == 1`, meaning no restriction: every training prompt (reuse is then 1 only if
        the task has at least `B_p M` training problems).
    """

    budget: int
    rollouts: int
    prompts: int
    steps: int
    reuse: int
    prompt_pool: int


def _positive_ints(name: str, values) -> list[int]:
    """`values` as a list of distinct ints >= 1.

    Raises:
      ValueError: naming `name` and the first bad value (not an integer, < 1, repeated), or
        an empty list.
    """
    values = list(values)
    if not values:
        raise ValueError(f"{name} is empty: give at least one positive integer")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name}: {v!r} is not an integer")
        if v < 1:
            raise ValueError(f"{name}: {v!r} is not positive")
        if int(v) in out:
            raise ValueError(f"{name}: {v!r} appears twice")
        out.append(int(v))
    return out


def iso_cells(
    budgets: Sequence[int],
    rollouts: Sequence[int],
    prompts: Sequence[int],
    *,
    reuse: Sequence[int] = (1,),
    min_steps: int = 1,
) -> list[Cell]:
    """Every (C, n, B_p, tau) whose split of C is exact: the IsoCompute grid.

    A combination is a cell when `M = C / (n B_p)` is an integer `>= min_steps` and, for
    `tau > 1`, `pool = B_p M / tau` is an integer `>= B_p` (at least one batch of distinct
    prompts, i.e. `M >= tau`); `tau == 1` has `prompt_pool = 0` (all prompts, see `Cell`).
    Other combinations are skipped. Cells come in input order, budget slowest and tau
    fastest.

    Args:
      budgets: C values, in rollouts.
      rollouts: n values.
      prompts: B_p values.
      reuse: tau values.
      min_steps: the fewest optimizer steps a cell may have.

    Returns:
      The cells.

    Raises:
      ValueError: a value that is not a positive integer (or repeats), naming it, or a
        budget with no cell at all.
    """
    budgets = _positive_ints("budgets", budgets)
    rollouts = _positive_ints("rollouts", rollouts)
    prompts = _positive_ints("prompts", prompts)
    reuse = _positive_ints("reuse", reuse)
    (min_steps,) = _positive_ints("min_steps", [min_steps])
    cells = []
    for C in budgets:
        mine = []
        for n in rollouts:
            for B_p in prompts:
                if C % (n * B_p) or C // (n * B_p) < min_steps:
                    continue
                M = C // (n * B_p)
                for tau in reuse:
                    if tau == 1:
                        mine.append(Cell(C, n, B_p, M, 1, 0))
                    elif (B_p * M) % tau == 0 and B_p * M // tau >= B_p:
                        mine.append(Cell(C, n, B_p, M, tau, B_p * M // tau))
        if not mine:
            raise ValueError(
                f"budget {C} has no cell: no n in {rollouts}, B_p in {prompts} and tau in "
                f"{reuse} gives M = C / (n B_p) an integer >= min_steps={min_steps} with "
                "B_p M / tau an integer >= B_p"
            )
        cells += mine
    return cells


def _mean_by_cell(cells, rewards) -> dict[Cell, float]:
    """The mean reward of each distinct cell (repeats such as seeds averaged).

    Raises:
      ValueError: mismatched lengths, no cells, or a NaN/inf reward (naming its index).
    """
    cells, r = list(cells), np.asarray(rewards, dtype=np.float64)
    if r.shape != (len(cells),):
        raise ValueError(f"{len(cells)} cells but rewards of shape {r.shape}")
    if not cells:
        raise ValueError("no cells: nothing to analyse")
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        i = bad[0]
        raise ValueError(f"reward {r[i]} of cell {i} ({cells[i]}) is not finite")
    sums = {}
    for cell, x in zip(cells, r):
        s = sums.setdefault(cell, [0.0, 0])
        s[0] += float(x)
        s[1] += 1
    return {cell: total / count for cell, (total, count) in sums.items()}


@dataclasses.dataclass(frozen=True)
class RolloutOptimum:
    """The compute-optimal n at one budget (see `optimal_rollouts`).

    Attributes:
      budget: C.
      rollouts: the distinct n measured, increasing.
      reward: the reward at each n: the best over the budget's other axes (B_p, tau).
      best_rollouts: the measured best n (the smallest on a tie).
      parabola: `(c2, c1, c0)` of the least-squares `reward = c2 x^2 + c1 x + c0` with
        `x = log2 n`, or None with fewer than 3 distinct n.
      n_star: n* = `2^(-c1 / (2 c2))`, the parabola's vertex; `best_rollouts` on fallback.
      reward_star: the parabola at n*; the measured best reward on fallback.
      fallback: why n* is the measured best and not the vertex (fewer than 3 distinct n,
        a parabola that is not concave, or a vertex outside the measured n), else None.
    """

    budget: int
    rollouts: tuple[int, ...]
    reward: tuple[float, ...]
    best_rollouts: int
    parabola: tuple[float, float, float] | None
    n_star: float
    reward_star: float
    fallback: str | None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(rollouts=list(self.rollouts), reward=list(self.reward))
        d["parabola"] = list(self.parabola) if self.parabola else None
        return d


def optimal_rollouts(cells: Sequence[Cell], rewards) -> list[RolloutOptimum]:
    """Per budget, reward against n and the compute-optimal n*.

    Equal cells (repeats, e.g. seeds) are averaged first; then at each budget C the reward
    at n is the best over that budget's cells with n (over B_p and tau). n* is the vertex of
    the least-squares parabola `reward = c2 x^2 + c1 x + c0` in `x = log2 n`,
    `n* = 2^(-c1 / (2 c2))`, when there are >= 3 distinct n, `c2 < 0` (concave) and
    `min n <= n* <= max n`; otherwise n* is the measured best n and `fallback` says why.

    Args:
      cells: the cells measured.
      rewards: one final reward per cell.

    Returns:
      One `RolloutOptimum` per budget, by increasing budget.

    Raises:
      ValueError: mismatched lengths, no cells, or a NaN/inf reward.
    """
    means = _mean_by_cell(cells, rewards)
    out = []
    for C in sorted({c.budget for c in means}):
        best = {}
        for cell, r in means.items():
            if cell.budget == C:
                best[cell.rollouts] = max(r, best.get(cell.rollouts, -math.inf))
        n = np.array(sorted(best), dtype=np.int64)
        r = np.array([best[k] for k in n.tolist()])
        i = int(np.argmax(r))
        parabola, fallback = None, None
        n_star, r_star = float(n[i]), float(r[i])
        if n.size < 3:
            fallback = f"{n.size} distinct n; a parabola needs 3"
        else:
            x = np.log2(n)
            c2, c1, c0 = np.polyfit(x, r, 2)
            parabola = (float(c2), float(c1), float(c0))
            if not c2 < 0:
                fallback = f"the parabola in log2 n is not concave (c2={c2:.3g})"
            else:
                x_star = -c1 / (2 * c2)
                if not x[0] <= x_star <= x[-1]:
                    with np.errstate(over="ignore"):  # A near-linear fit's vertex is far.
                        vertex = np.exp2(x_star)
                    fallback = f"the vertex n={vertex:.3g} is outside [{n[0]}, {n[-1]}]"
                else:
                    n_star, r_star = float(2**x_star), float(np.polyval(parabola, x_star))
        out.append(
            RolloutOptimum(
                budget=C,
                rollouts=tuple(n.tolist()),
                reward=tuple(r.tolist()),
                best_rollouts=int(n[i]),
                parabola=parabola,
                n_star=n_star,
                reward_star=r_star,
                fallback=fallback,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class RolloutScaling:
    """The power law of n*(C) (see `fit_optimal_rollouts`).

    Attributes:
      a, b: `log2 n* = a + b log2 C`, least squares.
      budgets, n_star: the points fitted, by increasing budget.
      growth: per interval between consecutive budgets, the growth per doubling of C,
        `(log2 n*_{i+1} - log2 n*_i) / (log2 C_{i+1} - log2 C_i)` (doublings of n*).
      grows: `b > 0`.
      saturates: `growth[-1] < growth[0] / 2` while `growth[0] > 0`; None with fewer than
        3 budgets (one interval cannot both grow and stop).
    """

    a: float
    b: float
    budgets: tuple[float, ...]
    n_star: tuple[float, ...]
    growth: tuple[float, ...]
    grows: bool
    saturates: bool | None

    def predict(self, budget) -> np.ndarray:
        """The fitted `n*(C) = 2^a C^b`."""
        return 2.0 ** (self.a + self.b * np.log2(np.asarray(budget, dtype=np.float64)))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(budgets=list(self.budgets), n_star=list(self.n_star), growth=list(self.growth))
        return d


def fit_optimal_rollouts(budgets, n_star) -> RolloutScaling:
    """Fits `log2 n* = a + b log2 C` by least squares and measures its growth per doubling.

    Definitions (points sorted by C): `growth_i = (log2 n*_{i+1} - log2 n*_i) /
    (log2 C_{i+1} - log2 C_i)`, the doublings of n* per doubling of C between consecutive
    budgets; `grows = b > 0`; `saturates = growth_last < growth_first / 2 and growth_first
    > 0`, None with fewer than 3 budgets.

    Args:
      budgets: C values, > 0 and distinct.
      n_star: n* at each budget, > 0.

    Returns:
      A `RolloutScaling`.

    Raises:
      ValueError: mismatched lengths, fewer than 2 budgets, a repeated budget, or a value
        that is not finite and > 0 (naming it).
    """
    C = np.asarray(budgets, dtype=np.float64)
    n = np.asarray(n_star, dtype=np.float64)
    if C.ndim != 1 or C.shape != n.shape:
        raise ValueError(f"budgets and n_star must be 1-D of one length; got {C.shape}, {n.shape}")
    if C.size < 2:
        raise ValueError(f"{C.size} budget(s): the n*(C) power law needs at least 2")
    for name, a in (("budget", C), ("n_star", n)):
        bad = np.flatnonzero(~(np.isfinite(a) & (a > 0)))
        if bad.size:
            raise ValueError(f"{name} {a[bad[0]]} at index {bad[0]} is not finite and > 0")
    order = np.argsort(C, kind="stable")
    C, n = C[order], n[order]
    if np.any(np.diff(C) == 0):
        raise ValueError(f"budget {C[np.flatnonzero(np.diff(C) == 0)[0]]:g} appears twice")
    x, y = np.log2(C), np.log2(n)
    b, a = np.polyfit(x, y, 1)
    growth = np.diff(y) / np.diff(x)
    saturates = None
    if C.size >= 3:
        saturates = bool(growth[0] > 0 and growth[-1] < growth[0] / 2)
    return RolloutScaling(
        a=float(a),
        b=float(b),
        budgets=tuple(C.tolist()),
        n_star=tuple(n.tolist()),
        growth=tuple(growth.tolist()),
        grows=bool(b > 0),
        saturates=saturates,
    )


@dataclasses.dataclass(frozen=True)
class RolloutBootstrap:
    """n* and the n*(C) exponent with intervals from resampling each cell's repeats (see
    `bootstrap_optimal_rollouts`).

    Attributes:
      budgets: C, increasing.
      n_star_interval: per budget, the percentile interval of n*.
      b_interval: the percentile interval of b in `log2 n* = a + b log2 C`.
      fallback_frac: per budget, the share of resamples whose n* is a measured n rather than
        a parabola's vertex (`RolloutOptimum.fallback`).
      n_boot, level: resamples drawn, the intervals' coverage.
    """

    budgets: tuple[int, ...]
    n_star_interval: tuple[tuple[float, float], ...]
    b_interval: tuple[float, float]
    fallback_frac: tuple[float, ...]
    n_boot: int
    level: float

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(budgets=list(self.budgets), fallback_frac=list(self.fallback_frac))
        d["n_star_interval"] = [list(x) for x in self.n_star_interval]
        d["b_interval"] = list(self.b_interval)
        return d


def bootstrap_optimal_rollouts(
    cells: Sequence[Cell], rewards, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> RolloutBootstrap:
    """Intervals on n* per budget and on the exponent b of n*(C) from the cells' repeats.

    Each resample draws, within every distinct cell, as many of its repeats (seeds) as it
    has, with replacement, then reruns `optimal_rollouts` and `fit_optimal_rollouts` on the
    cells' means; the intervals are the resamples' percentiles. So the error bar is the
    seed-to-seed noise of the cells' final rewards propagated through the parabolas and the
    line, not the fit's residuals.

    Raises:
      ValueError: a cell with fewer than 2 repeats (named), fewer than 2 budgets, `n_boot`
        < 1 or `level` outside (0, 1), or what `optimal_rollouts` raises.
    """
    if n_boot < 1 or not 0 < level < 1:
        raise ValueError(f"n_boot={n_boot} must be >= 1 and level={level} in (0, 1)")
    _mean_by_cell(cells, rewards)  # Checks lengths and finiteness.
    groups: dict[Cell, list[float]] = {}
    for cell, r in zip(cells, np.asarray(rewards, dtype=np.float64)):
        groups.setdefault(cell, []).append(float(r))
    for cell, values in groups.items():
        if len(values) < 2:
            raise ValueError(f"cell {cell} has {len(values)} repeat: a bootstrap needs 2 seeds")
    budgets = sorted({c.budget for c in groups})
    if len(budgets) < 2:
        raise ValueError(f"{len(budgets)} budget(s): the n*(C) exponent needs at least 2")
    rng = np.random.default_rng(seed)
    keys = list(groups)
    n_star, b, fallback = np.empty((n_boot, len(budgets))), np.empty(n_boot), np.zeros(len(budgets))
    for i in range(n_boot):
        means = [float(rng.choice(groups[k], len(groups[k])).mean()) for k in keys]
        optima = optimal_rollouts(keys, means)
        n_star[i] = [o.n_star for o in optima]
        fallback += [o.fallback is not None for o in optima]
        b[i] = fit_optimal_rollouts(budgets, n_star[i]).b
    q = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    return RolloutBootstrap(
        budgets=tuple(budgets),
        n_star_interval=tuple(
            tuple(np.percentile(n_star[:, j], q).tolist()) for j in range(len(budgets))
        ),
        b_interval=tuple(np.percentile(b, q).tolist()),
        fallback_frac=tuple((fallback / n_boot).tolist()),
        n_boot=n_boot,
        level=level,
    )


def format_bootstrap(boot: RolloutBootstrap) -> str:
    """The intervals of `bootstrap_optimal_rollouts`, one line per budget and one for b."""
    pct = f"{100 * boot.level:g}%"
    lines = [
        f"n* at C = {C:g}: {pct} [{lo:.3g}, {hi:.3g}] ({100 * f:.0f}% of resamples fall back to a "
        "measured n)"
        for C, (lo, hi), f in zip(boot.budgets, boot.n_star_interval, boot.fallback_frac)
    ]
    lo, hi = boot.b_interval
    return "\n".join(lines + [f"b: {pct} [{lo:.3g}, {hi:.3g}] ({boot.n_boot} seed resamples)"])


class RecordPoint(NamedTuple):
    """A point of the best-so-far frontier: its compute, reward and the index of its cell."""

    compute: float
    reward: float
    cell: int


def record_points(points, *, bin_width: float, origin: float = 0.0) -> list[RecordPoint]:
    """The IsoCompute best-so-far frontier over every cell's evaluations.

    The points `(compute, reward, cell)` of all cells are pooled and sorted by compute (at
    equal compute the higher reward first, so a point dominated at its own compute is never
    a record), then thinned by `record_breaking`: a point is kept when it is the first
    to enter a reward bin `[origin + k w, origin + (k + 1) w)` above every bin reached so
    far.

    Args:
      points: `(compute, reward, cell)` triples; compute >= 0, `cell` an index.
      bin_width: the reward bin width w, > 0.
      origin: where the bins start.

    Returns:
      The kept points, by increasing compute.

    Raises:
      ValueError: no points, NaN/inf, or `bin_width <= 0`.
    """
    pts = sorted(((float(c), float(r), int(i)) for c, r, i in points), key=lambda p: (p[0], -p[1]))
    if not pts:
        raise ValueError("no points: nothing to find records in")
    compute, reward, _ = zip(*pts)
    if min(compute) < 0:
        raise ValueError(f"negative compute {min(compute):g}")
    kept = record_breaking(compute, reward, bin_width=bin_width, origin=origin)
    return [RecordPoint(*pts[k]) for k in kept.tolist()]


def format_allocation_table(
    optima: Sequence[RolloutOptimum], scaling: RolloutScaling | None = None
) -> str:
    """Markdown: one row per budget with the reward at each n, the measured best n and n*
    (`(measured)` on fallback), then a line for the n*(C) fit when given."""
    ns = sorted({k for o in optima for k in o.rollouts})
    head = ["C"] + [f"n={k}" for k in ns] + ["best n", "n*"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for o in optima:
        at = dict(zip(o.rollouts, o.reward))
        row = [str(o.budget)] + [f"{at[k]:.3f}" if k in at else "-" for k in ns]
        row += [str(o.best_rollouts), f"{o.n_star:.3g}" + (" (measured)" if o.fallback else "")]
        lines.append("| " + " | ".join(row) + " |")
    if scaling is not None:
        sat = {None: "n/a (< 3 budgets)", True: "yes", False: "no"}[scaling.saturates]
        growth = ", ".join(f"{g:.2f}" for g in scaling.growth)
        lines.append("")
        lines.append(
            f"n*(C): log2 n* = {scaling.a:.3f} + {scaling.b:.3f} log2 C; growth per doubling "
            f"of C: {growth}; grows: {'yes' if scaling.grows else 'no'}; saturates: {sat}"
        )
    return "\n".join(lines)


def format_reuse_table(cells: Sequence[Cell], rewards) -> str:
    """Markdown: the final reward (repeats averaged) per (C, n, B_p, M) against tau."""
    means = _mean_by_cell(cells, rewards)
    taus = sorted({c.reuse for c in means})
    head = ["C", "n", "B_p", "M"] + [f"tau={t}" for t in taus]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    rows = sorted({(c.budget, c.rollouts, c.prompts, c.steps) for c in means})
    by_key = {(c.budget, c.rollouts, c.prompts, c.steps, c.reuse): r for c, r in means.items()}
    for key in rows:
        vals = [by_key.get((*key, t)) for t in taus]
        row = [str(k) for k in key] + ["-" if v is None else f"{v:.3f}" for v in vals]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def record_breaking(compute, reward, *, bin_width: float, origin: float = 0.0) -> np.ndarray:
    """Indices of IsoCompute-style record-breaking points.

    The reward axis is cut into bins `[origin + k w, origin + (k + 1) w)`; walking in compute
    order, a point is kept when it is the first to enter a bin above every bin reached so
    far (the first point always is). The kept points trace the best-so-far frontier at a
    resolution of `bin_width`, thinning a noisy curve before a fit (the ScaleRL paper's
    IsoCompute plots keep such record points).

    Args:
      compute: 1-D compute, non-decreasing.
      reward: 1-D rewards.
      bin_width: the reward bin width, > 0.
      origin: where the bins start.

    Returns:
      The kept indices, increasing (int array).

    Raises:
      ValueError: for NaN/inf, decreasing compute or `bin_width <= 0`.
    """
    if not bin_width > 0:
        raise ValueError(f"bin_width={bin_width} must be > 0")
    _, r = fit_lib.check_curve(compute, reward, positive=False)
    # Rounding first keeps values on a bin edge (0.3 / 0.1 = 2.9999...) in their bin.
    bins = np.floor(np.round((r - origin) / bin_width, 9)).astype(np.int64)
    kept, best = [], None
    for i, b in enumerate(bins):
        if best is None or b > best:
            kept.append(i)
            best = b
    return np.asarray(kept, dtype=np.int64)
