"""Train an environment agent (recipes/search_agent.py or recipes/service_agent.py) at several η and
print what long episodes cost: held-out success before → after, tool calls per episode, the episode
length distribution, time per group of episodes, and s/step — one row per η, measured in one run.

    python benchmarks/agents.py search_agent --eta 2 0 --steps 12 --batch 4 --out docs/agents_search.json
    python benchmarks/agents.py search_agent --summarize /tmp/agents/search_agent_eta2   # an existing run

Each run is ``torchrun --nproc_per_node=1 recipes/<recipe>.py --config recipes/configs/<recipe>.yaml``
with ``--total_train_steps``, ``--train_dataset.batch_size`` / ``--rollout.consumer_batch_size`` and
``--rollout.max_head_offpolicyness`` set from the flags (extra recipe flags after ``--``). Runs go one after
another: never time two at once on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _eta(run_dir: str) -> int | None:
    """``rollout.max_head_offpolicyness`` of the run (its dumped config.yaml)."""
    import yaml

    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f).get("rollout", {}).get("max_head_offpolicyness")


def summarize(run_dir: str) -> dict:
    """Figures of one finished run folder (``<fileroot>/<experiment>/<trial>``): its ``stats.jsonl``
    and ``rollouts/rollouts.jsonl``."""
    records = [json.loads(line) for line in open(os.path.join(run_dir, "stats.jsonl"))]
    steps = [r for r in records if "summary" not in r]
    summary = next((r["summary"] for r in records if "summary" in r), {})
    groups = [json.loads(line) for line in open(os.path.join(run_dir, "rollouts", "rollouts.jsonl"))]
    step_times = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
    turns = [t for g in groups for t in g["turns"]]
    calls = [i.get("tool_calls", 0.0) for g in groups for i in g["info"]]
    ended = Counter(k[len("ended_"):] for g in groups for i in g["info"] for k, v in i.items() if k.startswith("ended_") and v)
    durations = sorted(g["end_time"] - g["start_time"] for g in groups)
    head, tail = steps[:2], steps[-2:]
    mean = lambda rows, key: sum(r.get(key, 0.0) for r in rows) / max(1, len(rows))  # noqa: E731
    return {
        "run_dir": run_dir, "steps": len(steps),
        "eta": _eta(run_dir),
        "heldout_reward_start": summary.get("eval/reward_start"), "heldout_reward_end": summary.get("eval/reward_end"),
        "heldout_turns_start": summary.get("eval/turns_start"), "heldout_turns_end": summary.get("eval/turns_end"),
        "heldout_tool_calls_start": summary.get("eval/tool_calls_start"),
        "heldout_tool_calls_end": summary.get("eval/tool_calls_end"),
        "train_reward_first2": mean(head, "rollout/reward"), "train_reward_last2": mean(tail, "rollout/reward"),
        "tool_calls_per_episode_first2": mean(head, "rollout/tool_calls"),
        "tool_calls_per_episode_last2": mean(tail, "rollout/tool_calls"),
        "s_per_step_median": statistics.median(step_times) if step_times else None,
        "s_per_step_mean": statistics.mean(step_times) if step_times else None,
        "train_s_median": statistics.median(r["time/train_s"] for r in steps) if steps else None,
        "gen_wait_s_median": statistics.median(r["time/gen_wait_s"] for r in steps) if steps else None,
        "staleness_mean": mean(steps, "rollout/staleness_mean"),
        "episodes": len(turns), "turns_histogram": dict(sorted(Counter(turns).items())),
        "tool_calls_histogram": dict(sorted(Counter(int(c) for c in calls).items())),
        "ended": dict(ended),
        "group_seconds_p10_p50_p90": [durations[int(q * (len(durations) - 1))] for q in (0.1, 0.5, 0.9)] if durations else None,
    }


def run(recipe: str, eta: int, steps: int, batch: int, root: str, extra: list[str]) -> str:
    """Train ``recipe`` once at ``eta``; returns its run folder."""
    fileroot = os.path.join(root, f"{recipe}_eta{eta}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "recipes", f"{recipe}.py"), "--config", os.path.join(ROOT, "recipes", "configs", f"{recipe}.yaml"),
           "--fileroot", fileroot, "--total_train_steps", str(steps), "--train_dataset.batch_size", str(batch),
           "--rollout.consumer_batch_size", str(batch), "--rollout.max_head_offpolicyness", str(eta), *extra]
    print("+", " ".join(cmd), flush=True)
    start = time.time()
    subprocess.run(cmd, check=True, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"η={eta}: {time.time() - start:.0f} s", flush=True)
    return os.path.join(fileroot, recipe, "trial0")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", choices=["search_agent", "service_agent"])
    p.add_argument("--eta", type=int, nargs="+", default=[2, 0], help="rollout.max_head_offpolicyness values")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4, help="prompts per step (groups of gconfig.n_samples)")
    p.add_argument("--root", default="/tmp/agents")
    p.add_argument("--summarize", nargs="*", help="summarise these finished run folders instead of training")
    p.add_argument("--out", help="write the figures as JSON here")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    os.makedirs(args.root, exist_ok=True)
    if args.summarize:
        rows = [summarize(d) for d in args.summarize]
    else:
        rows = []
        for eta in args.eta:
            row = summarize(run(args.recipe, eta, args.steps, args.batch, args.root, extra))
            rows.append(row)
    import torch

    result = {"recipe": args.recipe, "date": time.strftime("%Y-%m-%d"), "cpu": _cpu_model(), "cores": os.cpu_count(),
              "torch": torch.__version__, "steps": args.steps, "batch": args.batch, "extra": extra, "runs": rows}
    for r in rows:
        print(f"η={r['eta']}: held-out {r['heldout_reward_start']} → {r['heldout_reward_end']}, "
              f"tool calls/episode {r['tool_calls_per_episode_first2']:.2f} → {r['tool_calls_per_episode_last2']:.2f}, "
              f"s/step median {r['s_per_step_median']}, turns {r['turns_histogram']}, ended {r['ended']}, "
              f"group s p10/p50/p90 {r['group_seconds_p10_p50_p90']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
