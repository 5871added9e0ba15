"""The quickstart notebook (`experiments/notebooks/quickstart.ipynb`) runs headless, end to end,
with small settings and the shared warm start."""

import os

import jax
import nbclient
import nbformat
from conftest import ROOT
from test_rl import recipe_workdir

from rlscale import stage_cache

NOTEBOOK = os.path.join(ROOT, "experiments", "notebooks", "quickstart.ipynb")


def _text(cell) -> str:
    return "".join(
        o.get("text", "") for o in cell.get("outputs", []) if o["output_type"] == "stream"
    )


def test_quickstart_notebook_executes(warm, shared_workdir, tmp_path, monkeypatch):
    # The kernel runs as this process does (the suite's XLA flags, its 8 CPU devices and matmul
    # precision), so the quickstart's and GRPO's programs are those of their recipe runs
    # (tests/test_rl.py), made first: it loads them from the compilation cache instead of
    # compiling them (on one device, as on a laptop, it compiled them all: 15 of its 35 CPU-s).
    for recipe in ("quickstart", "grpo"):
        recipe_workdir(recipe, warm, shared_workdir)
    precision = jax.config.jax_default_matmul_precision
    monkeypatch.setenv("JAX_DEFAULT_MATMUL_PRECISION", precision)
    # Two steps: evaluations at steps 0 and 2. Six gave three points, no fit either (a fit
    # needs four), and ran the same cells.
    monkeypatch.setenv("RLSCALE_NB_STEPS", "2")
    monkeypatch.setenv("RLSCALE_NB_SMOKE", "1")
    monkeypatch.setenv("RLSCALE_NB_REUSE_FROM", str(warm))
    monkeypatch.setenv("RLSCALE_NB_ROOT", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
    )
    client.execute()  # Raises CellExecutionError, with the cell and traceback, on any error.

    code = [c for c in nb.cells if c.cell_type == "code"]
    out = "\n".join(_text(c) for c in code)
    assert "Traceback" not in out
    sft = stage_cache.record(str(warm), stage_cache.WARM_START)
    assert f"'sft/steps': {sft['steps']}" in out  # The warm start was reused, not retrained.
    for name in ("quickstart", "grpo"):  # Both runs' curves were read from their workdirs.
        assert os.path.isfile(tmp_path / name / "metrics.jsonl")
        assert f"\n{name} " in out
    assert "scaling fit" in out
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # The curve with its fit, and the comparison.
    # The verifiers' verdicts: the arithmetic demo and its answer-less working; math answers.
    assert out.count("-> 1.0") == 3 and out.count("-> 0.0") == 3
