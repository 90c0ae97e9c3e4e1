"""Asynchronous GRPO on multi-turn math: answer; if wrong, the environment says so; try again.

    torchrun --nproc_per_node=1 recipes/multi_turn_math.py          # embedded defaults (CPU is fine)
    python recipes/multi_turn_math.py --config recipes/configs/multi_turn_math.yaml --agent.max_turns 3

One episode = up to ``agent.max_turns`` model turns against
:class:`arealite.workflow.multi_turn.MathFeedbackEnv`; reward = 1 · ``agent.turn_discount``^(turns−1)
when solved, else 0. The trajectory is token-in token-out (sampled ids + tokenised feedback,
feedback masked out of the loss). The loop is :func:`arealite.trainer.rl_loop.run_rl` (recover,
dynamic sampling, evaluation and logging as in every RL recipe; ``rollout/turns`` is logged).
The config comes from :func:`arealite.trainer.entry.load_run_config`, so the recipe runs
unchanged under ``python -m arealite.launcher.ray|slurm`` (docs/cluster.md).
"""

from __future__ import annotations

import sys

from arealite.algorithms.grpo import GRPO
from arealite.api.config import MultiTurnGRPOConfig
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl
from arealite.workflow.multi_turn import MultiTurnMathWorkflow


def build_multi_turn(config: MultiTurnGRPOConfig, tokenizer, dump_dir: str | None) -> MultiTurnMathWorkflow:
    a = config.agent  # each turn has its own max_new_tokens budget (the overlong penalty's L_max)
    return MultiTurnMathWorkflow(config.gconfig, tokenizer, a.max_turns, a.turn_discount, a.max_context_tokens,
                                 dump_dir=dump_dir)


def main(argv: list[str] | None = None) -> dict:
    return run_rl(load_run_config(MultiTurnGRPOConfig, argv), GRPO.from_config, build_multi_turn)


if __name__ == "__main__":
    main(sys.argv[1:])
