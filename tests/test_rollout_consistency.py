"""The server, the client and the trainer agree: logprobs, interruptible generation, versions."""

import asyncio
import os
import threading
import time

import pytest
import torch

from arealite.api.config import GenerationConfig, TrainEngineConfig
from arealite.api.io_struct import ModelRequest, WeightUpdateMeta
from arealite.train_engine.fsdp import FSDPEngine
from arealite.inference.remote import post_json
from arealite.inference.adapters import ServerError
from arealite.workflow.rlvr import build_trajectories

from conftest import save_tiny_model


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    actor = FSDPEngine(TrainEngineConfig(path=tiny_model_dir), temperature=0.7)
    actor.initialize(tiny_model_dir)
    yield actor


def _generate(engine, prompts, gconfig):
    async def run():
        try:
            return await asyncio.gather(*[engine.agenerate(ModelRequest(input_ids=p, gconfig=gconfig)) for p in prompts])
        finally:
            await engine.aclose()
    return asyncio.run(run())


def test_server_logprobs_equal_trainer_recompute(engine, trainer):
    gconfig = GenerationConfig(max_new_tokens=16, temperature=0.7)
    prompts = [[1, 17, 300, 4000, 25], [1, 9, 99], [1, 5, 6, 7, 8, 9, 10, 11, 12]]
    resps = _generate(engine, prompts, gconfig)
    batch = build_trajectories(resps, [0.0] * len(resps))
    recomputed = trainer.forward(batch)
    mask = batch["loss_mask"].bool()
    assert mask.sum() == sum(r.output_len for r in resps) > 0
    diff = (recomputed[mask] - batch["logprobs"][mask]).abs().max().item()
    assert diff < 1e-4, diff
    # prompt tokens carry no logprob and version -1
    assert (batch["versions"][~mask & batch["attention_mask"]] == -1).all()


def test_pause_update_continue_keeps_every_request_and_tags_versions(engine, tiny_model_dir, tmp_path):
    new_weights = save_tiny_model(str(tmp_path / "v1"), seed=1)
    gconfig = GenerationConfig(max_new_tokens=300, temperature=1.0, stop_token_ids=[])
    prompts = [[1, 2 + i, 3 + i] for i in range(8)]
    result = {}

    def rollout():
        # ignore_eos is not in GenerationConfig: a random tiny model rarely emits EOS anyway.
        result["resps"] = _generate(engine, prompts, gconfig)

    addr = engine.addresses[0]
    steps0 = post_json(addr, "/get_server_info", timeout=5, retries=1, method="GET")["decode_steps"]
    t = threading.Thread(target=rollout)
    t.start()
    # Pause once every request is mid-generation: all 8 running and a few tokens decoded (a fixed
    # 1 s sleep let all 300 tokens finish first on a fast machine, so no request spanned versions).
    deadline = time.monotonic() + 60
    while True:
        info = post_json(addr, "/get_server_info", timeout=5, retries=1, method="GET")
        if info["running_requests"] == len(prompts) and info["decode_steps"] >= steps0 + 5:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.005)
    engine.pause_generation()  # aborted segments are resubmitted at once and held by the paused server
    engine.update_weights(WeightUpdateMeta(type="disk", path=new_weights, version=1))
    engine.continue_generation()
    engine.set_version(1)
    t.join(timeout=120)
    resps = result["resps"]
    assert len(resps) == 8
    switched = 0
    for r in resps:
        assert r.stop_reason in ("stop", "length")
        assert len(r.output_tokens) == len(r.output_logprobs) == len(r.output_versions)
        assert r.output_versions == sorted(r.output_versions)  # 0 ... 0 1 ... 1
        assert set(r.output_versions) <= {0, 1}
        switched += set(r.output_versions) == {0, 1}
    assert switched >= 1
    # restore the original weights for the other tests
    engine.pause_generation()
    engine.update_weights(WeightUpdateMeta(type="disk", path=tiny_model_dir, version=0))
    engine.continue_generation()
    engine.set_version(0)


def test_malformed_request_is_a_clear_client_error(engine):
    with pytest.raises(ServerError, match="400"):
        post_json(engine.addresses[0], "/generate", {"input_ids": [], "sampling_params": {}}, retries=1)
    with pytest.raises(ServerError, match="max_new_tokens"):
        post_json(engine.addresses[0], "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, retries=1)
