"""``.ci/run`` stops at the first failing stage: with a setup script that fails, the test suite and
the vLLM stage never run and the run's status is that failure (stub stages in a copy, no install)."""

import os
import shutil
import subprocess

from conftest import REPO_ROOT


def test_a_failing_setup_stops_ci(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / "scripts").mkdir()
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(os.path.join(REPO_ROOT, ".ci", "run"), repo / ".ci" / "run")
    ran = tmp_path / "ran"
    stubs = {repo / "scripts" / "setup.sh": "exit 7",  # the failing stage
             repo / "scripts" / "test_vllm.sh": f"echo vllm >> {ran}",
             repo / ".venv" / "bin" / "python": f"echo pytest >> {ran}"}
    bin_dir = tmp_path / "bin"  # slurmctld/sbatch present, so the Slurm check passes as in CI
    bin_dir.mkdir()
    for name in ("slurmctld", "sbatch"):
        stubs[bin_dir / name] = "exit 0"
    for path, body in stubs.items():
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True)
    assert not ran.exists(), "a stage after the failing setup ran"
    # As root (CI) the failing setup's own status comes back; elsewhere the Slurm check stops it first.
    assert proc.returncode == (7 if os.geteuid() == 0 else 1), proc.stderr
