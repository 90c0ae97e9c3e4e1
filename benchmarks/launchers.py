"""Start-up time and per-step overhead of the launchers on the same work, one after another.

    .venv/bin/python benchmarks/launchers.py                 # tiny random model, 6 GRPO steps
    .venv/bin/python benchmarks/launchers.py --actor-path "" --steps 4   # the embedded SmolLM2

Runs ``recipes/grpo_math.py`` with 1 server and 1 trainer rank through ``torchrun`` (local),
``python -m arealite.launcher.ray`` (a fresh local Ray started by the launcher, or
``--ray-address``) and ``python -m arealite.launcher.slurm --wait`` (when ``sbatch`` works here;
``scripts/slurm_local.sh`` starts a one-node cluster). Prints, per launcher: seconds from the
command's start to the first generation request and to the first finished rollout
(``rollouts.jsonl`` ``start_time`` / ``end_time``), the median seconds per step over steps 2..N
(``stats.jsonl`` times), the whole wall time, and each as a ratio to the local launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "grpo_math.py")


def _tiny_model(path: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import save_tiny_model

    return save_tiny_model(path)


def run(name: str, cmd: list[str], out: str) -> dict:
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "stats.jsonl"))]
    times = [r["time"] for r in rows if "summary" not in r]
    rollouts = [json.loads(line) for line in open(os.path.join(out, "rollouts", "rollouts.jsonl"))]
    return {"launcher": name, "first_request_s": min(r["start_time"] for r in rollouts) - start,
            "first_rollout_s": min(r["end_time"] for r in rollouts) - start,
            "step_s": statistics.median(b - a for a, b in zip(times, times[1:])), "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actor-path", default=None, help="model folder ('' = embedded SmolLM2; default: a tiny random model)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ray-address", default="")
    p.add_argument("--skip", nargs="*", default=[], choices=["ray", "slurm"])
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="arealite-launchers-")
    model = _tiny_model(os.path.join(tmp, "tiny")) if args.actor_path is None else args.actor_path
    common = ["--actor.path", model, "--total_train_steps", str(args.steps), "--gconfig.n_samples", "4",
              "--gconfig.max_new_tokens", "16", "--rollout.consumer_batch_size", "4", "--train_dataset.batch_size", "4",
              "--evaluator.at_start", "False", "--evaluator.at_end", "False"]
    results = []
    try:
        def out_of(name):
            return os.path.join(tmp, name, "grpo_math", "trial0")

        results.append(run("local (torchrun)", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                "--nproc_per_node=1", RECIPE, *common, "--fileroot",
                                                os.path.join(tmp, "local")], out_of("local")))
        if "ray" not in args.skip:
            extra = ["--launcher.ray_address", args.ray_address] if args.ray_address else []
            results.append(run("ray", [sys.executable, "-m", "arealite.launcher.ray", RECIPE, *common, *extra,
                                       "--fileroot", os.path.join(tmp, "ray")], out_of("ray")))
        if "slurm" not in args.skip and shutil.which("sbatch") and \
                subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0:
            results.append(run("slurm", [sys.executable, "-m", "arealite.launcher.slurm", "--wait", RECIPE, *common,
                                         "--fileroot", os.path.join(tmp, "slurm")], out_of("slurm")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = results[0]
    print(f"{'launcher':<18} {'first request s':>16} {'first rollout s':>16} {'s/step':>8} {'wall s':>8}  ratios to local")
    for r in results:
        ratios = " ".join(f"{k.split('_')[0]} {r[k] / base[k]:.2f}×" for k in ("first_rollout_s", "step_s", "wall_s"))
        print(f"{r['launcher']:<18} {r['first_request_s']:>16.1f} {r['first_rollout_s']:>16.1f} {r['step_s']:>8.2f} "
              f"{r['wall_s']:>8.1f}  {ratios}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
