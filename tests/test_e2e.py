"""End to end: 2 GRPO steps of the real recipe under torchrun with 2 ranks (gloo), a tiny random
model, and our server launched by the recipe — asynchronous (η = 1) and synchronous (η = 0)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT


def _torchrun(args, cwd, timeout=900):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO_ROOT, "recipes", "grpo_math.py"), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("eta", [1, 0])
def test_two_grpo_steps_on_two_ranks(tiny_model_dir, tmp_path, eta):
    proc = _torchrun([
        "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "2",
        "--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8",
        "--rollout.consumer_batch_size", "4", "--train_dataset.batch_size", "4",
        "--rollout.max_head_offpolicyness", str(eta), "--valid_dataset.size", "4",
        # the asynchronous run in the main job's precision: bf16 where this CPU has it, else fp32
        *(["--actor.mixed_precision", "auto", "--rollout.dtype", "auto"] if eta else []),
    ], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / "grpo_math" / "trial0"
    steps = [json.loads(line) for line in open(out / "stats.jsonl")]
    train_steps = [s for s in steps if "summary" not in s]
    assert [s["step"] for s in train_steps] == [0, 1]
    for s in train_steps:
        assert s["rollout/staleness_max"] <= eta  # no trained token older than the bound
        assert s["rollout/dropped_stale"] == 0
        assert s["actor/n_microbatches"] >= 1
        # model FLOPs of the step's forwards/backwards over the measured GEMM peak (arealite/utils/perf.py)
        assert s["perf/model_tflops"] > 0 and s["perf/gemm_peak_tflops"] > 0
        assert s["perf/mfu"] == pytest.approx(s["perf/tflops_per_s"] / s["perf/gemm_peak_tflops"], rel=1e-6)
        if s["rollout/reward"] == 0.0:  # a random model: all-equal groups → zero advantage → zero gradient
            assert s["actor/grad_norm"] == 0.0
    if eta == 0:  # synchronous: nothing of step 2 was generated before step 1's update finished
        assert train_steps[1]["rollout/overlap_frac"] == 0.0 and train_steps[1]["rollout/staleness_max"] == 0
    else:  # asynchronous: step 2's rollouts began while step 1 was training
        assert train_steps[1]["rollout/overlap_frac"] > 0
    assert "step 2/2" in proc.stdout and "reward" in proc.stdout, proc.stdout
    from arealite.utils.perf import fast_bf16

    bf16 = eta == 1 and fast_bf16("cpu")[0]
    want = ("precision: trainer bf16 compute, fp32 master weights (actor.mixed_precision=auto), servers bfloat16 "
            "(rollout.dtype=auto)" if bf16 else "precision: trainer fp32 (actor.mixed_precision="
            + ("auto), servers float32 (rollout.dtype=auto)" if eta else "none), servers float32 (rollout.dtype=float32)"))
    assert want in proc.stdout, proc.stdout
    assert ("--dtype auto -> bfloat16" in open(out / "logs" / "server0.log").read()) == bf16
    print(proc.stdout)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    rollouts = [json.loads(line) for line in open(out / "rollouts" / "rollouts.jsonl")]
    assert len(rollouts) >= 2 and all(len(r["completions"]) == 2 for r in rollouts)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 2
