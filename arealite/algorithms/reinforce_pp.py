"""REINFORCE++ (Hu 2025, arXiv 2501.03262), with and without a group baseline, in one file.

No critic and no per-group std: the outcome reward sits on the last generated token, an
optional token-level KL penalty to the reference model is added to every token's reward, and
the reward-to-go is whitened over the WHOLE batch (all data-parallel ranks)::

    r'_i      = r_i                       (REINFORCE++)
              = r_i - mean_{j∈group} r_j   (REINFORCE++-baseline, group_baseline=True)
    R_{i,t}   = 1[t = last token of y_i] · r'_i  -  β · KL_t                  # Eq. 2
    KL_t      = k(π_behav, π_ref)_t, k = kl_estimator (k1 = log π_behav/π_ref, the paper's)
    G_{i,t}   = Σ_{t'≥t} γ^{t'-t} R_{i,t'}            (over generated tokens only)
    A_{i,t}   = (G_{i,t} - mean_batch G) / (std_batch G + 1e-8)                  # §3 (whitening)
    ℓ_t       = w_t · max(-A u_t, -A clip(u_t, 1-ε, 1+ε_high))       (the PPO-clip loss of GRPO)

With ``kl_in_reward=False`` the KL is instead a loss term ``β · k(π_θ, π_ref)_t`` (as in GRPO;
the paper's choice for REINFORCE++-baseline with k2/k3). When every token of the batch has the
same return (e.g. only all-equal groups with group_baseline), all advantages are exactly 0.
Note that whitening shifts a single all-equal group inside a mixed batch to -mean/std: that is
the algorithm, not a bug; pair it with dynamic sampling (grpo.should_accept) to drop them.

Config: :class:`arealite.api.config.ReinforcePPAlgoConfig` (GRPO keys + ``group_baseline``,
``gamma``, ``kl_in_reward``, ``kl_estimator``; ``adv_norm_std`` is unused).
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO
from arealite.api.config import ReinforcePPAlgoConfig
from arealite.api.engine import Batch, TrainEngine


class ReinforcePP(GRPO):
    """REINFORCE++ with GRPO's constructor and ``update(batch)``; only the advantages differ."""

    config: ReinforcePPAlgoConfig

    def __init__(self, config: ReinforcePPAlgoConfig, actor: TrainEngine, group_size: int,
                 ref: TrainEngine | None = None, max_new_tokens: int | None = None):
        super().__init__(config, actor, group_size, ref, max_new_tokens)
        self.kl_in_loss = config.kl_coef > 0 and not config.kl_in_reward

    def compute_advantages(self, batch: Batch, rewards: torch.Tensor) -> torch.Tensor:
        """Globally whitened discounted returns [B, T] (0 on non-generated tokens)."""
        c, mask = self.config, batch["loss_mask"]
        if c.group_baseline:
            rewards = F.group_normalize(rewards, self.group_size, use_std=False)  # r - group mean
        token_rewards = F.last_token_rewards(rewards, mask)  # [B, T]
        if c.kl_coef > 0 and c.kl_in_reward:
            kl = F.kl_estimate(batch["logprobs"], batch["ref_logp"], c.kl_estimator, mask)  # [B, T], no grad
            token_rewards = token_rewards - c.kl_coef * kl
        returns = F.discounted_returns(token_rewards, mask, c.gamma)  # [B, T]
        return F.masked_whiten(returns, mask)
