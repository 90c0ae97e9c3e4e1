"""Asynchronous (η = 1) vs synchronous (η = 0) GRPO on the same workload.

Runs ``recipes/grpo_math.py`` twice, identical except ``rollout.max_head_offpolicyness``, and prints
trained samples per second (trajectories trained / wall time of the training loop) and the ratio.

    python benchmarks/async_vs_sync.py                       # SmolLM2-135M, 6 steps, 4 prompts × 4
    python benchmarks/async_vs_sync.py --steps 10 --extra --gconfig.max_new_tokens 48

On 2 CPU cores the server and the trainer each get one core: in synchronous mode one of them
idles while the other works; in asynchronous mode both work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(trial: str, flags: list[str], args, root: str) -> dict:
    """``recipes/grpo_math.py`` with ``flags`` (+ the shared workload flags of ``args``) in
    ``root/grpo_math/trial``; returns figures from its ``stats.jsonl`` (times in seconds; the
    ``cpu_*`` fractions over the training loop, from :mod:`arealite.utils.cpu`)."""
    cmd = [
        sys.executable, os.path.join(ROOT, "recipes", "grpo_math.py"),
        "--fileroot", root, "--trial_name", trial, "--total_train_steps", str(args.steps),
        "--rollout.consumer_batch_size", str(args.prompts), "--train_dataset.batch_size", str(args.prompts),
        "--gconfig.n_samples", str(args.samples), "--evaluator.at_start", "False", "--evaluator.at_end", "False",
        *(["--actor.path", args.model_path] if args.model_path else []), *flags, *args.extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run {trial} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    stats = [json.loads(line) for line in open(os.path.join(root, "grpo_math", trial, "stats.jsonl"))]
    steps = [s for s in stats if "summary" not in s]
    summary = next(s["summary"] for s in stats if "summary" in s)
    step_s = sorted(s["time/gen_wait_s"] + s["time/train_s"] + s["time/weight_sync_s"] for s in steps[1:] or steps)
    return {
        "samples_per_s": summary["trained_samples_per_s"],
        "s_per_step": step_s[len(step_s) // 2],  # median, the first step (start-up) left out
        "gen_wait_s": sum(s["time/gen_wait_s"] for s in steps),
        "train_s": sum(s["time/train_s"] for s in steps),
        "sync_s": sum(s["time/weight_sync_s"] for s in steps),
        "shared_s": sum(s.get("cpu/shared_cores_s", 0.0) for s in steps),
        "lent_s": sum(s.get("cpu/lent_cores_s", 0.0) for s in steps),
        "staleness_max": max(s["rollout/staleness_max"] for s in steps),
        "cpu_busy_mean": summary.get("cpu/run_busy_mean", float("nan")),
        "cpu_busy_min": summary.get("cpu/run_busy_min", float("nan")),
    }


def parse_workload_args(doc: str, prompts: int, samples: int) -> argparse.Namespace:
    """The workload flags every A/B benchmark on ``grpo_math.py`` shares (see :func:`run`)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per step")
    p.add_argument("--samples", type=int, default=samples, help="completions per prompt")
    p.add_argument("--model-path", default="", help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more recipe flags")
    return p.parse_args()


def main() -> None:
    args = parse_workload_args(__doc__, prompts=4, samples=4)
    with tempfile.TemporaryDirectory() as root:
        results = {eta: run(f"eta{eta}", ["--rollout.max_head_offpolicyness", str(eta)], args, root) for eta in (0, 1)}
    for eta, r in results.items():
        print(f"η={eta}: {r['samples_per_s']:.3f} trained samples/s | generation wait {r['gen_wait_s']:.1f}s "
              f"train {r['train_s']:.1f}s weight sync {r['sync_s']:.1f}s | max staleness {r['staleness_max']:.0f}")
    print(f"ratio async/sync: {results[1]['samples_per_s'] / results[0]['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
