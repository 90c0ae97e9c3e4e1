"""Overhead of the timeline trace (arealite/utils/trace.py).

1. Micro: cost of one event (span, lane span, counter) with a tracer installed, and of the same
   calls with none installed (AREALITE_TRACE=0), in ns per call.
2. End to end (``--e2e``): the same tiny-model GRPO run (1 rank, our server, --steps steps)
   with and without tracing, ``--repeats`` times each, alternating; prints the loop's trained
   samples/s and the per-step wall time (mean of steps 2..N, from stats.jsonl), and the
   events per step and save time of the trace file.

    flock /tmp/arealite-heavy.lock .venv/bin/python benchmarks/trace_overhead.py --e2e
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from arealite.utils import trace  # noqa: E402


def micro(n: int = 200_000) -> dict[str, float]:
    def bench(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e9

    def span():
        with trace.span("forward"):
            pass

    res = {}
    for label, tracer in (("off", None), ("on", trace.Tracer(max_events=2 * n))):
        trace.install(tracer)
        res[f"span_{label}_ns"] = bench(span)
        clock = iter(range(10 * n))  # sequential requests: one lane (lanes grow with concurrency only)
        res[f"lane_{label}_ns"] = bench(lambda: trace.lane_complete("server x", "generate", next(clock), next(clock) + 0.5,
                                                                   {"tokens": 8}))
        res[f"counter_{label}_ns"] = bench(lambda: trace.counter("staleness gate", {"open": 1, "running": 3}))
        if tracer is not None:
            path = os.path.join(tempfile.mkdtemp(), "t.json")
            t0 = time.perf_counter()
            tracer.save(path)
            res["save_s_per_100k_events"] = (time.perf_counter() - t0) / len(tracer.events()) * 1e5
    trace.install(None)
    return res


def run(model: str, root: str, steps: int, traced: bool) -> dict[str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(REPO, "recipes", "grpo_math.py"), "--actor.path", model, "--fileroot", root,
           "--total_train_steps", str(steps), "--gconfig.n_samples", "4", "--gconfig.max_new_tokens", "16",
           "--rollout.consumer_batch_size", "8", "--train_dataset.batch_size", "8", "--valid_dataset.size", "4",
           "--evaluator.at_start", "False", "--evaluator.at_end", "False"]
    env = dict(os.environ, AREALITE_TRACE="1" if traced else "0")
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    out = os.path.join(root, "grpo_math", "trial0")
    stats = [json.loads(line) for line in open(os.path.join(out, "stats.jsonl"))]
    steps_ = [s for s in stats if "summary" not in s]
    walls = [b["time"] - a["time"] for a, b in zip(steps_, steps_[1:])]
    res = {"samples_per_s": stats[-1]["summary"]["trained_samples_per_s"], "step_s": statistics.mean(walls)}
    if traced:
        events = json.load(open(os.path.join(out, "trace.json")))["traceEvents"]
        res["events_per_step"] = sum(e["ph"] != "M" for e in events) / steps
        res["trace_bytes"] = os.path.getsize(os.path.join(out, "trace.json"))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--e2e", action="store_true", help="also the end-to-end runs (a few minutes)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    m = micro()
    print("per call (ns): " + ", ".join(f"{k} {v:.0f}" for k, v in m.items() if k.endswith("_ns")))
    print(f"save: {m['save_s_per_100k_events']:.2f} s per 100k events")
    if not args.e2e:
        return
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from conftest import save_tiny_model

    model = save_tiny_model(tempfile.mkdtemp(prefix="tiny_"))
    res = {True: [], False: []}
    for _ in range(args.repeats):
        for traced in (False, True):
            res[traced].append(run(model, tempfile.mkdtemp(prefix="trace_bench_"), args.steps, traced))
    for traced in (False, True):
        r = res[traced]
        print(f"tracing {'on ' if traced else 'off'}: step {statistics.mean(x['step_s'] for x in r):.3f} s "
              f"(runs: {', '.join('%.3f' % x['step_s'] for x in r)}), "
              f"{statistics.mean(x['samples_per_s'] for x in r):.2f} trained samples/s")
    on = res[True][0]
    per_step_cost = on["events_per_step"] * m["lane_on_ns"] * 1e-9
    print(f"trace: {on['events_per_step']:.0f} events/step, {on['trace_bytes'] / 1e3:.0f} kB for {args.steps} steps; "
          f"estimated recording cost {per_step_cost * 1e3:.3f} ms/step "
          f"= {100 * per_step_cost / statistics.mean(x['step_s'] for x in res[True]):.3f}% of a step")


if __name__ == "__main__":
    main()
