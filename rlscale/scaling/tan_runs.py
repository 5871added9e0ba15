"""Tan et al.'s law over runs of several model sizes (`scaling.tan` fits it): each run's
parameter count, the `(N, X, reward)` points of runs and CSVs, the fits.json record, the
per-size table and the report. Letters: N model size (parameters), X compute.
"""

import json
import os

import numpy as np

from rlscale.scaling.runs import DEFAULT_X, DEFAULT_Y, read_csv_columns, read_curve, write_json


def model_size(workdir: str) -> int:
    """A run's parameter count: `ModelConfig.num_params()` of the policy it trained.

    Read as `rl.setup.build` makes the model: a run from a Hugging Face checkpoint
    (`init.hf_checkpoint` in `WORKDIR/config.json`) has that checkpoint's `config.json`
    architecture; any other has its warm start's `WORKDIR/sft/model_config.json` (the
    configured model with the tokenizer's vocabulary size in place of `config.json`'s
    `model.vocab_size`).

    Raises:
      ValueError: a `config.json` without `init.hf_checkpoint` (not an RL run's).
      OSError: a file above cannot be read (the error names it).
    """
    from rlscale.model import config as model_config

    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        config = json.load(f)
    try:
        hf_dir = config["init"]["hf_checkpoint"]
    except (KeyError, TypeError):
        raise ValueError(f"{path} has no init.hf_checkpoint: not an RL run's config") from None
    if hf_dir:
        from rlscale.model import hf

        with open(os.path.join(hf_dir, "config.json")) as f:
            return hf.config_from_hf(json.load(f)).num_params()
    with open(os.path.join(workdir, "sft", "model_config.json")) as f:
        return model_config.from_dict(json.load(f)).num_params()


def read_sized_csv(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Points `(N, X, reward)` from a CSV whose header row names `model_size,compute,reward`.

    Raises:
      ValueError: a missing column or a value that is not a number (naming the line).
    """
    n, x, r = read_csv_columns(path, ("model_size", "compute", "reward"))
    return n, x, r


def read_sized_points(
    paths: list[str], x_key: str = DEFAULT_X, y_key: str = DEFAULT_Y
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Points `(N, X, reward)` of every input, concatenated.

    An input is a `model_size,compute,reward` CSV (`read_sized_csv`), or a run: its workdir
    or `metrics.jsonl` (`read_metrics`; the step-0 evaluation at zero compute has no log X
    and is left out), sized by `model_size`.

    Raises:
      ValueError / OSError: an input that cannot be read, named.
    """
    if not paths:
        raise ValueError("no inputs: give run workdirs or model_size,compute,reward CSVs")
    parts = []
    for path in paths:
        if path.endswith(".csv"):
            parts.append(read_sized_csv(path))
            continue
        curve = read_curve(path, x_key, y_key)
        workdir = os.path.dirname(os.path.abspath(path)) if path.endswith(".jsonl") else path
        try:
            size = model_size(workdir)
        except ValueError as e:
            raise ValueError(f"{path}: no model size: {e}") from None
        parts.append((np.full(curve.compute.size, float(size)), curve.compute, curve.reward))
    n, x, r = (np.concatenate(a) for a in zip(*parts))
    return n, x, r


def tan_record(fit, extrapolation=None) -> dict:
    """The fits.json object of a `tan.TanFit` and its `tan.SizeExtrapolation` (or None):
    `law: "tan", k_max, N0, E0_max, N1, r2, n_points, at_bounds` and
    `extrapolation` (`{holdout_size, mae, max_abs_err, n_points}` in reward units, or None
    without a held-out size)."""
    return {
        "law": "tan",
        **fit.as_dict(),
        "extrapolation": extrapolation.as_dict() if extrapolation else None,
    }


def format_tan_table(fit, size, compute, reward, holdout_size: float | None = None) -> str:
    """The fitted law, then one row per size: its exact parameter count (what
    `--holdout-size` takes), points, compute range, k(N), E0(N) and the mean and largest
    absolute reward error of the fit at its points (the held-out size marked)."""
    head = (
        f"Tan et al. law log10(1 - reward) = -k(N) log10 X + E0(N): k_max={fit.k_max:.4g} "
        f"N0={fit.N0:.4g} E0_max={fit.E0_max:.4g} N1={fit.N1:.4g} R2={fit.r2:.4f} "
        f"({fit.n_points} points)"
    )
    if fit.at_bounds:
        head += f"; on a bound: {', '.join(fit.at_bounds)} (not determined by the data)"
    cols = f"{'size':>12}  {'n':>4}  {'compute range':>19}  {'k(N)':>7}  {'E0(N)':>7}  "
    cols += f"{'MAE':>7}  {'max':>7}"
    lines = [head, cols, "-" * len(cols)]
    n, x, r = (np.asarray(a, dtype=np.float64) for a in (size, compute, reward))
    for s in np.unique(n):
        m = n == s
        err = np.abs(fit.predict(s, x[m]) - r[m])
        held = holdout_size is not None and np.isclose(s, holdout_size, rtol=1e-9, atol=0.0)
        lines.append(
            f"{s:12.12g}  {m.sum():4d}  {f'{x[m].min():.3g}..{x[m].max():.3g}':>19}  "
            f"{float(fit.k(s)):7.4f}  {float(fit.E0(s)):7.4f}  {err.mean():7.4f}  "
            f"{err.max():7.4f}" + ("  held out: predicted" if held else "")
        )
    return "\n".join(lines)


def write_tan_report(
    fit,
    size,
    compute,
    reward,
    out_dir: str,
    *,
    extrapolation=None,
    x_key: str = "compute",
    y_key: str = "reward",
) -> dict:
    """Writes `OUT/fits.json` (`tan_record`) and `OUT/tan.png` (`plot.plot_tan`).

    Returns:
      Paths written: `{"fits": ..., "plot": ...}`.
    """
    from rlscale.scaling import plot

    os.makedirs(out_dir, exist_ok=True)
    fits_path = os.path.join(out_dir, "fits.json")
    write_json(fits_path, tan_record(fit, extrapolation))
    holdout = extrapolation.holdout_size if extrapolation else None
    png = plot.plot_tan(
        fit,
        size,
        compute,
        reward,
        os.path.join(out_dir, "tan.png"),
        holdout_size=holdout,
        x_key=x_key,
        y_key=y_key,
    )
    return {"fits": fits_path, "plot": png}
