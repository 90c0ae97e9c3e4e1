"""SFT: supervised fine-tuning, the next-token negative log-likelihood of response tokens.

Loss (token-mean over the whole global batch, prompt tokens excluded by ``loss_mask``)::

    L = - Σ_{i,t} log π_θ(y_{i,t} | x_i, y_{i,<t}) · m_{i,t} / Σ_{i,t} m_{i,t}

The engine weight of a micro-batch is its number of loss tokens, so the engine's combination
over micro-batches and ranks gives exactly this global token mean (every token weighs the same,
whatever the row lengths). Batches come from :mod:`arealite.dataset.sft_data`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from arealite.algorithms import functional as F
from arealite.api.algorithm import Algorithm
from arealite.api.engine import Batch, TrainEngine


class SFT(Algorithm):
    """Next-token loss on response tokens; one optimizer step per batch.

    Args:
        actor: the trainable engine (temperature 1: the model's own likelihood).
    """

    def __init__(self, actor: TrainEngine):
        self.actor = actor

    def prepare(self, batch: Batch) -> Batch:
        """Checks the batch (``input_ids``, ``attention_mask``, ``loss_mask`` [B, T]).

        Raises:
            ValueError: a key is missing (names it).
        """
        for key in ("input_ids", "attention_mask", "loss_mask"):
            if key not in batch:
                raise ValueError(f"SFT batch has no {key!r}; build batches with arealite.dataset.sft_data.SFTCollator")
        return batch

    def loss_fn(self, logprobs: torch.Tensor, mb: Batch) -> torch.Tensor:
        """Token-mean NLL of one micro-batch (the mean over :meth:`loss_weight_fn`)."""
        return F.agg_loss(-logprobs, mb["loss_mask"], "token-mean")

    def loss_weight_fn(self, mb: Batch) -> float:
        """Loss tokens of the micro-batch."""
        return F.agg_weight(mb["loss_mask"], "token-mean")

    def update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step. Returns engine stats (``loss`` = global token-mean NLL before the
        step, ``grad_norm``, ``lr``) plus ``n_tokens`` (loss tokens over all ranks)."""
        batch = self.prepare(batch)
        stats = self.actor.train_batch(batch, self.loss_fn, self.loss_weight_fn)
        n = torch.tensor(float((batch["loss_mask"] > 0).sum()), dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(n)
        stats["n_tokens"] = float(n)
        return stats


@torch.no_grad()
def evaluate_nll(engine: TrainEngine, batches: list[Batch]) -> float:
    """Token-mean NLL [nats/token] of the response tokens of ``batches`` (this rank's share)
    over all ranks. Every rank must pass the same number of batches (forward is collective).

    Raises:
        ValueError: no loss token in any batch of any rank.
    """
    total = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        lp = engine.forward(batch)
        keep = batch["loss_mask"] > 0
        total += torch.tensor([float(-lp[keep].sum()), float(keep.sum())], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    if total[1] <= 0:
        raise ValueError("evaluate_nll: no response tokens in the held-out batches (valid_dataset)")
    return float(total[0] / total[1])
