"""Plots of fitted compute-reward curves (PNG, matplotlib's Agg canvas, no pyplot state).

Owns the one figure style for scaling fits: each run's points on a log-compute axis, its
fitted ScaleRL sigmoid (Khatri et al. 2025, arXiv 2510.13786), the asymptote A as a dashed
line and, when the fit stopped at a cut, the cut as a dotted vertical line with the
held-out points drawn hollow. Tan et al.'s law over model sizes (`plot_tan`) is drawn
log-log, `1 - reward` against X, where it is a straight line per size; a held-out size's
points are hollow there too. The IsoCompute allocation study (`plot_iso_compute`) draws
reward against rollouts per prompt per budget and the compute-optimal n*(C).
"""

import numpy as np


def plot_fits(results, path: str, *, title: str | None = None) -> str:
    """Draws one or more fitted runs on one figure and saves it as a PNG.

    Per run (one colour each): the fitted points (filled), points below the fit's
    `min_compute` (faint), points after the extrapolation cut (hollow), the curve
    `R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)` over the data and one doubling beyond,
    the asymptote `A` (dashed) and the cut (dotted).

    Args:
      results: `runs.RunFit`s that have a fit.
      path: the PNG to write.
      title: the figure title (default: the y key against the x key).

    Returns:
      `path`.
    """
    import matplotlib
    import matplotlib.ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = [r for r in results if r.fit is not None]
    if not results:
        raise ValueError("nothing to plot: no run has a fit")
    fig = Figure(figsize=(10, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if len(results) <= 10:
        colors = [f"C{i}" for i in range(len(results))]
    else:  # Distinct colours for up to 20 runs, then they repeat.
        cmap = matplotlib.colormaps["tab20"]
        colors = [cmap(i % 20) for i in range(len(results))]
    for r, color in zip(results, colors):
        f, c, y = r.fit, r.curve.compute, r.curve.reward
        ext = r.extrapolation
        cut = ext.fit_until if ext else np.inf
        low, held = c < f.min_compute, c > cut
        used = ~low & ~held
        ax.plot(c[used], y[used], "o", color=color, ms=4)
        if low.any():
            ax.plot(c[low], y[low], "o", color=color, ms=4, alpha=0.3)
        if held.any():
            ax.plot(c[held], y[held], "o", color=color, ms=5, mfc="none")
        grid = np.geomspace(c.min(), 2 * c.max(), 200)
        label = f"{r.name}: A={f.A:.3f}, B={f.B:.2f}, C_mid={f.C_mid:.3g}"
        ax.plot(grid, f.predict(grid), "-", color=color, lw=1.5, label=label)
        ax.axhline(f.A, color=color, ls="--", lw=1)
        if ext:
            ax.axvline(ext.fit_until, color=color, ls=":", lw=1)
    ax.set_xscale("log")
    # Label decades only: minor-tick labels on a short log axis overlap.
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    curve = results[0].curve
    ax.set_xlabel(curve.x_key)
    ax.set_ylabel(curve.y_key)
    ax.set_title(title or f"{curve.y_key} vs {curve.x_key}: ScaleRL sigmoid fits")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_tan(
    fit,
    size,
    compute,
    reward,
    path: str,
    *,
    holdout_size: float | None = None,
    x_key: str = "compute",
    y_key: str = "reward",
) -> str:
    """Draws Tan et al.'s law over model sizes, log-log: `L = 1 - reward` against X.

    In these axes the law `log10 L = -k(N) log10 X + E0(N)` (Tan et al. 2025, arXiv
    2509.25300) is one straight line per size, of slope `-k(N)`. Per size (one colour each,
    a viridis ramp from the smallest): its points (hollow for `holdout_size`, which the fit
    did not see), and the fitted line over its compute range (dashed for the held-out size:
    a prediction).

    Args:
      fit: a `tan.TanFit`.
      size, compute, reward: the points (N, X, reward), as fitted plus any held-out size.
      path: the PNG to write.
      holdout_size: the size left out of the fit, or None.
      x_key, y_key: axis names.

    Returns:
      `path`.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n, x, r = (np.asarray(a, dtype=np.float64) for a in (size, compute, reward))
    sizes = np.unique(n)
    fig = Figure(figsize=(10, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = matplotlib.colormaps["viridis"]
    for i, s in enumerate(sizes):
        color = cmap(0.9 * i / max(sizes.size - 1, 1))
        m = n == s
        held = holdout_size is not None and np.isclose(s, holdout_size, rtol=1e-9, atol=0.0)
        ax.plot(x[m], 1 - r[m], "o", color=color, ms=4, mfc="none" if held else color)
        grid = np.geomspace(x[m].min(), x[m].max(), 100)
        label = f"N={s:.3g}: k={float(fit.k(s)):.4f}, E0={float(fit.E0(s)):.3f}"
        label += " (held out)" if held else ""
        line = 10.0 ** fit.log10_loss(s, grid)
        ax.plot(grid, line, "--" if held else "-", color=color, lw=1.5, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x_key)
    ax.set_ylabel(f"L = 1 - {y_key}")
    ax.set_title(
        f"Tan et al. law: k_max={fit.k_max:.3g}, N0={fit.N0:.3g}, E0_max={fit.E0_max:.3g}, "
        f"N1={fit.N1:.3g} (R2={fit.r2:.3f} in log L)"
    )
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_iso_compute(optima, scaling, path: str, *, budget_label: str = "C (rollouts)") -> str:
    """Draws the IsoCompute allocation study (arXiv 2603.12151): two panels.

    Left: per budget C (one colour each, a viridis ramp from the smallest), the reward at
    each n on a log2 axis, the least-squares parabola `c2 x^2 + c1 x + c0` in `x = log2 n`
    over the measured n, and n* as a star (hollow when n* fell back to the measured best n).
    Right: n* against C on log-log axes and, when fitted, the power law `n* = 2^a C^b`.

    Args:
      optima: `allocation.RolloutOptimum`s, one per budget.
      scaling: the `allocation.RolloutScaling` fitted to them, or None.
      path: the PNG to write.
      budget_label: the budget axis name.

    Returns:
      `path`.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not optima:
        raise ValueError("nothing to plot: no budget has a measured cell")
    fig = Figure(figsize=(12, 5), dpi=110)
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    cmap = matplotlib.colormaps["viridis"]
    colors = [cmap(0.9 * i / max(len(optima) - 1, 1)) for i in range(len(optima))]
    for o, color in zip(optima, colors):
        n = np.asarray(o.rollouts, dtype=np.float64)
        left.plot(n, o.reward, "o", color=color, ms=5, label=f"C={o.budget:g}: n*={o.n_star:.3g}")
        if o.parabola is not None:
            grid = np.geomspace(n.min(), n.max(), 100)
            left.plot(grid, np.polyval(o.parabola, np.log2(grid)), "-", color=color, lw=1.2)
        mfc = "none" if o.fallback else color
        left.plot([o.n_star], [o.reward_star], "*", color=color, ms=14, mfc=mfc)
        right.plot([o.budget], [o.n_star], "*", color=color, ms=12, mfc=mfc)
    left.set_xscale("log", base=2)
    left.set_xlabel("n, rollouts per prompt")
    left.set_ylabel("final reward")
    left.set_title("reward against n (star: n*; hollow: no vertex, the best measured)")
    left.grid(True, which="both", alpha=0.25)
    left.legend(fontsize=8, frameon=False)
    if scaling is not None:
        c = np.geomspace(min(scaling.budgets), max(scaling.budgets), 100)
        sat = {None: "n/a", True: "yes", False: "no"}[scaling.saturates]
        label = f"log2 n* = {scaling.a:.2f} + {scaling.b:.3f} log2 C (saturates: {sat})"
        right.plot(c, scaling.predict(c), "-", color="0.3", lw=1.2, label=label)
        right.legend(fontsize=8, frameon=False)
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set_xlabel(budget_label)
    right.set_ylabel("n*")
    right.set_title("compute-optimal n*(C)")
    right.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path)
    return path
