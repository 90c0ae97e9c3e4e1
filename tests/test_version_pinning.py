"""Per-request version pinning (AReaL #1569's bug class) against a scripted server that reports
no weight version (vLLM-like; SGLang's "default"): a reply read after the next update landed keeps
the version its segment was sent to, and a continuation held by a paused server gets the version
that serves it. The first test fails on the code before pinning (it tagged at reply time)."""

import asyncio
import threading

import pytest
from aiohttp import web

from arealite.api.config import GenerationConfig, InferenceEngineConfig
from arealite.api.io_struct import ModelRequest
from arealite.inference.remote import RemoteInferenceEngine
from arealite.utils.proc import free_port


def _reply(tokens, finish):
    return {"output_ids": tokens, "meta_info": {
        "finish_reason": {"type": finish}, "output_token_logprobs": [[-0.5, t, None] for t in tokens]}}


class _Server:
    """/generate answers the scripted replies in order; each waits for its gate (a threading
    Event the test sets) before answering. ``received`` counts the requests that arrived."""

    def __init__(self, script):
        self.script, self.received = list(script), 0
        self.gates = [threading.Event() for _ in script]
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = free_port()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    @staticmethod
    async def _health(request):
        return web.json_response({"status": "ok"})

    async def _generate(self, request):
        await request.json()
        i = self.received
        self.received += 1
        await asyncio.to_thread(self.gates[i].wait, 20)
        return web.json_response(self.script[i])

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _generate_in_thread(engine):
    out = {}

    def run():
        async def main():
            try:
                out["resp"] = await engine.agenerate(ModelRequest([1, 2, 3], GenerationConfig(max_new_tokens=4)))
            finally:
                await engine.aclose()
        asyncio.run(main())

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wait(cond, timeout=10.0):
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.01)


@pytest.fixture
def make():
    servers = []

    def build(script):
        srv = _Server(script)
        servers.append(srv)
        return srv, RemoteInferenceEngine(InferenceEngineConfig(request_timeout=30), [f"127.0.0.1:{srv.port}"])
    yield build
    for s in servers:
        s.stop()


def test_a_reply_read_after_an_update_keeps_the_version_it_was_sent_to(make):
    srv, engine = make([_reply([7, 8], "stop")])
    t, out = _generate_in_thread(engine)
    _wait(lambda: srv.received == 1)  # sent at version 0, served by the weights of version 0 ...
    engine.set_version(1)  # ... and an update lands before the reply is read
    srv.gates[0].set()
    t.join(10)
    assert out["resp"].output_versions == [0, 0]  # tagging at reply time said [1, 1]


def test_a_continuation_held_by_paused_servers_gets_the_version_that_serves_it(make):
    srv, engine = make([_reply([7], "abort"), _reply([8, 9], "stop")])
    t, out = _generate_in_thread(engine)
    srv.gates[0].set()  # the pause aborts the first segment: 1 token of version 0
    _wait(lambda: srv.received == 2)  # the continuation is sent while the servers are paused ...
    engine.set_version(1)  # ... the new weights load, the servers continue and serve it
    srv.gates[1].set()
    t.join(10)
    assert out["resp"].output_tokens == [7, 8, 9]
    assert out["resp"].output_versions == [0, 1, 1]


def test_rank_0_tags_a_request_sent_during_its_own_pause_with_the_new_version(make):
    srv, engine = make([_reply([5, 6], "stop")])
    engine._all_servers = lambda *a, **k: []  # no control endpoints on the scripted server
    engine.pause_generation()
    t, out = _generate_in_thread(engine)
    _wait(lambda: srv.received == 1)
    engine.set_version(1)
    engine.continue_generation()
    srv.gates[0].set()
    t.join(10)
    assert out["resp"].output_versions == [1, 1]
