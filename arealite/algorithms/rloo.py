"""RLOO: REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740), in one file.

Each response's baseline is the mean reward of the OTHER G-1 responses to the same prompt,
an unbiased baseline (it does not depend on the response itself)::

    A_i = r_i - 1/(G-1) Σ_{j≠i} r_j  =  G/(G-1) · (r_i - mean_j r_j)        # Eq. 7; G ≥ 2

The advantage goes on every generated token of response i and is optimised with GRPO's
(decoupled) PPO-clip loss, as TRL's and verl's RLOO do (the paper's pure REINFORCE is the
on-policy case, where the ratio is 1 and the clip never acts)::

    ℓ_t = w_t · max(-A_i u_t, -A_i clip(u_t, 1-ε, 1+ε_high)) [+ β · KL_t],   u_t = π_θ/π_prox

with the same options as GRPO (``loss_agg_mode``, ``c_clip``, ``overlong_penalty``, KL).
Unlike GRPO there is no std normalisation (``adv_norm_std`` is unused). Group size 1 has no
leave-one-out baseline: the constructor raises ``ValueError``.

Config: :class:`arealite.api.config.GRPOAlgoConfig`.
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO
from arealite.api.config import GRPOAlgoConfig
from arealite.api.engine import Batch, TrainEngine


class RLOO(GRPO):
    """RLOO with GRPO's constructor and ``update(batch)``; only the advantages differ."""

    def __init__(self, config: GRPOAlgoConfig, actor: TrainEngine, group_size: int,
                 ref: TrainEngine | None = None, max_new_tokens: int | None = None):
        super().__init__(config, actor, group_size, ref, max_new_tokens)  # group_size >= 2 (cli.check_algorithm)

    def compute_advantages(self, batch: Batch, rewards: torch.Tensor) -> torch.Tensor:
        """Leave-one-out advantage of each response on its generated tokens, [B, T]."""
        adv = F.rloo_advantages(rewards, self.group_size)  # [B]
        return adv[:, None] * batch["loss_mask"].float()
