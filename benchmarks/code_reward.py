"""Code reward throughput: programs scored per second in the sandbox, and the share of a training
step spent scoring.

    python benchmarks/code_reward.py                                   # HumanEval canonical + synthetic task
    python benchmarks/code_reward.py --parallel 1,2,4,8 --repeat 2
    python benchmarks/code_reward.py --stats outputs/code_grpo/trial0/stats.jsonl   # a run's share

Throughput: the 164 HumanEval canonical solutions (real programs with real tests) and the
synthetic task's test-split reference solutions, scored with
:func:`arealite.reward.code.ascore_code` (one sandbox process per program, all its tests inside),
``--parallel`` programs at a time; it prints programs/s and the mean latency per program for each
setting, and the ratio to one at a time. With ``--stats``: from a code run's ``stats.jsonl``, the
sandbox seconds per step (``reward/code_score_s``, summed over programs), the step's wall time, and
their ratio — how much scoring the rollouts of one step cost, against the step. (The rollout loop
scores while the trainer trains, so this is work overlapped with training, not a pause of it,
unless the trainer waits for rollouts: ``time/wait_rollout_s``.)

Timing is meaningful only on an otherwise idle machine: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arealite.dataset.code_data import FAMILIES, all_problems, humaneval_problems  # noqa: E402
from arealite.reward.code import ascore_many, problem_answer  # noqa: E402

# Reference solutions of the synthetic families (the same as tests/test_code_data.py's).
_SOLUTIONS = {
    "plus_k": "return x + {k}", "minus_k": "return x - {k}", "times_k": "return x * {k}", "mod_k": "return n % {k}",
    "is_multiple": "return n % {k} == 0", "square_plus_k": "return x * x + {k}", "clip_k": "return min(x, {k})",
    "repeat_k": "return s * {k}", "first_k": "return s[:{k}]", "count_char": "return s.count({k!r})",
    "replace_char": "return s.replace({k!r}, '_')", "sum_plus_k": "return sum(items) + {k}",
    "max_times_k": "return max(items) * {k}", "add_each": "return [v + {k} for v in items]",
    "count_above": "return sum(1 for v in items if v > {k})", "last_k": "return items[-{k}:]",
}


def workload() -> list[tuple[str, str]]:
    """(completion, problem JSON) pairs: HumanEval canonical solutions, then the synthetic test split."""
    pairs = [(p["canonical_solution"], problem_answer(p)) for p in humaneval_problems()]
    fam = {f.entry: f for f in FAMILIES}
    for p in all_problems("test"):
        f = fam[p["entry_point"]]
        k = next(k for k in f.consts if str(k) == p["task_id"].split("/", 2)[2])
        code = f"def {f.entry}({f.arg}):\n    " + _SOLUTIONS[f.entry].format(k=k) + "\n"
        pairs.append((code, problem_answer(p)))
    return pairs


async def _score_all(pairs, parallel: int) -> tuple[float, list]:
    t0 = time.perf_counter()
    results = await ascore_many(pairs, parallel)
    return time.perf_counter() - t0, results


def throughput(parallels: list[int], repeat: int) -> list[dict]:
    pairs = workload()
    asyncio.run(_score_all(pairs[:8], 2))  # warm the page cache and the namespace probe
    rows = []
    for par in parallels:
        best = None
        for _ in range(repeat):
            wall, results = asyncio.run(_score_all(pairs, par))
            best = wall if best is None else min(best, wall)
            passed = sum(r.outcome == "pass" for r in results)
        rows.append({"parallel": par, "programs": len(pairs), "wall_s": best, "programs_per_s": len(pairs) / best,
                     "latency_ms": 1000 * best * par / len(pairs), "passed": passed})
    return rows


def step_share(path: str) -> list[dict]:
    rows = [json.loads(line) for line in open(path)]
    steps = [r for r in rows if "summary" not in r and "reward/code_score_s" in r]
    out, prev_s, prev_t = [], 0.0, None
    for s in steps:
        t_end = s["time/train_end"]
        wall = t_end - prev_t if prev_t is not None else None
        score = s["reward/code_score_s"] - prev_s
        out.append({"step": s["step"], "score_s": score, "step_wall_s": wall,
                    "share": score / wall if wall else None, "programs": s["reward/code_programs"]})
        prev_s, prev_t = s["reward/code_score_s"], t_end
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parallel", default="1,2,4", help="programs scored at once, comma separated")
    p.add_argument("--repeat", type=int, default=1, help="runs per setting (the fastest is reported)")
    p.add_argument("--stats", default="", help="a code run's stats.jsonl: sandbox seconds per step")
    args = p.parse_args(argv)
    result = {"cpus": os.cpu_count()}
    if args.stats:
        share = step_share(args.stats)
        print("| step | sandbox s | step wall s | share |\n|---|---|---|---|")
        for r in share:
            print(f"| {r['step']} | {r['score_s']:.2f} | {r['step_wall_s'] or float('nan'):.1f} | "
                  f"{(r['share'] or float('nan')):.3f} |")
        later = [r for r in share[1:] if r["share"] is not None]
        if later:
            mean = sum(r["share"] for r in later) / len(later)
            print(f"mean share over steps 1..: {mean:.3f} (sandbox seconds per step / step wall seconds)")
            result["mean_share"] = mean
        result["steps"] = share
        return result
    rows = throughput([int(x) for x in args.parallel.split(",")], args.repeat)
    base = rows[0]["programs_per_s"]
    print(f"| parallel | programs | wall (s) | programs/s | × vs {rows[0]['parallel']} | latency (ms) | passed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['parallel']} | {r['programs']} | {r['wall_s']:.1f} | {r['programs_per_s']:.1f} | "
              f"{r['programs_per_s'] / base:.2f} | {r['latency_ms']:.0f} | {r['passed']} |")
    result["throughput"] = rows
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
