"""The math verifier from the four places users call it: its workers never re-run the caller.

Each caller appends a line to a marker file when it runs, then scores three completions with
`rlscale.rewards.math.verify_batch`: the marker must hold exactly one line (the workers did not
re-import the caller's main module), the scores must be right and nothing may print a traceback.
"""

import os
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

# No `if __name__ == "__main__":` guard: a worker that imported `__main__` would run it again.
CALLER = """\
import os
with open(os.environ["RLSCALE_TEST_MARKER"], "a") as f:
    f.write("ran\\n")
from rlscale.rewards import math as math_reward
print("scores", math_reward.verify_batch(
    [r"So $\\boxed{\\frac{2}{4}}$.", "Answer: 7", "The answer is 3."], ["0.5", "8", "3"]
))
"""
# Independent of the verifier: 2/4 == 0.5, 7 != 8, 3 == 3.
EXPECTED = "scores [1.0, 0.0, 1.0]\n"


def _no_traceback(output: str):
    assert "Traceback" not in output and "Error" not in output, output


@pytest.mark.parametrize("how", ["script", "-c", "stdin"])
def test_scoring_from_a_plain_python_caller(tmp_path, how):
    # The script lives elsewhere and runs from a directory holding a file named like a
    # standard module the workers import: theirs must come from the standard library.
    (tmp_path / "selectors.py").write_text("raise SystemExit('the working directory shadowed')\n")
    script = tmp_path / "project" / "caller.py"
    script.parent.mkdir()
    script.write_text(CALLER)
    args, stdin = {"script": ([str(script)], None), "-c": (["-c", CALLER], None)}.get(
        how, (["-"], CALLER)
    )
    marker = tmp_path / "marker"
    proc = subprocess.run(
        [sys.executable, *args],
        input=stdin,
        cwd=tmp_path if how == "script" else script.parent,
        env={**os.environ, "RLSCALE_TEST_MARKER": str(marker)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == EXPECTED, proc.stdout + proc.stderr
    _no_traceback(proc.stdout + proc.stderr)
    assert marker.read_text() == "ran\n"


def test_scoring_from_a_notebook_kernel(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(CALLER)]
    marker = tmp_path / "marker"
    client = NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    # Keyword arguments reach the kernel manager: the kernel gets the marker's path.
    client.execute(env={**os.environ, "RLSCALE_TEST_MARKER": str(marker)})
    outputs = notebook.cells[0].outputs
    assert [o.output_type for o in outputs] == ["stream"], outputs
    assert (outputs[0].name, outputs[0].text) == ("stdout", EXPECTED)
    _no_traceback(str(outputs))
    assert marker.read_text() == "ran\n"
