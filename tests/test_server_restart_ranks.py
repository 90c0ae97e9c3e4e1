"""A server restarted by the launcher, seen from a trainer rank other than 0.

Rank 0 runs the :class:`~arealite.launcher.local.ServerWatcher` (it catches a restarted server up
to the current weights and version); every other rank runs a
:class:`~arealite.launcher.local.ServerFollower`: its requests wait while the server is down and
go to it again only once it reports the rank's weight version. Two engines in one process play
the two ranks against one real server (tiny model), which is killed and started again on the
same port, as Ray or Slurm would restart it.
"""

import asyncio
import os
import signal
import subprocess
import threading
import time

import pytest

from arealite.api.config import GenerationConfig, InferenceEngineConfig
from arealite.api.io_struct import ModelRequest, WeightUpdateMeta
from arealite.inference.remote import RemoteInferenceEngine, post_json, wait_healthy
from arealite.inference.adapters import ServerError
from arealite.launcher.local import ServerFollower, ServerWatcher
from arealite.utils.proc import free_port

from conftest import save_tiny_model
import slow_server
from test_remote import _teacher_forced

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(model: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(slow_server.command(0.02, "--model-path", model, "--port", str(port)),
                            cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _generate_in_thread(engine, n: int, max_new_tokens: int, out: dict) -> threading.Thread:
    gconfig = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0)

    async def main():
        try:
            return await asyncio.gather(*[engine.agenerate(ModelRequest(input_ids=[1, 7 + i, 300 + 11 * i],
                                                                        gconfig=gconfig)) for i in range(n)],
                                        return_exceptions=True)
        finally:
            await engine.aclose()

    t = threading.Thread(target=lambda: out.setdefault("resps", asyncio.run(main())))
    t.start()
    return t


@pytest.fixture()
def two_models(tmp_path, tiny_model_dir):
    return tiny_model_dir, save_tiny_model(str(tmp_path / "v1"), seed=3)


def test_rank1_requests_wait_for_the_restart_and_its_catch_up(two_models):
    from transformers import AutoModelForCausalLM

    model_v0, model_v1 = two_models
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = _start(model_v0, port)
    cfg = InferenceEngineConfig(request_timeout=60, request_retries=3, setup_timeout=90, max_server_restarts=1)
    lead, follower = RemoteInferenceEngine(cfg, [addr]), RemoteInferenceEngine(cfg, [addr])
    watchers = []
    try:
        wait_healthy([addr], 120, poll=0.2)
        # Both ranks at version 1: the server loaded model_v1 from disk.
        lead.update_weights(WeightUpdateMeta(type="disk", path=model_v1, version=1))
        lead.set_version(1)
        follower.set_version(1)
        for engine, cls in ((lead, ServerWatcher), (follower, ServerFollower)):
            w = cls(engine, cfg, poll_s=0.2)
            engine.restart_hook = w.claim
            engine.on_destroy.append(w.stop)
            w.start()
            watchers.append(w)
        out = {}
        t = _generate_in_thread(follower, n=4, max_new_tokens=150, out=out)  # >= 3 s at 20 ms per token
        time.sleep(1.0)
        assert follower._outstanding[addr] == 4  # mid-generation
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(3.0)  # down for a while: more than request_retries x backoff of the old client
        assert addr in follower.restarting and addr in lead.restarting
        proc = _start(model_v0, port)  # the launcher restarts it: it holds the version-0 model again
        t.join(timeout=180)
        assert not t.is_alive()
    finally:
        for engine in (lead, follower):
            engine.destroy()
        proc.kill()
        proc.wait()
    assert all(w.stopped.is_set() for w in watchers)  # destroy() stopped the watchers
    resps = out["resps"]
    assert [type(r).__name__ for r in resps] == ["ModelResponse"] * 4, resps
    assert addr not in follower.restarting and follower.live_addresses() == [addr]
    v1 = AutoModelForCausalLM.from_pretrained(model_v1).eval()
    for i, r in enumerate(resps):
        assert r.stop_reason in ("stop", "length") and r.output_len == len(r.output_logprobs) > 0
        # Every token came from the version-1 weights: none from the restarted server before
        # rank 0 brought it back to version 1.
        assert r.output_versions == [1] * r.output_len
        expected = _teacher_forced(v1, [1, 7 + i, 300 + 11 * i], r.output_tokens)
        assert r.output_logprobs == pytest.approx(expected.tolist(), abs=2e-3)


def test_rank1_never_uses_a_restarted_server_that_was_not_caught_up(two_models):
    """No rank 0 here: the restarted server stays at version 0 while this rank is at 1, so the
    follower keeps it out and excludes it after ``rollout.setup_timeout``; the request fails
    with a clear error instead of getting version-0 tokens."""
    model_v0, _ = two_models
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = _start(model_v0, port)
    cfg = InferenceEngineConfig(request_timeout=30, request_retries=2, setup_timeout=8, max_server_restarts=1)
    follower = RemoteInferenceEngine(cfg, [addr])
    try:
        wait_healthy([addr], 120, poll=0.2)
        follower.set_version(1)
        w = ServerFollower(follower, cfg, poll_s=0.2)
        follower.restart_hook = w.claim
        follower.on_destroy.append(w.stop)
        w.start()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(1.0)
        assert addr in follower.restarting
        proc = _start(model_v0, port)
        wait_healthy([addr], 120, poll=0.2)
        assert post_json(addr, "/get_model_info", method="GET")["weight_version"] == 0
        out = {}
        start = time.monotonic()
        t = _generate_in_thread(follower, n=1, max_new_tokens=5, out=out)
        t.join(timeout=60)
        assert not t.is_alive()
    finally:
        follower.destroy()
        proc.kill()
        proc.wait()
    [err] = out["resps"]
    assert isinstance(err, ServerError), err
    assert time.monotonic() - start < 30
    assert addr in follower.excluded and addr not in follower.restarting
