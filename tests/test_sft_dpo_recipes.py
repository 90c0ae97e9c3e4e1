"""End to end: 2 steps of recipes/sft_math.py, recipes/dpo_math.py offline and online under
torchrun with 2 ranks (gloo) and a tiny random model; the final checkpoints load with
``from_pretrained``."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

TESTS = os.path.join(REPO_ROOT, "tests")


def _torchrun(script, args, cwd, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO_ROOT, "recipes", script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _stats(out):
    rows = [json.loads(line) for line in open(out / "stats.jsonl")]
    return [r for r in rows if "summary" not in r], [r["summary"] for r in rows if "summary" in r][-1]


def _loads(path):
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(path).config.num_hidden_layers == 2


def test_sft_recipe_two_steps_on_two_ranks(tiny_model_dir, tmp_path):
    proc = _torchrun("sft_math.py", [
        "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "2",
        "--train_dataset.batch_size", "4", "--valid_dataset.size", "5", "--valid_dataset.batch_size", "2",
        "--evaluator.freq_steps", "1", "--actor.optimizer.lr", "1e-3",
    ], cwd=str(tmp_path))
    steps, summary = _stats(tmp_path / "sft_math" / "trial0")
    assert [s["step"] for s in steps] == [0, 1]
    assert "eval/loss" in steps[0] and "eval/loss" not in steps[1]  # the last eval is the summary's
    # random model over a ~49k vocabulary: NLL near ln(49152) = 10.8 nats/token
    assert 9.0 < summary["eval/loss_start"] < 12.0 and summary["eval/loss_end"] < summary["eval/loss_start"]
    assert all(s["actor/n_tokens"] > 0 and s["actor/loss"] > 9.0 for s in steps)
    assert "held-out loss before training" in proc.stdout
    _loads(tmp_path / "sft_math" / "trial0" / "final")


def test_dpo_offline_recipe_two_steps_on_two_ranks(tiny_model_dir, tmp_path):
    _torchrun("dpo_math.py", [
        "--mode", "offline", "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "2",
        "--train_dataset.batch_size", "4", "--valid_dataset.size", "2", "--evaluator.at_start", "False",
    ], cwd=str(tmp_path))
    steps, summary = _stats(tmp_path / "dpo_math" / "trial0")
    assert [s["step"] for s in steps] == [0, 1]
    # step 0: policy = reference, so Δ = 0 for every pair: loss = ln 2, margin 0, accuracy 0
    assert steps[0]["actor/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[0]["actor/rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    assert all(s["actor/n_pairs"] == 4 for s in steps)
    assert steps[1]["actor/logps/chosen"] < 0 and steps[1]["actor/grad_norm"] > 0
    assert summary["eval/accuracy_end"] == 0.0  # a random model solves nothing
    _loads(tmp_path / "dpo_math" / "trial0" / "final")


def test_dpo_online_recipe_two_steps_on_two_ranks(tiny_model_dir, tmp_path):
    eta = 1
    _torchrun("dpo_math.py", [
        "--mode", "online", "--reward_fn", "dpo_reward_fns:even_length", "--actor.path", tiny_model_dir,
        "--fileroot", str(tmp_path), "--total_train_steps", "2", "--train_dataset.batch_size", "4",
        "--rollout.consumer_batch_size", "2", "--rollout.max_head_offpolicyness", str(eta),
        "--gconfig.n_samples", "4", "--gconfig.max_new_tokens", "6", "--evaluator.at_start", "False",
        "--evaluator.at_end", "False",
    ], cwd=str(tmp_path))
    out = tmp_path / "dpo_math" / "trial0"
    steps, _ = _stats(out)
    assert [s["step"] for s in steps] == [0, 1]
    assert steps[0]["actor/loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 0
    for s in steps:
        assert s["actor/n_pairs"] == 2  # consumer_batch_size pairs over both ranks
        assert s["rollout/chosen_reward"] == 1.0  # even_length gives 0/1: chosen is always the 1
        assert s["rollout/staleness_max"] <= eta and s["rollout/dropped_stale"] == 0
    episodes = [json.loads(line) for line in open(out / "rollouts" / "rollouts.jsonl")]
    assert len(episodes) >= 2 and all(len(e["completions"]) == 4 for e in episodes)
    _loads(out / "final")
