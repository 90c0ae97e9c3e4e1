"""Reward-model training: a Bradley–Terry head on a causal LM, from preference pairs.

    torchrun --nproc_per_node=1 recipes/rm_math.py                          # embedded arithmetic pairs
    python recipes/rm_math.py --train_dataset.path pairs.jsonl --valid_dataset.path test_pairs.jsonl
    python benchmarks/rlhf_demo.py                                          # pairs from the model's own samples, then RL

Pairs are the DPO format (``prompt`` or ``messages``, ``chosen``, ``rejected``;
:mod:`arealite.dataset.preference_data`; None = the embedded arithmetic pairs). Per step:
``train_dataset.batch_size`` pairs → the Bradley–Terry loss (:mod:`arealite.algorithms.reward_model`)
→ one AdamW step → log ``actor/loss``, ``actor/accuracy`` (pairs ranked right, before the step),
``actor/margin``; at the start, every ``evaluator.freq_steps`` steps and at the end the held-out
pairwise accuracy on ``valid_dataset`` (``eval/accuracy``). The loop is
:func:`arealite.trainer.offline_loop.run_offline` (recover checkpoints, data position, logging).
``final/`` is an ``AutoModelForSequenceClassification`` folder (``num_labels=1``) that
``from_pretrained`` loads and ``python -m arealite.server.reward_model --model-path`` serves.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from arealite.algorithms.reward_model import BradleyTerry
from arealite.api.config import RMConfig
from arealite.dataset.loader import load_rows
from arealite.dataset.preference_data import RewardPairCollator, load_preference_dataset
from arealite.train_engine.fsdp import FSDPRewardEngine, init_distributed
from arealite.trainer.entry import load_run_config
from arealite.trainer.offline_loop import prepare_offline, run_offline


def evaluate_pairs(algo: BradleyTerry, rows: list[dict], collate, batch_size: int) -> dict[str, float]:
    """Held-out pair metrics over all ranks (collective): rank r scores pairs ``r::world``; every
    rank runs the same number of forwards (a rank out of pairs re-scores its first and drops it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = rows[rank::world]
    per_rank = -(-len(rows) // world)
    totals: dict = {}
    for i in range(0, per_rank, batch_size):
        chunk = shard[i:i + batch_size]
        _, _, sums = algo.pair_stats(algo.scores(collate(chunk or rows[:1])))
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + (v if chunk else 0.0 * v)
    return algo.reduce_sums(totals)


def main(argv: list[str] | None = None) -> dict:
    config = load_run_config(RMConfig, argv, uses_servers=False)
    init_distributed()
    rank = dist.get_rank()
    train_rows = load_rows("train_dataset", config.train_dataset, "train", config.seed, load_preference_dataset)
    valid_rows = load_rows("valid_dataset", config.valid_dataset, "test", config.seed, load_preference_dataset)
    model_path, tokenizer, recover_path = prepare_offline(config, rank)
    collate_valid = RewardPairCollator(tokenizer, config.valid_dataset.max_length)
    algo: dict = {}

    def build(rm) -> BradleyTerry:
        algo["bt"] = BradleyTerry(rm, config.algo.margin, config.algo.center_coef)
        return algo["bt"]

    def evaluate(_rm, _path: str) -> dict:
        return evaluate_pairs(algo["bt"], valid_rows, collate_valid, config.valid_dataset.batch_size)

    return run_offline(config, model_path, recover_path, train_rows,
                       RewardPairCollator(tokenizer, config.train_dataset.max_length), build, evaluate,
                       eval_freq_steps=config.evaluator.freq_steps, eval_at_start=config.evaluator.at_start,
                       eval_at_end=config.evaluator.at_end, engine_cls=FSDPRewardEngine)


if __name__ == "__main__":
    main(sys.argv[1:])
