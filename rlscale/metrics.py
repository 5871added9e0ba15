"""The one metrics writer: JSONL (`WORKDIR/metrics.jsonl`), TensorBoard events, one console
line per step (`console.StepLines`). Every record carries `step`, `compute/flops` and
`compute/device_seconds`. A `Histogram` value goes to TensorBoard only."""

import json
import math
import os
import sys
from typing import NamedTuple

import numpy as np

from rlscale import console


def _import_tensorboardx():
    """tensorboardX, imported without torch where torch is installed but not yet imported:
    tensorboardX imports it (2-3 s, at every command's start) only to accept torch tensors,
    which this writer never passes."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError while this is here.
    try:
        import tensorboardX
    finally:
        if hide:
            del sys.modules["torch"]
    return tensorboardX


SummaryWriter = _import_tensorboardx().SummaryWriter


class Histogram(NamedTuple):
    """A record's histogram: `counts[i]` values in (limits[i - 1], limits[i]] (the first
    bucket from -inf), and the values' min, max, sum and sum of squares. Written to
    TensorBoard (`add_histogram_raw`); not to metrics.jsonl, the console or a sink."""

    limits: np.ndarray
    counts: np.ndarray
    min: float
    max: float
    sum: float
    sum_squares: float


def _plain(v):
    if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "item"):
        v = np.asarray(v).item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; the key stays, with null.
    return v


class MetricWriter:
    """Appends records to `WORKDIR/metrics.jsonl` and TensorBoard.

    `resume_offset` (a resumed run: `offset()` as saved with its checkpoint) first cuts the
    file back to that length, dropping the lines written after the checkpoint, which the
    resumed run writes again. `sink`: where each record goes too (`tracking.WandbSink`).
    """

    def __init__(
        self,
        workdir: str,
        total_steps: int | None = None,
        enabled: bool = True,
        resume_offset: int | None = None,
        sink=None,
    ):
        self.enabled, self.sink = enabled, sink
        self._lines = console.StepLines(total_steps)
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            self.path = os.path.join(workdir, "metrics.jsonl")
            if resume_offset is None and os.path.exists(self.path):
                resume_offset = 0  # A fresh run in a used workdir starts a fresh file.
            if resume_offset is not None:
                with open(self.path, "a") as f:
                    if f.tell() < resume_offset:
                        raise ValueError(
                            f"{self.path} has {f.tell()} bytes, fewer than the {resume_offset} "
                            "its checkpoint recorded: the file was edited or replaced"
                        )
                    f.truncate(resume_offset)
            self._jsonl = open(self.path, "a")
            self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: dict, progress: bool = True):
        """Appends one record; keys must include the compute counters."""
        for key in ("compute/flops", "compute/device_seconds"):
            if key not in metrics:
                raise KeyError(f"metric record for step {step} lacks {key!r}")
        if not self.enabled:
            return
        hists = {k: v for k, v in metrics.items() if isinstance(v, Histogram)}
        metrics = {k: v for k, v in metrics.items() if k not in hists}
        record = {"step": int(step), **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                # TensorBoard tags allow no "@": eval/pass@1 -> eval/pass_at_1.
                self._tb.add_scalar(k.replace("@", "_at_"), v, step)
        for k, h in sorted(hists.items()):
            self._tb.add_histogram_raw(
                k,
                min=h.min,
                max=h.max,
                num=int(h.counts.sum()),
                sum=h.sum,
                sum_squares=h.sum_squares,
                bucket_limits=[float(x) for x in h.limits],
                bucket_counts=[int(x) for x in h.counts],
                global_step=step,
            )
        if self.sink is not None:
            self.sink.log(step, record)
        if progress:
            self._lines.write(step, record)

    def offset(self) -> int:
        """Length of metrics.jsonl so far: saved with a checkpoint, to resume from."""
        return self._jsonl.tell() if self.enabled else 0

    def close(self):
        self._lines.close()
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
        if self.sink is not None:
            self.sink.close()
