"""GRPO: group-relative policy optimisation (DeepSeekMath, arXiv 2402.03300), in one file.

Objective per token of response i in a group of G responses to one prompt (token-level
aggregation as in DAPO, arXiv 2503.14476, Eq. 12; decoupled for stale data as in AReaL,
arXiv 2505.24298, Eq. 5)::

    A_i   = (r_i - mean_j r_j) / (std_j r_j + 1e-6)          # adv_norm_std=False: no division
    u_t   = π_θ(a_t|s_t) / π_prox(a_t|s_t)                  # π_prox: weights before this update
    w_t   = π_prox(a_t|s_t) / π_behav(a_t|s_t)              # π_behav: the sampling weights
    ℓ_t   = w_t · max(-A_i u_t, -A_i clip(u_t, 1-ε, 1+ε_high)) + β · k3(π_θ, π_ref)_t
    L     = Σ_{i,t} ℓ_t · mask_t / Σ_{i,t} mask_t              # token mean over the global batch

With ``use_decoupled_loss``, ``π_prox`` is the policy before this update: with one minibatch
it is the training forward's own detached logprobs (same weights, no extra pass); with several
minibatches it is recomputed by a forward pass before the first one. Without it,
``π_prox = π_behav`` and w = 1 (standard PPO/GRPO, clipping around the possibly stale
behaviour policy).

Config: :class:`arealite.api.config.GRPOAlgoConfig`.
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F
from arealite.api.algorithm import Algorithm
from arealite.api.config import GRPOAlgoConfig
from arealite.api.engine import Batch, TrainEngine


class GRPO(Algorithm):
    """GRPO on a policy engine ``actor`` and an optional frozen reference ``ref`` (for KL).

    Batch layout (rows of one prompt consecutive): ``input_ids``, ``attention_mask``,
    ``loss_mask``, ``logprobs`` (behaviour), ``versions`` [B, T]; ``rewards`` [B], with
    B a multiple of ``group_size``.
    """

    def __init__(self, config: GRPOAlgoConfig, actor: TrainEngine, group_size: int, ref: TrainEngine | None = None):
        if config.kl_coef > 0 and ref is None:
            raise ValueError("algo.kl_coef > 0 needs a reference model; pass ref= or set algo.kl_coef 0")
        if config.n_minibatches < 1:
            raise ValueError(f"algo.n_minibatches must be >= 1, got {config.n_minibatches}")
        self.config, self.actor, self.ref, self.group_size = config, actor, ref, group_size

    def prepare(self, batch: Batch) -> Batch:
        """Adds ``advantages`` [B, T] (group-normalised reward on generated tokens, 0 elsewhere),
        ``prox_logp`` [B, T] (unless the training forward provides it, see the module doc) and,
        with KL, ``ref_logp`` [B, T]."""
        adv = F.group_normalize(batch["rewards"], self.group_size, self.config.adv_norm_std)  # [B]
        batch["advantages"] = adv[:, None] * batch["loss_mask"].float()  # [B, T]
        if self.config.n_minibatches > 1:
            batch["prox_logp"] = self.actor.forward(batch)
        elif not self.config.use_decoupled_loss:
            batch["prox_logp"] = batch["logprobs"]
        # else: one minibatch — π_prox are the weights of this very update, so the training
        # forward's own (detached) logprobs are exactly π_prox: no extra forward pass needed.
        if self.ref is not None:
            batch["ref_logp"] = self.ref.forward(batch)
        return batch

    def loss_fn(self, logprobs: torch.Tensor, mb: Batch) -> torch.Tensor:
        """Token-mean GRPO loss of one micro-batch (weights: :meth:`loss_weight_fn`)."""
        c = self.config
        prox_logp = mb["prox_logp"] if "prox_logp" in mb else logprobs.detach()
        loss, stats = F.ppo_actor_loss(
            logprobs, prox_logp, mb["logprobs"], mb["advantages"], mb["loss_mask"],
            c.eps_clip, c.eps_clip_high, c.behav_imp_weight_cap,
        )
        if c.kl_coef > 0:
            kl = F.masked_mean(F.kl_k3(logprobs, mb["ref_logp"]), mb["loss_mask"])
            loss = loss + c.kl_coef * kl
            stats["kl_ref"] = kl.detach()
        self._mb_stats.append({k: float(v) for k, v in stats.items()})
        return loss

    @staticmethod
    def loss_weight_fn(mb: Batch) -> float:
        """Number of loss tokens: makes the engine's combination a global token mean."""
        return float(mb["loss_mask"].sum())

    def update(self, batch: Batch) -> dict[str, float]:
        """Prepare, then ``n_minibatches`` optimizer steps over whole groups of the batch."""
        batch = self.prepare(batch)
        n_groups = batch["rewards"].shape[0] // self.group_size
        splits = torch.arange(n_groups).chunk(self.config.n_minibatches)
        stats: dict[str, float] = {}
        for groups in splits:
            rows = (groups[:, None] * self.group_size + torch.arange(self.group_size)).view(-1)
            mb = {k: v[rows] for k, v in batch.items()}
            self._mb_stats: list[dict[str, float]] = []
            stats = self.actor.train_batch(mb, self.loss_fn, self.loss_weight_fn)
        for key in self._mb_stats[0] if self._mb_stats else []:
            stats[f"actor/{key}"] = sum(s[key] for s in self._mb_stats) / len(self._mb_stats)
        mask = batch["loss_mask"].bool()
        stats["actor/advantage_abs_mean"] = float(batch["advantages"][mask].abs().mean()) if mask.any() else 0.0
        return stats
