"""What a workflow that owns a :class:`~arealite.reward.worker.RewardWorker` tells the loop."""

from __future__ import annotations

from typing import Any, Callable

from arealite.reward.worker import RewardWorker


class OwnsRewardWorker:
    """Mixin for a :class:`~arealite.api.workflow.RolloutWorkflow` with a ``reward_worker`` that
    runs ``reward_fn``: :meth:`start` imports ``reward_fn`` in a worker process early, the loop logs
    the worker's counters (:meth:`reward_counters`) and :meth:`close` kills its processes."""

    reward_worker: RewardWorker
    reward_fn: Callable[..., Any]

    def start(self) -> None:
        self.reward_worker.prewarm(self.reward_fn)

    def reward_counters(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.reward_worker.stats_snapshot().items()}

    def close(self) -> None:
        self.reward_worker.close()
