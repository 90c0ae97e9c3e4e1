"""DPPO (arXiv 2602.04879): a trust region on the token *probabilities*, not the ratio.

A token keeps its gradient unless the update already moved its probability too far in the
direction its advantage pushes (p = π_θ(y_t), p_prox = π_prox(y_t), both detached)::

    binary TV:  keep_t = [Â > 0 ∧ p − p_prox ≤ δ] ∨ [Â < 0 ∧ p − p_prox ≥ −δ]           (δ = 0.2)
    binary KL:  keep_t = [Â > 0 ∧ (p ≤ p_prox ∨ KL_b(p_prox‖p) ≤ δ)]
                       ∨ [Â < 0 ∧ (p ≥ p_prox ∨ KL_b(p_prox‖p) ≤ δ)]                      (δ = 0.05)
    ℓ_t = −Â_t · sg(min(r_t, C)) · log π_θ(y_t) · keep_t · w_t                            (C = 20)

with r = π_θ/π_prox (π_prox = μ in bypass mode, the paper's and prime-rl's setting) and w the
behaviour correction; δ = ``algo.dppo_delta``, C = ``algo.dppo_ratio_cap``. Selected with
``--algo.loss dppo_tv`` or ``--algo.loss dppo_kl``.
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F
from arealite.algorithms.corrections import binary_kl


def dppo_keep(logprobs: torch.Tensor, prox_logp: torch.Tensor, advantages: torch.Tensor, kind: str,
              delta: float) -> torch.Tensor:
    """The DPPO trust-region mask [B, T] bool (``kind`` "tv" or "kl"; see the module doc)."""
    p, p_prox = torch.exp(logprobs.detach().float()), torch.exp(prox_logp.detach().float())
    diff = p - p_prox
    if kind == "tv":
        return ((advantages > 0) & (diff <= delta)) | ((advantages < 0) & (diff >= -delta)) | (advantages == 0)
    close = binary_kl(p_prox, p) <= delta
    return ((advantages > 0) & ((diff <= 0) | close)) | ((advantages < 0) & ((diff >= 0) | close)) | (advantages == 0)


class _DPPOSurrogate:
    kind = "tv"
    default_delta = 0.2

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mb, corr):
        """ℓ [B, T] (0 off ``corr.keep`` and off the trust region) and ``trust_region_masked_frac``
        (loss tokens outside it) / ``approx_kl`` over the kept tokens."""
        c, keep = self.config, corr.keep
        delta = self.default_delta if c.dppo_delta is None else c.dppo_delta
        lr = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
        adv = torch.where(keep, mb["advantages"], torch.zeros_like(lr))
        prox = logprobs.detach() - lr.detach()  # log π_prox on the kept tokens
        region = keep & dppo_keep(logprobs, prox, adv, self.kind, delta)
        weight = torch.exp(lr).detach().clamp(max=c.dppo_ratio_cap)
        lp = torch.where(region, logprobs, torch.zeros_like(logprobs))
        loss = torch.where(region, -adv * weight * lp * corr.weight, torch.zeros_like(lp))
        with torch.no_grad():
            stats = {"trust_region_masked_frac": F.masked_mean((keep & ~region).float(), mb["loss_mask"] > 0),
                     "approx_kl": F.masked_mean(-lr, keep)}
        return loss, stats


class DPPOTVSurrogate(_DPPOSurrogate):
    """Mixin over :class:`arealite.algorithms.grpo.GRPO`: DPPO with the binary-TV region."""

    kind, default_delta = "tv", 0.2


class DPPOKLSurrogate(_DPPOSurrogate):
    """Mixin over :class:`arealite.algorithms.grpo.GRPO`: DPPO with the binary-KL region."""

    kind, default_delta = "kl", 0.05
