"""PPO with a learned critic (Schulman et al. 2017, arXiv 1707.06347; for LLMs as in Ouyang et
al. 2022, arXiv 2203.02155), decoupled for stale data (AReaL, arXiv 2505.24298, Eq. 5), in one file.

A critic (:class:`arealite.train_engine.fsdp.FSDPCriticEngine`: the policy's backbone with a scalar
value head) estimates V_t, the expected return of the state before token t. Per update::

    r̃_i      = normalise(r_i)                  # algo.reward_norm: none | group | batch
    R_{i,t}  = 1[t = last token of y_i] · r̃_i - β · k(π_behav, π_ref)_t  # KL penalty in the reward
    δ_t      = R_t + γ V_{t'} - V_t ;  A_t = δ_t + γλ A_{t'}             # GAE (arXiv 1506.02438)
    Â_t      = whiten(A_t) over the global batch                        # algo.adv_whiten
    ℓ^π_t    = w_t · max(-Â_t u_t, -Â_t clip(u_t, 1-ε, 1+ε_high))      # as GRPO (decoupled PPO)
    ℓ^V_t    = ½ max((V_t - G_t)², (V_old,t + clip(V_t - V_old,t, ±ε_v) - G_t)²),  G_t = A_t + V_old,t

where t' is the next generated token, u_t = π_θ/π_prox and w_t = π_prox/π_behav (capped).
The actor and the critic take one optimizer step each per minibatch; both losses are
token-means over the global batch (``loss_agg_mode`` applies to the actor only).

Defaults follow verl for outcome rewards (γ = λ = 1: A_t = G_t - V_t, no bootstrapping from a
young critic); the value head starts at 0, so the first update is REINFORCE with a whitened
return. Config: :class:`arealite.api.config.PPOAlgoConfig`; the critic's engine config is
``PPOConfig.critic``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO, combine_stats
from arealite.api.config import REWARD_NORMS, PPOAlgoConfig
from arealite.api.engine import Batch, TrainEngine



def normalize_rewards(rewards: torch.Tensor, mode: str, group_size: int) -> torch.Tensor:
    """Sequence rewards [B] → [B] float32: ``none`` unchanged; ``group``: (r - group mean) /
    (group std + 1e-6) (GRPO); ``batch``: whitened over the rows of all data-parallel ranks."""
    if mode == "none":
        return rewards.float()
    if mode == "group":
        return F.group_normalize(rewards, group_size)
    if mode == "batch":
        ones = torch.ones(rewards.shape[0], 1)
        return F.masked_whiten(rewards.float()[:, None], ones).view(-1)
    raise ValueError(f"algo.reward_norm: unknown {mode!r}; choose one of {REWARD_NORMS}")


class PPO(GRPO):
    """PPO on a policy engine ``actor`` and a value engine ``critic`` (+ optional frozen ``ref``).

    Batch layout as :class:`GRPO` (``group_size`` only decides how minibatches are cut, so
    that a prompt's samples stay together). :meth:`prepare` adds ``values`` (V_old),
    ``returns`` and ``advantages``, all [B, T] float32.
    """

    config: PPOAlgoConfig

    def __init__(self, config: PPOAlgoConfig, actor: TrainEngine, critic: TrainEngine, group_size: int = 1,
                 ref: TrainEngine | None = None, max_new_tokens: int | None = None):
        super().__init__(config, actor, group_size, ref, max_new_tokens)
        self.critic = critic
        self.kl_in_loss = config.kl_coef > 0 and not config.kl_in_reward

    def prepare(self, batch: Batch) -> Batch:
        """Critic values V_old first (the advantages need them), then GRPO's preparation
        (reference and proximal logprobs) with the GAE advantages below."""
        batch["values"] = self.critic.forward(batch) * (batch["loss_mask"] > 0)
        return super().prepare(batch)

    def compute_advantages(self, batch: Batch, rewards: torch.Tensor) -> torch.Tensor:
        """GAE advantages [B, T] (whitened if ``adv_whiten``); stores ``returns`` [B, T]."""
        c, mask = self.config, batch["loss_mask"]
        token_rewards = F.last_token_rewards(normalize_rewards(rewards, c.reward_norm, self.group_size), mask)
        if c.kl_coef > 0 and c.kl_in_reward:
            kl = F.kl_estimate(batch["logprobs"], batch["ref_logp"], c.kl_estimator, mask)  # [B, T], no grad
            token_rewards = token_rewards - c.kl_coef * kl
        adv, batch["returns"] = F.gae(token_rewards, batch["values"], mask, c.gamma, c.lam)
        return F.masked_whiten(adv, mask) if c.adv_whiten else adv

    def critic_loss_fn(self, values: torch.Tensor, mb: Batch) -> torch.Tensor:
        """Clipped value loss of one micro-batch, token-mean over ``loss_mask`` (engine contract)."""
        loss_tok, stats = F.value_loss_per_token(values, mb["values"], mb["returns"], mb["loss_mask"],
                                                 self.config.value_eps_clip)
        self._critic_mb_stats.append({k: float(v) for k, v in stats.items()})
        return F.agg_loss(loss_tok, mb["loss_mask"], "token-mean")

    def train_minibatch(self, mb: Batch) -> dict[str, float]:
        """One actor step, then one critic step on the same minibatch."""
        stats = super().train_minibatch(mb)
        self._critic_mb_stats: list[dict[str, float]] = []
        cstats = self.critic.train_batch(mb, self.critic_loss_fn, lambda m: F.agg_weight(m["loss_mask"]))
        stats.update({f"critic/{k}": v for k, v in cstats.items()})
        stats.update(combine_stats(self._critic_mb_stats, "critic/"))
        return stats

    def update(self, batch: Batch) -> dict[str, float]:
        """GRPO's minibatch loop (actor + critic steps) plus the critic's explained variance
        ``1 - Var(G - V_old) / Var(G)`` over the loss tokens of all ranks."""
        stats = super().update(batch)
        mask = batch["loss_mask"] > 0
        g, v = batch["returns"][mask].double(), batch["values"][mask].double()
        sums = torch.stack([g.sum(), (g * g).sum(), (g - v).sum(), ((g - v) ** 2).sum(),
                            torch.tensor(float(g.numel()), dtype=torch.float64)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        n = sums[4].clamp(min=1)
        var_g = sums[1] / n - (sums[0] / n) ** 2
        var_res = sums[3] / n - (sums[2] / n) ** 2
        stats["critic/explained_var"] = float(1 - var_res / var_g) if var_g > 1e-12 else 0.0
        return stats
