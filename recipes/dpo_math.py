"""DPO on math, offline (a pair file) or online (pairs sampled by the current policy).

    torchrun --nproc_per_node=1 recipes/dpo_math.py --mode online     # embedded arithmetic task
    python recipes/dpo_math.py --mode offline --train_dataset.path pairs.jsonl   # prompt/chosen/rejected
    python recipes/dpo_math.py --config recipes/configs/dpo_math_online.yaml
    python -m arealite.launcher.ray recipes/dpo_math.py --mode offline --launcher.trainer_ranks 2   # or .slurm

Offline: each step takes ``train_dataset.batch_size`` pairs from the file (None = embedded
arithmetic pairs) → DPO update (frozen reference = the initial weights) → log; the loop is
:func:`arealite.trainer.offline_loop.run_offline`.
Online: the rollout pipeline samples ``gconfig.n_samples`` answers per prompt from the current
policy, the reward (``reward_fn``) picks a (best, worst) pair (prompts without one are skipped),
and each step takes ``rollout.consumer_batch_size`` pairs — generated asynchronously, at most
``rollout.max_head_offpolicyness`` versions old — → DPO update → weight sync; the loop is
:func:`arealite.trainer.rl_loop.run_rl`. Both: logprobs at temperature 1 (the models' own
likelihoods), recover checkpoints, held-out greedy accuracy at the start and end. The config
comes from :func:`arealite.trainer.entry.load_run_config`; under the Ray and Slurm launchers an
offline run starts only the trainer ranks, an online run its servers too.
"""

from __future__ import annotations

import importlib
import sys

import torch.distributed as dist

from arealite.algorithms.dpo import DPO
from arealite.api.config import DPOConfig
from arealite.dataset.loader import load_rows
from arealite.dataset.math_data import load_dataset
from arealite.dataset.preference_data import PreferenceCollator, load_preference_dataset
from arealite.train_engine.fsdp import FSDPEngine, init_distributed
from arealite.evaluate import evaluate_hf
from arealite.trainer.entry import load_run_config
from arealite.trainer.offline_loop import prepare_offline, run_offline
from arealite.trainer.rl_loop import run_rl
from arealite.utils.hf import resolve_model_path
from arealite.workflow.preference import PreferenceWorkflow


def import_reward(spec: str):
    """The function named by ``reward_fn`` ("module:function"); ValueError naming the field otherwise."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"reward_fn={spec!r}: cannot import it ({e}); pass 'module:function', "
                         "e.g. arealite.reward.math:math_reward") from None


def build_dpo(config: DPOConfig, actor: FSDPEngine, _ref=None) -> DPO:
    """DPO on ``actor`` against a frozen copy of the starting weights (the reference)."""
    ref = FSDPEngine(config.actor, trainable=False)
    ref.initialize(resolve_model_path(config.actor.path))
    return DPO(config.algo, actor, ref)


def main(argv: list[str] | None = None) -> dict:
    config = load_run_config(DPOConfig, argv, uses_servers=lambda c: c.mode == "online")  # servers online only
    if config.mode == "online":
        reward_fn = import_reward(config.reward_fn)
        return run_rl(config, build_dpo, lambda c, tok, d: PreferenceWorkflow(reward_fn, c.gconfig, tok, dump_dir=d),
                      actor_temperature=1.0)
    init_distributed()
    rank = dist.get_rank()
    train_rows = load_rows("train_dataset", config.train_dataset, "train", config.seed, load_preference_dataset)
    evaluating = config.evaluator.at_start or config.evaluator.at_end
    valid_rows = load_rows("valid_dataset", config.valid_dataset, "test", config.seed, load_dataset) if evaluating else []
    model_path, tokenizer, recover_path = prepare_offline(config, rank)

    def evaluate(_actor, path: str) -> dict:  # greedy held-out accuracy with HF generate (rank 0)
        return {"accuracy": evaluate_hf(path, valid_rows, config.gconfig.max_new_tokens)} if rank == 0 else {}

    return run_offline(config, model_path, recover_path, train_rows,
                       PreferenceCollator(tokenizer, config.train_dataset.max_length),
                       lambda actor: build_dpo(config, actor), evaluate,
                       eval_at_start=config.evaluator.at_start, eval_at_end=config.evaluator.at_end)


if __name__ == "__main__":
    main(sys.argv[1:])
