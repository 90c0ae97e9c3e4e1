"""The unit a user writes for a new task or agent: :class:`RolloutWorkflow`."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from arealite.api.engine import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """Turns one dataset row into trajectories by calling ``engine.agenerate`` (any number of
    times, concurrently or in turns) and scoring the result.

    Subclass it and implement :meth:`arun_episode`; the executor runs many episodes
    concurrently on its asyncio loop, so never block the loop (use ``await``).

    ``stat_keys``: names of extra per-trajectory float tensors [N] in the returned dict whose
    batch mean the training loop logs as ``rollout/<key>`` (e.g. ``turns``). A workflow used by
    the RL loop also has ``aevaluate(engine, rows) -> dict[str, float]`` (held-out evaluation).
    :meth:`counters` returns cumulative event counts (e.g. timed-out agent sessions) that the loop
    sums over ranks and logs each step as ``workflow/<name>``.
    """

    stat_keys: tuple[str, ...] = ()

    def counters(self) -> dict[str, float]:
        """Cumulative counts since the workflow was built (``{}`` by default); the same keys on
        every rank (the loop sums them with a collective)."""
        return {}

    @abc.abstractmethod
    async def arun_episode(
        self, engine: "InferenceEngine", data: dict[str, Any]
    ) -> dict[str, torch.Tensor] | None:
        """Run one episode.

        Returns: a dict of padded tensors with leading dim N (trajectories of this episode, e.g.
        the GRPO group): ``input_ids`` [N, T] int64, ``attention_mask`` [N, T] bool,
        ``loss_mask`` [N, T] int32, ``logprobs`` [N, T] float32, ``versions`` [N, T] int64,
        ``rewards`` [N] float32 (token-aligned layout, see :mod:`arealite.api.io_struct`);
        or ``None`` to reject the episode. An exception is logged and counted by the executor,
        which goes on with other episodes.
        """
