"""Supervised fine-tuning on math solutions, as one explicit training loop.

    torchrun --nproc_per_node=1 recipes/sft_math.py            # embedded arithmetic task (CPU is fine)
    python recipes/sft_math.py --config recipes/configs/sft_gsm8k.yaml   # GSM8K solutions

Per step: a batch of (prompt, response) rows → next-token loss on the response tokens
(token-mean over the global batch) → one AdamW step → log; every ``eval_freq_steps`` the
held-out token-mean NLL on ``valid_dataset``. Outputs under ``fileroot/experiment_name/
trial_name/``: ``stats.jsonl``, ``tensorboard/``, ``final/`` (HF checkpoint, loads with
``from_pretrained``).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from arealite.algorithms.sft import SFT, evaluate_nll
from arealite.api.config import SFTConfig, load_config, to_dict
from arealite.dataset.sft_data import SFTCollator, load_sft_dataset
from arealite.engine.fsdp import FSDPEngine, init_distributed
from arealite.utils.hf import load_tokenizer, resolve_model_path
from arealite.utils.stats_logger import StatsLogger


def load_or_explain(name: str, cfg, split: str, seed: int) -> list[dict]:
    """``load_sft_dataset`` whose errors name the config field to fix."""
    try:
        return load_sft_dataset(cfg.path, split, cfg.size, seed)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{name}.path={cfg.path!r}: {e}") from None


def shard_batches(rows: list[dict], rank: int, world: int, batch_size: int, collate) -> list[dict]:
    """This rank's held-out batches (rows ``rank::world``); every rank gets the same number of
    batches (forward is collective): a rank that runs out gets a dummy row without loss tokens."""
    per_rank = -(-len(rows) // world)
    shard = rows[rank::world]
    batches = []
    for i in range(0, per_rank, batch_size):
        batch = collate(shard[i:i + batch_size] or rows[:1])
        if not shard[i:i + batch_size]:
            batch["loss_mask"].zero_()
        batches.append(batch)
    return batches


def main(argv: list[str] | None = None) -> dict:
    config = load_config(SFTConfig, argv)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)
    if config.train_dataset.batch_size % world:
        raise ValueError(f"train_dataset.batch_size={config.train_dataset.batch_size} must be divisible by {world} ranks")

    # Data, model path, tokenizer (cheap checks before anything expensive or written).
    train_rows = load_or_explain("train_dataset", config.train_dataset, "train", config.seed)
    valid_rows = load_or_explain("valid_dataset", config.valid_dataset, "test", config.seed)
    model_path = resolve_model_path(config.actor.path)
    out = config.output_dir
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(config), f)
    tokenizer = load_tokenizer(model_path)
    sampler = DistributedSampler(train_rows, num_replicas=world, rank=rank, shuffle=config.train_dataset.shuffle,
                                 seed=config.seed, drop_last=True)
    dataloader = StatefulDataLoader(train_rows, batch_size=config.train_dataset.batch_size // world, sampler=sampler,
                                    collate_fn=SFTCollator(tokenizer, config.train_dataset.max_length), drop_last=True)
    if len(dataloader) == 0:
        raise ValueError(f"train_dataset: {len(train_rows)} rows give no full batch of {config.train_dataset.batch_size}; "
                         "lower train_dataset.batch_size")
    valid_batches = shard_batches(valid_rows, rank, world, config.valid_dataset.batch_size,
                                  SFTCollator(tokenizer, config.valid_dataset.max_length))

    actor = FSDPEngine(config.actor)  # temperature 1: the model's own likelihood
    actor.initialize(model_path, config.total_train_steps)
    algo = SFT(actor)
    stats_logger = StatsLogger(out, rank, config.total_train_steps)

    summary = {"eval/loss_start": evaluate_nll(actor, valid_batches)}
    if rank == 0:
        print(f"held-out loss before training: {summary['eval/loss_start']:.4f} nats/token "
              f"({len(valid_rows)} rows)", flush=True)
    epoch, data_iter, run_start = 0, None, time.time()
    for step in range(config.total_train_steps):
        if data_iter is None:  # a new shuffle order every epoch
            sampler.set_epoch(epoch)
            data_iter, epoch = iter(dataloader), epoch + 1
        try:
            batch = next(data_iter)
        except StopIteration:
            data_iter = None
            sampler.set_epoch(epoch)
            data_iter, epoch = iter(dataloader), epoch + 1
            batch = next(data_iter)
        t0 = time.time()
        stats = algo.update(batch)
        stats = {f"actor/{k}": v for k, v in stats.items()}
        stats.update({"time/train_s": time.time() - t0, "perf/trained_tokens_per_s": stats["actor/n_tokens"] / (time.time() - t0),
                      "data/epoch": float(epoch)})
        if config.eval_freq_steps and (step + 1) % config.eval_freq_steps == 0 and step + 1 < config.total_train_steps:
            stats["eval/loss"] = evaluate_nll(actor, valid_batches)
            if rank == 0:
                print(f"held-out loss after step {step + 1}: {stats['eval/loss']:.4f}", flush=True)
        if config.saver.freq_steps and (step + 1) % config.saver.freq_steps == 0:
            actor.save(os.path.join(out, "checkpoints", f"step{step + 1}"))
        stats_logger.commit(step, stats)

    loop_time = time.time() - run_start
    summary["eval/loss_end"] = evaluate_nll(actor, valid_batches)
    actor.save(os.path.join(out, "final"))
    summary.update(steps=config.total_train_steps, train_time_s=loop_time)
    stats_logger.summary(config.total_train_steps, summary)
    stats_logger.close()
    actor.destroy()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
