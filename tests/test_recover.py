"""Recover checkpoints and exact resume (arealite/utils/recover.py, the executor's state).

The end-to-end properties run under torchrun (2 ranks, gloo) with SIGKILLs: see
tests/dist/resume_train.py."""

import asyncio
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from arealite.api.config import InferenceEngineConfig, RecoverConfig
from arealite.api.engine import InferenceEngine
from arealite.dataset.loader import EpochLoader
from arealite.api.workflow import RolloutWorkflow
from arealite.rollout.executor import WorkflowExecutor
from arealite.utils.recover import list_checkpoints, resolve_checkpoint, should_save
from conftest import REPO_ROOT


def _mark(path, step):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "COMPLETE"), "w") as f:
        json.dump({"step": step, "world_size": 2}, f)


def test_only_complete_step_folders_are_resumable(tmp_path):
    root = str(tmp_path)
    _mark(os.path.join(root, "step2"), 2)
    _mark(os.path.join(root, "step5"), 5)
    os.makedirs(os.path.join(root, "step7"))  # half-written: no marker
    _mark(os.path.join(root, ".tmp-step9"), 9)  # not renamed yet
    _mark(os.path.join(root, "step8"), 3)  # marker of another step
    assert [s for s, _ in list_checkpoints(root)] == [2, 5]
    assert resolve_checkpoint(RecoverConfig(mode="auto"), root) == os.path.join(root, "step5")
    assert resolve_checkpoint(RecoverConfig(mode="resume"), root) == os.path.join(root, "step5")
    assert resolve_checkpoint(RecoverConfig(mode="disabled"), root) is None


def test_resume_mode_without_checkpoint_is_a_clear_error(tmp_path):
    os.makedirs(tmp_path / "step3")  # no marker: does not count
    assert resolve_checkpoint(RecoverConfig(mode="auto"), str(tmp_path)) is None  # auto: start fresh
    with pytest.raises(ValueError, match="recover.mode=resume: no complete recover checkpoint"):
        resolve_checkpoint(RecoverConfig(mode="resume"), str(tmp_path))
    with pytest.raises(ValueError, match="recover.keep_last"):
        resolve_checkpoint(RecoverConfig(keep_last=0), str(tmp_path))


def test_save_schedule():
    assert [s for s in range(1, 8) if should_save(RecoverConfig(freq_steps=3), s)] == [3, 6]
    assert not any(should_save(RecoverConfig(freq_steps=0), s) for s in range(1, 8))


def _loader(rows, batch_size, seed=3):
    sampler = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return StatefulDataLoader(rows, batch_size=batch_size, sampler=sampler, collate_fn=lambda r: r)


def test_epoch_loader_resumes_at_every_position_including_epoch_boundaries():
    rows = list(range(10))  # batches of 3: 4 per epoch, the last one of a single row
    ref = EpochLoader(_loader(rows, 3))
    expected = [ref.next() for _ in range(12)]  # 3 epochs
    assert sorted(sum(expected[:4], [])) == rows and expected[:4] != expected[4:8]  # reshuffled per epoch
    for k in range(13):
        a = EpochLoader(_loader(rows, 3))
        head = [a.next() for _ in range(k)]
        state = pickle.loads(pickle.dumps(a.state_dict()))
        b = EpochLoader(_loader(rows, 3))  # a fresh process: new objects
        b.load_state_dict(state)
        assert b.state_dict() == state  # saving again before reading keeps the position
        assert head + [b.next() for _ in range(12 - k)] == expected, k


class _Engine(InferenceEngine):
    """Generates nothing (the workflow is instant); owns the weight version, as every engine."""

    async def agenerate(self, req): raise NotImplementedError
    def update_weights(self, meta): ...
    def pause_generation(self): ...
    def continue_generation(self): ...


class _RecordingWorkflow(RolloutWorkflow):
    """Instant episodes (finish in start order); the reward is the row id."""

    def __init__(self):
        self.started = []

    async def arun_episode(self, engine, data):
        self.started.append(data["id"])
        await asyncio.sleep(0)
        v = engine.get_version()
        return {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2, dtype=torch.bool),
                "loss_mask": torch.tensor([[0, 1]]), "versions": torch.tensor([[-1, v]]),
                "rewards": torch.tensor([float(data["id"])])}


def _train(ex, dl, wf, steps, version=0):
    trained = []
    for step in range(version, version + steps):
        trained += [int(r) for r in ex.prepare_batch(dl, wf)["rewards"].tolist()]
        ex.pause()
        ex.engine.set_version(step + 1)
        ex.resume()
    return trained


def _executor():
    ex = WorkflowExecutor(InferenceEngineConfig(consumer_batch_size=4, max_head_offpolicyness=1,
                                                max_concurrent_rollouts=64), _Engine())
    ex.initialize()
    return ex


def test_executor_resume_neither_skips_nor_repeats_prompts():
    rows = [{"id": i} for i in range(18)]  # 4.5 steps per epoch: resumes mid-epoch
    ex = _executor()
    try:
        reference = _train(ex, EpochLoader(_loader(rows, 2)), _RecordingWorkflow(), steps=10)
    finally:
        ex.destroy()
    first, data = _executor(), EpochLoader(_loader(rows, 2))
    try:
        trained = _train(first, data, _RecordingWorkflow(), steps=4)
        # as stored in a checkpoint: the executor's pending rows and the loader's position
        state, data_state = pickle.loads(pickle.dumps((first.state_dict(), data.state_dict())))
    finally:
        first.destroy()
    pending = [r["id"] for r in state["pending_rows"]]
    assert len(pending) >= 8  # (η + 1)·B rows were pulled ahead and not trained on
    assert pending == reference[16:16 + len(pending)]  # exactly the rows next in line
    second, data = _executor(), EpochLoader(_loader(rows, 2))
    wf = _RecordingWorkflow()
    try:
        second.load_state_dict(state)
        data.load_state_dict(data_state)
        second.engine.set_version(4)
        assert second.staleness.stat.accepted == 16 and second.staleness.stat.running == 0
        trained += _train(second, data, wf, steps=6, version=4)
    finally:
        second.destroy()
    assert wf.started[: len(pending)] == pending  # resubmitted first, in their order
    assert trained == reference  # the same prompts in the same order: none skipped or repeated
    assert sorted(reference[:18]) == list(range(18))  # (and the first epoch is each row once)


def test_data_position_needs_a_stateful_dataloader():
    ex, data = _executor(), EpochLoader([[{"id": 0}, {"id": 1}]] * 4)
    try:
        _train(ex, data, _RecordingWorkflow(), steps=1)
        with pytest.raises(TypeError, match="StatefulDataLoader"):
            data.state_dict()
    finally:
        ex.destroy()


# -- SIGKILL and resume under torchrun ----------------------------------------------------------------------
def _torchrun(model_dir, run_dir, total, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO_ROOT, "tests", "dist", "resume_train.py"), model_dir, str(run_dir), str(total)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{k: str(v) for k, v in env.items()})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _consumed(run_dir):
    return [json.loads(line) for line in open(run_dir / "consumed.jsonl")]


def test_sigkill_and_resume_reach_identical_parameters_and_data_order(tiny_model_dir, tmp_path):
    total = 8  # 3 steps per epoch
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    proc = _torchrun(tiny_model_dir, ref_dir, total)
    assert proc.returncode == 0, proc.stderr[-4000:]

    # 1. SIGKILL right after checkpoint step3 = exactly at the end of epoch 0.
    proc = _torchrun(tiny_model_dir, run_dir, total, KILL_AT=3, KILL_MODE="after_save")
    assert proc.returncode != 0 and "start step 0" in proc.stdout
    assert [s for s, _ in list_checkpoints(str(run_dir / "recover"))] == [2, 3]
    # 2. Resume from step 3 (epoch boundary); SIGKILL while writing step5 (before its marker).
    proc = _torchrun(tiny_model_dir, run_dir, total, KILL_AT=5, KILL_MODE="during_save")
    assert proc.returncode != 0 and "start step 3 " in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert os.path.isdir(run_dir / "recover" / ".tmp-step5")  # the half-written one is left behind
    assert [s for s, _ in list_checkpoints(str(run_dir / "recover"))] == [3, 4]
    os.makedirs(run_dir / "recover" / "step99")  # a folder without marker: must be ignored too
    # 3. Resume from step 4 (mid-epoch 1: the half-written step5 is ignored) to the end.
    proc = _torchrun(tiny_model_dir, run_dir, total)
    assert proc.returncode == 0 and "start step 4 " in proc.stdout and "version 4" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]

    ref, got = torch.load(ref_dir / "final_params.pt"), torch.load(run_dir / "final_params.pt")
    assert got["version"] == ref["version"] == total
    assert ref["params"].keys() == got["params"].keys()
    for name, p in ref["params"].items():
        assert torch.equal(p, got["params"][name]), name  # bitwise on CPU float32

    expected, lines = _consumed(ref_dir), _consumed(run_dir)
    assert [e["step"] for e in expected] == list(range(total))
    assert [e["step"] for e in lines] == [0, 1, 2, 3, 4, 4, 5, 6, 7]  # step 4 ran again after the kill
    assert lines[4] == lines[5]  # ... on the same rows with the same loss
    del lines[5]
    assert [e["ids"] for e in lines] == [e["ids"] for e in expected]  # same rows, same order
    assert [e["loss"] for e in lines] == [e["loss"] for e in expected]
    assert sorted(sum(sum((e["ids"] for e in expected[:3]), []), [])) == list(range(24))  # epoch = every row once
    assert [s for s, _ in list_checkpoints(str(run_dir / "recover"))] == [7, 8]  # keep_last = 2


# -- the asynchronous RL recipe ------------------------------------------------------------------------------
def test_grpo_recipe_resumes_at_the_saved_step_and_version(tiny_model_dir, tmp_path):
    def run(*extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               os.path.join(REPO_ROOT, "recipes", "grpo_math.py"),
               "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--gconfig.n_samples", "2",
               "--gconfig.max_new_tokens", "4", "--rollout.consumer_batch_size", "4", "--train_dataset.batch_size", "4",
               "--rollout.max_head_offpolicyness", "1", "--evaluator.at_start", "False", "--evaluator.at_end", "False",
               "--recover.freq_steps", "1", *extra]
        proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc

    out = tmp_path / "grpo_math" / "trial0"
    run("--total_train_steps", "2")
    assert [s for s, _ in list_checkpoints(str(out / "recover"))] == [2]  # keep_last = 1
    saved = torch.load(out / "recover" / "step2" / "trainer_state_rank0.pt", weights_only=False)
    assert saved["step"] == 2 and saved["stateful"]["rollout"]["returned"] == 8  # step = weight version
    assert len(saved["stateful"]["rollout"]["pending_rows"]) >= 4  # pulled ahead, not trained: run again
    n_lines = len(open(out / "stats.jsonl").readlines())

    proc = run("--total_train_steps", "3", "--recover.mode", "auto")
    assert f"resuming from {out / 'recover' / 'step2'}" in proc.stdout
    new = [json.loads(line) for line in open(out / "stats.jsonl").readlines()[n_lines:]]
    steps = [s for s in new if "summary" not in s]
    assert [s["step"] for s in steps] == [2]  # starts at step index 2, nothing earlier is redone
    # The servers got the resumed weights at version 2: every trained token was generated at
    # version 2 (staleness 0; version-0 tokens would be 2 stale and dropped, and the run would hang).
    assert steps[0]["rollout/staleness_max"] == 0 and steps[0]["rollout/dropped_stale"] == 0
    assert [s for s, _ in list_checkpoints(str(out / "recover"))] == [3]
    resumed = torch.load(out / "recover" / "step3" / "trainer_state_rank0.pt", weights_only=False)
    assert resumed["step"] == 3 and resumed["stateful"]["rollout"]["returned"] == 12
    assert resumed["engines"]["actor"]["lr_scheduler"]["last_epoch"] == 3  # the schedule continued


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_names_the_folder(tmp_path):
    """The writer fails with ENOSPC during the step-2 save: the error names the folder and the
    kept checkpoint, the partial folder is gone, and step 1 loads back to its exact parameters."""
    root = str(tmp_path / "recover")
    out = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tests", "disk_full_drill.py"), root],
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert "No space left on device" in r["message"]
    assert os.path.join(root, ".tmp-step2") in r["message"] and os.path.join(root, "step1") in r["message"]
    assert r["complete"] == [1] and r["loaded_step"] == 1 and r["params_restored"]
    assert r["left"] == ["step1"]
