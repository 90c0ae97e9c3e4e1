"""Asynchronous GRPO on math: the arealite main job.

    torchrun --nproc_per_node=1 recipes/grpo_math.py            # embedded defaults (CPU is fine)
    python recipes/grpo_math.py --config recipes/configs/grpo_math.yaml --actor.optimizer.lr 2e-5
    python recipes/grpo_math.py --train_dataset.path openai/gsm8k \
        --gconfig.max_new_tokens 256 --actor.path /models/Qwen2.5-0.5B-Instruct

A recipe is two builders — the algorithm and the rollout workflow — and a call of the one RL
loop, :func:`arealite.trainer.rl_loop.main` → ``run_rl`` → :func:`arealite.trainer.rl_loop.train`,
the step loop (read it top to bottom: per step, take a batch of finished rollouts, at most
``rollout.max_head_offpolicyness`` versions old → ``algo.update`` → push the new weights to the
inference servers → log). ``recipes/grpo_custom_loop.py`` writes that loop out, to change the step. Every RL recipe (GSPO, PPO, online DPO,
multi-turn, tool agent, custom agents) is this file with other builders. Outputs under
``fileroot/experiment_name/trial_name/``: ``stats.jsonl``, ``tensorboard/``,
``rollouts/rollouts.jsonl``, ``final/`` (HF checkpoint), server logs, and with
``--recover.freq_steps N`` recover checkpoints ``recover/stepK``; ``--recover.mode auto`` resumes
the newest after a crash (README "Resuming a run").
"""

from __future__ import annotations

import sys

from arealite.algorithms.grpo import GRPO
from arealite.api.config import GRPOConfig
from arealite.trainer.rl_loop import main as run
from arealite.reward.math import math_reward
from arealite.workflow.rlvr import RLVRWorkflow


def build_rlvr(config: GRPOConfig, tokenizer, dump_dir: str | None) -> RLVRWorkflow:
    """One prompt → ``gconfig.n_samples`` completions → math reward (math-verify, in a worker)."""
    return RLVRWorkflow(math_reward, config.gconfig, tokenizer, dump_dir=dump_dir)


def main(argv: list[str] | None = None) -> dict:
    return run(GRPOConfig, GRPO.from_config, build_rlvr, argv)  # GRPO on the actor (+ frozen ref if algo.kl_coef > 0)


if __name__ == "__main__":
    main(sys.argv[1:])
