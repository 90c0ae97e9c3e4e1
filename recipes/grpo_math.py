"""Asynchronous GRPO on math: the arealite main job, as one explicit training loop.

    torchrun --nproc_per_node=1 recipes/grpo_math.py            # embedded defaults (CPU is fine)
    python recipes/grpo_math.py --config recipes/configs/grpo_math.yaml --actor.optimizer.lr 2e-5
    python recipes/grpo_math.py --train_dataset.path ../shared/data/gsm8k/train.jsonl \
        --gconfig.max_new_tokens 256 --actor.path /models/Qwen2.5-0.5B-Instruct

Per step: take a batch of finished rollouts (generated asynchronously, at most
``rollout.max_head_offpolicyness`` versions old) → GRPO update → push the new weights to the
inference servers (pause → save → load → version bump → resume) → log.
Outputs under ``fileroot/experiment_name/trial_name/``: ``stats.jsonl``, ``tensorboard/``,
``rollouts/rollouts.jsonl``, ``final/`` (HF checkpoint), server logs, and with
``--recover.freq_steps N`` recover checkpoints ``recover/stepK``; ``--recover.mode auto`` resumes
the newest after a crash (README "Resuming a run").
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
import time

import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from arealite.algorithms.grpo import GRPO, DynamicSampling
from arealite.api.config import GRPOConfig, load_config, to_dict
from arealite.dataset.math_data import load_dataset
from arealite.engine.fsdp import FSDPEngine, init_distributed
from arealite.engine.weight_sync import WeightSyncError
from arealite.evaluate import aevaluate
from arealite.launcher.local import make_inference_engine, trainer_threads
from arealite.reward.math import math_reward
from arealite.utils.hf import load_tokenizer, resolve_model_path
from arealite.utils.recover import list_checkpoints, load_checkpoint, resolve_checkpoint, save_checkpoint, should_save
from arealite.utils.stats_logger import StatsLogger
from arealite.workflow.rlvr import RLVRWorkflow


def all_reduce(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def load_dataset_or_explain(name: str, cfg, split: str, seed: int) -> list[dict]:
    """``load_dataset`` whose errors name the config field to fix (e.g. ``train_dataset.path``)."""
    try:
        return load_dataset(cfg.path, split, cfg.size, seed)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{name}.path={cfg.path!r}: {e}") from None


def sync_weights(actor: FSDPEngine, rollout, weight_dir: str, version: int) -> None:
    """Pause → push the actor's weights (rollout.weight_sync: disk | distributed) → servers load
    them → version bump on both sides → resume.

    Distributed push: a failure makes every rank raise ``WeightSyncError``; the servers it names
    as dead or hung are excluded for good and the push is retried once, with a new group of the
    remaining servers. A second failure (e.g. no server left) raises."""
    rollout.pause()
    if dist.get_rank() == 0:
        rollout.pause_generation()  # servers that do not answer are excluded (not in the meta)
    for attempt in (1, 2):
        meta = rollout.weight_update_meta(weight_dir, version)
        try:
            actor.upload_weights(meta)
            break
        except WeightSyncError as e:  # raised on every rank, with the same e.failed
            rollout.exclude_servers(e.failed, f"failed the weight update to version {version}")
            if attempt == 2:
                raise
    if dist.get_rank() == 0:
        rollout.update_weights(meta)
        rollout.continue_generation()
    dist.barrier()
    actor.set_version(version)
    rollout.set_version(version)
    rollout.resume()


def rollout_stats(batch: dict, version: int, prev_train_end: float, rollout) -> dict[str, float]:
    """Batch statistics over all ranks. Staleness = trainer version − oldest version among the
    trained tokens (≤ η by construction; ``staleness_mean`` averages over those tokens);
    overlap = share of rows whose generation began before the previous training step ended
    (0 in synchronous mode)."""
    gen = batch["versions"][batch["loss_mask"].bool()]  # versions of the trained tokens
    reward_sum, n_tokens, no_eos, overlap, n, stale_sum, n_gen = all_reduce([
        float(batch["rewards"].sum()), float(batch["attention_mask"].sum()), float(batch["no_eos"].sum()),
        float((batch["rollout_start_time"] < prev_train_end).sum()), float(batch["rewards"].numel()),
        float((version - gen).sum()), float(gen.numel()),
    ])
    stale_max, = all_reduce([float(version - gen.min()) if gen.numel() else 0.0], dist.ReduceOp.MAX)
    first_start, = all_reduce([float(batch["rollout_start_time"].min())], dist.ReduceOp.MIN)
    stat = rollout.executor.staleness.stat
    return {
        "rollout/reward": reward_sum / n, "rollout/staleness_max": stale_max,
        "rollout/staleness_mean": stale_sum / max(n_gen, 1.0), "rollout/no_eos_ratio": no_eos / n,
        "rollout/overlap_frac": overlap / n, "rollout/n_samples": n, "rollout/n_tokens": n_tokens,
        "rollout/dropped_stale": float(stat.dropped_stale), "rollout/failed": float(stat.failed),
        "rollout/rejected": float(stat.rejected),
        "time/batch_rollout_start_min": first_start,
    }


def build_grpo(config: GRPOConfig, actor: FSDPEngine, ref: FSDPEngine | None, model_path: str) -> GRPO:
    """This recipe's algorithm. ``gspo_math.py`` and ``ppo_math.py`` run the same loop with
    another ``build_algorithm`` (and config class)."""
    return GRPO(config.algo, actor, group_size=config.gconfig.n_samples, ref=ref,
                max_new_tokens=config.gconfig.max_new_tokens)


def main(argv: list[str] | None = None, config_cls: type = GRPOConfig, build_algorithm=build_grpo) -> dict:
    config = load_config(config_cls, argv)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(config.seed + rank)
    torch.manual_seed(config.seed)
    if config.train_dataset.batch_size % world or config.rollout.consumer_batch_size % world:
        raise ValueError(f"train_dataset.batch_size and rollout.consumer_batch_size must be divisible by {world} ranks")

    # Data, model path, tokenizer (cheap checks before anything expensive or written).
    train_rows = load_dataset_or_explain("train_dataset", config.train_dataset, "train", config.seed)
    valid_rows = load_dataset_or_explain("valid_dataset", config.valid_dataset, "test", config.seed)
    model_path = resolve_model_path(config.actor.path)
    out = config.output_dir
    recover_dir = os.path.join(out, "recover")
    recover_path = resolve_checkpoint(config.recover, recover_dir)  # recover.mode; None = start fresh
    if rank == 0:
        if recover_path:
            print(f"resuming from {recover_path}; logs and rollouts are appended to", flush=True)
        elif list_checkpoints(recover_dir):
            print(f"WARNING: starting fresh; the recover checkpoints in {recover_dir} will be replaced "
                  "(pass --recover.mode auto to resume from them instead)", flush=True)
        if os.path.exists(os.path.join(out, "stats.jsonl")) and not recover_path:
            print(f"WARNING: {out} already holds a run; its logs and rollouts will be appended to. "
                  "Pass --trial_name NAME for a separate run.", flush=True)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(config), f)
    tokenizer = load_tokenizer(model_path)
    sampler = DistributedSampler(train_rows, num_replicas=world, rank=rank, shuffle=config.train_dataset.shuffle, seed=config.seed)
    dataloader = StatefulDataLoader(train_rows, batch_size=config.train_dataset.batch_size // world, sampler=sampler,
                                    collate_fn=lambda rows: rows)

    # Engines: inference servers (launched unless addresses are given), FSDP2 actor, optional reference.
    torch.set_num_threads(config.actor.num_threads or trainer_threads(config.rollout, world))
    rollout = make_inference_engine(config.rollout, model_path, os.path.join(out, "logs"), config.seed)
    actor = FSDPEngine(config.actor, temperature=config.gconfig.temperature)
    actor.initialize(model_path, config.total_train_steps)
    ref = None
    if config.algo.kl_coef > 0:
        ref = FSDPEngine(config.actor, temperature=config.gconfig.temperature, trainable=False)
        ref.initialize(model_path)
    algo = build_algorithm(config, actor, ref, model_path)
    rlvr = RLVRWorkflow(math_reward, config.gconfig, tokenizer,
                        dump_dir=os.path.join(out, "rollouts") if rank == 0 else None)
    # DAPO dynamic sampling: groups with all-equal rewards are dropped and replaced by new ones
    # (the run stops with an error after 8 batches' worth of such groups in a row)
    workflow = DynamicSampling(rlvr, 8 * config.rollout.consumer_batch_size) if config.algo.dynamic_sampling else rlvr
    stats_logger = StatsLogger(out, rank, config.total_train_steps)
    weight_dir = os.path.join(out, "weight_update")

    def evaluate() -> float:  # greedy held-out accuracy through the servers (rank 0)
        return asyncio.run(aevaluate(rollout, tokenizer, valid_rows, config.gconfig)) if rank == 0 else 0.0

    # Resume: actor (+ critic) weights, optimizer, LR schedule, version, RNG, and the rollout
    # executor's data position incl. the prompts pulled but not trained on (they run again first).
    engines = {"actor": actor}
    if getattr(algo, "critic", None) is not None:
        engines["critic"] = algo.critic
    start_step = 0
    if recover_path:
        start_step = load_checkpoint(recover_path, engines, {"rollout": rollout.executor})
        sync_weights(actor, rollout, weight_dir, start_step)  # the servers started from model_path

    summary = {}
    if config.evaluator.at_start and not start_step:
        summary["eval/accuracy_start"] = evaluate()
        if rank == 0:
            print(f"held-out greedy accuracy before training: {summary['eval/accuracy_start']:.3f} "
                  f"({len(valid_rows)} problems)", flush=True)
    prev_train_end = 0.0
    trained_samples, run_start = 0, time.time()
    for step in range(start_step, config.total_train_steps):
        version = step  # weights the servers hold = completed updates
        # 1. Rollouts: asynchronous; generation of the next batches continues during training.
        t0 = time.time()
        batch = rollout.prepare_batch(dataloader, workflow)
        t1 = time.time()
        # 2. GRPO update (advantages, proximal logprobs, PPO minibatches).
        stats = algo.update(batch)
        t2 = time.time()
        # 3. Weight sync: pause → push → servers load → version bump → resume.
        sync_weights(actor, rollout, weight_dir, version + 1)
        t3 = time.time()

        # 4. Logging: reward, staleness, overlap evidence, time split.
        stats.update(rollout_stats(batch, version, prev_train_end, rollout))
        trained_samples += int(stats["rollout/n_samples"])
        stats.update({
            "time/gen_wait_s": t1 - t0, "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2,
            "time/train_start": t1, "time/train_end": t2,
            "perf/trained_tokens_per_s": stats["rollout/n_tokens"] / (t3 - t0),
            "perf/trained_samples_per_s": trained_samples / (t3 - run_start),
        })
        stats = {f"actor/{k}" if "/" not in k else k: v for k, v in stats.items()}
        prev_train_end = t2
        if config.saver.freq_steps and (step + 1) % config.saver.freq_steps == 0:
            actor.save(os.path.join(out, "checkpoints", f"step{step + 1}"))
        stats_logger.commit(step, stats)
        if should_save(config.recover, step + 1):  # exact-resume state (a crash before it redoes this step)
            save_checkpoint(recover_dir, step + 1, engines, {"rollout": rollout.executor}, config.recover.keep_last)

    loop_time = time.time() - run_start
    actor.save(os.path.join(out, "final"))
    if rank == 0:
        shutil.rmtree(weight_dir, ignore_errors=True)  # the last weight-sync copy (= final/)
    if config.evaluator.at_end:
        summary["eval/accuracy_end"] = evaluate()
    summary.update(steps=config.total_train_steps, trained_samples=trained_samples,
                   trained_samples_per_s=trained_samples / loop_time)
    stats_logger.summary(config.total_train_steps, {k: float(v) for k, v in summary.items()})
    stats_logger.close()
    rollout.destroy()
    rlvr.reward_worker.close()
    actor.destroy()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
