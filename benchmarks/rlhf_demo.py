"""The whole RLHF loop on a CPU, and on-policy distillation beside GRPO, on the embedded task.

    python benchmarks/rlhf_demo.py --teacher outputs/grpo_math/trial0/final   # all stages
    python benchmarks/rlhf_demo.py --stages pairs,rm,rl                         # without distillation

Stages (each writes under ``--out``; a later stage reuses an earlier one's files):

1. ``pairs`` — one of our servers samples ``--samples`` completions of the starting model
   (SmolLM2-135M-Instruct, temperature 0.7, the main job's 24 tokens) for ``--train-prompts``
   training and ``--test-prompts`` held-out prompts of the arithmetic task; the verifier
   (:func:`arealite.reward.math.math_reward`) splits each prompt's samples into correct and
   incorrect, and up to ``--pairs-per-prompt`` (correct, incorrect) pairs per prompt go to
   ``train_pairs.jsonl`` / ``test_pairs.jsonl``.
2. ``rm`` — ``recipes/rm_math.py`` trains a Bradley–Terry reward model (the starting model's
   backbone + a zero head, full fine-tuning) on the training pairs; held-out pairwise accuracy
   before and after.
3. ``rl`` — ``recipes/grpo_rlhf.py`` with the main job's settings (``recipes/configs/grpo_math.yaml``)
   against the reward model ALONE (the verifier at weight 0, only logged); per step the mean RM
   score and the verifier's score of the same training samples, and every ``--eval-freq`` steps
   the verifier's held-out greedy accuracy — side by side, so reward hacking (RM score up,
   verifier flat or down) is visible.
4. ``distill`` — ``recipes/distill_math.py`` with the same settings, ``--teacher`` (e.g. README
   command 1's ``final/``) as teacher and the starting model as student: held-out accuracy and
   wall time, beside the teacher's own GRPO run (``--grpo-stats``, its ``stats.jsonl``).

Prints one table per stage and writes ``--out/summary.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from arealite.api.config import GenerationConfig, InferenceEngineConfig  # noqa: E402
from arealite.api.io_struct import ModelRequest  # noqa: E402
from arealite.dataset.math_data import load_dataset  # noqa: E402
from arealite.inference.remote import RemoteInferenceEngine  # noqa: E402
from arealite.launcher.local import launch_servers  # noqa: E402
from arealite.reward.math import math_reward  # noqa: E402
from arealite.utils.hf import load_tokenizer, resolve_model_path, tokenize_chat  # noqa: E402

MAIN_JOB = os.path.join(REPO, "recipes", "configs", "grpo_math.yaml")


def make_pairs(path: str, rows: list[dict], samples: int, per_prompt: int, seed: int, log_dir: str) -> tuple[list, dict]:
    """(pairs, counts) from the starting model's own samples (stage 1)."""
    tok = load_tokenizer(path)
    cfg = InferenceEngineConfig(n_servers=1, server_threads=os.cpu_count() or 1)
    engine = RemoteInferenceEngine(cfg, launch_servers(cfg, path, log_dir, seed))
    engine.initialize()
    g = GenerationConfig(n_samples=1, max_new_tokens=24, temperature=0.7)
    rng = random.Random(seed)

    async def sample_all():
        sem = asyncio.Semaphore(64)

        async def one(ids):
            async with sem:
                return await engine.agenerate(ModelRequest(input_ids=ids, gconfig=g))

        try:
            prompts = [tokenize_chat(tok, r["messages"]) for r in rows]
            return await asyncio.gather(*[one(p) for p in prompts for _ in range(samples)])
        finally:
            await engine.aclose()

    start = time.time()
    resps = asyncio.run(sample_all())
    engine.destroy()
    pairs, n_correct = [], 0
    for i, r in enumerate(rows):
        texts = [tok.decode(x.output_tokens, skip_special_tokens=True) for x in resps[i * samples:(i + 1) * samples]]
        good = [t for t in texts if math_reward(t, r["answer"]) > 0.5]
        bad = [t for t in texts if math_reward(t, r["answer"]) <= 0.5]
        n_correct += len(good)
        rng.shuffle(good), rng.shuffle(bad)
        for c, w in list(zip(good, bad))[:per_prompt]:
            pairs.append({"messages": r["messages"], "chosen": c, "rejected": w})
    return pairs, {"prompts": len(rows), "samples": len(resps), "correct_frac": n_correct / max(1, len(resps)),
                   "pairs": len(pairs), "sampling_s": time.time() - start}


def run(cmd: list[str], log: str) -> float:
    """Run a recipe to completion (output in ``log``); wall seconds. Raises on failure."""
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return time.time() - start


def stats(path: str) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if "summary" not in r], next((r["summary"] for r in rows if "summary" in r), {})


def held_out(steps: list[dict], summary: dict) -> list[tuple[int, float]]:
    """(weight version = trained steps, held-out accuracy) at the start, at the in-loop (background)
    evaluations (the offline loop's: after that step) and at the end."""
    out = [(0, summary.get("eval/accuracy_start"))]
    out += [(int(s["eval/version"]), s["eval/accuracy"]) for s in steps if "eval/accuracy" in s and "eval/version" in s]
    out += [(s["step"] + 1, s["eval/accuracy"]) for s in steps if "eval/accuracy" in s and "eval/version" not in s]
    out.append((len(steps), summary.get("eval/accuracy_end")))
    return sorted(set((k, v) for k, v in out if v is not None))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/rlhf_demo")
    p.add_argument("--stages", default="pairs,rm,rl,distill")
    p.add_argument("--train-prompts", type=int, default=384)
    p.add_argument("--test-prompts", type=int, default=96)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--pairs-per-prompt", type=int, default=2)
    p.add_argument("--rm-steps", type=int, default=60)
    p.add_argument("--rm-lr", type=float, default=1e-5)
    p.add_argument("--rl-steps", type=int, default=24)
    p.add_argument("--eval-freq", type=int, default=4)
    p.add_argument("--teacher", default="", help="distill: the teacher folder (README command 1's final/)")
    p.add_argument("--grpo-stats", default="", help="distill: stats.jsonl of the teacher's GRPO run, for the table")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    stages = args.stages.split(",")
    base = resolve_model_path("")
    summary_path = os.path.join(out, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    summary["machine"] = {"cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                          "avx512_bf16": "avx512_bf16" in open("/proc/cpuinfo").read()}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]

    if "pairs" in stages:
        for split, n in (("train", args.train_prompts), ("test", args.test_prompts)):
            rows = load_dataset(None, split, n, args.seed)
            pairs, counts = make_pairs(base, rows, args.samples, args.pairs_per_prompt, args.seed,
                                       os.path.join(out, "logs", f"pairs_{split}"))
            with open(os.path.join(out, f"{split}_pairs.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in pairs)
            summary[f"pairs_{split}"] = counts
            print(f"pairs {split}: {counts}", flush=True)

    rm_final = os.path.join(out, "rm", "rm_math", "trial0", "final")
    if "rm" in stages:
        n_train = sum(1 for _ in open(os.path.join(out, "train_pairs.jsonl")))
        n_test = sum(1 for _ in open(os.path.join(out, "test_pairs.jsonl")))
        wall = run(torchrun + [os.path.join(REPO, "recipes", "rm_math.py"), "--fileroot", os.path.join(out, "rm"),
                               "--train_dataset.path", os.path.join(out, "train_pairs.jsonl"),
                               "--valid_dataset.path", os.path.join(out, "test_pairs.jsonl"),
                               "--valid_dataset.size", str(n_test), "--train_dataset.batch_size", "16",
                               "--total_train_steps", str(args.rm_steps), "--evaluator.freq_steps", "20",
                               "--actor.optimizer.lr", str(args.rm_lr), "--seed", str(args.seed)],
                   os.path.join(out, "rm.log"))
        steps, s = stats(os.path.join(out, "rm", "rm_math", "trial0", "stats.jsonl"))
        summary["rm"] = {"train_pairs": n_train, "test_pairs": n_test, "steps": len(steps), "wall_s": wall,
                         "heldout_accuracy": held_out(steps, s), "train_accuracy_last": steps[-1]["actor/accuracy"]}
        print(f"reward model: held-out pairwise accuracy {summary['rm']['heldout_accuracy']} ({n_test} pairs), "
              f"{wall:.0f} s", flush=True)

    common = ["--config", MAIN_JOB, "--total_train_steps", str(args.rl_steps), "--evaluator.freq_steps",
              str(args.eval_freq), "--seed", str(args.seed)]
    if "rl" in stages:
        wall = run(torchrun + [os.path.join(REPO, "recipes", "grpo_rlhf.py"), *common, "--experiment_name", "grpo_rlhf",
                               "--fileroot", os.path.join(out, "rl"), "--reward.reward_model.path", rm_final],
                   os.path.join(out, "rl.log"))
        steps, s = stats(os.path.join(out, "rl", "grpo_rlhf", "trial0", "stats.jsonl"))
        summary["rl"] = {"wall_s": wall, "heldout_verifier_accuracy": held_out(steps, s),
                         "per_step": [{"step": st["step"] + 1, "rm_score": st["rollout/reward_rm"],
                                       "verifier_on_samples": st["rollout/reward_verifier"]} for st in steps]}
        print("GRPO against the reward model alone (verifier only logged):", flush=True)
        print("| step | mean RM score | verifier on the same samples |", flush=True)
        for r in summary["rl"]["per_step"]:
            print(f"| {r['step']} | {r['rm_score']:.3f} | {r['verifier_on_samples']:.3f} |", flush=True)
        print(f"held-out verifier accuracy: {summary['rl']['heldout_verifier_accuracy']}; {wall:.0f} s", flush=True)

    if "distill" in stages:
        if not args.teacher:
            raise SystemExit("--teacher is needed for the distill stage (README command 1's final/ folder)")
        wall = run(torchrun + [os.path.join(REPO, "recipes", "distill_math.py"), *common, "--experiment_name",
                               "distill_math", "--fileroot", os.path.join(out, "distill"), "--teacher.path", args.teacher],
                   os.path.join(out, "distill.log"))
        steps, s = stats(os.path.join(out, "distill", "distill_math", "trial0", "stats.jsonl"))
        summary["distill"] = {"wall_s": wall, "heldout_accuracy": held_out(steps, s),
                              "reverse_kl": [st["actor/reverse_kl"] for st in steps]}
        if args.grpo_stats:
            g_steps, g_s = stats(args.grpo_stats)
            summary["grpo"] = {"heldout_accuracy": held_out(g_steps, g_s), "train_time_s": g_s.get("train_time_s")}
        print(f"distillation: held-out {summary['distill']['heldout_accuracy']}, {wall:.0f} s; reverse KL per step "
              f"{[round(x, 3) for x in summary['distill']['reverse_kl']]}", flush=True)
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
