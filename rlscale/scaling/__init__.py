"""Scaling science: compute accounting, compute-reward curve fits, extrapolation, plots.

`compute` counts FLOPs; `fit` fits the ScaleRL sigmoid (Khatri et al. 2025) and the one-curve
power law (Tan et al. 2025) to arrays; `tan` fits Tan et al.'s law jointly over model sizes
and predicts a run's rest or a held-out size; `runs` reads runs' curves, fits them and writes
`fits.json`; `tan_runs` sizes runs and reads, tables and reports Tan's law over them;
`allocation` splits a rollout budget into rollouts per prompt, prompts per batch and steps
(the IsoCompute playbook, arXiv 2603.12151) and finds the compute-optimal rollouts per prompt
n*(C); `plot` draws the fits (matplotlib is imported only when plotting). Statistics that
survive a referee: `baselines` (the flat and log-linear errors every prediction is scored
beside), `seeds` (fits per seed and across seeds, a bootstrap over seeds), `stats` (Welch's t,
Holm's correction, seeds per arm) and `evidence` (stored runs, README numbers checked against
them, the protocol committed before its results).
"""

from rlscale.scaling.allocation import (
    Cell,
    RecordPoint,
    RolloutOptimum,
    RolloutScaling,
    fit_optimal_rollouts,
    format_allocation_table,
    format_reuse_table,
    iso_cells,
    optimal_rollouts,
    record_breaking,
    record_points,
)
from rlscale.scaling.baselines import BaselineErrors, baseline_errors, beats_baselines
from rlscale.scaling.fit import (
    Extrapolation,
    PowerLawFit,
    SigmoidFit,
    check_curve,
    extrapolation_check,
    fit_power_law,
    fit_sigmoid,
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
from rlscale.scaling.seeds import SeedFits, fit_seeds
from rlscale.scaling.stats import holm, seeds_per_arm, welch
from rlscale.scaling.tan import (
    RunPrediction,
    SizeExtrapolation,
    TanFit,
    extrapolate_to_size,
    fit_tan,
    predict_within_run,
)
from rlscale.scaling.tan_runs import (
    format_tan_table,
    model_size,
    read_sized_csv,
    read_sized_points,
    tan_record,
    write_tan_report,
)

__all__ = [
    "BaselineErrors",
    "SeedFits",
    "baseline_errors",
    "beats_baselines",
    "fit_seeds",
    "holm",
    "seeds_per_arm",
    "welch",
    "Cell",
    "Curve",
    "Extrapolation",
    "PowerLawFit",
    "RecordPoint",
    "RolloutOptimum",
    "RolloutScaling",
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
    "fit_optimal_rollouts",
    "fit_power_law",
    "fit_run",
    "fit_sigmoid",
    "fit_tan",
    "format_allocation_table",
    "format_reuse_table",
    "format_table",
    "format_tan_table",
    "iso_cells",
    "model_size",
    "optimal_rollouts",
    "predict_within_run",
    "read_csv",
    "read_curve",
    "read_metrics",
    "read_sized_csv",
    "read_sized_points",
    "record_breaking",
    "record_points",
    "sigmoid",
    "tan_record",
    "write_report",
    "write_tan_report",
]
