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
    assert "held-out greedy episodes end training" in proc.stdout
    assert os.path.exists(out / "final" / "config.json")
