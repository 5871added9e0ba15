"""Stored evidence: every study that stores its runs regenerates its README's numbers from them.

For each `experiments/STUDY/` with `runs/*.jsonl`, its `analyze.py` runs on the stored runs
(in-process, writing its results to a temporary file) and `evidence.check_study` compares
them with the committed `results.json` (the runs it was computed from, each number) and with
the README (every `NUMBER<!--=key-->` and every results block). A study without stored runs
must be in `NO_EVIDENCE` with the reason, and is listed as skipped, one line each
(`pytest -rs`): storing its runs is the only way out of the list, since a listed study
that stores runs fails here too. Deleting one stored run of a copy makes the check fail.
"""

import importlib.util
import os
import shutil

import pytest

from rlscale.scaling import evidence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
# The fits' least squares stop at relative tolerances of about 1e-8 (scipy's curve_fit
# defaults); their last digits differ between machines, so committed numbers are compared
# to 100 times that.
REL_TOL = 1e-6

# Studies whose runs are not in the repository: the reason each cannot be recomputed.
NO_EVIDENCE = {
    "batch_size": "no metrics.jsonl or fit.json stored; no analyze.py",
    "iso_compute": "only the aggregated iso_compute.json and reuse.json; no per-run lines",
    "ladder": "analyze.py reads a ROOT of workdirs; only fits_tan.json and prediction_xl.json",
    "paradigms": "analyze.py reads a ROOT of workdirs; only the aggregated paradigms.json",
    "pipeline": "analyze.py reads a ROOT of workdirs; only fits.json stored",
    "scalerl_ablations": "analyze.py reads a ROOT of workdirs; only fits_first_half.json",
    "verifier_audit": "no runs: its table is checked by tests/test_math_verifier.py",
}


def _studies():
    return sorted(
        d
        for d in os.listdir(EXPERIMENTS)
        if os.path.isfile(os.path.join(EXPERIMENTS, d, "README.md"))
    )


def _stored(study_dir):
    return bool(evidence.manifest(study_dir))


def _analyze(study_dir, out):
    """Runs STUDY/analyze.py (the committed one) on `study_dir`'s runs; its results."""
    name = os.path.basename(study_dir)
    path = os.path.join(EXPERIMENTS, name, "analyze.py")
    spec = importlib.util.spec_from_file_location(f"_analyze_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--study", study_dir, "--results", str(out)])


def test_every_study_stores_evidence_or_is_listed_without():
    problems = []
    for study in _studies():
        stored = _stored(os.path.join(EXPERIMENTS, study))
        if stored and study in NO_EVIDENCE:
            problems.append(f"{study} stores runs now: remove it from NO_EVIDENCE")
        if not stored and study not in NO_EVIDENCE:
            problems.append(f"{study} stores no runs/*.jsonl: store them (or list it)")
    problems += [f"{s} in NO_EVIDENCE is not a study" for s in NO_EVIDENCE if s not in _studies()]
    assert not problems, problems


@pytest.mark.parametrize("study", _studies())
def test_readme_numbers_are_regenerated_from_stored_runs(study, tmp_path):
    study_dir = os.path.join(EXPERIMENTS, study)
    if not _stored(study_dir):
        pytest.skip(f"no stored evidence: {study}: {NO_EVIDENCE.get(study, '?')}")
    regenerated = _analyze(study_dir, tmp_path / "results.json")
    assert regenerated["runs"] == evidence.manifest(study_dir)
    assert evidence.check_study(study_dir, regenerated, rel_tol=REL_TOL) == []


def test_deleting_a_stored_run_fails_the_check(tmp_path):
    study = os.path.join(tmp_path, "tool_rl")
    shutil.copytree(os.path.join(EXPERIMENTS, "tool_rl"), study)
    os.remove(os.path.join(study, "runs", "tool_s1.jsonl"))
    problems = evidence.check_study(study, _analyze(study, tmp_path / "r.json"), rel_tol=REL_TOL)
    assert "run 'tool_s1' is in results.json but not stored in runs/" in problems
    # The numbers it fed are gone, and the README's tables and means no longer match.
    assert any(p.startswith("number tool_s1.final: results.json has 0.96") for p in problems)
    assert "README.md: results block 'runs' differs from what analyze.py makes" in problems
    assert any(p.startswith("README.md: quotes mean_error.logistic = 0.038") for p in problems)
