"""Bounded load drill of the generation server on loopback (benchmarks/server_load.py prints the
same figures at a larger size): concurrent /generate requests with random client aborts and
pause/continue pairs. No request is lost, the server is idle and healthy afterwards, and its
resident memory after two more identical rounds is within MEMORY_BOUND_MIB of the first's."""

import importlib.util
import json
import os
import urllib.request

import pytest

from conftest import REPO_ROOT

MEMORY_BOUND_MIB = 64  # allocator noise of a CPU torch process; per-request leaks of 150 requests exceed it

_spec = importlib.util.spec_from_file_location("server_load", os.path.join(REPO_ROOT, "benchmarks", "server_load.py"))
server_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_load)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc, addr = server_load.start_server(tiny_model_dir, str(tmp_path_factory.mktemp("srv") / "server.log"))
    yield proc, addr
    proc.terminate()
    proc.wait(timeout=30)


def test_concurrent_requests_with_aborts_and_pauses_lose_nothing(server):
    proc, addr = server
    r = server_load.run_load(addr, proc.pid, n_requests=150, concurrency=48, abort_frac=0.25, n_pauses=3,
                             max_new_tokens=(4, 32), seed=3, warmup_requests=48)
    print(r)
    assert r["lost"] == 0 and r["errors"] == 0, r
    assert r["served"] + r["client_aborts"] == 150
    assert r["client_aborts"] > 0 and r["pause_aborts"] > 0, r  # both fault kinds happened
    assert r["running_after"] == 0 and r["waiting_after"] == 0  # every aborted row was freed
    assert 0 < r["p50_latency_s"] <= r["p99_latency_s"]
    # memory: the first rounds may raise the allocator's high-water mark and build oneDNN's
    # primitives for new row buckets; a per-request leak grows again in every later, identical
    # round. Two more rounds must stay in bounds (before the server bucketed its packed-GEMM row
    # counts and trimmed the heap when idle, they grew 110 MiB here and 79 MiB once in CI).
    for _ in range(2):
        again = server_load.run_load(addr, proc.pid, n_requests=150, concurrency=48, abort_frac=0.25,
                                     n_pauses=3, max_new_tokens=(4, 32), seed=3, warmup_requests=0)
        assert again["lost"] == 0 and again["errors"] == 0, again
    assert again["rss_after_mib"] - r["rss_after_mib"] < MEMORY_BOUND_MIB, (r, again)
    # still serving normally: a greedy request gets its full budget
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 0.0,
                                                                   "ignore_eos": True}}).encode()
    req = urllib.request.Request(f"http://{addr}/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    assert len(out["output_ids"]) == 5 and out["meta_info"]["finish_reason"]["type"] == "length"
