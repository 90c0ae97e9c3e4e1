"""Asynchronous PPO with a critic on math: the loop of ``grpo_math.py`` plus a value model.

    torchrun --nproc_per_node=1 recipes/ppo_math.py
    python recipes/ppo_math.py --config recipes/configs/ppo_math.yaml --critic.optimizer.lr 5e-5

The critic (``FSDPCriticEngine``: the policy's backbone with a zero-initialised value head, its
own optimizer, ``--critic.*``) is loaded from ``critic.path`` (default: the actor's model folder); PPO computes GAE
advantages from its values and takes one actor and one critic step per minibatch (see
``arealite/algorithms/ppo.py``). Only the actor's weights go to the inference servers. The rest
of the loop — asynchronous rollouts, staleness bound, weight sync, logging, outputs under
``outputs/ppo_math/trial0/`` — is ``recipes/grpo_math.py``; read it top to bottom.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_math import main  # noqa: E402  (the shared explicit loop)

from arealite.algorithms.ppo import PPO  # noqa: E402
from arealite.api.config import PPOConfig  # noqa: E402
from arealite.engine.fsdp import FSDPCriticEngine  # noqa: E402
from arealite.utils.hf import resolve_model_path  # noqa: E402


def build_ppo(config: PPOConfig, actor, ref, model_path: str) -> PPO:
    """Build and load the critic engine (``--critic.*``), then PPO on actor + critic (+ ref)."""
    critic = FSDPCriticEngine(config.critic)  # critic.path "" = the actor's model folder
    critic.initialize(resolve_model_path(config.critic.path) if config.critic.path else model_path,
                      config.total_train_steps)
    return PPO(config.algo, actor, critic, group_size=config.gconfig.n_samples, ref=ref,
               max_new_tokens=config.gconfig.max_new_tokens)


if __name__ == "__main__":
    main(sys.argv[1:], PPOConfig, build_ppo)
