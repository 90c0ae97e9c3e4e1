"""Distributed weight sync (gloo, CPU): trainer rank 0 broadcasts to two servers in buckets.

Servers start on model A (seed 0); the trainer holds model B (seed 1, tied embeddings). After
each push every server parameter must be bit-identical to the trainer's (sha256 of the bytes),
and greedy generation must equal HF greedy on model B.
"""

import hashlib

import pytest
import torch

from arealite.api.config import InferenceEngineConfig, TrainEngineConfig
from arealite.api.io_struct import WeightUpdateMeta
from arealite.train_engine.fsdp import FSDPEngine
from arealite.inference.remote import RemoteInferenceEngine, post_json
from arealite.inference.adapters import ServerError
from arealite.weights.sync import iter_buckets
from arealite.launcher.local import launch_servers
from arealite.trainer.weight_update import push_weights

from conftest import save_tiny_model

PROMPT = [1, 17, 300, 4000, 25, 9]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("wsync")
    model_a = tiny_model_dir  # seed 0
    model_b = save_tiny_model(str(root / "b"), seed=1)
    cfg = InferenceEngineConfig(n_servers=2, setup_timeout=120, request_timeout=120,
                                weight_sync="distributed")
    addrs = launch_servers(cfg, model_a, str(root / "logs"))
    rollout = RemoteInferenceEngine(cfg, addrs)
    actor = FSDPEngine(TrainEngineConfig(path=model_b))
    actor.initialize(model_b)
    yield rollout, actor, model_a, model_b


def _server_digests(addr, names):
    return {n: post_json(addr, "/get_weights_by_name", {"name": n, "digest": True})["sha256"]
            for n in names}


def _greedy(addr, n=12):
    out = post_json(addr, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                        "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                            "ignore_eos": True}})
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def _hf_greedy(path, n=12):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("bucket_mb,expect_buckets", [(0, "per_tensor"), (1024, 1)])
def test_broadcast_makes_server_weights_identical(setup, bucket_mb, expect_buckets):
    rollout, actor, model_a, model_b = setup
    from arealite.weights.sync import broadcast_weights

    # Start from model A on every server (the previous case left B there).
    rollout.update_weights(WeightUpdateMeta(type="disk", path=model_a, version=0))
    trainer = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in actor.model.named_parameters()}
    assert "lm_head.weight" not in trainer  # tied: the embedding is sent once
    before = _server_digests(rollout.addresses[0], list(trainer))
    assert before != {n: _digest(t) for n, t in trainer.items()}

    rollout.config.weight_sync_bucket_mb = bucket_mb
    meta = rollout.weight_update_meta("", version=3)
    rollout.pause_generation()
    stats = broadcast_weights(actor.model, meta.addresses, meta.version, meta.bucket_bytes)
    rollout.update_weights(meta)  # checks the reported version
    rollout.continue_generation()
    assert stats["n_tensors"] == len(trainer)
    assert stats["n_buckets"] == (len(trainer) if expect_buckets == "per_tensor" else 1)
    expected_tokens = _hf_greedy(model_b)
    outputs = []
    for addr in rollout.addresses:
        assert _server_digests(addr, list(trainer)) == {n: _digest(t) for n, t in trainer.items()}
        # lm_head shares storage with the embedding on the server too
        assert post_json(addr, "/get_weights_by_name", {"name": "lm_head.weight", "digest": True})["sha256"] == \
            _digest(trainer["model.embed_tokens.weight"])
        assert post_json(addr, "/get_model_info", method="GET")["weight_version"] == 3
        tokens, logprobs = _greedy(addr)
        assert tokens == expected_tokens
        outputs.append((tokens, logprobs))
    assert outputs[0] == outputs[1]


def test_push_weights_distributed_through_the_coordinator(setup):
    """The coordinator's push_weights(actor, meta) with meta.type == "distributed" is the same push."""
    rollout, actor, model_a, model_b = setup
    rollout.config.weight_sync_bucket_mb = 0.01
    meta = rollout.weight_update_meta("", version=4)
    assert meta.type == "distributed" and meta.bucket_bytes == int(0.01 * 2**20)
    push_weights(actor, meta)
    rollout.update_weights(meta)
    assert _greedy(rollout.addresses[1])[0] == _hf_greedy(model_b)
    with pytest.raises(ServerError, match="weight_version"):
        rollout.update_weights(rollout.weight_update_meta("", version=5))  # nobody pushed v5


def test_restarted_trainer_rejoins_under_the_same_group_name(setup):
    """A new trainer process knows nothing of the old group; the servers still hold one of the
    same name. Its first push must replace that group, not be refused."""
    from arealite.weights import sync as ws

    rollout, actor, model_a, model_b = setup
    rollout.update_weights(WeightUpdateMeta(type="disk", path=model_a, version=0))
    assert ws._GROUPS  # the earlier pushes left a group on the trainer side and on the servers
    ws._GROUPS.clear()  # what a restarted trainer starts with (the old group is freed)
    rollout.config.weight_sync_bucket_mb = 1024
    meta = rollout.weight_update_meta("", version=6)
    push_weights(actor, meta)
    rollout.update_weights(meta)
    trainer = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in actor.model.named_parameters()}
    for addr in rollout.addresses:
        assert _server_digests(addr, list(trainer)) == {n: _digest(t) for n, t in trainer.items()}
    assert _greedy(rollout.addresses[0])[0] == _hf_greedy(model_b)


def test_bad_distributed_requests_are_rejected_before_receiving(setup):
    addr = setup[0].addresses[0]
    with pytest.raises(ServerError, match="no weight-update group 'nope'"):
        post_json(addr, "/update_weights_from_distributed",
                  {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"}, retries=1)
    with pytest.raises(ServerError, match="equal length"):
        post_json(addr, "/update_weights_from_distributed",
                  {"names": ["x"], "dtypes": [], "shapes": [[1]]}, retries=1)
    with pytest.raises(ServerError, match="rank_offset"):
        post_json(addr, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                        "rank_offset": 0, "world_size": 2}, retries=1)


def test_iter_buckets_respects_budget_and_order():
    ts = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100])]  # float32: 4 B each
    sizes = lambda budget: [[n for n, _ in b] for b in iter_buckets(ts, budget)]  # noqa: E731
    assert sizes(0) == [["t0"], ["t1"], ["t2"], ["t3"], ["t4"]]
    assert sizes(80) == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]  # 80 B = 20 floats; big ones alone
    assert sizes(10**6) == [["t0", "t1", "t2", "t3", "t4"]]
