"""GMPO (arXiv 2507.20673): the geometric mean of the token ratios, clipped in log space.

    l_t = log r_t,   l̃_t = sgn(Â)·min(sgn(Â)·l_t, sgn(Â)·clamp(l_t, −ε_low, ε_high))
    R_i = exp(Σ_t m_t l̃_t / |y_i|),   L_i = −Â_i · R_i

with r = π_θ/π_prox, ε_low = ``algo.eps_clip``, ε_high = ``algo.eps_clip_high`` (None = ε_low; the
paper's ε = 0.4 in log space, so pass ``--algo.eps_clip 0.4``). Each kept token of row i carries
L_i · w_t (w the behaviour correction), aggregated ``seq-mean-token-mean`` (required: the loss is
per sequence), so a row with all tokens kept contributes L_i. Selected with ``--algo.loss gmpo``.
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F


class GMPOSurrogate:
    """Mixin over :class:`arealite.algorithms.grpo.GRPO`: :meth:`surrogate` is GMPO's."""

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mb, corr):
        """ℓ [B, T] (0 off ``corr.keep``) and ``clip_frac`` / ``approx_kl`` over the kept tokens."""
        c, keep = self.config, corr.keep
        high = c.eps_clip if c.eps_clip_high is None else c.eps_clip_high
        lr = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
        adv = torch.where(keep, mb["advantages"], torch.zeros_like(lr))
        sign = torch.sign(adv)
        clipped = sign * torch.minimum(sign * lr, sign * lr.clamp(-c.eps_clip, high))
        n = keep.sum(-1, keepdim=True).clamp(min=1)
        seq_ratio = torch.exp((clipped * keep).sum(-1, keepdim=True) / n)  # R_i [B, 1]
        seq_adv = (adv * keep).sum(-1, keepdim=True) / n  # Â_i (constant over a GRPO row)
        loss = torch.where(keep, -seq_adv * seq_ratio * corr.weight, torch.zeros_like(lr))
        with torch.no_grad():
            stats = {"clip_frac": F.masked_mean((clipped != lr).float(), keep), "approx_kl": F.masked_mean(-lr, keep)}
        return loss, stats
