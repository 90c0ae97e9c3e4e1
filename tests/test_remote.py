"""The rollout client (arealite.inference.remote) against fake, stalled, killed and real servers.

* Payloads: requests the client sends and the SGLang replies it parses, with the field names
  and types of SGLang's native ``/generate`` replies (docs.sglang.ai, "Native APIs"; incl. abort
  replies with and without partial tokens), and the same shapes produced by our server's scheduler.
* Failures: a server that accepts connections and never answers -> ``ServerTimeoutError``
  within the configured bound; a stalled or killed server next to a live one -> requests move.
* 16 long requests in flight -> pause -> weight update -> continue: all finish, versions switch
  once per trajectory, and every token's logprob matches the model version that produced it.
"""

import asyncio
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from aiohttp import web

from arealite.api.config import GenerationConfig, InferenceEngineConfig
from arealite.api.io_struct import ModelRequest, WeightUpdateMeta
from arealite.inference.remote import RemoteInferenceEngine, wait_healthy
from arealite.inference.adapters import ServerError, ServerTimeoutError
from arealite.utils.proc import free_port

from conftest import save_tiny_model
import slow_server

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(engine, coro_fn):
    async def main():
        try:
            return await coro_fn()
        finally:
            await engine.aclose()
    return asyncio.run(main())


class _Background:
    """An asyncio server running in its own thread (started by ``start(factory)``)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def fake_sglang():
    """An aiohttp server replying to /generate with a scripted list of SGLang replies; records
    the request bodies. Yields ``(address, script, bodies)``; ``script`` is consumed in order."""
    script, bodies = [], []

    async def generate(request):
        bodies.append(await request.json())
        return web.json_response(script.pop(0))

    async def health(request):
        return web.json_response({"status": "ok"})

    bg = _Background()
    port = free_port()

    async def start():
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = bg.call(start())
    yield f"127.0.0.1:{port}", script, bodies
    bg.call(runner.cleanup())
    bg.stop()


@pytest.fixture
def stalled_server():
    """Accepts TCP connections, reads, and never answers. Yields its address."""
    bg = _Background()
    port = free_port()

    async def handle(reader, writer):
        await asyncio.sleep(3600)

    server = bg.call(asyncio.start_server(handle, "127.0.0.1", port))
    yield f"127.0.0.1:{port}"
    server.close()
    bg.stop()


# ------------------------------------------------------------------------------- payload shapes

# Verbatim shapes of SGLang's /generate replies: a waiting-queue abort without any token list
# (mid-2025 SGLang, weight_version absent), a running abort with partial tokens and SGLang's
# string weight_version, then a stop on a matched token.
ABORT_BEFORE_PREFILL = {"text": "", "meta_info": {
    "id": "x1", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
    "prompt_tokens": 0, "completion_tokens": 0}}
ABORT_PARTIAL = {"output_ids": [11, 12], "meta_info": {
    "id": "x2", "finish_reason": {"type": "abort", "message": "Abort by pause",
                                  "status_code": 200, "err_type": None},
    "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0, "weight_version": "default",
    "output_token_logprobs": [[-0.5, 11, None], [-1.25, 12, None]]}}
STOP = {"output_ids": [13, 2], "meta_info": {
    "id": "x3", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 5,
    "completion_tokens": 2, "weight_version": "7",
    "output_token_logprobs": [[-0.125, 13, None], [-2.0, 2, None]]}}


def test_client_payloads_and_abort_replies_follow_sglang_shapes(fake_sglang):
    addr, script, bodies = fake_sglang
    script += [ABORT_BEFORE_PREFILL, ABORT_PARTIAL, STOP]
    engine = RemoteInferenceEngine(InferenceEngineConfig(request_timeout=10), [addr])
    engine.set_version(4)
    gconfig = GenerationConfig(max_new_tokens=10, temperature=0.5, top_p=0.9, top_k=20, stop_token_ids=[2])
    resp = _run(engine, lambda: engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig)))
    assert resp.output_tokens == [11, 12, 13, 2]
    assert resp.output_logprobs == [-0.5, -1.25, -0.125, -2.0]
    # a non-integer weight_version ("default") falls back to the client's version
    assert resp.output_versions == [4, 4, 7, 7]
    assert resp.stop_reason == "stop"
    assert [b["input_ids"] for b in bodies] == [[1, 2, 3], [1, 2, 3], [1, 2, 3, 11, 12]]
    assert [b["sampling_params"]["max_new_tokens"] for b in bodies] == [10, 10, 8]
    for b in bodies:
        assert set(b) == {"input_ids", "sampling_params", "return_logprob", "stream"}  # no rid
        assert b["return_logprob"] is True and b["stream"] is False
        assert all(type(t) is int for t in b["input_ids"])
        assert b["sampling_params"] == {"temperature": 0.5, "top_p": 0.9, "top_k": 20,
                                        "max_new_tokens": b["sampling_params"]["max_new_tokens"],
                                        "stop_token_ids": [2]}


def test_abort_at_the_end_of_the_budget_is_reported_as_length(fake_sglang):
    addr, script, _ = fake_sglang
    script.append(ABORT_PARTIAL)
    engine = RemoteInferenceEngine(InferenceEngineConfig(request_timeout=10), [addr])
    gconfig = GenerationConfig(max_new_tokens=2)
    resp = _run(engine, lambda: engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig)))
    assert resp.output_tokens == [11, 12] and resp.stop_reason == "length"


def test_scheduler_replies_have_sglang_shapes(tiny_model_dir):
    """Our scheduler's replies: length / stop-token / stop-string finishes and both abort kinds
    (running -> partial tokens, waiting -> "Abort before prefill" with zero tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arealite.server.messages import Generate, Pause
    from arealite.server.protocol import ABORT_BEFORE_PREFILL as BEFORE, SamplingParams
    from arealite.server.scheduler import Scheduler

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sched = Scheduler(model, max_batch_size=1, seed=1, tokenizer=tok)
    decode_step = sched._decode_step

    def slowed_decode_step():  # >= 10 ms per decode step: r2 (500 tokens) is mid-way at the pause
        decode_step()
        time.sleep(0.01)

    sched._decode_step = slowed_decode_step
    prompt = [1, 17, 300, 4000]

    async def main():
        sched.start()
        greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        full = await sched.submit(Generate("r0", prompt, greedy, True))
        text = tok.decode(full["output_ids"])
        # a stop string = the text of the 5th..6th generated tokens
        stop = tok.decode(full["output_ids"][:6])[len(tok.decode(full["output_ids"][:4])):]
        assert stop.strip(), "tiny model produced only whitespace; pick other tokens"
        by_str = await sched.submit(Generate("r1", prompt, SamplingParams(
            temperature=0.0, max_new_tokens=12, ignore_eos=True, stop=(stop,)), True))
        running = sched.submit(Generate("r2", prompt, SamplingParams(max_new_tokens=500, ignore_eos=True), True))
        await asyncio.sleep(0.3)
        waiting = sched.submit(Generate("r3", prompt, SamplingParams(max_new_tokens=5), True))
        await asyncio.sleep(0.05)
        n = await sched.submit(Pause())
        return full, text, stop, by_str, await running, await waiting, n

    try:
        full, text, stop, by_str, running, waiting, n = asyncio.run(main())
    finally:
        sched.shutdown()
    assert n == 2
    for reply in (full, by_str, running, waiting):
        assert set(reply) == {"output_ids", "meta_info", "text"}
        meta = reply["meta_info"]
        assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
                "output_token_logprobs"} == set(meta)
        assert type(meta["prompt_tokens"]) is int and type(meta["completion_tokens"]) is int
        assert type(meta["weight_version"]) is int
        assert all(type(t) is int for t in reply["output_ids"])
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == reply["output_ids"]
        assert all(type(lp) is float and lp <= 0 and x is None for lp, _, x in triples)
        assert meta["completion_tokens"] == len(reply["output_ids"])
    assert full["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert full["text"] == text
    # stop string: tokens up to (and including) the one completing it; text ends before it
    k = len(by_str["output_ids"])
    assert by_str["output_ids"] == full["output_ids"][:k] and k <= 6
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in by_str["text"] and text.startswith(by_str["text"] + stop)
    assert [t[0] for t in by_str["meta_info"]["output_token_logprobs"]] == \
        [t[0] for t in full["meta_info"]["output_token_logprobs"][:k]]
    assert running["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(running["output_ids"]) < 500
    assert waiting["meta_info"]["finish_reason"] == {"type": "abort", "message": BEFORE}
    assert waiting["output_ids"] == [] and waiting["meta_info"]["output_token_logprobs"] == []


# ------------------------------------------------------------------------------- failures


def test_stalled_server_raises_timeout_within_bound(stalled_server):
    cfg = InferenceEngineConfig(request_timeout=1.0, request_retries=2)
    engine = RemoteInferenceEngine(cfg, [stalled_server])
    start = time.monotonic()
    with pytest.raises(ServerTimeoutError, match="request_timeout=1.0"):
        _run(engine, lambda: engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig())))
    elapsed = time.monotonic() - start
    # 2 attempts × 1 s + one 1 s backoff (no other server) = 3 s
    assert 2.0 <= elapsed < 4.5, elapsed
    assert isinstance(ServerTimeoutError("x"), TimeoutError)


def test_stalled_server_next_to_a_live_one_fails_over(stalled_server, fake_sglang):
    live, script, bodies = fake_sglang
    script.append(STOP)
    cfg = InferenceEngineConfig(request_timeout=1.0, request_retries=2)
    engine = RemoteInferenceEngine(cfg, [stalled_server, live])
    engine._outstanding[live] = 1  # least-outstanding routing picks the stalled server first
    start = time.monotonic()
    resp = _run(engine, lambda: engine.agenerate(ModelRequest(input_ids=[1, 2], rid="ep")))
    assert time.monotonic() - start < 2.0  # one timeout, no backoff
    assert resp.output_tokens == [13, 2] and len(bodies) == 1
    assert engine.live_addresses() == [live]
    assert engine._choose_server("ep") == live  # the episode now sticks to the live server


def test_unreachable_server_fails_fast_with_a_clear_error():
    cfg = InferenceEngineConfig(request_timeout=5.0, request_retries=2)
    engine = RemoteInferenceEngine(cfg, [f"127.0.0.1:{free_port()}"])
    with pytest.raises(ServerError, match="request_retries=2"):
        _run(engine, lambda: engine.agenerate(ModelRequest(input_ids=[1, 2])))


def test_bad_backend_config_is_rejected():
    with pytest.raises(ValueError, match="rollout.backend"):
        RemoteInferenceEngine(InferenceEngineConfig(backend="tgi"), ["a:1"])


# ------------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def real_servers(tmp_path_factory, tiny_model_dir):
    """Two of our servers on the tiny model (>= 10 ms per decode step). Yields (addresses, procs, model dirs)."""
    root = tmp_path_factory.mktemp("remote")
    model_a = tiny_model_dir  # seed 0
    model_b = save_tiny_model(str(root / "b"), seed=1)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs, addrs = [], []
    for i in range(2):
        port = free_port()
        procs.append(subprocess.Popen(
            slow_server.command(0.01, "--model-path", model_a, "--port", str(port), "--seed", str(i + 1)),
            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        addrs.append(f"127.0.0.1:{port}")
    try:
        wait_healthy(addrs, timeout=120, poll=0.2)
        yield addrs, procs, (model_a, model_b)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _teacher_forced(model, prompt, output):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return steps.gather(1, torch.tensor(output)[:, None])[:, 0]


def test_sixteen_requests_survive_pause_update_continue(real_servers):
    from transformers import AutoModelForCausalLM

    addrs, _, (model_a, model_b) = real_servers
    cfg = InferenceEngineConfig(request_timeout=120, consumer_batch_size=16)
    engine = RemoteInferenceEngine(cfg, addrs)
    engine.initialize()
    gconfig = GenerationConfig(max_new_tokens=200, temperature=1.0)
    prompts = [[1, 5 + i, 200 + 7 * i, 31] for i in range(16)]
    result = {}

    def rollout():
        result["resps"] = _run(engine, lambda: asyncio.gather(
            *[engine.agenerate(ModelRequest(input_ids=p, gconfig=gconfig)) for p in prompts]))

    try:
        t = threading.Thread(target=rollout)
        t.start()
        time.sleep(0.7)  # 200 tokens take >= 2 s at 10 ms per step: all 16 are mid-generation
        engine.pause_generation()  # aborted segments are resubmitted at once and held by the paused servers
        engine.update_weights(WeightUpdateMeta(type="disk", path=model_b, version=1))
        engine.continue_generation()
        engine.set_version(1)
        t.join(timeout=120)
        assert not t.is_alive()
    finally:
        engine.destroy()
    resps = result["resps"]
    assert len(resps) == 16
    models = {0: AutoModelForCausalLM.from_pretrained(model_a).eval(),
              1: AutoModelForCausalLM.from_pretrained(model_b).eval()}
    switched = 0
    for p, r in zip(prompts, resps):
        assert r.stop_reason in ("stop", "length")
        assert r.output_len == len(r.output_logprobs) == len(r.output_versions) > 0
        if r.stop_reason == "length":
            assert r.output_len == 200
        k = r.output_versions.count(0)
        assert r.output_versions == [0] * k + [1] * (r.output_len - k)  # one switch, in order
        switched += 0 < k < r.output_len
        # each token's logprob is the one of the weights that produced it
        for v, (lo, hi) in ((0, (0, k)), (1, (k, r.output_len))):
            if hi > lo:
                expected = _teacher_forced(models[v], p, r.output_tokens)[lo:hi]
                assert r.output_logprobs[lo:hi] == pytest.approx(expected.tolist(), abs=2e-3)
    assert switched >= 14  # a random tiny model rarely emits EOS before the pause
    # both servers took part (least-outstanding routing spreads new rids)
    for a in addrs:
        from arealite.inference.remote import post_json

        assert post_json(a, "/get_model_info", method="GET")["weight_version"] == 1


def test_killed_server_requests_move_to_the_live_one(real_servers):
    addrs, procs, _ = real_servers
    cfg = InferenceEngineConfig(request_timeout=60, request_retries=3)
    engine = RemoteInferenceEngine(cfg, addrs)
    gconfig = GenerationConfig(max_new_tokens=100, temperature=1.0)
    result = {}

    def rollout():
        result["resps"] = _run(engine, lambda: asyncio.gather(
            *[engine.agenerate(ModelRequest(input_ids=[1, 2, 3 + i], gconfig=gconfig)) for i in range(6)]))

    t = threading.Thread(target=rollout)
    t.start()
    time.sleep(0.5)
    assert engine._outstanding[addrs[1]] > 0  # requests are running on the server we kill
    procs[1].send_signal(signal.SIGKILL)
    t.join(timeout=120)
    assert not t.is_alive()
    resps = result["resps"]
    assert len(resps) == 6
    for r in resps:
        assert r.stop_reason in ("stop", "length") and r.output_len == len(r.output_logprobs)
        if r.stop_reason == "length":
            assert r.output_len == 100
    assert engine.live_addresses() == [addrs[0]]
