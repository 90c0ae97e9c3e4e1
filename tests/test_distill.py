"""On-policy distillation: the server's prompt logprobs (SGLang's ``logprob_start_len``) equal a
plain forward of the teacher, the per-token signal equals a hand computation from two known
models on the student's exact tokens, tokenizers are checked up front, and recipes/distill_math.py
runs 2 steps on 2 ranks (teacher = student: the signal is 0 up to float noise)."""

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, env_without_dist, save_tiny_model
from arealite.algorithms.distill import reverse_kl_advantages


def test_reverse_kl_advantages_by_hand():
    teacher = torch.tensor([[0.0, 0.0, -1.0, -2.0, 0.0]])
    student = torch.tensor([[0.0, 0.0, -1.5, -1.0, 0.0]])
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    assert reverse_kl_advantages(teacher, student, mask).tolist() == [[0.0, 0.0, 0.5, -1.0, 0.0]]
    inf = torch.tensor([[float("-inf"), 0.0, -1.0, -2.0, float("nan")]])  # masked entries are never read
    assert reverse_kl_advantages(inf, student, mask).tolist() == [[0.0, 0.0, 0.5, -1.0, 0.0]]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return save_tiny_model(str(root / "student"), seed=0), save_tiny_model(str(root / "teacher"), seed=5, initializer_range=0.2)


def _hf_logprobs(path, ids, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def run_closing(coro, *engines):
    """``asyncio.run(coro)``, then the engines' sessions of that loop are closed."""
    async def main():
        try:
            return await coro
        finally:
            for e in engines:
                await e.aclose()

    return asyncio.run(main())


def _engine(path, tmp):
    from arealite.api.config import InferenceEngineConfig
    from arealite.inference.remote import RemoteInferenceEngine
    from arealite.launcher.local import launch_servers

    cfg = InferenceEngineConfig(n_servers=1, setup_timeout=120, request_timeout=60)
    eng = RemoteInferenceEngine(cfg, launch_servers(cfg, path, str(tmp)))
    eng.initialize()
    return eng


def test_server_prompt_logprobs_equal_a_plain_forward_and_bad_fields_are_400(two_models, tmp_path):
    from arealite.inference.remote import post_json
    from arealite.inference.adapters import ServerError

    _, teacher_path = two_models
    eng = _engine(teacher_path, tmp_path)
    ids = [1, 504, 1001, 77, 3000, 12, 2, 9, 40]
    for temperature, start in ((1.0, 1), (0.7, 4)):
        got = run_closing(eng.aprompt_logprobs(ids, start=start, temperature=temperature), eng)
        want = _hf_logprobs(teacher_path, ids, temperature)[start - 1:]
        assert len(got) == len(ids) - start
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-5)
    addr = eng.addresses[0]
    reply = post_json(addr, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                          "return_logprob": True, "logprob_start_len": 0})
    lp = reply["meta_info"]["input_token_logprobs"]
    assert lp[0] == [None, 1, None] and [t[1] for t in lp] == ids and reply["output_ids"] == []
    for body, field in (({"logprob_start_len": 9, "return_logprob": True}, "logprob_start_len"),
                        ({"logprob_start_len": 2}, "logprob_start_len"),
                        ({"logprob_start_len": "1", "return_logprob": True}, "logprob_start_len")):
        with pytest.raises(ServerError, match=field) as e:
            post_json(addr, "/generate", {"input_ids": ids, **body}, retries=1)
        assert e.value.status == 400
    with pytest.raises(ValueError, match="start"):
        asyncio.run(eng.aprompt_logprobs(ids, start=0))
    eng.destroy()


def test_distill_episode_signal_equals_hand_computation_from_two_known_models(two_models, tmp_path):
    from arealite.algorithms.distill import OnPolicyDistillation
    from arealite.api.config import GenerationConfig
    from arealite.reward.math import math_reward
    from arealite.utils.hf import load_tokenizer, tokenize_chat
    from arealite.workflow.distill import DistillWorkflow

    student_path, teacher_path = two_models
    student, teacher = _engine(student_path, tmp_path / "s"), _engine(teacher_path, tmp_path / "t")
    tok = load_tokenizer(student_path)
    g = GenerationConfig(n_samples=3, max_new_tokens=6, temperature=0.8)
    wf = DistillWorkflow(teacher, g, tok, math_reward)
    row = {"messages": [{"role": "user", "content": "What is 12 + 30?"}], "answer": "42"}
    wf.start()
    traj = run_closing(wf.arun_episode(student, row), student, teacher)
    P = len(tokenize_chat(tok, row["messages"]))
    algo = OnPolicyDistillation.__new__(OnPolicyDistillation)
    adv = algo.compute_advantages(traj, traj["rewards"])
    for i in range(3):
        n = int(traj["loss_mask"][i].sum())
        ids = traj["input_ids"][i, :P + n].tolist()
        t_lp, s_lp = _hf_logprobs(teacher_path, ids, 0.8)[P - 1:], _hf_logprobs(student_path, ids, 0.8)[P - 1:]
        torch.testing.assert_close(traj["teacher_logprobs"][i, P:P + n], t_lp, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(traj["logprobs"][i, P:P + n], s_lp, rtol=1e-4, atol=1e-4)  # the student's own
        torch.testing.assert_close(adv[i, P:P + n], t_lp - s_lp, rtol=1e-4, atol=2e-4)
        assert adv[i, :P].abs().sum() == 0 and adv[i, P + n:].abs().sum() == 0
        assert traj["teacher_logprobs"][i, :P].abs().sum() == 0
    c = wf.reward_counters()
    assert c["reward/teacher/ok"] == 3 and c["reward/teacher/tokens"] == float(traj["loss_mask"].sum())
    assert abs(float((traj["teacher_logprobs"] - traj["logprobs"])[traj["loss_mask"].bool()].mean())) > 0.01  # two models differ
    teacher.destroy()
    from arealite.api.config import InferenceEngineConfig
    from arealite.inference.remote import RemoteInferenceEngine
    from arealite.utils.proc import free_port

    wf.teacher = RemoteInferenceEngine(InferenceEngineConfig(request_retries=1, request_timeout=5),
                                       [f"127.0.0.1:{free_port()}"])  # nothing listens: the group is dropped, counted
    assert run_closing(wf.arun_episode(student, row), student, wf.teacher) is None
    assert wf.reward_counters()["reward/teacher/failed"] == 3
    wf.close()
    student.destroy()


def test_teacher_tokenizer_must_match(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from arealite.utils.hf import load_tokenizer
    from arealite.workflow.distill import check_same_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    check_same_tokenizer(tok, load_tokenizer(tiny_model_dir))
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["<extra_token_for_the_test>"])
    with pytest.raises(ValueError, match="teacher.path.*differs"):
        check_same_tokenizer(tok, other)
    cmd = [sys.executable, os.path.join(REPO_ROOT, "recipes", "distill_math.py"), "--actor.path", tiny_model_dir,
           "--fileroot", str(tmp_path), "--teacher.path", str(tmp_path / "nowhere")]
    proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env=env_without_dist())
    assert proc.returncode != 0 and "teacher.path" in proc.stderr, proc.stderr[-3000:] and not (tmp_path / "distill_math" / "trial0" / "logs").exists()


def test_distill_recipe_two_ranks_teacher_equal_to_student(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO_ROOT, "recipes", "distill_math.py"), "--actor.path", tiny_model_dir,
           "--teacher.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "2",
           "--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8", "--rollout.consumer_batch_size", "4",
           "--train_dataset.batch_size", "4", "--valid_dataset.size", "4"]
    proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=900,
                          env=env_without_dist(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [s for s in map(json.loads, open(tmp_path / "distill_math" / "trial0" / "stats.jsonl")) if "summary" not in s]
    assert [s["step"] for s in steps] == [0, 1]
    first = steps[0]  # version-0 samples, teacher = the starting student: log π_T = log π_behav
    assert abs(first["actor/reverse_kl"]) < 1e-4 and first["actor/advantage_abs_mean"] < 1e-4
    assert all(s["reward/teacher/failed"] == 0 and s["reward/teacher/ok"] >= 8 for s in steps)
