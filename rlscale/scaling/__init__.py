"""Scaling science: compute accounting, compute-reward curve fits, extrapolation, plots.

`compute` counts FLOPs; `fit` fits the ScaleRL sigmoid (Khatri et al. 2025) and the one-curve
power law (Tan et al. 2025) to arrays; `tan` fits Tan et al.'s law jointly over model sizes
and predicts a run's rest or a held-out size; `runs` reads runs' curves (and their model
sizes), fits them and writes `fits.json`; `plot` draws the fits (matplotlib is imported only
when plotting).
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
    format_tan_table,
    model_size,
    read_csv,
    read_curve,
    read_metrics,
    read_sized_csv,
    read_sized_points,
    tan_record,
    write_report,
    write_tan_report,
)
from rlscale.scaling.tan import (
    RunPrediction,
    SizeExtrapolation,
    TanFit,
    extrapolate_to_size,
    fit_tan,
    predict_within_run,
)

__all__ = [
    "Curve",
    "Extrapolation",
    "PowerLawFit",
    "RunFit",
    "RunPrediction",
    "SigmoidFit",
    "SizeExtrapolation",
    "TanFit",
    "check_curve",
    "describe",
    "extrapolate_to_size",
    "extrapolation_check",
    "fit_curve",
    "fit_inputs",
    "fit_power_law",
    "fit_run",
    "fit_sigmoid",
    "fit_tan",
    "format_table",
    "format_tan_table",
    "model_size",
    "predict_within_run",
    "read_csv",
    "read_curve",
    "read_metrics",
    "read_sized_csv",
    "read_sized_points",
    "record_breaking",
    "sigmoid",
    "tan_record",
    "write_report",
    "write_tan_report",
]
