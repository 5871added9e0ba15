"""Tan et al.'s RL power law across model sizes: the law, its joint fit, and its intra- and
inter-model predictions, on plain arrays of (model size N, compute or data X, reward). The law and
the fit: docs/scaling.md.
"""

import dataclasses
import math

import numpy as np

from rlscale.scaling import baselines as baselines_lib
from rlscale.scaling import fit as fit_lib

# The authors' bounds (Tan et al. 2025): k_max in [0, 2], |E0_max| <= 10, and N0, N1 within
# the fitted sizes' range (`size_range=None`): outside it only k_max / N0 (all sizes far below
# N0) or k_max alone (all far above) is identified, and an unbounded fit wanders there.
K_MAX_BOUNDS = (0.0, 2.0)
E0_MAX_BOUNDS = (-10.0, 10.0)
_GRID = 121  # Starting-value grid points per axis of (log N0, log N1).
_STARTS = 8  # At most this many grid minima are refined.


def log10_loss(size, compute, k_max: float, N0: float, E0_max: float, N1: float) -> np.ndarray:
    """The law `log10 L = -k(N) log10 X + E0(N)` (Tan et al. 2025), broadcast over inputs.

    `k(N) = k_max N / (N + N0)`, `E0(N) = E0_max N / (N + N1)`.

    Args:
      size: model sizes N (parameters), > 0; broadcasts against `compute`.
      compute: compute or data X, > 0.
      k_max, N0, E0_max, N1: the law's parameters (N0, N1 > 0).

    Returns:
      `log10 L` at every (N, X).
    """
    n = np.asarray(size, dtype=np.float64)
    x = np.asarray(compute, dtype=np.float64)
    return -k_max * n / (n + N0) * np.log10(x) + E0_max * n / (n + N1)


@dataclasses.dataclass(frozen=True)
class TanFit:
    """The law fitted jointly over model sizes (see `log10_loss`).

    Attributes:
      k_max, N0, E0_max, N1: the parameters.
      r2: `1 - SSE / SST` in log10 L over the fitted points.
      n_points: points fitted.
      sizes: the fitted model sizes, ascending.
      at_bounds: the parameters on a bound of the fit (`"k_max=upper"`, `"N1=lower"`...):
        the data did not determine them.
    """

    k_max: float
    N0: float
    E0_max: float
    N1: float
    r2: float
    n_points: int
    sizes: tuple[float, ...]
    at_bounds: tuple[str, ...] = ()

    def k(self, size) -> np.ndarray:
        """Learning efficiency `k(N) = k_max N / (N + N0)`."""
        n = np.asarray(size, dtype=np.float64)
        return self.k_max * n / (n + self.N0)

    def E0(self, size) -> np.ndarray:
        """Intercept `E0(N) = E0_max N / (N + N1)` (log10 L at X = 1)."""
        n = np.asarray(size, dtype=np.float64)
        return self.E0_max * n / (n + self.N1)

    def log10_loss(self, size, compute) -> np.ndarray:
        return log10_loss(size, compute, self.k_max, self.N0, self.E0_max, self.N1)

    def predict(self, size, compute) -> np.ndarray:
        """Predicted reward `1 - 10^(log10 L)` at every (N, X)."""
        return 1.0 - 10.0 ** self.log10_loss(size, compute)

    def as_dict(self) -> dict:
        """`k_max, N0, E0_max, N1, r2, n_points, at_bounds` (the fits.json fields)."""
        keys = ("k_max", "N0", "E0_max", "N1", "r2", "n_points")
        return {**{k: getattr(self, k) for k in keys}, "at_bounds": list(self.at_bounds)}


@dataclasses.dataclass(frozen=True)
class SizeExtrapolation:
    """The law fitted on every size but `holdout_size`, scored on that size's points.

    Attributes:
      fit: the law fitted on the other sizes.
      holdout_size: the held-out model size.
      mae, max_abs_err: mean and largest `|fit.predict(N, X_i) - reward_i|` on its points
        (reward units).
      n_points: its points.
    """

    fit: TanFit
    holdout_size: float
    mae: float
    max_abs_err: float
    n_points: int

    def as_dict(self) -> dict:
        return {
            "holdout_size": self.holdout_size,
            "mae": self.mae,
            "max_abs_err": self.max_abs_err,
            "n_points": self.n_points,
        }


@dataclasses.dataclass(frozen=True)
class RunPrediction:
    """One size's line `log10 L = -k log10 X + E0` fitted up to `fit_until`, scored after it.

    Attributes:
      k, E0: the fitted line.
      r2: its R^2 in log L on the fitted points.
      fit_n_points: points fitted.
      fit_until: the compute cut.
      mae, max_abs_err: mean and largest reward error on the later points.
      n_points: the later points.
      baselines: the flat and log-linear baselines' errors on them
        (`baselines.baseline_errors`, fitted on the same points).
    """

    k: float
    E0: float
    r2: float
    fit_n_points: int
    fit_until: float
    mae: float
    max_abs_err: float
    n_points: int
    baselines: baselines_lib.BaselineErrors

    def predict(self, compute) -> np.ndarray:
        """Predicted reward `1 - 10^(E0) X^(-k)`."""
        x = np.asarray(compute, dtype=np.float64)
        return 1.0 - 10.0 ** (self.E0 - self.k * np.log10(x))


# ==========================================================================================
# Input checks.
# ==========================================================================================


def check_points(size, compute, reward) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validates points `(N, X, reward)` and returns them as float64 arrays.

    Raises:
      ValueError: mismatched shapes; NaN/inf, N <= 0, X <= 0, or a reward outside [0, 1)
        (L = 1 - reward must be in (0, 1] for its log); the message names the first
        offending row and its values.
    """
    n, x, r = (np.asarray(a, dtype=np.float64) for a in (size, compute, reward))
    if n.ndim != 1 or not n.shape == x.shape == r.shape:
        raise ValueError(
            f"size, compute and reward must be 1-D and of the same length; got shapes "
            f"{n.shape}, {x.shape} and {r.shape}"
        )

    def row(i):
        return f"row {i} (size={n[i]:g}, compute={x[i]:g}, reward={r[i]:g})"

    for name, a in (("size", n), ("compute", x), ("reward", r)):
        bad = np.flatnonzero(~np.isfinite(a))
        if bad.size:
            raise ValueError(f"NaN or inf {name} at {row(bad[0])} of {a.size}; drop or repair it")
    for name, a, why in (
        ("size", n, "a model size is a parameter count"),
        ("compute", x, "the law takes log10 X (leave a step-0 evaluation out)"),
    ):
        bad = np.flatnonzero(a <= 0)
        if bad.size:
            raise ValueError(f"non-positive {name} at {row(bad[0])}: {why}")
    bad = np.flatnonzero((r < 0) | (r >= 1))
    if bad.size:
        raise ValueError(
            f"reward outside [0, 1) at {row(bad[0])}: the law takes log10(1 - reward), so a "
            "reward must be a pass rate below 1 (drop a perfect score, or evaluate on more "
            "problems)"
        )
    return n, x, r


def _check_sizes(n, x):
    """The joint fit needs two sizes, two compute values per size and connected ranges."""
    sizes = np.unique(n)
    if sizes.size == 0:
        raise ValueError("no points: nothing to fit")
    if sizes.size < 2:
        raise ValueError(
            f"one model size only (N={sizes[0]:g}): the joint fit over sizes needs at least "
            "2 (for one size, fit its line with predict_within_run)"
        )
    for s in sizes:
        if np.unique(x[n == s]).size < 2:
            raise ValueError(
                f"size N={s:g} has a single compute value {x[n == s][0]:g}: its slope k(N) "
                "is undetermined; it needs points at 2 or more compute values"
            )
    if n.size <= 4:
        raise ValueError(f"too few points: {n.size}; the law's 4 parameters need at least 5")
    # Intervals on a line are connected through overlaps iff their union is one interval.
    ranges = sorted((x[n == s].min(), x[n == s].max(), s) for s in sizes)
    reach, group = ranges[0][1], [ranges[0][2]]
    for lo, hi, s in ranges[1:]:
        if lo > reach:
            rest = [r[2] for r in ranges if r[0] >= lo]
            raise ValueError(
                f"sizes without compute overlap: {_names(group)} reach compute {reach:g}, "
                f"{_names(rest)} start at {lo:g}; the joint fit needs overlapping compute "
                "ranges, or a gap in loss between sizes is indistinguishable from each "
                "line's extrapolation"
            )
        reach, group = max(reach, hi), group + [s]


def _names(sizes):
    return "N=" + ", ".join(f"{s:g}" for s in sizes)


# ==========================================================================================
# The joint fit.
# ==========================================================================================


def _starts(n, u, y, lo, hi):
    """Starting values: a grid over (log N0, log N1) with (k_max, E0_max) solved exactly at
    each cell (the law is linear in them); the cells that are local minima of the squared
    error, best first (at most `_STARTS`). The error has more than one basin (measured: on a
    noise-free curve over the seven Qwen2.5 sizes, a second minimum with an RMS error of
    0.008 in log10 L, which a 41-point grid's best cell falls into), so every basin the
    grid resolves is refined, not only the lowest cell."""
    axis = np.linspace(lo, hi, _GRID)
    s = n / (n + np.exp(axis)[:, None])  # [G, points]: N / (N + N0) for every N0 on the axis.
    c1, c2 = -s * u, s  # Row i: k_max's column at N0 = exp(axis[i]), E0_max's at N1 = same.
    a11, a22, a12 = np.sum(c1**2, 1)[:, None], np.sum(c2**2, 1)[None, :], c1 @ c2.T
    b1, b2 = (c1 @ y)[:, None], (c2 @ y)[None, :]
    det = a11 * a22 - a12**2
    with np.errstate(divide="ignore", invalid="ignore"):
        k = (a22 * b1 - a12 * b2) / det
        e = (a11 * b2 - a12 * b1) / det
        sse = y @ y - 2 * (k * b1 + e * b2) + k**2 * a11 + 2 * k * e * a12 + e**2 * a22
    sse = np.where(det > 0, sse, np.inf)
    padded = np.pad(sse, 1, constant_values=np.inf)
    neighbours = [
        padded[1 + di : 1 + di + _GRID, 1 + dj : 1 + dj + _GRID]
        for di in (-1, 0, 1)
        for dj in (-1, 0, 1)
        if di or dj
    ]
    minima = np.argwhere(np.isfinite(sse) & (sse <= np.min(neighbours, axis=0)))
    minima = sorted(minima, key=lambda ij: sse[tuple(ij)])[:_STARTS]
    return [np.array([k[i, j], axis[i], e[i, j], axis[j]]) for i, j in minima]


def _least_squares(n, u, y, x0, lower, upper):
    """Bounded least squares on (k_max, log N0, E0_max, log N1); returns (params, sse)."""

    def parts(p):
        k_max, a, e0_max, b = p
        return k_max, n / (n + math.exp(a)), e0_max, n / (n + math.exp(b))

    def residual(p):
        k_max, s0, e0_max, s1 = parts(p)
        return -k_max * s0 * u + e0_max * s1 - y

    def jacobian(p):
        k_max, s0, e0_max, s1 = parts(p)
        # d s / d log N0 = -s (1 - s).
        return np.stack([-s0 * u, k_max * s0 * (1 - s0) * u, s1, -e0_max * s1 * (1 - s1)], -1)

    return fit_lib.solve_least_squares(residual, jacobian, x0, lower, upper)


def _param_bounds(n, k_max_bounds, e0_max_bounds, size_range):
    """(lower, upper) over (k_max, log N0, E0_max, log N1), checked.

    Raises:
      ValueError: a bound pair that is not `low < high` (`size_range` also `low > 0`),
        naming it.
    """
    size_range = size_range or (float(n.min()), float(n.max()))
    pairs = {"k_max_bounds": k_max_bounds, "e0_max_bounds": e0_max_bounds}
    for name, (lo, hi) in {**pairs, "size_range": size_range}.items():
        if not lo < hi or (name == "size_range" and lo <= 0):
            raise ValueError(f"{name}={(lo, hi)} must satisfy low < high (sizes > 0)")
    a, b = math.log(size_range[0]), math.log(size_range[1])
    lower = np.array([k_max_bounds[0], a, e0_max_bounds[0], a])
    upper = np.array([k_max_bounds[1], b, e0_max_bounds[1], b])
    return lower, upper


def fit_tan(
    size,
    compute,
    reward,
    *,
    k_max_bounds: tuple[float, float] = K_MAX_BOUNDS,
    e0_max_bounds: tuple[float, float] = E0_MAX_BOUNDS,
    size_range: tuple[float, float] | None = None,
) -> TanFit:
    """Fits Tan et al.'s law jointly over model sizes by least squares in log10 L.

    `log10 L = -k_max N / (N + N0) log10 X + E0_max N / (N + N1)`, `L = 1 - reward` (Tan et
    al. 2025, arXiv 2509.25300). The law is linear in (k_max, E0_max) for fixed (N0, N1), so
    the starting values come from a grid over (log N0, log N1), each cell solved exactly for
    (k_max, E0_max); scipy's bounded trust-region least squares then refines all four from
    every local minimum of the grid (the error has more than one basin) and the lowest
    error wins. Bounded as the law's authors bound it: k_max in [0, 2], |E0_max| <= 10,
    N0 and N1 (fitted as logs) within the fitted sizes' range; a parameter that ends on a
    bound is named in `at_bounds`.

    Args:
      size: model size N of each point (parameters), > 0.
      compute: compute or data X of each point, > 0.
      reward: pass rate of each point, in [0, 1).
      k_max_bounds, e0_max_bounds: (low, high) of k_max and E0_max.
      size_range: (low, high) of N0 and N1; None: the smallest and largest fitted size.

    Returns:
      A `TanFit`.

    Raises:
      ValueError: degenerate input (see `check_points`), one size only, a size with a
        single compute value, fewer than 5 points, a reward equal at every point, sizes
        whose compute ranges do not overlap (naming them) or inconsistent bounds.
    """
    n, x, r = check_points(size, compute, reward)
    _check_sizes(n, x)
    lower, upper = _param_bounds(n, k_max_bounds, e0_max_bounds, size_range)
    u, y = np.log10(x), np.log10(1.0 - r)
    sst = float(np.sum((y - y.mean()) ** 2))
    if sst == 0:
        raise ValueError(f"flat: the reward is {r[0]:g} at all {r.size} points; nothing to fit")
    starts = _starts(n, u, y, lower[1], upper[1])
    fits = [_least_squares(n, u, y, x0, lower, upper) for x0 in starts]
    params, sse = min(fits, key=lambda f: f[1])
    k_max, a, e0_max, b = params
    names = ("k_max", "N0", "E0_max", "N1")
    on = [(k, fit_lib.on_bound(v, lo, hi)) for k, v, lo, hi in zip(names, params, lower, upper)]
    return TanFit(
        k_max=float(k_max),
        N0=math.exp(a),
        E0_max=float(e0_max),
        N1=math.exp(b),
        r2=1.0 - sse / sst,
        n_points=int(n.size),
        sizes=tuple(float(s) for s in np.unique(n)),
        at_bounds=tuple(f"{k}={side}" for k, side in on if side),
    )


# ==========================================================================================
# Predictions: across sizes and within a run.
# ==========================================================================================


def extrapolate_to_size(
    size, compute, reward, *, holdout_size: float, **bounds
) -> SizeExtrapolation:
    """Fits the law on every size but `holdout_size` and scores it on that size.

    Tan et al.'s inter-model use: from smaller models' curves, predict a larger model's.
    `mae = mean |R_fit(N_h, X_i) - R_i|`, `max_abs_err = max |...|` over the held-out
    size's points, in reward (pass@1 = 1 - L) units.

    `bounds`: `fit_tan`'s keyword arguments; the default `size_range` is the fitted sizes'
    (without the held-out one).

    Raises:
      ValueError: degenerate input (as `fit_tan`, on the remaining sizes) or a
        `holdout_size` that is not among the sizes (naming those there are).
    """
    n, x, r = check_points(size, compute, reward)
    held = np.isclose(n, holdout_size, rtol=1e-9, atol=0.0)
    if not held.any():
        raise ValueError(
            f"holdout size {holdout_size:.12g} is not among the model sizes "
            f"{', '.join(f'{s:.12g}' for s in np.unique(n))}"
        )
    try:
        fit = fit_tan(n[~held], x[~held], r[~held], **bounds)
    except ValueError as e:
        raise ValueError(f"fitting the sizes other than {holdout_size:g}: {e}") from None
    err = np.abs(fit.predict(n[held], x[held]) - r[held])
    return SizeExtrapolation(
        fit=fit,
        holdout_size=float(n[held][0]),
        mae=float(err.mean()),
        max_abs_err=float(err.max()),
        n_points=int(held.sum()),
    )


def predict_within_run(compute, reward, *, fit_until_frac: float) -> RunPrediction:
    """Fits one run's first fraction of compute with `log10 L = -k log10 X + E0`; scores
    the rest.

    Tan et al.'s intra-model use: with one size, k(N) and E0(N) are two numbers, so the law
    is a line in (log10 X, log10 L), fitted by `fit.fit_power_law` (the slope is the same in
    any log base; `E0 = E / ln 10`). The fit uses the points with compute <= `fit_until_frac`
    times the largest; `mae` and `max_abs_err` are reward errors on the later points, beside
    the flat and log-linear baselines' (`baselines`).

    Args:
      compute: 1-D compute (or data) in the order it was spent, > 0.
      reward: pass rates in [0, 1).
      fit_until_frac: the cut as a fraction of the largest compute, in (0, 1).

    Raises:
      ValueError: degenerate input (see `fit.check_curve`), a fraction outside (0, 1) or a
        prefix that `fit.fit_power_law` refuses (too few points, a flat reward, a reward
        outside [0, 1)), naming why.
    """
    if not 0 < fit_until_frac < 1:
        raise ValueError(f"fit_until_frac={fit_until_frac} must be in (0, 1)")
    c, r = fit_lib.check_curve(compute, reward)
    if c.size == 0:
        raise ValueError("no points: nothing to fit")
    fit_until = fit_until_frac * float(c[-1])
    later = c > fit_until  # Never empty: the last point is past any fraction of itself.
    try:
        line = fit_lib.fit_power_law(c[~later], r[~later])
    except ValueError as e:
        raise ValueError(f"fitting compute <= fit_until={fit_until:g}: {e}") from None
    err = np.abs(line.predict(c[later]) - r[later])
    return RunPrediction(
        k=line.k,
        E0=line.E / math.log(10.0),
        r2=line.r2,
        fit_n_points=line.n_points,
        fit_until=fit_until,
        mae=float(err.mean()),
        max_abs_err=float(err.max()),
        n_points=int(later.sum()),
        baselines=baselines_lib.baseline_errors(c[~later], r[~later], c[later], r[later]),
    )
