"""Asynchronous PPO with a critic on math: the GRPO recipe plus a value model.

    torchrun --nproc_per_node=1 recipes/ppo_math.py
    python recipes/ppo_math.py --config recipes/configs/ppo_math.yaml --critic.optimizer.lr 5e-5

The critic (``FSDPCriticEngine``: the policy's backbone with a zero-initialised value head, its
own optimizer, ``--critic.*``) is loaded from ``critic.path`` (default: the actor's model
folder); PPO computes GAE advantages from its values and takes one actor and one critic step per
minibatch (see ``arealite/algorithms/ppo.py``). Only the actor's weights go to the inference
servers; recover checkpoints hold both. The loop is :func:`arealite.trainer.rl_loop.run_rl`.
"""

from __future__ import annotations

import sys

from arealite.algorithms.grpo import with_surrogate
from arealite.algorithms.ppo import PPO
from arealite.api.config import PPOConfig
from arealite.train_engine.fsdp import FSDPCriticEngine
from arealite.trainer.rl_loop import main as run
from arealite.reward.math import math_reward
from arealite.utils.hf import resolve_model_path
from arealite.workflow.rlvr import RLVRWorkflow


def build_ppo(config: PPOConfig, actor, ref) -> PPO:
    """Build and load the critic engine (``--critic.*``), then PPO on actor + critic (+ ref)."""
    critic = FSDPCriticEngine(config.critic)
    critic.initialize(resolve_model_path(config.critic.path or config.actor.path), config.total_train_steps)
    return with_surrogate(PPO, config.algo.loss)(config.algo, actor, critic, group_size=config.gconfig.n_samples,
                                                 ref=ref, max_new_tokens=config.gconfig.max_new_tokens)


def main(argv: list[str] | None = None) -> dict:
    return run(PPOConfig, build_ppo, lambda c, tok, d: RLVRWorkflow(math_reward, c.gconfig, tok, dump_dir=d), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
