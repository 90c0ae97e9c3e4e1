"""GSPO: group sequence policy optimisation (Zheng et al. 2025, arXiv 2507.18071), in one file.

GRPO clips a per-token ratio; GSPO clips one ratio per response, the length-normalised
(geometric-mean) likelihood ratio, so the trust region matches the sequence-level reward::

    A_i       = (r_i - mean_j r_j) / (std_j r_j + 1e-6)                     # as GRPO (Eq. 6)
    s_i(θ)    = exp( 1/|y_i| Σ_t log π_θ(y_{i,t}) / π_old(y_{i,t}) )         # Eq. 7
    J(θ)      = 1/G Σ_i min( s_i A_i, clip(s_i, 1-ε, 1+ε_high) A_i )         # Eq. 5

implemented in the GSPO-token form (Eq. 13), which has the same value and gradient when every
token of y_i carries A_i::

    s_{i,t}   = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]      # value s_i, ∂/∂log π_θ(y_{i,t}) = s_i
    ℓ_{i,t}   = w_t · max(-A_i s_{i,t}, -A_i clip(s_{i,t}, 1-ε, 1+ε_high))
    L         = 1/#seqs Σ_i 1/|y_i| Σ_t ℓ_{i,t}                 # loss_agg_mode="seq-mean-token-mean"

so ∂L/∂log π_θ(y_{i,t}) = -A_i s_i / (|y_i| · #seqs) when s_i is inside the clip range, 0 when
the clipped branch is active. π_old is π_prox of the decoupled objective (AReaL, arXiv
2505.24298): recomputed before the first of several minibatches, the training forward itself
with one minibatch (then s_i = 1), the behaviour policy with ``use_decoupled_loss=False``.
The per-token behaviour weight w_t = π_prox/π_behav and its cap are as in GRPO. ``sg[log s_i]``
is capped at 10 (verl). The paper's clip range is tiny (3e-4, 4e-4): a sequence ratio is an
average over |y_i| token log-ratios.

Config: :class:`arealite.api.config.GSPOAlgoConfig` (all GRPO keys; defaults
``eps_clip=3e-4``, ``eps_clip_high=4e-4``, ``loss_agg_mode=seq-mean-token-mean``).
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO


class GSPO(GRPO):
    """GSPO with GRPO's constructor and ``update(batch)``; only the ratio differs."""

    def log_ratio(self, logprobs: torch.Tensor, prox_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """GSPO-token log-ratio [B, T]: value log s_i on every token of row i, per-token gradient."""
        return F.sequence_log_ratio(logprobs, prox_logp, loss_mask)
