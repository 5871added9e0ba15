"""Scaling science: compute accounting, compute-reward curve fits, extrapolation, plots.

`compute` counts FLOPs; `fit` fits the ScaleRL sigmoid (Khatri et al. 2025) and the power
law (Tan et al. 2025) to arrays; `runs` reads runs' curves, fits them and writes `fits.json`;
`plot` draws the fits (matplotlib is imported only when plotting).
"""

from rlscale.scaling.fit import (
    Extrapolation,
    PowerLawFit,
    SigmoidFit,
    check_curve,
    extrapolation_check,
    fit_power_law,
    fit_sigmoid,
    record_breaking,
    sigmoid,
)
from rlscale.scaling.runs import (
    Curve,
    RunFit,
    describe,
    fit_curve,
    fit_inputs,
    fit_run,
    format_table,
    read_csv,
    read_curve,
    read_metrics,
    write_report,
)

__all__ = [
    "Curve",
    "Extrapolation",
    "PowerLawFit",
    "RunFit",
    "SigmoidFit",
    "check_curve",
    "describe",
    "extrapolation_check",
    "fit_curve",
    "fit_inputs",
    "fit_power_law",
    "fit_run",
    "fit_sigmoid",
    "format_table",
    "read_csv",
    "read_curve",
    "read_metrics",
    "record_breaking",
    "sigmoid",
    "write_report",
]
