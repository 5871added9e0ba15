"""Scaling fits of whole runs: read a run's curve, fit it, write `fits.json` and plots.

Owns the step from files to fits that `tools/fit_scaling.py`, `tools/sweep.py` and the end
of an RL run (`fit_run`, called by `rlscale.main`) share: reading `WORKDIR/metrics.jsonl`
(eval lines are those holding the y key; the step-0 evaluation at zero compute gives R0) or
a `compute,reward` CSV, fitting the ScaleRL sigmoid (`scaling.fit`), the extrapolation check,
the JSON records and the comparison table. A curve that cannot be fitted yields a record
with an `error` field, never an exception, so one bad run does not stop the others.
"""

import csv
import dataclasses
import json
import math
import os

import numpy as np

from rlscale.scaling import fit as fit_lib

DEFAULT_X = "compute/flops"
DEFAULT_Y = "eval/reward_mean"
# The data axis (Tan et al.'s X = data): samples drawn so far, derived from each step's
# `data/prompt_ids` (every prompt sampled, all dynamic-sampling rounds) times the run's
# `batch.group_size` (its config.json); no line stores it.
SAMPLES_X = "data/samples"


@dataclasses.dataclass(frozen=True)
class Curve:
    """One run's compute-reward points.

    Attributes:
      name: a short label (the workdir's or file's base name).
      path: where it was read from.
      compute, reward: the points with compute > 0, in file order.
      r0: the reward of an evaluation at zero compute (the step-0 eval), or None.
      x_key, y_key: what was read.
    """

    name: str
    path: str
    compute: np.ndarray
    reward: np.ndarray
    r0: float | None
    x_key: str
    y_key: str


@dataclasses.dataclass(frozen=True)
class RunFit:
    """The outcome of fitting one input: a fit, or the reason there is none.

    Attributes:
      name, path: the input.
      curve: the points read (None when reading failed).
      fit: the sigmoid fitted on the points up to the cut (all points without one).
      extrapolation: the check on the points after the cut, or None without a cut.
      full: with a cut, the fit on all points, for comparison; else None.
      error: why there is no fit, or None.
      options: the fit options used (recorded in the JSON).
    """

    name: str
    path: str
    curve: Curve | None = None
    fit: fit_lib.SigmoidFit | None = None
    extrapolation: fit_lib.Extrapolation | None = None
    full: fit_lib.SigmoidFit | None = None
    error: str | None = None
    options: dict = dataclasses.field(default_factory=dict)

    def record(self) -> dict:
        """The JSON record: `name, A, B, C_mid, R0, r2, n_points, A_interval, at_bounds,
        extrapolation` (with its baselines' errors), plus `path, x, y, error, full` and the
        options; fit fields are None on error."""
        f = self.fit
        rec = {
            "name": self.name,
            "path": self.path,
            "x": self.curve.x_key if self.curve else self.options.get("x_key"),
            "y": self.curve.y_key if self.curve else self.options.get("y_key"),
            "A": f.A if f else None,
            "B": f.B if f else None,
            "C_mid": f.C_mid if f else None,
            "R0": f.R0 if f else None,
            "r2": f.r2 if f else None,
            "n_points": f.n_points if f else None,
            "A_interval": list(f.A_interval) if f and f.A_interval else None,
            "at_bounds": list(f.at_bounds) if f else None,
            "method": self.options.get("method"),
            "min_compute": self.options.get("min_compute"),
            "fit_until": self.extrapolation.fit_until if self.extrapolation else None,
            "extrapolation": self.extrapolation.as_dict() if self.extrapolation else None,
            "full": None,
            "error": self.error,
        }
        if self.full:
            rec["full"] = {k: getattr(self.full, k) for k in ("A", "B", "C_mid", "r2", "n_points")}
        return rec


# ==========================================================================================
# Reading curves.
# ==========================================================================================


def _name_of(path):
    base = os.path.basename(os.path.normpath(path))
    if base == "metrics.jsonl":
        base = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return os.path.splitext(base)[0] if base.endswith((".csv", ".jsonl")) else base


def _split_r0(name, path, compute, reward, x_key, y_key):
    """A first point at zero compute (the step-0 eval) is R0, not a point of the fit."""
    c, r = np.asarray(compute, dtype=np.float64), np.asarray(reward, dtype=np.float64)
    r0 = None
    if c.size and c[0] == 0:
        r0, c, r = float(r[0]), c[1:], r[1:]
    return Curve(name, path, c, r, r0, x_key, y_key)


def _records(file):
    """(line number, JSON object) of each non-blank line of a metrics file.

    Raises:
      ValueError: a line that is not JSON, naming it.
    """
    with open(file) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{lineno} is not a JSON object ({e})") from None


def read_metrics(path: str, x_key: str = DEFAULT_X, y_key: str = DEFAULT_Y) -> Curve:
    """Reads the evaluation curve from a `metrics.jsonl` (a workdir or the file itself).

    Every line is a JSON object; eval lines are those that contain `y_key` (a null value,
    the metrics writer's NaN, reads as NaN and fails the fit's checks, naming the index).

    Raises:
      ValueError: a line that is not JSON, no line with `y_key`, or an eval line without
        `x_key`.
      OSError: the file cannot be read.
    """
    file = path if path.endswith(".jsonl") else os.path.join(path, "metrics.jsonl")
    if x_key == SAMPLES_X:
        return _read_samples_curve(path, file, y_key)
    compute, reward = [], []
    keys = set()
    for lineno, record in _records(file):
        keys.update(record)
        if y_key not in record:
            continue
        if x_key not in record:
            raise ValueError(f"{file}:{lineno} has {y_key!r} but no {x_key!r}")
        compute.append(math.nan if record[x_key] is None else record[x_key])
        reward.append(math.nan if record[y_key] is None else record[y_key])
    if not reward:
        close = sorted(k for k in keys if k.split("/")[0] == y_key.split("/")[0])
        raise ValueError(
            f"no line of {file} has {y_key!r}"
            + (f" (keys like it: {', '.join(close)})" if close else "")
        )
    return _split_r0(_name_of(path), path, compute, reward, x_key, y_key)


def _read_samples_curve(path, file, y_key) -> Curve:
    """`read_metrics` with X = samples drawn up to each evaluation's step (`SAMPLES_X`).

    A step logged twice (a resumed run replays the steps after its checkpoint) counts once,
    its last line."""
    config_path = os.path.join(os.path.dirname(os.path.abspath(file)), "config.json")
    try:
        with open(config_path) as f:
            group = json.load(f)["batch"]["group_size"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        raise ValueError(
            f"{config_path} has no batch.group_size (missing or unreadable): {SAMPLES_X} "
            "needs the run's group size"
        ) from None
    drawn, evals = {}, {}
    for _, record in _records(file):
        if "data/prompt_ids" in record:
            drawn[record["step"]] = len(record["data/prompt_ids"]) * group
        if y_key in record:
            evals[record["step"]] = math.nan if record[y_key] is None else record[y_key]
    if not evals:
        raise ValueError(f"no line of {file} has {y_key!r}")
    steps = sorted(evals)
    samples = np.cumsum([drawn.get(s, 0) for s in range(steps[-1] + 1)])
    x = [float(samples[s]) for s in steps]
    return _split_r0(_name_of(path), path, x, [evals[s] for s in steps], SAMPLES_X, y_key)


def read_csv(path: str) -> Curve:
    """Reads a CSV whose header row names the columns `compute` and `reward`.

    Raises:
      ValueError: a missing column or a value that is not a number (naming the line).
    """
    compute, reward = read_csv_columns(path, ("compute", "reward"))
    return _split_r0(_name_of(path), path, compute, reward, "compute", "reward")


def read_csv_columns(path: str, keys: tuple[str, ...]) -> np.ndarray:
    """The columns `keys` of a CSV with a header row, as float64 [len(keys), rows].

    Raises:
      ValueError: a missing column or a value that is not a number (naming the line).
    """
    values = []
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        header = [h.strip() for h in rows.fieldnames or []]
        missing = [k for k in keys if k not in header]
        if missing:
            raise ValueError(
                f"{path}: the header row {header} lacks {', '.join(missing)} "
                f"(expected {','.join(keys)!r})"
            )
        for row in rows:
            row = {k.strip(): v for k, v in row.items() if k is not None}
            try:
                values.append([float(row[k]) for k in keys])
            except (TypeError, ValueError):
                bad = ", ".join(repr(row[k]) for k in keys)
                raise ValueError(f"{path}:{rows.line_num}: not a number in {bad}") from None
    return np.asarray(values, dtype=np.float64).reshape(-1, len(keys)).T


def read_curve(path: str, x_key: str = DEFAULT_X, y_key: str = DEFAULT_Y) -> Curve:
    """A run workdir or `.jsonl` file (`read_metrics`) or a `.csv` file (`read_csv`)."""
    if path.endswith(".csv"):
        return read_csv(path)
    if not os.path.isdir(path) and not path.endswith(".jsonl"):
        raise ValueError(f"{path}: expected a run workdir, a metrics .jsonl or a .csv file")
    return read_metrics(path, x_key, y_key)


# ==========================================================================================
# Fitting.
# ==========================================================================================


def fit_curve(
    curve: Curve,
    *,
    r0: float | None = None,
    min_compute: float = 0.0,
    method: str = "grid",
    fit_until: float | None = None,
    fit_until_frac: float | None = None,
    a_max: float = 1.0,
    n_boot: int = 200,
    seed: int = 0,
) -> RunFit:
    """Fits the ScaleRL sigmoid to one curve (Khatri et al. 2025, arXiv 2510.13786).

    `R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)`, see `fit.fit_sigmoid`. R0 is, in order:
    `r0`, the curve's zero-compute evaluation, the reward at its first point. With a cut
    (`fit_until`, or `fit_until_frac` times the largest compute), the fit uses the points
    up to the cut, the extrapolation check scores it on the later ones, and `full` holds
    the fit on all points.

    Returns:
      A `RunFit`; on degenerate input its `error` says why (never raises ValueError).
    """
    options = dict(method=method, min_compute=min_compute, a_max=a_max, n_boot=n_boot, seed=seed)
    out = dict(name=curve.name, path=curve.path, curve=curve, options=options)
    if fit_until is not None and fit_until_frac is not None:
        raise ValueError("give fit_until or fit_until_frac, not both")
    r0 = r0 if r0 is not None else curve.r0
    kwargs = dict(r0=r0, min_compute=min_compute, method=method, a_max=a_max)
    boot = dict(n_boot=n_boot, seed=seed)
    try:
        if fit_until_frac is not None:
            if not 0 < fit_until_frac < 1:
                raise ValueError(f"fit_until_frac={fit_until_frac} must be in (0, 1)")
            fit_lib.check_curve(curve.compute, curve.reward)
            if curve.compute.size == 0:
                raise ValueError("no points with compute > 0")
            fit_until = fit_until_frac * float(curve.compute[-1])
        if fit_until is None:
            fit = fit_lib.fit_sigmoid(curve.compute, curve.reward, **kwargs, **boot)
            return RunFit(fit=fit, **out)
        ext = fit_lib.extrapolation_check(
            curve.compute, curve.reward, fit_until=fit_until, **kwargs, **boot
        )
        full = fit_lib.fit_sigmoid(curve.compute, curve.reward, **kwargs)
        return RunFit(fit=ext.fit, extrapolation=ext, full=full, **out)
    except ValueError as e:
        return RunFit(error=str(e), **out)


def fit_inputs(
    paths: list[str], *, x_key: str = DEFAULT_X, y_key: str = DEFAULT_Y, **fit_kwargs
) -> list[RunFit]:
    """Reads and fits each input (`read_curve`, `fit_curve`); failures carry their reason.

    Names are the inputs' base names, made unique with their paths where two collide.
    """
    results = []
    for path in paths:
        try:
            curve = read_curve(path, x_key, y_key)
        except (OSError, ValueError) as e:
            options = dict(x_key=x_key, y_key=y_key, **fit_kwargs)
            results.append(RunFit(name=_name_of(path), path=path, error=str(e), options=options))
            continue
        results.append(fit_curve(curve, **fit_kwargs))
    names = [r.name for r in results]
    return [dataclasses.replace(r, name=r.path) if names.count(r.name) > 1 else r for r in results]


def sort_by_asymptote(results: list[RunFit]) -> list[RunFit]:
    """Fitted runs by A, highest first, then the failures in input order."""
    fitted = sorted((r for r in results if r.fit), key=lambda r: -r.fit.A)
    return fitted + [r for r in results if not r.fit]


def format_table(results: list[RunFit]) -> str:
    """A plain-text comparison table, sorted by A (descending); failures listed after."""
    rows = sort_by_asymptote(results)
    width = max([len(r.name) for r in rows] + [4])
    head = f"{'name':<{width}}  {'A':>6}  {'A interval':>15}  {'B':>6}  {'C_mid':>9}  "
    head += f"{'R0':>6}  {'R2':>6}  {'n':>4}  {'extrap MAE/max':>14}  {'flat/line MAE':>13}  "
    head += "on a bound"
    lines = [head, "-" * len(head)]
    for r in rows:
        f = r.fit
        if f is None:
            lines.append(f"{r.name:<{width}}  no fit: {r.error}")
            continue
        iv = f"[{f.A_interval[0]:.3f}, {f.A_interval[1]:.3f}]" if f.A_interval else "-"
        ex, base = r.extrapolation, "-"
        if ex:
            base = f"{ex.baselines.flat_mae:.3f}/{ex.baselines.line_mae:.3f}"
        ex = f"{ex.mae:.3f}/{ex.max_abs_err:.3f}" if ex else "-"
        lines.append(
            f"{r.name:<{width}}  {f.A:6.3f}  {iv:>15}  {f.B:6.3f}  {f.C_mid:9.3g}  "
            f"{f.R0:6.3f}  {f.r2:6.3f}  {f.n_points:4d}  {ex:>14}  {base:>13}  "
            + (", ".join(f.at_bounds) or "-")
        )
    return "\n".join(lines)


def describe(record: dict) -> str:
    """One line for a fit record (`RunFit.record()` or `fit_run`'s return value)."""
    if record.get("error"):
        return f"scaling fit: none ({record['error']})"
    iv = record.get("A_interval")
    iv = f" [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else ""
    line = (
        f"scaling fit ({record['y']} vs {record['x']}): A={record['A']:.4f}{iv} "
        f"B={record['B']:.3f} C_mid={record['C_mid']:.4g} R0={record['R0']:.4f} "
        f"R2={record['r2']:.3f} ({record['n_points']} points)"
    )
    if record.get("at_bounds"):
        line += f" on a bound: {', '.join(record['at_bounds'])}"
    ex = (record.get("prediction") or {}).get("extrapolation")
    if ex:
        line += (
            f"; first half predicts the second: MAE {ex['mae']:.3f} ({ex['n_points']} "
            f"points; flat {ex['flat_mae']:.3f}, log-linear {ex['line_mae']:.3f})"
        )
    return line


# ==========================================================================================
# Writing.
# ==========================================================================================


def write_json(path, obj):
    """Writes `obj` as indented JSON, atomically (sweep shards may share a directory)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)  # Atomic: sweep shards may share the directory.


def safe_name(name: str) -> str:
    """A file-name-safe version of a run name."""
    out = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name).strip("._")
    return out or "run"


def write_report(results: list[RunFit], out_dir: str, *, per_run_plots: bool = True) -> dict:
    """Writes `OUT/fits.json` (records sorted by A, failures last) and the plots.

    `OUT/curves.png` shows every fitted run; with `per_run_plots`, `OUT/curve_NAME.png`
    shows each alone.

    Returns:
      Paths written: `{"fits": ..., "curves": ... or None, "runs": [...]}`.
    """
    from rlscale.scaling import plot

    os.makedirs(out_dir, exist_ok=True)
    fits_path = os.path.join(out_dir, "fits.json")
    write_json(fits_path, [r.record() for r in sort_by_asymptote(results)])
    fitted = [r for r in results if r.fit]
    paths = {"fits": fits_path, "curves": None, "runs": []}
    if fitted:
        paths["curves"] = plot.plot_fits(fitted, os.path.join(out_dir, "curves.png"))
        if per_run_plots:
            for r in fitted:
                png = os.path.join(out_dir, f"curve_{safe_name(r.name)}.png")
                paths["runs"].append(plot.plot_fits([r], png))
    return paths


def fit_run(
    workdir: str,
    *,
    x_key: str = DEFAULT_X,
    y_key: str = DEFAULT_Y,
    min_compute: float = 0.0,
    method: str = "grid",
    n_boot: int = 200,
) -> dict:
    """Fits a finished run's curve; writes `WORKDIR/scaling/fit.json` and `curve.png`.

    The ScaleRL sigmoid `R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)` (Khatri et al. 2025,
    arXiv 2510.13786) of `y_key` against `x_key` from `WORKDIR/metrics.jsonl`, R0 from the
    step-0 evaluation. Meant for the end of an RL run: a run too short to fit (or with a
    broken metrics file) costs a record with an `error` field, not an exception. Nothing
    is written when `workdir` does not exist.

    With the fit comes the run's own prediction check, `record["prediction"]`: the sigmoid
    fitted on the first half of the evaluations (compute up to `fit_until`) and its errors
    on the second half (`extrapolation`: mae, max_abs_err, n_points), as a study would fit
    early compute before paying for the rest.

    Returns:
      The fit record (see `RunFit.record`); `record["error"]` is None when it fitted.
    """
    options = dict(min_compute=min_compute, method=method, n_boot=n_boot)
    prediction = None
    try:
        curve = read_metrics(workdir, x_key, y_key)
    except (OSError, ValueError) as e:
        result = RunFit(name=_name_of(workdir), path=workdir, error=str(e))
    else:
        result = fit_curve(curve, **options)
        if result.fit:  # Predict, then check: the first half of the evaluations fitted.
            half = fit_curve(
                curve, fit_until=float(curve.compute[(curve.compute.size - 1) // 2]), **options
            )
            rec = half.record()
            keys = ("fit_until", "A", "B", "C_mid", "A_interval", "at_bounds")
            prediction = {k: rec[k] for k in keys}
            prediction.update(extrapolation=rec["extrapolation"], error=rec["error"])
    record = result.record()
    record.update(x=x_key, y=y_key, prediction=prediction)
    if not os.path.isdir(workdir):
        return record
    out_dir = os.path.join(workdir, "scaling")
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "fit.json"), record)
    if result.fit:
        from rlscale.scaling import plot

        plot.plot_fits([result], os.path.join(out_dir, "curve.png"))
    return record
