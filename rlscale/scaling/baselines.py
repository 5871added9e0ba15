"""Baselines for every prediction: what a fitted law's extrapolation error must beat.

A law fitted on the early part of a curve and scored on the rest is only worth its error
when it beats what needs no law: the **flat** baseline (the last fitted point's reward held)
and a **straight line in log-compute** fitted by least squares to the same points. On a
nearly flat curve both score about as well as any law; `beats_baselines` says whether a
prediction beats both by more than the evaluation noise (for pass@1 over n prompts, the
binomial standard error `binomial_se`). Plain arrays in, no fitting library needed.
"""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class BaselineErrors:
    """The two baselines' mean and largest absolute errors on the scored points.

    Attributes:
      flat_mae, flat_max: of the last fitted reward held flat.
      line_mae, line_max: of the least-squares line `reward = a + b log C` on the fitted
        points.
    """

    flat_mae: float
    flat_max: float
    line_mae: float
    line_max: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def baseline_errors(fit_compute, fit_reward, later_compute, later_reward) -> BaselineErrors:
    """Scores the flat and the log-linear baseline, fitted on `fit_*`, on `later_*`.

    Args:
      fit_compute, fit_reward: the fitted range's points (compute > 0, in compute order);
        the line needs two distinct compute values (with one, it is the flat baseline).
      later_compute, later_reward: the scored points.

    Returns:
      `BaselineErrors`.

    Raises:
      ValueError: an empty fitted range or no scored point.
    """
    c, r = np.asarray(fit_compute, np.float64), np.asarray(fit_reward, np.float64)
    cl, rl = np.asarray(later_compute, np.float64), np.asarray(later_reward, np.float64)
    if c.size == 0 or cl.size == 0:
        raise ValueError(
            f"baselines need fitted and scored points; got {c.size} fitted, {cl.size} scored"
        )
    flat = np.abs(r[-1] - rl)
    if np.unique(c).size >= 2:
        slope, intercept = np.polyfit(np.log(c), r, 1)
        line = np.abs(intercept + slope * np.log(cl) - rl)
    else:
        line = flat
    return BaselineErrors(
        flat_mae=float(flat.mean()),
        flat_max=float(flat.max()),
        line_mae=float(line.mean()),
        line_max=float(line.max()),
    )


def binomial_se(pass_rate: float, n_prompts: int) -> float:
    """The standard error of a pass rate measured on `n_prompts` independent prompts:
    `sqrt(p (1 - p) / n)` (one sample per prompt; correlated samples of a prompt add less
    than their count).

    Raises:
      ValueError: a pass rate outside [0, 1] or `n_prompts` < 1.
    """
    if not 0.0 <= pass_rate <= 1.0:
        raise ValueError(f"pass_rate={pass_rate} is outside [0, 1]")
    if n_prompts < 1:
        raise ValueError(f"n_prompts={n_prompts} must be >= 1")
    return math.sqrt(pass_rate * (1.0 - pass_rate) / n_prompts)


def beats_baselines(mae: float, baselines: BaselineErrors, noise: float) -> bool:
    """Whether a prediction's MAE beats both baselines' by more than `noise`:
    `flat_mae - mae > noise` and `line_mae - mae > noise`.

    Args:
      mae: the prediction's mean absolute error on the scored points.
      baselines: the baselines' errors on the same points (`baseline_errors`).
      noise: the evaluation noise in reward units (e.g. `binomial_se`), >= 0.

    Raises:
      ValueError: a negative or non-finite `noise`, or a non-finite `mae`.
    """
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise={noise} must be finite and >= 0 (reward units)")
    if not math.isfinite(mae):
        raise ValueError(f"mae={mae} is not finite")
    margin = min(baselines.flat_mae, baselines.line_mae) - mae
    return bool(margin > noise)
