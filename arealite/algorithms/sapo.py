"""SAPO (arXiv 2511.20347): a soft, temperature-controlled gate instead of PPO's hard clip.

    f(r) = (4/τ) · σ(τ (r − 1)),   τ = τ_pos if Â > 0 else τ_neg,   ℓ_t = −f(r_t) · Â_t · w_t

with r = π_θ/π_prox and w the behaviour correction. ∂f/∂r = 4σ(1 − σ), 1 at r = 1: the gradient
equals the vanilla policy gradient on-policy and fades smoothly as r leaves 1 (faster for
negative advantages, τ_neg > τ_pos). Defaults τ_pos = 1.0, τ_neg = 1.05 (``algo.sapo_tau_pos``,
``algo.sapo_tau_neg``). Token level; with GSPO's sequence ratio it is the sequence form.
Selected with ``--algo.loss sapo``.
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F


def sapo_gate(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """f(r) = (4/τ) σ(τ (r − 1)) [B, T], τ chosen per token by the sign of the advantage."""
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))


class SAPOSurrogate:
    """Mixin over :class:`arealite.algorithms.grpo.GRPO`: :meth:`surrogate` is SAPO's."""

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mb, corr):
        """ℓ [B, T] (0 off ``corr.keep``) and ``approx_kl`` over the kept tokens."""
        c, keep = self.config, corr.keep
        lr = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
        adv = torch.where(keep, mb["advantages"], torch.zeros_like(lr))
        gate = sapo_gate(torch.exp(lr), adv, c.sapo_tau_pos, c.sapo_tau_neg)
        loss = torch.where(keep, -gate * adv * corr.weight, torch.zeros_like(lr))
        with torch.no_grad():
            stats = {"approx_kl": F.masked_mean(-lr, keep)}
        return loss, stats
