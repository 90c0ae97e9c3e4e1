"""Our server's generation time with its torch threads switched live (``POST /set_num_threads``).

Core sharing lends a waiting trainer's cores to the server (``docs/cluster.md``). This measures
what that buys: one server process (``python -m arealite.server``, started with 1 thread)
runs the same batch of concurrent requests with each thread count in turn, switched between
rounds through the endpoint, and prints seconds per round, tokens/s and the ratio.

    python benchmarks/server_threads.py                      # SmolLM2-135M, 64 requests × 48 tokens, 1 and 2 threads
    python benchmarks/server_threads.py --requests 32 --threads 1 2 --rounds 3

Each round is ``--requests`` greedy requests at once, prompts of 60–99 random tokens,
``--new-tokens`` tokens each (``ignore_eos``: the same work every round). Figures are the median
over ``--rounds`` rounds per thread count, after one warm-up round; the counts alternate so a
drift of the machine hits both. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_load import start_server  # noqa: E402

from arealite.inference.remote import post_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="", help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from arealite.utils.hf import resolve_model_path

    path = resolve_model_path(args.model_path)
    log = os.path.join(tempfile.gettempdir(), "server_threads_server.log")
    server, addr = start_server(path, log, ["--num-threads", "1"], timeout=600)
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 40000) for _ in range(60 + i % 40)] for i in range(args.requests)]
        sp = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}

        def one_round() -> float:
            t = time.perf_counter()
            with ThreadPoolExecutor(args.requests) as pool:
                list(pool.map(lambda ids: post_json(addr, "/generate", {"input_ids": ids, "sampling_params": sp},
                                                    timeout=900, retries=1), prompts))
            return time.perf_counter() - t

        one_round()  # warm-up
        times: dict[int, list[float]] = {n: [] for n in args.threads}
        for _ in range(args.rounds):
            for n in args.threads:
                reply = post_json(addr, "/set_num_threads", {"num_threads": n}, timeout=900, retries=1)
                assert reply["num_threads"] == n, reply
                times[n].append(one_round())
        tokens = args.requests * args.new_tokens
        base = statistics.median(times[args.threads[0]])
        for n, ts in times.items():
            m = statistics.median(ts)
            print(f"{n} thread(s): {m:.2f} s per round ({', '.join(f'{t:.2f}' for t in ts)}) | "
                  f"{tokens / m:.0f} generated tokens/s | {base / m:.2f}x vs {args.threads[0]} thread(s)")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
