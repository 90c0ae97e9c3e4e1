"""The supervised training loop (SFT, offline DPO): batches from a fixed dataset, no rollouts.

    from arealite.trainer.entry import load_run_config
    from arealite.trainer.offline_loop import prepare_offline, run_offline
    config = load_run_config(SFTConfig, argv, uses_servers=False)   # the one config door (cluster launchers too)
    model_path, tokenizer, recover_path = prepare_offline(config, rank)
    run_offline(config, model_path, recover_path, train_rows, collate, build_algorithm, evaluate)

It shares the RL loop's data position (:class:`arealite.dataset.loader.EpochLoader`: a new
shuffle order every epoch, resumable), recover checkpoints (``--recover.freq_steps N``,
``--recover.mode auto``: weights, optimizer, LR schedule, RNG, data position) and logging.
Per step: next batch → ``algorithm.update(batch)`` → log; every ``eval_freq_steps`` steps and
at the start and end ``evaluate(actor, path)``.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import yaml

from arealite.api.cli import to_dict, validate_config
from arealite.dataset.loader import EpochLoader, make_dataloader
from arealite.train_engine.fsdp import FSDPEngine
from arealite.utils.hf import load_tokenizer, resolve_model_path
from arealite.utils.recover import load_checkpoint, resolve_checkpoint, save_checkpoint, should_save
from arealite.utils.stats_logger import StatsLogger

Evaluate = Callable[[FSDPEngine, str], "dict[str, float]"]


def prepare_offline(config, rank: int) -> tuple[str, Any, "str | None"]:
    """The cheap checks and first writes of a supervised run, before any model is loaded:
    resolve the model path and the recover checkpoint (``recover.mode``), write ``config.yaml``.

    Returns: ``(model_path, tokenizer, recover_path or None)``.
    """
    validate_config(config, world_size=dist.get_world_size())  # also for configs built in Python
    model_path = resolve_model_path(config.actor.path)
    recover_path = resolve_checkpoint(config.recover, os.path.join(config.output_dir, "recover"))
    if rank == 0:
        os.makedirs(config.output_dir, exist_ok=True)
        with open(os.path.join(config.output_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(config), f)
        if recover_path:
            print(f"resuming from {recover_path}; logs are appended to", flush=True)
    return model_path, load_tokenizer(model_path), recover_path


def run_offline(config, model_path: str, recover_path: str | None, train_rows: list, collate: Callable,
                build_algorithm: Callable[[FSDPEngine], Any], evaluate: Evaluate,
                eval_freq_steps: int = 0, eval_at_start: bool = True, eval_at_end: bool = True,
                engine_cls: type = FSDPEngine) -> dict[str, float]:
    """Train ``config.total_train_steps`` steps on ``train_rows``; see the module docstring.

    Args:
        config: ``actor``, ``train_dataset`` (``batch_size`` global, ``shuffle``), ``seed``,
            ``saver``, ``recover``, ``total_train_steps``, ``output_dir``.
        model_path, recover_path: from :func:`prepare_offline`.
        collate: rows → a padded batch (e.g. ``SFTCollator``, ``PreferenceCollator``).
        build_algorithm: ``fn(actor) -> algorithm`` with ``update(batch) -> dict[str, float]``.
        evaluate: ``fn(actor, model_folder) -> {key: value}`` (collective; logged as
            ``eval/<key>`` per step and ``eval/<key>_start|_end`` in the summary; the folder is
            the starting model at the start and ``final/`` at the end).

    Raises:
        ValueError: the rows give no full global batch (before the model is loaded).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(config.seed + rank)
    torch.manual_seed(config.seed)
    out = config.output_dir
    dataloader = make_dataloader(train_rows, config.train_dataset.batch_size, rank, world,
                                 config.train_dataset.shuffle, config.seed, collate, drop_last=True)
    if len(dataloader) == 0:
        raise ValueError(f"train_dataset: {len(train_rows)} rows give no full batch of "
                         f"{config.train_dataset.batch_size}; lower train_dataset.batch_size")
    loader = EpochLoader(dataloader)

    actor = engine_cls(config.actor)  # FSDPEngine: temperature 1, the model's own likelihood
    actor.initialize(model_path, config.total_train_steps)
    algo = build_algorithm(actor)
    stats_logger = StatsLogger(out, rank, config.total_train_steps, config.logger.wandb, to_dict(config))
    start_step = load_checkpoint(recover_path, {"actor": actor}, {"data": loader}) if recover_path else 0

    def evaluate_at(when: str, path: str) -> dict[str, float]:
        res = evaluate(actor, path)
        if rank == 0:
            for k, v in res.items():
                print(f"held-out {k} {when}: {v:.4f}", flush=True)
        return res

    summary = {}
    if eval_at_start and not start_step:
        summary = {f"eval/{k}_start": v for k, v in evaluate_at("before training", model_path).items()}
    run_start = time.time()
    for step in range(start_step, config.total_train_steps):
        batch = loader.next()
        t0 = time.time()
        stats = {f"actor/{k}": v for k, v in algo.update(batch).items()}
        t1 = time.time()
        stats.update({"time/train_s": t1 - t0, "data/epoch": float(loader.epoch + 1)})
        if "actor/n_tokens" in stats:
            stats["perf/trained_tokens_per_s"] = stats["actor/n_tokens"] / (t1 - t0)
        if eval_freq_steps and (step + 1) % eval_freq_steps == 0 and step + 1 < config.total_train_steps:
            stats.update({f"eval/{k}": v for k, v in evaluate_at(f"after step {step + 1}", "").items()})
        if config.saver.freq_steps and (step + 1) % config.saver.freq_steps == 0:
            actor.save(os.path.join(out, "checkpoints", f"step{step + 1}"))
        stats_logger.commit(step, stats)
        if should_save(config.recover, step + 1):
            save_checkpoint(os.path.join(out, "recover"), step + 1, {"actor": actor}, {"data": loader},
                            config.recover.keep_last)

    loop_time = time.time() - run_start
    final = os.path.join(out, "final")
    actor.save(final)
    if eval_at_end:
        summary.update({f"eval/{k}_end": v for k, v in evaluate_at("after training", final).items()})
    summary.update(steps=config.total_train_steps, train_time_s=loop_time)
    stats_logger.summary(config.total_train_steps, {k: float(v) for k, v in summary.items()})
    stats_logger.close()
    actor.destroy()
    return summary
