"""DPO on math, offline (a pair file) or online (pairs sampled by the current policy), as one
explicit training loop.

    torchrun --nproc_per_node=1 recipes/dpo_math.py --mode online     # embedded arithmetic task
    python recipes/dpo_math.py --mode offline --train_dataset.path pairs.jsonl   # prompt/chosen/rejected
    python recipes/dpo_math.py --config recipes/configs/dpo_math_online.yaml

Offline: each step takes ``train_dataset.batch_size`` pairs from the file (None = embedded
arithmetic pairs) → DPO update (frozen reference = the initial weights) → log.
Online: the rollout pipeline samples ``gconfig.n_samples`` answers per prompt from the current
policy, the math reward picks a (correct, incorrect) pair (prompts without one are skipped),
and each step takes ``rollout.consumer_batch_size`` pairs — generated asynchronously, at most
``rollout.max_head_offpolicyness`` versions old — → DPO update → weight sync to the servers.
Outputs under ``fileroot/experiment_name/trial_name/``: ``stats.jsonl``, ``tensorboard/``,
``final/`` (HF checkpoint), online: ``rollouts/rollouts.jsonl`` and server logs.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_math import sync_weights  # noqa: E402

from arealite.algorithms.dpo import DPO  # noqa: E402
from arealite.api.config import DPOConfig, load_config, to_dict  # noqa: E402
from arealite.dataset.math_data import load_dataset  # noqa: E402
from arealite.dataset.preference_data import PreferenceCollator, load_preference_dataset  # noqa: E402
from arealite.engine.fsdp import FSDPEngine, init_distributed  # noqa: E402
from arealite.evaluate import aevaluate, evaluate_hf  # noqa: E402
from arealite.utils.hf import load_tokenizer, resolve_model_path  # noqa: E402
from arealite.utils.stats_logger import StatsLogger  # noqa: E402
from arealite.workflow.preference import PreferenceWorkflow  # noqa: E402


def load_or_explain(name: str, cfg, split: str, seed: int, loader) -> list[dict]:
    """``loader(path, split, size, seed)`` whose errors name the config field to fix."""
    try:
        return loader(cfg.path, split, cfg.size, seed)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{name}.path={cfg.path!r}: {e}") from None


def import_reward(spec: str):
    """The function named by ``reward_fn`` ("module:function"); ValueError naming the field otherwise."""
    import importlib

    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"reward_fn={spec!r}: cannot import it ({e}); pass 'module:function', "
                         "e.g. arealite.reward.math:math_reward") from None
    return fn


def all_reduce(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def main(argv: list[str] | None = None) -> dict:
    config = load_config(DPOConfig, argv)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(config.seed + rank)
    torch.manual_seed(config.seed)
    online = config.mode == "online"
    if config.train_dataset.batch_size % world or (online and config.rollout.consumer_batch_size % world):
        raise ValueError(f"train_dataset.batch_size and rollout.consumer_batch_size must be divisible by {world} ranks")

    # Data, model path, tokenizer (cheap checks before anything expensive or written).
    loader = load_dataset if online else load_preference_dataset  # prompts (online) or pairs (offline)
    train_rows = load_or_explain("train_dataset", config.train_dataset, "train", config.seed, loader)
    evaluate_any = config.evaluator.at_start or config.evaluator.at_end
    valid_rows = load_or_explain("valid_dataset", config.valid_dataset, "test", config.seed, load_dataset) if evaluate_any else []
    reward_fn = import_reward(config.reward_fn) if online else None
    model_path = resolve_model_path(config.actor.path)
    out = config.output_dir
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(config), f)
    tokenizer = load_tokenizer(model_path)
    sampler = DistributedSampler(train_rows, num_replicas=world, rank=rank, shuffle=config.train_dataset.shuffle,
                                 seed=config.seed, drop_last=True)
    collate = (lambda rows: rows) if online else PreferenceCollator(tokenizer, config.train_dataset.max_length)
    dataloader = StatefulDataLoader(train_rows, batch_size=config.train_dataset.batch_size // world, sampler=sampler,
                                    collate_fn=collate, drop_last=True)

    # Engines: (online) inference servers, FSDP2 policy, frozen reference = the initial weights.
    rollout = workflow = None
    if online:
        from arealite.launcher.local import make_inference_engine, trainer_threads

        torch.set_num_threads(config.actor.num_threads or trainer_threads(config.rollout, world))
        rollout = make_inference_engine(config.rollout, model_path, os.path.join(out, "logs"), config.seed)
        workflow = PreferenceWorkflow(reward_fn, config.gconfig, tokenizer,
                                      dump_dir=os.path.join(out, "rollouts") if rank == 0 else None)
    actor = FSDPEngine(config.actor)  # temperature 1: DPO compares the models' own likelihoods
    actor.initialize(model_path, config.total_train_steps)
    ref = FSDPEngine(config.actor, trainable=False)
    ref.initialize(model_path)
    algo = DPO(config.algo, actor, ref)
    stats_logger = StatsLogger(out, rank, config.total_train_steps)
    weight_dir = os.path.join(out, "weight_update")

    def evaluate(path: str) -> float:  # greedy held-out accuracy (rank 0): servers online, HF generate offline
        if rank != 0:
            return 0.0
        if online:
            return asyncio.run(aevaluate(rollout, tokenizer, valid_rows, config.gconfig))
        return evaluate_hf(path, valid_rows, config.gconfig.max_new_tokens)

    summary = {}
    if config.evaluator.at_start:
        summary["eval/accuracy_start"] = evaluate(model_path)
        if rank == 0:
            print(f"held-out greedy accuracy before training: {summary['eval/accuracy_start']:.3f} "
                  f"({len(valid_rows)} problems)", flush=True)
    epoch, data_iter, run_start = 0, None, time.time()
    for step in range(config.total_train_steps):
        version = step  # completed updates = the weights the servers hold
        # 1. Pairs: from the file, or from asynchronous rollouts under the staleness bound.
        t0 = time.time()
        if online:
            batch = rollout.prepare_batch(dataloader, workflow)
        else:
            if data_iter is None:  # a new shuffle order every epoch
                sampler.set_epoch(epoch)
                data_iter, epoch = iter(dataloader), epoch + 1
            batch = next(data_iter, None)
            if batch is None:
                sampler.set_epoch(epoch)
                data_iter, epoch = iter(dataloader), epoch + 1
                batch = next(data_iter)
        t1 = time.time()
        # 2. DPO update (reference and policy forward, then one optimizer step).
        stats = algo.update(batch)
        t2 = time.time()
        # 3. Online: weight sync (pause → push → servers load → version bump → resume).
        if online:
            sync_weights(actor, rollout, weight_dir, version + 1)  # rollout.weight_sync: disk | distributed
        actor.set_version(version + 1)
        t3 = time.time()

        # 4. Logging: pair metrics, (online) rewards of the sampled pairs and staleness.
        stats = {f"actor/{k}": v for k, v in stats.items()}
        stats.update({"time/data_wait_s": t1 - t0, "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2})
        if online:
            gen = batch["versions"][batch["loss_mask"].bool()]
            chosen_reward, n_pairs = all_reduce([float(batch["rewards"][0::2].sum()), float(batch["rewards"].numel() / 2)])
            stale, = all_reduce([float(version - gen.min()) if gen.numel() else 0.0], dist.ReduceOp.MAX)
            stat = rollout.executor.staleness.stat
            stats.update({"rollout/chosen_reward": chosen_reward / n_pairs, "rollout/staleness_max": stale,
                          "rollout/rejected_no_pair": float(stat.rejected), "rollout/dropped_stale": float(stat.dropped_stale)})
        if config.saver.freq_steps and (step + 1) % config.saver.freq_steps == 0:
            actor.save(os.path.join(out, "checkpoints", f"step{step + 1}"))
        stats_logger.commit(step, stats)

    loop_time = time.time() - run_start
    actor.save(os.path.join(out, "final"))
    if rank == 0:
        shutil.rmtree(weight_dir, ignore_errors=True)  # the last weight-sync copy (= final/)
    if config.evaluator.at_end:
        summary["eval/accuracy_end"] = evaluate(os.path.join(out, "final"))
    summary.update(steps=config.total_train_steps, train_time_s=loop_time)
    stats_logger.summary(config.total_train_steps, {k: float(v) for k, v in summary.items()})
    stats_logger.close()
    if online:
        rollout.destroy()
        workflow.reward_worker.close()
    actor.destroy()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
