"""CISPO (MiniMax-M1, arXiv 2506.13585 Eq. 4–5): clip the importance weight, never the gradient.

    ℓ_t = −sg(clip(r_t, 1 − ε_low, 1 + ε_high)) · Â_t · log π_θ(y_t) · w_t

with r = π_θ/π_prox, ε_low = ``algo.eps_clip``, ε_high = ``algo.eps_clip_high`` (None = ε_low) and
w the behaviour correction. Every kept token keeps a gradient (Â·sg(clip r)·∇log π), unlike PPO,
whose clipped tokens get none. AReaL suggests ε_low = 1.0 (lower bound 0) and ε_high = 4.0.
Selected with ``--algo.loss cispo`` on any GRPO-family recipe.
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F


class CISPOSurrogate:
    """Mixin over :class:`arealite.algorithms.grpo.GRPO`: :meth:`surrogate` is CISPO's."""

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mb, corr):
        """ℓ [B, T] (0 off ``corr.keep``) and ``clip_frac`` / ``approx_kl`` over the kept tokens."""
        c, keep = self.config, corr.keep
        high = c.eps_clip if c.eps_clip_high is None else c.eps_clip_high
        lr = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
        ratio = torch.exp(lr).detach()
        weight = ratio.clamp(1.0 - c.eps_clip, 1.0 + high)
        adv = torch.where(keep, mb["advantages"], torch.zeros_like(ratio))
        lp = torch.where(keep, logprobs, torch.zeros_like(logprobs))
        loss = torch.where(keep, -weight * adv * lp * corr.weight, torch.zeros_like(lp))
        with torch.no_grad():
            stats = {"clip_frac": F.masked_mean((weight != ratio).float(), keep), "approx_kl": F.masked_mean(-lr, keep)}
        return loss, stats
