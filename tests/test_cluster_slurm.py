"""The Slurm launcher on a real one-node Slurm cluster started here (Debian's slurm-wlm: munged,
slurmctld and slurmd on localhost via scripts/slurm_local.sh): 2 GRPO steps through
``python -m arealite.launcher.slurm``, ``scancel`` leaving no process behind, the dry run, and
an impossible placement. Skips where Slurm is not installed or this is not root; with
``AREALITE_REQUIRE_SLURM=1`` (set by ``.ci/run``, which installs Slurm) each test fails instead,
so a CI stage that cannot run is never reported as passed."""

import json
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO_ROOT, kill_once_after_checkpoint

MISSING = ("needs Slurm (apt-get install -y slurm-wlm munge) and root to start a local cluster"
           if shutil.which("slurmctld") is None or shutil.which("sbatch") is None or os.geteuid() != 0 else "")
REQUIRED = os.environ.get("AREALITE_REQUIRE_SLURM") == "1"  # CI: a stage that would skip fails
pytestmark = pytest.mark.skipif(bool(MISSING) and not REQUIRED, reason=MISSING)

SMALL = ["--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8", "--rollout.consumer_batch_size", "4",
         "--train_dataset.batch_size", "4", "--valid_dataset.size", "2", "--evaluator.at_start", "False",
         "--train_dataset.path", "arithmetic", "--valid_dataset.path", "arithmetic"]
RECIPE = os.path.join(REPO_ROOT, "recipes", "grpo_math.py")


@pytest.fixture(scope="module")
def slurm():
    if MISSING:
        pytest.fail(f"AREALITE_REQUIRE_SLURM=1 but the Slurm tests cannot run here: {MISSING}", pytrace=False)
    proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "slurm_local.sh")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield


def _launch(args, cwd, timeout=600):
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "arealite.launcher.slurm", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _leftovers(marker: str, port: int | None) -> list[str]:
    """Processes whose command line names ``marker`` (the run folder) or the server's port."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if (marker in cmd or (port and f"--port {port}" in cmd)) and p.pid != os.getpid():
            found.append(f"{p.pid}: {cmd[:200]}")
    return found


def _server_port(out) -> int | None:
    path = out / "servers" / "server0.addr"
    return int(path.read_text().strip().rsplit(":", 1)[1]) if path.exists() else None


def _wait_gone(marker, port, timeout=30.0) -> list[str]:
    deadline = time.time() + timeout
    while (left := _leftovers(marker, port)) and time.time() < deadline:
        time.sleep(0.5)
    return left


def test_grpo_two_steps_as_a_slurm_job(slurm, tiny_model_dir, tmp_path):
    proc = _launch(["--wait", RECIPE, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                    "--total_train_steps", "2", *SMALL], str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    out = tmp_path / "grpo_math" / "trial0"
    job_id = proc.stdout.split("submitted job ", 1)[1].split()[0]
    assert f"job {job_id} COMPLETED" in proc.stdout
    rows = [json.loads(line) for line in open(out / "stats.jsonl")]
    train = [r for r in rows if "summary" not in r]
    assert [r["step"] for r in train] == [0, 1]
    assert all(r["rollout/n_samples"] == 8 and r["rollout/staleness_max"] <= 1 for r in train)
    assert "step 2/2" in (out / "logs" / f"slurm-{job_id}.out").read_text()
    assert "starting on" in (out / "logs" / "server0.log").read_text()
    script = (out / "slurm" / "job.sh").read_text()
    assert "srun" in script and "torch.distributed.run" in script and "arealite.launcher.slurm serve" in script
    assert _wait_gone(str(tmp_path), _server_port(out)) == []


def test_scancel_stops_every_process(slurm, tiny_model_dir, tmp_path):
    proc = _launch([RECIPE, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                    "--total_train_steps", "200", *SMALL], str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split("submitted job ", 1)[1].split()[0]
    out = tmp_path / "grpo_math" / "trial0"
    deadline = time.time() + 300
    while not (out / "stats.jsonl").exists() and time.time() < deadline:  # training is under way
        time.sleep(0.5)
    assert (out / "stats.jsonl").exists(), (out / "logs" / f"slurm-{job_id}.out").read_text()[-3000:]
    port = _server_port(out)
    assert _leftovers(str(tmp_path), port)  # trainer and server are running
    subprocess.run(["scancel", job_id], check=True)
    assert _wait_gone(str(tmp_path), port) == []
    state = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip()
    assert state == "" or "CG" in state


def test_dry_run_prints_the_script_and_writes_nothing(slurm, tiny_model_dir, tmp_path):
    proc = _launch(["--dry-run", RECIPE, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                    "--rollout.n_servers", "1", *SMALL], str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=1" in proc.stdout
    assert "#SBATCH --cpus-per-task=2" in proc.stdout  # 1 server thread + 1 trainer CPU on the one node
    assert "--rollout.addresses $ADDRS" in proc.stdout
    assert not (tmp_path / "grpo_math").exists()


@pytest.mark.parametrize("flags,field", [(["--launcher.trainer_gpus", "1"], "launcher.trainer_gpus"),
                                         (["--launcher.n_nodes", "2"], "launcher.n_nodes")])
def test_impossible_placement_fails_fast(slurm, tiny_model_dir, tmp_path, flags, field):
    start = time.monotonic()
    proc = _launch([RECIPE, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), *flags], str(tmp_path), 60)
    assert proc.returncode == 2 and field in proc.stderr and "Slurm cluster has 1 node" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 10
    assert not (tmp_path / "grpo_math").exists()


def test_server_step_relaunched_and_trainer_failure_restarts_the_job(slurm, tiny_model_dir, tmp_path):
    """The server process is SIGKILLed after step 1: the job script starts its step again on
    the same port and trainer rank 0 catches it up. Then the trainer SIGKILLs itself after
    recover/step3: the script restarts servers and trainers, which resume at step 3."""
    (tmp_path / "kill.py").write_text(kill_once_after_checkpoint(rank=0, step=3))
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "arealite.launcher.slurm", "--wait", str(tmp_path / "kill.py"), RECIPE,
           "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "4",
           "--recover.freq_steps", "1", "--recover.mode", "auto", "--launcher.max_restarts", "1",
           "--evaluator.at_end", "False", *SMALL]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = tmp_path / "grpo_math" / "trial0"
    deadline, killed = time.time() + 300, None
    while killed is None and time.time() < deadline and proc.poll() is None:
        if (out / "stats.jsonl").exists() and (port := _server_port(out)):
            servers = [p for p in psutil.process_iter(["pid", "cmdline"])
                       if f"--port {port}" in " ".join(p.info["cmdline"] or []) and "arealite.server" in
                       " ".join(p.info["cmdline"] or [])]
            if servers:
                servers[0].kill()
                killed = port
        time.sleep(0.2)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and killed, log[-6000:]
    assert "arealite: server 0 on" in log and "starting it again (restart 1 of 3)" in log
    assert "is back (restarted, at weight version" in log
    assert "restarting the job from the newest recover checkpoint (restart 1 of 1)" in log
    assert f"resuming from {out / 'recover' / 'step3'}" in log
    rows = [json.loads(line) for line in open(out / "stats.jsonl") if "summary" not in line]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["rollout/n_samples"] == 8 and r["rollout/dropped_stale"] == 0 for r in rows)
    assert _wait_gone(str(tmp_path), _server_port(out)) == []
