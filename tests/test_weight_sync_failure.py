"""A server SIGKILLed in the middle of a distributed weight update (gloo, CPU).

Two local servers start on model A (seed 0); the trainer (1-rank FSDPEngine) holds model B
(seed 1). The coordinator's ``sync_weights`` pushes B; server 1 is killed between two broadcasts of
the second bucket, while server 0 is waiting for the rest of that bucket. Expected: the push
raises ``WeightSyncError`` naming server 1 long before ``rollout.weight_sync_timeout``, the
client excludes server 1, the retry re-creates the group with server 0 only, and server 0 ends
bit-identical to the trainer, at the new version, generating like HF on model B.
"""

import hashlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import arealite.weights.sync as ws
import arealite.trainer.weight_update as wu
from arealite.api.config import InferenceEngineConfig, TrainEngineConfig
from arealite.api.io_struct import WeightUpdateMeta
from arealite.train_engine.fsdp import FSDPEngine
from arealite.inference.remote import RemoteInferenceEngine, post_json, wait_healthy
from arealite.inference.adapters import ServerError
from arealite.weights.sync import WeightSyncError
from arealite.launcher.local import server_command
from arealite.utils.proc import free_port

from conftest import save_tiny_model

PROMPT = [1, 17, 300, 4000, 25, 9]
TIMEOUT_S = 30.0  # rollout.weight_sync_timeout: what a hung (not dead) server would cost per bucket


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _server_digests(addr, names):
    return {n: post_json(addr, "/get_weights_by_name", {"name": n, "digest": True})["sha256"] for n in names}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("wsync_fail")
    model_a, model_b = tiny_model_dir, save_tiny_model(str(root / "b"), seed=1)
    cfg = InferenceEngineConfig(n_servers=2, setup_timeout=120, request_timeout=120, request_retries=1,
                                weight_sync="distributed", weight_sync_bucket_mb=1, weight_sync_timeout=TIMEOUT_S)
    # Started here (not by launch_servers) so that the test holds the process handles.
    procs, addrs = [], []
    for i in range(2):
        port = free_port()
        with open(root / f"server{i}.log", "w") as log:
            procs.append(subprocess.Popen(server_command(cfg, model_a, port, 1 + i), stdout=log,
                                          stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1")))
        addrs.append(f"127.0.0.1:{port}")
    try:
        wait_healthy(addrs, cfg.setup_timeout)
        actor = FSDPEngine(TrainEngineConfig(path=model_b))
        actor.initialize(model_b)
        yield RemoteInferenceEngine(cfg, addrs), actor, procs, model_a, model_b
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_server_killed_mid_broadcast_is_named_excluded_and_survivor_gets_retried_push(setup, monkeypatch):
    rollout, actor, procs, model_a, model_b = setup
    survivor, victim = rollout.addresses
    trainer = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in actor.model.named_parameters()}
    expected = {n: _digest(t) for n, t in trainer.items()}
    initial = _server_digests(survivor, list(trainer))  # model A
    differing = [n for n in trainer if initial[n] != expected[n]]  # norms are all ones in A and B
    assert "model.embed_tokens.weight" in differing and len(differing) >= 10

    # Kill the victim just before the 4th broadcast of the trainer: #1 is the group's first
    # (connect) collective, #2 the embedding (bucket 1, alone: 12 MiB > 1 MiB), #3-#4 the first
    # tensors of bucket 2 -- the survivor has been asked for bucket 2 and waits for tensor #4.
    real_broadcast, calls = ws.broadcast_tensor, []

    def broadcast_then_kill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
        return real_broadcast(*args, **kwargs)

    monkeypatch.setattr(ws, "broadcast_tensor", broadcast_then_kill)
    attempts = []  # (meta, seconds, exception or None, survivor digests and version after a failure)
    real_push = wu.push_weights

    def recording_push(actor, meta):
        start = time.monotonic()
        try:
            real_push(actor, meta)
        except WeightSyncError as e:
            attempts.append((meta, time.monotonic() - start, e, (_server_digests(survivor, differing), post_json(
                survivor, "/get_model_info", method="GET")["weight_version"])))
            monkeypatch.setattr(ws, "broadcast_tensor", real_broadcast)  # the retry is not sabotaged
            raise
        attempts.append((meta, time.monotonic() - start, None, None))

    monkeypatch.setattr(wu, "push_weights", recording_push)
    wu.sync_weights(actor, rollout, None, "", version=1)

    # First attempt: both servers, a named error well before the hung-server bound.
    (meta1, seconds, error, partial), (meta2, _, no_error, _) = attempts
    assert meta1.addresses == [survivor, victim] and meta1.timeout_s == TIMEOUT_S
    assert isinstance(error, ServerError) and error.failed == [victim]
    assert victim in str(error) and "version 1" in str(error)
    assert seconds < TIMEOUT_S  # a dead peer is detected from its closed connections, not by the timeout
    assert procs[1].poll() == -signal.SIGKILL
    # The survivor loaded bucket 1 (the embedding) and nothing of the interrupted bucket 2; only
    # the last bucket carries the version, so it still reports version 0.
    assert partial[0] == {n: expected[n] if n == "model.embed_tokens.weight" else initial[n] for n in differing}
    assert partial[1] == 0
    assert not any(victim in key[0] for key in ws._GROUPS)  # the broken group is forgotten

    # Recovery: the victim is excluded; the retry went to the survivor alone and succeeded.
    assert no_error is None and meta2.addresses == [survivor]
    assert rollout.live_addresses() == [survivor] and rollout.weight_update_meta("", 2).addresses == [survivor]
    assert ((survivor,), ws.DEFAULT_GROUP_NAME) in ws._GROUPS
    assert _server_digests(survivor, list(trainer)) == expected
    assert post_json(survivor, "/get_model_info", method="GET")["weight_version"] == 1
    assert rollout.get_version() == 1

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_b).eval()
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    out = post_json(survivor, "/generate", {"input_ids": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
    assert out["output_ids"] == hf_tokens


def test_push_with_no_server_left_raises_on_every_rank(setup):
    rollout, actor, *_ = setup
    with pytest.raises(WeightSyncError, match="no server to push to") as info:
        ws.broadcast_weights(actor.model, [], version=7, bucket_bytes=0)
    assert info.value.failed == []


TWO_RANKS = """
import sys
import torch.distributed as dist
from arealite.api.config import TrainEngineConfig
from arealite.train_engine.fsdp import FSDPEngine
from arealite.utils.proc import exit_without_teardown
from arealite.weights.sync import WeightSyncError, broadcast_weights
actor = FSDPEngine(TrainEngineConfig(path=sys.argv[1]))
actor.initialize(sys.argv[1])
try:
    broadcast_weights(actor.model, [sys.argv[2]], version=1, bucket_bytes=0, timeout_s=60)
except WeightSyncError as e:
    print(f"rank {dist.get_rank()} failed {e.failed}", flush=True)
actor.destroy()
exit_without_teardown()
"""


def test_every_rank_raises_when_rank0_cannot_push(tiny_model_dir, tmp_path):
    """2 FSDP ranks; nothing listens at the address: rank 0 fails to create the group, rank 1
    (which only all-gathers) must learn it and raise too instead of hanging."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    dead = f"127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), tiny_model_dir, dead], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reports = sorted(re.findall(r"rank \d failed \[[^]]*\]", proc.stdout))  # the ranks' lines may interleave
    assert reports == [f"rank 0 failed {[dead]}", f"rank 1 failed {[dead]}"]


def test_sync_weights_retries_once_then_raises(setup, monkeypatch):
    """Control flow of the coordinator: exclude what the error names, retry once, then give up."""
    actor = setup[1]
    calls = []

    class Rollout:  # records the calls sync_weights makes (as the inference engine and the executor)
        def __getattr__(self, name):  # pause, pause_generation, update_weights, continue_generation, ...
            return lambda *args: calls.append((name, *args))

        def weight_update_meta(self, path, version):
            calls.append(("meta", version))
            return WeightUpdateMeta(type="distributed", path=path, version=version)

    def fail(*culprits):  # push_weights raising once per culprit list, then succeeding
        queue = list(culprits)

        def push(actor, meta):
            if queue:
                raise WeightSyncError("boom", failed=queue.pop(0))
        return push

    monkeypatch.setattr(wu, "push_weights", fail(["10.0.0.1:1"], ["10.0.0.2:1"]))
    rollout = Rollout()
    with pytest.raises(WeightSyncError, match="boom"):
        wu.sync_weights(actor, rollout, rollout, "", version=5)
    reason = "failed the weight update to version 5"
    assert calls == [("pause",), ("pause_generation",), ("meta", 5), ("exclude_servers", ["10.0.0.1:1"], reason),
                     ("meta", 5), ("exclude_servers", ["10.0.0.2:1"], reason)]  # no third attempt, no resume

    calls.clear()
    monkeypatch.setattr(wu, "push_weights", fail([]))  # no culprit (e.g. a restarted server): retried
    wu.sync_weights(actor, rollout, rollout, "", version=6)
    assert [c[0] for c in calls] == ["pause", "pause_generation", "meta", "exclude_servers", "meta",
                                     "update_weights", "set_version", "continue_generation", "resume"]
    assert calls[3] == ("exclude_servers", [], "failed the weight update to version 6")
    assert calls[5][1].version == 6 and calls[6] == ("set_version", 6)  # set before the servers continue


def test_exclude_servers_rejects_unknown_address(setup):
    with pytest.raises(ValueError, match="not one of this engine's servers"):
        setup[0].exclude_servers(["10.9.9.9:1"], "test")
