"""``.ci/run`` stops at the first failing stage and runs the Slurm and vLLM stages as required
ones (their skips become failures). It is run on a copy of itself with stub stages (a setup script,
a python and a vLLM script that record what ran and with which variables): nothing is installed."""

import os
import shutil
import subprocess

import pytest

from conftest import REPO_ROOT


def _ci(tmp_path, setup_status: int, pytest_status: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    repo = tmp_path / "repo"
    for d in (".ci", "scripts", ".venv/bin"):
        (repo / d).mkdir(parents=True)
    shutil.copy(os.path.join(REPO_ROOT, ".ci", "run"), repo / ".ci" / "run")
    ran = tmp_path / "ran"
    stubs = {repo / "scripts" / "setup.sh": f"echo setup >> {ran}; exit {setup_status}",
             repo / ".venv" / "bin" / "python": f'echo "pytest slurm=${{AREALITE_REQUIRE_SLURM:-}}" >> {ran}; '
                                                f"exit {pytest_status}",
             repo / "scripts" / "test_vllm.sh": f'echo "vllm vllm=${{AREALITE_REQUIRE_VLLM:-}}" >> {ran}'}
    bin_dir = tmp_path / "bin"  # slurmctld present: .ci/run installs nothing
    bin_dir.mkdir()
    stubs[bin_dir / "slurmctld"] = "exit 0"
    for path, body in stubs.items():
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("AREALITE_REQUIRE_SLURM", None)
    env.pop("AREALITE_REQUIRE_VLLM", None)
    proc = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    return proc, (ran.read_text().splitlines() if ran.exists() else [])


@pytest.mark.parametrize("setup_status,pytest_status,status,stages", [
    (7, 0, 7, ["setup"]),  # a failing setup stops CI with its status: no tests, no vLLM stage
    (0, 1, 1, ["setup", "pytest slurm=1"]),  # failing tests (e.g. the required Slurm tests) stop it too
    (0, 0, 0, ["setup", "pytest slurm=1", "vllm vllm=1"]),  # every stage, the last two as required ones
])
def test_ci_stops_at_the_first_failing_stage(tmp_path, setup_status, pytest_status, status, stages):
    proc, ran = _ci(tmp_path, setup_status, pytest_status)
    assert proc.returncode == status, proc.stderr
    assert ran == stages


@pytest.mark.parametrize("required,outcome", [("1", " error"), ("", " skipped in ")])
def test_slurm_tests_fail_instead_of_skipping_when_required(tmp_path, required, outcome):
    """On a machine without Slurm (PATH without slurmctld/sbatch) the Slurm tests skip for the
    README's command and fail (their fixture, before any cluster starts) under .ci/run's variable."""
    import sys

    env = {**os.environ, "PATH": str(tmp_path), "AREALITE_REQUIRE_SLURM": required}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "tests/test_cluster_slurm.py"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    last = proc.stdout.splitlines()[-1]
    assert outcome in last and "passed" not in last, proc.stdout[-2000:]
    if required:
        assert "AREALITE_REQUIRE_SLURM=1 but the Slurm tests cannot run here" in proc.stdout


@pytest.mark.parametrize("required", ["1", ""])
def test_vllm_tests_fail_instead_of_skipping_when_required(required):
    import sys

    env = {k: v for k, v in os.environ.items() if k != "AREALITE_VLLM_PYTHON"}
    env["AREALITE_REQUIRE_VLLM"] = required
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_vllm_real.py"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    if required:
        assert proc.returncode != 0 and "AREALITE_REQUIRE_VLLM=1 but AREALITE_VLLM_PYTHON is not set" in proc.stdout
    else:
        assert proc.returncode in (0, 5) and "1 skipped" in proc.stdout.splitlines()[-1], proc.stdout  # 5: none ran
