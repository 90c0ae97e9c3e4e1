"""The agent recipes run 2 GRPO steps under torchrun with 2 ranks and a tiny random model, with
their YAML configs, and log reward and turns per episode."""

import json
import os
import subprocess
import sys
import time

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


KILL_AFTER_SAVE = """
import os, runpy, signal, sys
import arealite.trainer.rl_loop as loop
real = loop.save_checkpoint
def save_then_die(root, step, *args, **kwargs):
    path = real(root, step, *args, **kwargs)
    if step == int(os.environ["KILL_AFTER_STEP"]):
        os.killpg(os.getpgrp(), signal.SIGKILL)  # trainer, torchrun and the server, mid-run
    return path
loop.save_checkpoint = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("name,extra", [
    ("tool_agent_math", ["--config", os.path.join(REPO_ROOT, "recipes", "configs", "tool_agent_math.yaml")]),
    ("multi_turn_math", ["--config", os.path.join(REPO_ROOT, "recipes", "configs", "multi_turn_math.yaml"),
                         "--agent.max_turns", "1"]),
    ("gspo_math", []),
    ("ppo_math", []),  # the critic's weights and optimizer are in the checkpoint too
    ("dpo_math", ["--mode", "online", "--reward_fn", "dpo_reward_fns:even_length"]),
])
def test_rl_recipe_resumes_after_sigkill_at_the_saved_step(tiny_model_dir, tmp_path, name, extra):
    """--recover.freq_steps 1 --recover.mode auto: the run is SIGKILLed (trainer, torchrun and the
    server) right after recover/step2 is written; the same command again resumes at step 2 and
    trains steps 2, 3 only. Every RL recipe runs the same loop; three different ones here."""
    from arealite.utils.recover import list_checkpoints

    recipe = os.path.join(REPO_ROOT, "recipes", f"{name}.py")
    args = [*extra, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--train_dataset.path", "arithmetic",
            "--valid_dataset.path", "arithmetic", "--recover.freq_steps", "1", "--recover.mode", "auto",
            "--evaluator.at_end", "False", *SMALL]
    args[args.index("--total_train_steps") + 1] = "4"
    out = tmp_path / name / "trial0"
    (tmp_path / "kill_after_save.py").write_text(KILL_AFTER_SAVE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_AFTER_STEP": "2",
           "PYTHONPATH": os.path.join(REPO_ROOT, "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    first = subprocess.run([*torchrun, str(tmp_path / "kill_after_save.py"), recipe, *args], cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=600, env=env, start_new_session=True)
    killed_at = time.time()
    assert first.returncode != 0, first.stdout[-3000:] + first.stderr[-3000:]  # killed, not finished
    assert [s for s, _ in list_checkpoints(str(out / "recover"))] == [2]
    steps = [json.loads(line)["step"] for line in open(out / "stats.jsonl")]
    assert steps == [0, 1]

    second = subprocess.run([*torchrun, recipe, *args], cwd=str(tmp_path), capture_output=True, text=True,
                            timeout=600, env=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert f"resuming from {out / 'recover' / 'step2'}" in second.stdout
    rows = [json.loads(line) for line in open(out / "stats.jsonl")]
    assert [r["step"] for r in rows if "summary" not in r] == [0, 1, 2, 3]  # resumed at 2, nothing redone
    resumed = next(r for r in rows if r.get("step") == 2)
    print(f"{name}: killed after recover/step2; the rerun trained step 2 "
          f"{resumed['time/train_start'] - killed_at:.1f} s after the kill; steps redone: 0")
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


@pytest.mark.parametrize("recipe,keys", [
    ("search_agent", ("tool_calls", "answered", "correct")),
    ("service_agent", ("tool_calls", "policy_violations", "user_turns", "db_match")),
])
def test_env_agent_recipe_two_steps_on_two_ranks(tiny_model_dir, tmp_path, recipe, keys):
    """The search and the customer-service agent: 2 GRPO steps on 2 ranks (tiny random model) with their
    YAML configs and generated data; each step logs the tool counters and exactly one end reason per
    episode (the ended_* means sum to 1)."""
    config = os.path.join(REPO_ROOT, "recipes", "configs", f"{recipe}.yaml")
    fit = ["--agent.max_context_tokens", "1024"] + (["--retail.demos", "False"] if recipe == "service_agent" else [])
    proc = _torchrun(f"{recipe}.py", ["--config", config, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                                      *fit, *SMALL], cwd=str(tmp_path))  # the tiny model's context is 1024
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / recipe / "trial0"
    steps = [s for s in map(json.loads, open(out / "stats.jsonl")) if "summary" not in s]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert all(f"rollout/{k}" in s for k in keys) and 1.0 <= s["rollout/turns"] <= 4
        assert sum(v for k, v in s.items() if k.startswith("rollout/ended_")) == pytest.approx(1.0)
    rollouts = [json.loads(line) for line in open(out / "rollouts" / "rollouts.jsonl")]
    assert rollouts and all(sum(v for k, v in info.items() if k.startswith("ended_")) == 1
                            for r in rollouts for info in r["info"])
    assert "held-out greedy evaluation after training: reward" in proc.stdout
