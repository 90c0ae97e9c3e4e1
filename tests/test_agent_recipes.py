"""The agent recipes run 2 GRPO steps under torchrun with 2 ranks and a tiny random model, with
their YAML configs, and log reward and turns per episode."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

SMALL = ["--total_train_steps", "2", "--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8",
         "--rollout.consumer_batch_size", "4", "--train_dataset.batch_size", "4", "--valid_dataset.size", "2",
         "--evaluator.at_start", "False"]


def _torchrun(recipe, args, cwd, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO_ROOT, "recipes", recipe), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("recipe,max_turns", [("multi_turn_math", 2), ("tool_agent_math", 3)])
def test_agent_recipe_two_steps_on_two_ranks(tiny_model_dir, tmp_path, recipe, max_turns):
    config = os.path.join(REPO_ROOT, "recipes", "configs", f"{recipe}.yaml")
    data = ["--train_dataset.path", "arithmetic", "--valid_dataset.path", "arithmetic"]  # no files needed
    proc = _torchrun(f"{recipe}.py", ["--config", config, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                                      "--agent.max_turns", str(max_turns), *data, *SMALL], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / recipe / "trial0"
    steps = [json.loads(line) for line in open(out / "stats.jsonl")]
    train_steps = [s for s in steps if "summary" not in s]
    assert [s["step"] for s in train_steps] == [0, 1]
    rollouts = [json.loads(line) for line in open(out / "rollouts" / "rollouts.jsonl")]
    for s in train_steps:
        assert 1.0 <= s["rollout/turns"] <= max_turns and s["rollout/staleness_max"] <= 1
        assert s["rollout/reward"] == 0.0 and s["actor/grad_norm"] == 0.0  # random model: all wrong
    for r in rollouts:
        assert len(r["turns"]) == 2 and all(len(t) == n for t, n in zip(r["texts"], r["turns"]))
    if recipe == "multi_turn_math":  # a random model is always wrong, so it uses every retry
        assert all(s["rollout/turns"] == 2.0 for s in train_steps)
        assert all(t == 2 for r in rollouts for t in r["turns"])
    assert "held-out greedy evaluation after training: reward" in proc.stdout
    assert os.path.exists(out / "final" / "config.json")


def test_tool_agent_recipe_resumes_after_sigkill_at_the_saved_step(tiny_model_dir, tmp_path):
    """--recover.freq_steps 1: SIGKILL the whole run (trainer + its server) once recover/step2 is
    complete, rerun with --recover.mode auto: it resumes at step 2 and trains steps 2, 3 only."""
    import signal
    import time

    from arealite.utils.recover import list_checkpoints

    args = ["--config", os.path.join(REPO_ROOT, "recipes", "configs", "tool_agent_math.yaml"),
            "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--train_dataset.path", "arithmetic",
            "--valid_dataset.path", "arithmetic", "--recover.freq_steps", "1", "--recover.mode", "auto",
            "--evaluator.at_end", "False", *SMALL[:-2], "--evaluator.at_start", "False"]
    args[args.index("--total_train_steps") + 1] = "4"
    out = tmp_path / "tool_agent_math" / "trial0"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(REPO_ROOT, "recipes", "tool_agent_math.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if [s for s, _ in list_checkpoints(str(out / "recover"))] == [2]:
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [s for s, _ in list_checkpoints(str(out / "recover"))] == [2], open(tmp_path / "first.log").read()[-3000:]
    steps = [json.loads(line)["step"] for line in open(out / "stats.jsonl") if "summary" not in line]
    assert steps[:2] == [0, 1]

    second = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert f"resuming from {out / 'recover' / 'step2'}" in second.stdout
    rows = [json.loads(line) for line in open(out / "stats.jsonl")]
    resumed = [r["step"] for r in rows if "summary" not in r][len(steps):]
    assert resumed == [2, 3]  # resumed at the saved step; nothing before it trained again
    assert [s for s, _ in list_checkpoints(str(out / "recover"))] == [4]


def test_multi_turn_recipe_honours_dynamic_sampling(tiny_model_dir, tmp_path):
    """A random model fails every episode, so every group has all-equal rewards: with
    --algo.dynamic_sampling True all of them are rejected and the run stops with the dynamic
    sampling error (without it the same run trains, see the test above)."""
    config = os.path.join(REPO_ROOT, "recipes", "configs", "multi_turn_math.yaml")
    proc = _torchrun("multi_turn_math.py", [
        "--config", config, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--agent.max_turns", "1",
        "--train_dataset.path", "arithmetic", "--valid_dataset.path", "arithmetic", "--algo.dynamic_sampling", "True",
        *SMALL], cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "algo.dynamic_sampling" in proc.stdout + proc.stderr and "all-equal rewards" in proc.stdout + proc.stderr
    assert not os.path.exists(tmp_path / "multi_turn_math" / "trial0" / "final")
