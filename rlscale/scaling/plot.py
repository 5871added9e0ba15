"""Plots of fitted compute-reward curves (PNG, matplotlib's Agg canvas, no pyplot state).

Owns the one figure style for scaling fits: each run's points on a log-compute axis, its
fitted ScaleRL sigmoid (Khatri et al. 2025, arXiv 2510.13786), the asymptote A as a dashed
line and, when the fit stopped at a cut, the cut as a dotted vertical line with the
held-out points drawn hollow.
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
