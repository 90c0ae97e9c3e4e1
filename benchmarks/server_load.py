"""Load drill of ``python -m arealite.server`` on loopback: many concurrent ``/generate``
requests, a fraction of them aborted by the client (the connection is closed mid-request, which
cancels the handler and frees the row), and ``/pause_generation`` + ``/continue_generation``
pairs at random moments (running requests come back with their partial output and finish reason
``abort``; new ones are held until the continue).

Reported: requests sent, served (HTTP 200), client aborts, aborted by a pause, lost (neither
served nor aborted by the client: must be 0), p50/p99 latency of served requests [s], the
server's resident memory [MiB] after a warm-up round (baseline) and after the load (the server
must not keep per-request state: back within a stated bound), and its running/waiting request
counts afterwards (must be 0).

    python benchmarks/server_load.py                      # a tiny random model, 400 requests
    python benchmarks/server_load.py --model-path DIR --requests 1000 --concurrency 128

:func:`run_load` is also used by ``tests/test_server_load.py`` (smaller, with asserted bounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from arealite.utils.proc import free_port  # noqa: E402


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` [MiB] (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024




def start_server(model_path: str, log_path: str, extra: list[str] | None = None,
                 timeout: float = 180.0) -> tuple[subprocess.Popen, str]:
    """Start the server on a free loopback port; return (process, "127.0.0.1:port") once healthy.

    Raises: RuntimeError if it exits or is not healthy after ``timeout`` s (see ``log_path``)."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "arealite.server", "--model-path", model_path,
                             "--host", "127.0.0.1", "--port", str(port), *(extra or [])],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    addr, deadline = f"127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://{addr}/health", timeout=2).read()
            return proc, addr
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"server did not become healthy; see {log_path}") from None
            time.sleep(0.3)


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


async def _load(addr: str, n_requests: int, concurrency: int, abort_frac: float, n_pauses: int,
                max_new_tokens: tuple[int, int], vocab: int, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    url = f"http://{addr}"
    outcome: dict[str, int] = {"served": 0, "client_aborts": 0, "pause_aborts": 0, "errors": 0}
    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=300)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(i: int) -> None:
            body = {"input_ids": [rng.randrange(vocab) for _ in range(rng.randint(4, 48))],
                    "sampling_params": {"max_new_tokens": rng.randint(*max_new_tokens), "temperature": 1.0,
                                        "ignore_eos": True},
                    "return_logprob": True, "rid": f"load-{i}"}
            abort_after = rng.uniform(0.0, 0.3) if rng.random() < abort_frac else None
            async with sem:
                t0 = time.monotonic()
                task = asyncio.ensure_future(session.post(f"{url}/generate", json=body))
                try:
                    if abort_after is not None:
                        done, _ = await asyncio.wait({task}, timeout=abort_after)
                        if not done:  # client gives up: the connection is closed
                            task.cancel()
                            try:
                                await task
                            except (asyncio.CancelledError, Exception):
                                pass
                            outcome["client_aborts"] += 1
                            return
                    resp = await task
                    async with resp:
                        data = await resp.json()
                    if resp.status != 200:
                        outcome["errors"] += 1
                        if outcome["errors"] <= 3:
                            print(f"request {i}: HTTP {resp.status} {data}", file=sys.stderr)
                        return
                    fin = data["meta_info"]["finish_reason"]
                    n_out = len(data["output_ids"])
                    assert n_out == len(data["meta_info"]["output_token_logprobs"])
                    if fin["type"] == "abort":
                        outcome["pause_aborts"] += 1
                    else:
                        assert fin["type"] == "length" and n_out == body["sampling_params"]["max_new_tokens"], data
                    outcome["served"] += 1
                    latencies.append(time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001 - counted as an error, the drill goes on
                    outcome["errors"] += 1
                    if outcome["errors"] <= 3:
                        print(f"request {i} failed: {e!r}", file=sys.stderr)

        async def pauser() -> None:
            for _ in range(n_pauses):
                await asyncio.sleep(rng.uniform(0.05, 0.5))
                async with session.post(f"{url}/pause_generation", json={}) as r:
                    assert r.status == 200
                await asyncio.sleep(rng.uniform(0.0, 0.1))
                async with session.post(f"{url}/continue_generation", json={}) as r:
                    assert r.status == 200

        t0 = time.monotonic()
        await asyncio.gather(pauser(), *[one(i) for i in range(n_requests)])
        wall = time.monotonic() - t0
        # let the server notice closed connections and free their rows
        for _ in range(100):
            async with session.get(f"{url}/get_server_info") as r:
                info = await r.json()
            if info["running_requests"] == 0 and info["waiting_requests"] == 0:
                break
            await asyncio.sleep(0.1)
    lost = n_requests - outcome["served"] - outcome["client_aborts"]
    return {"requests": n_requests, **outcome, "lost": lost, "wall_s": wall,
            "p50_latency_s": _percentile(latencies, 50), "p99_latency_s": _percentile(latencies, 99),
            "running_after": info["running_requests"], "waiting_after": info["waiting_requests"]}


def run_load(addr: str, pid: int, n_requests: int = 200, concurrency: int = 64, abort_frac: float = 0.2,
             n_pauses: int = 3, max_new_tokens: tuple[int, int] = (4, 32), seed: int = 0,
             warmup_requests: int = 64) -> dict:
    """A warm-up round of the same shape, aborts and a pause included (then the memory baseline),
    then the load. The warm-up takes every code path the load takes, so the allocator's pools for
    aborted rows and paused batches exist before the baseline: what grows afterwards is growth
    per request (a leak), not first-use allocation.

    Returns the figures listed in the module docstring plus ``rss_before_mib`` /
    ``rss_after_mib`` (server RSS after the warm-up and after the load)."""
    with urllib.request.urlopen(f"http://{addr}/get_model_info", timeout=10) as r:
        vocab = json.loads(r.read())["vocab_size"]
    asyncio.run(_load(addr, warmup_requests, concurrency, abort_frac, min(n_pauses, 1), max_new_tokens, vocab, seed + 1))
    before = rss_mib(pid)
    out = asyncio.run(_load(addr, n_requests, concurrency, abort_frac, n_pauses, max_new_tokens, vocab, seed))
    return {**out, "rss_before_mib": before, "rss_after_mib": rss_mib(pid)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="", help="HF model folder; default: a tiny random Llama")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--abort-frac", type=float, default=0.2)
    ap.add_argument("--pauses", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, nargs=2, default=(4, 32))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                    help="extra server flags, e.g. --max-batch-size 32")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="arealite_load_")
    model = args.model_path
    if not model:
        sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
        from conftest import save_tiny_model

        model = save_tiny_model(os.path.join(tmp, "tiny"))
    proc, addr = start_server(model, os.path.join(tmp, "server.log"), args.server_args)
    try:
        r = run_load(addr, proc.pid, args.requests, args.concurrency, args.abort_frac, args.pauses,
                     tuple(args.max_new_tokens), args.seed)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"requests {r['requests']}  served {r['served']}  client aborts {r['client_aborts']}  "
          f"aborted by pause {r['pause_aborts']}  errors {r['errors']}  lost {r['lost']}")
    print(f"latency p50 {r['p50_latency_s']:.3f} s  p99 {r['p99_latency_s']:.3f} s  wall {r['wall_s']:.1f} s")
    print(f"server RSS before {r['rss_before_mib']:.1f} MiB  after {r['rss_after_mib']:.1f} MiB  "
          f"(+{r['rss_after_mib'] - r['rss_before_mib']:.1f})  running/waiting after {r['running_after']}/"
          f"{r['waiting_after']}")


if __name__ == "__main__":
    main()
