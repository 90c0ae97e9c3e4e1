"""The Ray launcher on a real two-node Ray cluster built on this machine (a head raylet with 1 CPU
and a worker raylet with 2 CPUs, ``ray.cluster_utils.Cluster``): placement, training, a server
killed mid-run, a trainer rank SIGKILLed and the job restarted, impossible placements."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO_ROOT, kill_once_after_checkpoint

ray = pytest.importorskip("ray")

SMALL = ["--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8", "--rollout.consumer_batch_size", "4",
         "--train_dataset.batch_size", "4", "--valid_dataset.size", "2", "--evaluator.at_start", "False",
         "--train_dataset.path", "arithmetic", "--valid_dataset.path", "arithmetic",
         "--launcher.trainer_ranks", "2", "--launcher.n_nodes", "2"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = c.add_node(num_cpus=2)
    c.wait_for_nodes()
    yield c, c.head_node.node_id, worker.node_id
    c.shutdown()


def _launch(cluster_address, recipe, args, cwd, timeout=600):
    cmd = [sys.executable, "-m", "arealite.launcher.ray", recipe, *args, "--launcher.ray_address", cluster_address]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _train_rows(out):
    return [json.loads(line) for line in open(out / "stats.jsonl") if "summary" not in json.loads(line)]


def test_grpo_on_two_ray_nodes_servers_on_one_trainers_on_the_other(cluster, tiny_model_dir, tmp_path):
    c, head, worker = cluster
    recipe = os.path.join(REPO_ROOT, "recipes", "grpo_math.py")
    proc = _launch(c.address, recipe, ["--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                                        "--total_train_steps", "3", *SMALL], str(tmp_path))
    rc, log = _finish(proc)
    assert rc == 0, log[-6000:]
    out = tmp_path / "grpo_math" / "trial0"
    placement = json.load(open(out / "logs" / "placement.json"))
    assert [s["node_id"] for s in placement["servers"]] == [head]  # 1 CPU: the server
    assert [t["node_id"] for t in placement["trainers"]] == [worker, worker]  # 2 CPUs: both ranks
    rows = _train_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:  # every step trains the configured batch, within the staleness bound
        assert r["rollout/n_samples"] == 8 and r["rollout/staleness_max"] <= 1 and r["rollout/dropped_stale"] == 0
    versions = sorted({v for rec in map(json.loads, open(out / "rollouts" / "rollouts.jsonl"))
                       for vs in rec["versions"] for v in vs})
    assert versions[0] == 0 and set(range(3)) <= set(versions) <= set(range(4))  # servers followed v = 0, 1, 2
    for name in ("server0.log", "trainer0.log", "trainer1.log"):
        assert (out / "logs" / name).stat().st_size > 0
    assert "[trainer0] step 3/3" in log and "[trainer1]" in log and "[server0]" in log  # streamed to the driver
    assert "finished" in log


def test_server_killed_and_trainer_rank_killed_the_job_recovers(cluster, tiny_model_dir, tmp_path):
    """The server process is SIGKILLed after step 1: Ray restarts its actor, rank 0 catches it up
    (disk weights, current version) and readmits it. Then trainer rank 1 SIGKILLs itself after
    recover/step5: the launcher reports the rank, restarts the job, which resumes at step 5."""
    c, head, worker = cluster
    # Rank 1 dies after recover/step5, not earlier: the batches of steps 1–3 may all be generated
    # before the server is killed (the tiny model is fast; η = 1 admits them at versions 0–1), but
    # step 5's batch is admitted only at version 3, after the kill, so the first job must wait for
    # the restarted server and rank 0 must catch it up before that checkpoint exists.
    (tmp_path / "kill_rank1.py").write_text(kill_once_after_checkpoint(rank=1, step=5))
    recipe = os.path.join(REPO_ROOT, "recipes", "grpo_math.py")
    args = [recipe, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "6",
            "--recover.freq_steps", "1", "--recover.mode", "auto", "--launcher.max_restarts", "1",
            "--evaluator.at_end", "False", *SMALL]
    proc = _launch(c.address, str(tmp_path / "kill_rank1.py"), args, str(tmp_path))
    out = tmp_path / "grpo_math" / "trial0"
    killed = {}

    def kill_server_after_step1():
        deadline = time.time() + 300
        while time.time() < deadline:
            if (out / "stats.jsonl").exists() and len(open(out / "stats.jsonl").readlines()) >= 1:
                pid = json.load(open(out / "logs" / "placement.json"))["servers"][0]["pid"]
                os.kill(pid, signal.SIGKILL)
                killed["at"] = time.time()
                return
            time.sleep(0.2)

    t = threading.Thread(target=kill_server_after_step1)
    t.start()
    rc, log = _finish(proc)
    t.join()
    (tmp_path / "driver.log").write_text(log)
    assert rc == 0, log[-8000:]
    assert "aiohttp.access" not in log  # the servers' per-request log is off (--access-log turns it on)
    assert "at" in killed
    trainer0 = open(out / "logs" / "trainer0.log").read()
    # the restarted server was caught up to a version >= 1 before it took requests again
    back = [line for line in trainer0.splitlines() if "is back (restarted, at weight version" in line]
    assert back and int(back[0].rsplit("version ", 1)[1].split(")")[0]) >= 1, trainer0[-4000:]
    # Step 1 was logged (weights at version 1 pushed) before the kill, so every rollout begun
    # after it was generated by a caught-up server: no token of version 0.
    later = [r for r in map(json.loads, open(out / "rollouts" / "rollouts.jsonl")) if r["start_time"] > killed["at"]]
    assert later and all(min(vs) >= 1 for r in later for vs in r["versions"])
    # Rank 0 fails too once its peer is gone, and may be reported first by Ray: the launcher names
    # every failed rank ordered by when each process ended, so the SIGKILLed rank 1 comes first.
    failure = next(line for line in log.splitlines() if "arealite.launcher.ray: trainer rank" in line)
    assert re.search(r"^arealite\.launcher\.ray: trainer rank 1 on node \S+ \(Ray node \w+\) failed( first)?: "
                     r"killed by SIGKILL; see \S+/logs/trainer1\.log", failure), failure
    assert "restarting the job from the newest recover checkpoint (restart 1 of 1)" in log
    assert f"resuming from {out / 'recover' / 'step5'}" in log
    rows = _train_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # resumed at 5: no step redone or skipped
    for r in rows:
        assert r["rollout/n_samples"] == 8 and r["rollout/staleness_max"] <= 1 and r["rollout/dropped_stale"] == 0
    assert json.load(open(out / "logs" / "placement.json"))["attempt"] == 1


@pytest.mark.parametrize("flags,field", [
    (["--launcher.trainer_gpus", "1"], "launcher.trainer_gpus"),
    (["--rollout.n_servers", "0"], "rollout.n_servers"),
    (["--launcher.n_nodes", "3"], "launcher.n_nodes"),
    (["--launcher.trainer_cpus", "3"], "launcher.trainer_cpus"),
])
def test_impossible_placement_fails_fast_naming_the_field(cluster, tiny_model_dir, tmp_path, flags, field):
    c, _, _ = cluster
    start = time.monotonic()
    proc = _launch(c.address, os.path.join(REPO_ROOT, "recipes", "grpo_math.py"),
                   ["--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), *SMALL, *flags], str(tmp_path))
    rc, log = _finish(proc, timeout=60)
    elapsed = time.monotonic() - start
    assert rc != 0 and field in log, log[-3000:]
    assert "Traceback" not in log or "ConfigError" in log
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert not (tmp_path / "grpo_math").exists()  # nothing started, nothing written
