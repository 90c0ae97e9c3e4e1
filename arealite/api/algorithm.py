"""The :class:`Algorithm` contract: turn a rollout batch into policy updates."""

from __future__ import annotations

import abc

from arealite.api.engine import Batch, TrainEngine


class Algorithm(abc.ABC):
    """An RL (or SFT/DPO) algorithm on top of one or more :class:`TrainEngine` s.

    A recipe calls ``stats = algo.update(batch)`` once per training step; ``update`` calls
    :meth:`prepare` (recompute logprobs, reference logprobs, advantages) and then the
    optimizer steps.

    ``critic``: the value model an algorithm trains besides the policy (PPO), or None; the loop
    checkpoints it for recover and gives it the shared cores.
    """

    critic: "TrainEngine | None" = None

    @abc.abstractmethod
    def prepare(self, batch: Batch) -> Batch:
        """Add the tensors the loss needs (e.g. ``prox_logp``, ``ref_logp``, ``advantages``),
        all token-aligned [B, T] float32. Returns the same dict."""

    @abc.abstractmethod
    def update(self, batch: Batch) -> dict[str, float]:
        """Prepare and train on ``batch``; return scalar stats for logging."""
