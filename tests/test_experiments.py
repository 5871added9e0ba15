"""Stored evidence: every study that stores its runs regenerates its README's numbers from them.

For each `experiments/STUDY/` with `runs/*.jsonl`, its `analyze.py` runs on the stored runs
(in-process, writing its results to a temporary file) and `evidence.check_study` compares
them with the committed `results.json` (the runs it was computed from, each number) and with
the README (every `NUMBER<!--=key-->` and every results block). A study without stored runs
must be in `NO_EVIDENCE` with the reason, and is listed as skipped, one line each
(`pytest -rs`): storing its runs is the only way out of the list, since a listed study
that stores runs fails here too. Deleting one stored run of a copy makes the check fail.
A study whose runs span sessions is in `IN_PROGRESS` while they are collected: its runs are
stored as each finishes (a session's machine keeps nothing else) and must each read as
evidence, and it has no results until its protocol's analysis, which takes it off the list.
"""

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from rlscale.scaling import allocation, evidence

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
    "moe_lora": "runs pending (protocol registered)",
    "paradigms": "analyze.py reads a ROOT of workdirs; only the aggregated paradigms.json",
    "pipeline": "analyze.py reads a ROOT of workdirs; only fits.json stored",
    "scalerl_ablations": "analyze.py reads a ROOT of workdirs; only fits_first_half.json",
    "verifier_audit": "no runs: its table is checked by tests/test_math_verifier.py",
}

# Studies whose runs are being collected, stored as each finishes: no analysis yet.
IN_PROGRESS = {
    "off_policy": "54 runs (protocol.md), stored as they finish; the analysis after the last",
    "long_testbed": "the ceiling and 5 seeds (protocol.md); the analysis after the last",
    "iso_compute_v2": "87 runs (protocol.md), registered, not started",
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
        if not stored and study not in NO_EVIDENCE and study not in IN_PROGRESS:
            problems.append(f"{study} stores no runs/*.jsonl: store them (or list it)")
    for study in IN_PROGRESS:
        study_dir = os.path.join(EXPERIMENTS, study)
        if study in NO_EVIDENCE or os.path.exists(os.path.join(study_dir, "results.json")):
            problems.append(f"{study} is in progress: not in NO_EVIDENCE, no results.json")
        for name in evidence.manifest(study_dir):  # Each reads, or this raises naming it.
            evidence.read_run(os.path.join(study_dir, "runs", f"{name}.jsonl"))
    listed = {**NO_EVIDENCE, **IN_PROGRESS}
    problems += [
        f"{s} in NO_EVIDENCE or IN_PROGRESS is not a study" for s in listed if s not in _studies()
    ]
    assert not problems, problems


@pytest.mark.parametrize("study", _studies())
def test_readme_numbers_are_regenerated_from_stored_runs(study, tmp_path):
    study_dir = os.path.join(EXPERIMENTS, study)
    if study in IN_PROGRESS:
        stored = len(evidence.manifest(study_dir))
        pytest.skip(f"runs in progress: {study}: {stored} stored; {IN_PROGRESS[study]}")
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


# ==========================================================================================
# The evidence format and the README convention, on hand-made files.
# ==========================================================================================


def test_compact_run_from_a_workdir(tmp_path):
    config = {"seed": 3, "batch": {"group_size": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    lines = [
        {"step": 0, "compute/flops": 0.0, "eval/pass@1": 0.2, "eval/reward_mean": 0.25},
        {"step": 1, "compute/flops": 10.0, "data/prompt_ids": [1, 2, 3], "loss": 1.0},
        {"step": 2, "compute/flops": 20.0, "data/prompt_ids": [4, 5], "loss": 0.9},
        {"step": 2, "compute/flops": 20.0, "eval/pass@1": 0.4, "eval/reward_mean": 0.45},
        # A resumed run replays step 2: counted once, its last lines.
        {"step": 2, "compute/flops": 20.0, "data/prompt_ids": [6, 7], "loss": 0.8},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta, kept = evidence.compact_run(str(tmp_path), keep=("loss",))
    assert meta == {"run": tmp_path.name, "seed": 3, "config_hash": evidence.config_hash(config)}
    assert kept == [
        {"step": 0, "flops": 0.0, "samples": 0, "pass@1": 0.2, "reward": 0.25},
        {"step": 1, "flops": 10.0, "samples": 12, "loss": 1.0},
        {"step": 2, "flops": 20.0, "samples": 20, "pass@1": 0.4, "reward": 0.45, "loss": 0.8},
    ]
    path = tmp_path / "runs" / "a_s3.jsonl"
    evidence.write_run(str(path), meta, kept)
    run = evidence.read_run(str(path))
    assert run.meta == meta and run.evals() == ([0, 2], [0.0, 20.0], [0, 20], [0.2, 0.4])
    assert evidence.arms(evidence.read_study(str(tmp_path)), last=2) == {"a": [pytest.approx(0.3)]}
    path.write_text(json.dumps(meta) + "\n" + json.dumps({"step": 1, "pass@1": 0.3}) + "\n")
    with pytest.raises(ValueError, match=r"a_s3.jsonl:2: lacks flops, samples, reward"):
        evidence.read_run(str(path))
    # A study's store.py: the keys its pattern matches in full, kept beside the evaluations.
    stored = evidence.store_run(str(tmp_path), str(tmp_path / "stored"), r"l\w+|data/x")
    assert list(evidence.read_run(stored).lines) == kept


def test_readme_convention_by_hand():
    results = {"numbers": {"a.final": 0.9716, "gap": -0.0056}, "tables": {"t": "| x |\n| 1 |"}}
    ok = "final 0.972<!--=a.final-->, gap -0.006<!--=gap-->, -0.0056<!--=gap-->.\n"
    ok += "<!-- begin results: t -->\n| x |\n| 1 |\n<!-- end results: t -->\n"
    assert evidence.check_readme(ok, results) == []
    bad = ok.replace("0.972<", "0.971<").replace("| 1 |\n<", "| 2 |\n<") + "1.0<!--=nope-->"
    assert evidence.check_readme(bad, results) == [
        "README.md: quotes a.final = 0.971, the evidence gives 0.972",
        "README.md: 1.0<!--=nope--> but results have no 'nope'",
        "README.md: results block 't' differs from what analyze.py makes",
    ]
    assert evidence.check_readme("no numbers", results) == [
        "README.md: quotes no number as NUMBER<!--=key--> and no results block"
    ]


# ==========================================================================================
# The corrections (issue 31): numbers recomputed from the committed JSONs, quoted checkably.
# ==========================================================================================

# READMEs quoting `experiments/corrections.py`'s numbers; experiments/README.md from its
# "Corrections" section on (its conventions section shows the tag as an example).
CORRECTED = ("ladder", "paradigms", "iso_compute", "scalerl_ablations")


def test_corrections_are_recomputed_from_committed_files(tmp_path):
    path = os.path.join(EXPERIMENTS, "corrections.py")
    spec = importlib.util.spec_from_file_location("_corrections", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = module.main(["--results", str(tmp_path / "corrections.json")])
    with open(os.path.join(EXPERIMENTS, "corrections.json")) as f:
        committed = json.load(f)
    assert committed["tables"] == fresh["tables"]
    assert committed["numbers"].keys() == fresh["numbers"].keys()
    for key, value in committed["numbers"].items():
        assert value == pytest.approx(fresh["numbers"][key], rel=REL_TOL), key
    problems = []
    for study in CORRECTED:
        with open(os.path.join(EXPERIMENTS, study, "README.md")) as f:
            problems += evidence.check_readme(f.read(), fresh, name=f"{study}/README.md")
    with open(os.path.join(EXPERIMENTS, "README.md")) as f:
        text = f.read()
    assert "## Corrections" in text
    corrections = text[text.index("## Corrections") :]
    problems += evidence.check_readme(corrections, fresh, name="experiments/README.md")
    assert problems == []


# ==========================================================================================
# The analyses of studies still collecting runs, on synthetic evidence (their real runs come
# later, and the analysis is registered with the protocol: it must work before them).
# ==========================================================================================


def _load_analysis(study):
    path = os.path.join(EXPERIMENTS, study, "analyze.py")
    spec = importlib.util.spec_from_file_location(f"_analyze_{study}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_evals(path, name, seed, points):
    lines = [
        {"step": s, "flops": c, "samples": s * 128, "pass@1": a, "reward": a} for s, c, a in points
    ]
    evidence.write_run(
        str(path / "runs" / f"{name}.jsonl"), dict(run=name, seed=seed, config_hash="x"), lines
    )


def test_long_testbed_analysis_on_synthetic_runs(tmp_path):
    """Three seeds on exact sigmoids with A = 0.69, 0.70, 0.71 (R0 0.2, B 1.5, C_mid 5e13) and
    a ceiling of 200 prompts, half with 16 of 64 samples right and half with 1: pass@1 =
    (16 + 1) / 128 = 0.1328, pass@64 = 1."""
    from rlscale.scaling import fit

    for seed, A in enumerate((0.69, 0.70, 0.71)):
        C = np.arange(0, 201, 25) * 1e12
        acc = [0.2] + fit.sigmoid(C[1:], A, 1.5, 5e13, 0.2).tolist()
        _write_evals(tmp_path, f"full_s{seed}", seed, zip(range(0, 201, 25), C.tolist(), acc))
    rewards = [[1.0] * 16 + [0.0] * 48] * 100 + [[1.0] + [0.0] * 63] * 100
    (tmp_path / "ceiling.json").write_text(json.dumps({"per_prompt": {"rewards": rewards}}))
    numbers = _load_analysis("long_testbed").main(
        ["--study", str(tmp_path), "--results", str(tmp_path / "r.json")]
    )["numbers"]
    assert numbers["ceiling.pass@1"] == pytest.approx(17 / 128) and numbers["ceiling.pass@64"] == 1
    assert numbers["gate.ceiling"] == 1 and numbers["R0"] == pytest.approx(0.2)
    for seed, A in enumerate((0.69, 0.70, 0.71)):
        assert numbers[f"full_s{seed}.A"] == pytest.approx(A, abs=2e-3)
        assert numbers[f"full_s{seed}.half.mae"] < numbers[f"full_s{seed}.half.flat_mae"]
    assert numbers["A.sd"] == pytest.approx(0.01, abs=2e-3) and numbers["gate.sd_A"] == 1
    assert numbers["gate.A_off_bounds"] == 1 and numbers["half.mae"] < 0.005


def test_iso_compute_v2_analysis_on_synthetic_runs(tmp_path):
    """Parabolas in log2 n peaking at n = 4 (C = 2048) and 8 (C = 8192), so b = 0.5, each cell
    at two seeds +-0.005 about it; B_p = 32 is 0.03 better than B_p = 8 at every budget."""
    cells = allocation.iso_cells([2048, 8192], [2, 4, 8, 16], [8, 32], min_steps=4)
    for i, cell in enumerate(cells):
        peak = 2 if cell.budget == 2048 else 3
        value = 0.5 - 0.02 * (np.log2(cell.rollouts) - peak) ** 2 + 0.03 * (cell.prompts == 32)
        for r, offset in enumerate((0.005, -0.005)):
            M, seed = cell.steps, 2 * i + r
            name = f"C{cell.budget}__n{cell.rollouts}__B{cell.prompts}__M{M}__seed_{seed}"
            _write_evals(tmp_path, name, seed, [(0, 0.0, 0.4), (M, M * 1e9, value + offset)])
    analysis = _load_analysis("iso_compute_v2")
    analysis.N_BOOT = 200
    numbers = analysis.main(["--study", str(tmp_path), "--results", str(tmp_path / "r.json")])[
        "numbers"
    ]
    assert (numbers["C2048.n_star"], numbers["C8192.n_star"]) == (
        pytest.approx(4),
        pytest.approx(8),
    )
    assert numbers["b"] == pytest.approx(0.5) and numbers["b_lo"] <= 0.5 <= numbers["b_hi"]
    assert numbers["grows"] == 1
    # Welch on {v +- 0.005} against {v + 0.03 +- 0.005}: t = 0.03 / 0.00707 = 4.24, df 2.
    assert numbers["C2048.bp_diff"] == pytest.approx(0.03)
    assert numbers["C2048.bp_p"] == pytest.approx(0.0513, abs=1e-3)
    assert numbers["C2048.bp_holm"] == pytest.approx(2 * numbers["C2048.bp_p"])
    with pytest.raises(ValueError, match="not M=16"):  # A run stopped before its M.
        name = "C2048__n8__B16__M16__seed_99"
        _write_evals(tmp_path, name, 99, [(0, 0.0, 0.4), (8, 8e9, 0.5)])
        analysis.main(["--study", str(tmp_path), "--results", "/dev/null"])
