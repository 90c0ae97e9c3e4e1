"""Supervised fine-tuning on math solutions.

    torchrun --nproc_per_node=1 recipes/sft_math.py            # embedded arithmetic task (CPU is fine)
    python recipes/sft_math.py --config recipes/configs/sft_gsm8k.yaml   # GSM8K solutions
    python -m arealite.launcher.ray recipes/sft_math.py --launcher.trainer_ranks 2   # Ray (or .slurm)

Per step: a batch of (prompt, response) rows → next-token loss on the response tokens
(token-mean over the global batch) → one AdamW step → log; every ``evaluator.freq_steps`` (and
at the start and end: ``evaluator.at_start`` / ``at_end``) the held-out token-mean NLL on
``valid_dataset``. The loop is
:func:`arealite.trainer.offline_loop.run_offline` (data position and recover checkpoints as in
the RL loop). Outputs under ``fileroot/experiment_name/trial_name/``: ``stats.jsonl``,
``tensorboard/``, ``final/`` (HF checkpoint, loads with ``from_pretrained``). The config comes
from :func:`arealite.trainer.entry.load_run_config` (``uses_servers=False``): under the Ray and
Slurm launchers only the trainer ranks are started, no inference server.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from arealite.algorithms.sft import SFT, evaluate_nll
from arealite.api.config import SFTConfig
from arealite.dataset.loader import load_rows
from arealite.dataset.sft_data import SFTCollator, load_sft_dataset
from arealite.train_engine.fsdp import init_distributed
from arealite.trainer.entry import load_run_config
from arealite.trainer.offline_loop import prepare_offline, run_offline


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
    config = load_run_config(SFTConfig, argv, uses_servers=False)  # ends here under a cluster launcher's config read
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    # Data, model path, tokenizer (cheap checks before anything expensive or written).
    train_rows = load_rows("train_dataset", config.train_dataset, "train", config.seed, load_sft_dataset)
    valid_rows = load_rows("valid_dataset", config.valid_dataset, "test", config.seed, load_sft_dataset)
    model_path, tokenizer, recover_path = prepare_offline(config, rank)
    valid = shard_batches(valid_rows, rank, world, config.valid_dataset.batch_size,
                          SFTCollator(tokenizer, config.valid_dataset.max_length))
    return run_offline(config, model_path, recover_path, train_rows,
                       SFTCollator(tokenizer, config.train_dataset.max_length), SFT,
                       evaluate=lambda actor, _path: {"loss": evaluate_nll(actor, valid)},
                       eval_freq_steps=config.evaluator.freq_steps, eval_at_start=config.evaluator.at_start,
                       eval_at_end=config.evaluator.at_end)


if __name__ == "__main__":
    main(sys.argv[1:])
