"""AReaL#1618 class: agent calls that arrive, or are generating, while the trainer updates the
weights are held, not dropped, and complete; every sampled token records the version whose
weights produced it (checked against each version's own logprobs).

Our server on the tiny model (10 ms per decode step), the proxy, and the weight-update order of
``arealite.trainer.weight_update.sync_weights`` (pause → load → set_version → continue) in the
middle of a two-turn session, while a second session's first call arrives during the pause.
"""

import asyncio
import os
import subprocess

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.agent.proxy import TrainingProxy
from arealite.api.config import GenerationConfig, InferenceEngineConfig
from arealite.api.io_struct import WeightUpdateMeta
from arealite.inference.remote import RemoteInferenceEngine, wait_healthy
from arealite.utils.proc import free_port
from conftest import REPO_ROOT, save_tiny_model
from slow_server import command as slow_server_command

LONG = 150  # tokens of the call that the update interrupts (>= 1.5 s at 10 ms per step)


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir, tmp_path_factory):
    """One of our servers on the tiny model (seed 0), >= 10 ms per decode step; yields
    ``(address, model_b)`` with ``model_b`` another tiny model (seed 1) to update to."""
    model_b = save_tiny_model(str(tmp_path_factory.mktemp("proxy_update") / "b"), seed=1)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(slow_server_command(0.01, "--model-path", tiny_model_dir, "--port", str(port),
                                                "--seed", "1"),
                            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy([f"127.0.0.1:{port}"], timeout=120, poll=0.2)
        yield f"127.0.0.1:{port}", model_b
    finally:
        proc.kill()
        proc.wait()


def _teacher_forced(model, prompt, output):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return steps.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_calls_during_a_weight_update_are_held_and_record_each_tokens_version(slow_server, tiny_model_dir):
    addr, model_b = slow_server
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RemoteInferenceEngine(InferenceEngineConfig(request_timeout=60), [addr])
    engine.initialize()
    gconfig = GenerationConfig(temperature=1.0, max_new_tokens=8)

    async def main():
        proxy = await TrainingProxy(tok, gconfig).start()
        a, b = proxy.open_session(engine), proxy.open_session(engine)
        try:
            async with aiohttp.ClientSession() as http:
                async def post(session, messages, max_tokens):
                    async with http.post(session.base_url + "/chat/completions",
                                         json={"messages": messages, "max_tokens": max_tokens}) as r:
                        assert r.status == 200, await r.text()
                        return (await r.json())["choices"][0]["message"]
                first_msgs = [{"role": "user", "content": "Count to twenty."}]
                first = await post(a, first_msgs, 8)  # under version 0
                second = asyncio.create_task(post(a, first_msgs + [first, {"role": "user", "content": "Again."}], LONG))
                await asyncio.sleep(0.5)  # the second call is generating
                await asyncio.to_thread(engine.pause_generation)
                late = asyncio.create_task(post(b, [{"role": "user", "content": "Hi"}], 8))  # arrives while paused
                await asyncio.sleep(0.5)
                held = (second.done(), late.done(), len(a.client.records), len(b.client.records))
                await asyncio.to_thread(engine.update_weights, WeightUpdateMeta(type="disk", path=model_b, version=1))
                engine.set_version(1)  # before the servers continue, as sync_weights does
                await asyncio.to_thread(engine.continue_generation)
                await asyncio.wait_for(asyncio.gather(second, late), 60)
        finally:
            await proxy.aclose()
            await engine.aclose()
        return a, b, held, proxy.stats
    try:
        a, b, held, stats = asyncio.run(main())
    finally:
        engine.destroy()
    assert held == (False, False, 1, 0)  # held by the paused server, not answered, not dropped
    assert stats["engine_errors"] == 0 and stats["bad_requests"] == 0
    r1, r2 = a.client.records
    [r3] = b.client.records
    assert r2.parent == r1.id  # one trajectory across the update
    assert r1.output_versions == [0] * len(r1.output_ids) and r3.output_versions == [1] * len(r3.output_ids)
    k = r2.output_versions.count(0)
    assert 0 < k < len(r2.output_ids) and r2.output_versions == [0] * k + [1] * (len(r2.output_ids) - k)
    assert r2.stop_reason == "stop" or len(r2.output_ids) == LONG  # the interrupted call got its whole budget
    models = {0: AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(),
              1: AutoModelForCausalLM.from_pretrained(model_b).eval()}
    for rec in (r1, r2, r3):  # each token's logprob is the one of the weights its version names
        for v, model in models.items():
            want = _teacher_forced(model, rec.prompt_ids, rec.output_ids)
            got = [(lp, w) for lp, w, ver in zip(rec.output_logprobs, want, rec.output_versions) if ver == v]
            assert [lp for lp, _ in got] == pytest.approx([w for _, w in got], abs=2e-3)
    ep = a.client.export_episode(1.0)
    sampled = [v for v, m in zip(ep.versions, ep.loss_mask) if m]
    assert sampled == r1.output_versions + r2.output_versions
    assert all(v == -1 for v, m in zip(ep.versions, ep.loss_mask) if not m)
