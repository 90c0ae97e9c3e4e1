"""The GSPO and PPO recipes run 3 steps under torchrun with 2 ranks (gloo) on a tiny random
model with our server; GRPO with dynamic sampling stops with a clear error when no group ever
carries a learning signal (instead of sampling forever)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

SMALL = ["--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8", "--rollout.consumer_batch_size", "4",
         "--train_dataset.batch_size", "4", "--valid_dataset.size", "4"]


def _torchrun(recipe, args, cwd, timeout=900):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO_ROOT, "recipes", recipe), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _train_steps(path):
    return [s for s in map(json.loads, open(path)) if "summary" not in s]


def test_gspo_recipe_three_steps(tiny_model_dir, tmp_path):
    proc = _torchrun("gspo_math.py", ["--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                                      "--total_train_steps", "3", *SMALL], str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = _train_steps(tmp_path / "gspo_math" / "trial0" / "stats.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["rollout/staleness_max"] <= 1 and s["actor/n_microbatches"] >= 1
        # one minibatch (the dataclass default): π_prox is the training forward itself, so the
        # sequence ratio is exactly 1 and nothing is clipped, even with GSPO's tiny clip range
        assert s["actor/clip_frac"] == 0.0 and s["actor/approx_kl"] == 0.0
    assert (tmp_path / "gspo_math" / "trial0" / "final" / "config.json").exists()


def test_ppo_recipe_three_steps_trains_the_critic(tiny_model_dir, tmp_path):
    proc = _torchrun("ppo_math.py", ["--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                                     "--total_train_steps", "3", "--critic.optimizer.lr", "1e-3", *SMALL],
                     str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = _train_steps(tmp_path / "ppo_math" / "trial0" / "stats.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        for key in ("critic/loss", "critic/grad_norm", "critic/explained_var", "critic/value_clip_frac",
                    "actor/advantage_std", "actor/importance_weight_max", "actor/approx_kl_behav"):
            assert key in s, key
    # the zero-initialised value head predicts 0 at step 0: its loss is ½·mean(G²) with G = the
    # (all-zero for a random model) reward → 0 loss and no gradient; then it stays at 0
    assert steps[0]["critic/value_mean"] == 0.0


def test_dynamic_sampling_without_any_signal_stops_with_a_clear_error(tiny_model_dir, tmp_path):
    # a random model never answers correctly: every group has all-equal (zero) rewards
    proc = _torchrun("grpo_math.py", ["--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                                      "--total_train_steps", "2", "--algo.dynamic_sampling", "True",
                                      "--evaluator.at_start", "False", *SMALL], str(tmp_path), timeout=600)
    assert proc.returncode != 0
    assert "algo.dynamic_sampling" in proc.stdout + proc.stderr
