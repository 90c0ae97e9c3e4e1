"""Staleness control (AReaL, arXiv 2505.24298, §4.1 Eq. 3).

With trainer version ``v`` (completed weight updates), consumer batch ``B`` trajectories per
step (per rank) and bound ``η = max_head_offpolicyness``:

* **admission**: a new episode starts only while
  ``accepted + running < (η + v + 1) · B`` and ``running < max_concurrent``;
* **drain**: a finished trajectory is handed to the trainer only if the oldest version among its
  generated tokens is ``≥ v − η``; older ones are dropped and counted, never trained on.

``η = 0`` is synchronous RL: the rollouts of step k all start after update k−1.
"""

from __future__ import annotations

import threading

from arealite.api.io_struct import RolloutStat
from arealite.utils import trace


class StalenessManager:
    """Thread-safe counters plus the two rules above (all counts in trajectories, per rank).

    Args:
        consumer_batch_size: B, trajectories consumed per training step by this rank (≥ 1).
        max_concurrent_rollouts: episodes allowed in flight at once (≥ 1).
        max_head_offpolicyness: η ≥ 0.

    Raises:
        ValueError: any argument out of range (names the config field).
    """

    def __init__(self, consumer_batch_size: int, max_concurrent_rollouts: int, max_head_offpolicyness: int):
        if consumer_batch_size < 1:
            raise ValueError(f"rollout.consumer_batch_size must be >= 1 per rank, got {consumer_batch_size}")
        if max_concurrent_rollouts < 1:
            raise ValueError(f"rollout.max_concurrent_rollouts must be >= 1 per rank, got {max_concurrent_rollouts}")
        if max_head_offpolicyness < 0:
            raise ValueError(f"rollout.max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}")
        self.batch_size = consumer_batch_size
        self.max_concurrent = max_concurrent_rollouts
        self.eta = max_head_offpolicyness
        self.stat = RolloutStat()
        self._lock = threading.Lock()
        self._gate: tuple[bool, int] | None = None
        self.trace_process = "rollout"  # track group of the gate in the trace (the executor names its rank)

    def capacity(self, version: int) -> int:
        """How many more episodes may start now at trainer version ``version``."""
        with self._lock:
            s = self.stat
            staleness_room = (self.eta + version + 1) * self.batch_size - (s.accepted + s.running)
            gate = (staleness_room > 0, s.running)
        if gate != self._gate:  # the timeline's gate track: open/closed and episodes in flight
            self._gate = gate
            trace.counter("staleness gate", {"open": int(gate[0]), "running": gate[1]}, process=self.trace_process)
        return min(self.max_concurrent - gate[1], staleness_room)

    def on_start(self) -> None:
        with self._lock:
            self.stat.submitted += 1
            self.stat.running += 1

    def on_finish(self, accepted: bool, failed: bool = False) -> None:
        """An episode ended: accepted (queued for training), rejected (None) or failed (raised)."""
        with self._lock:
            self.stat.running -= 1
            if accepted:
                self.stat.accepted += 1
            elif failed:
                self.stat.failed += 1
            else:
                self.stat.rejected += 1

    def is_fresh(self, min_version: int, version: int) -> bool:
        """Drain rule: trajectory whose oldest generated token has ``min_version`` may be trained
        at trainer version ``version``. A trajectory with no generated tokens (min_version < 0)
        is fresh."""
        return min_version < 0 or min_version >= version - self.eta

    def on_drop_stale(self) -> None:
        """A drained trajectory was too old: it no longer counts as accepted (frees capacity)."""
        with self._lock:
            self.stat.accepted -= 1
            self.stat.dropped_stale += 1

    def on_resume(self, saved: RolloutStat, trained: int) -> None:
        """Restore the counters of a recover checkpoint, whose unfinished episodes will run again.

        ``accepted`` = ``trained`` (trajectories the trainer already received, normally v · B at
        version v, so that admission neither bursts nor stalls; AReaL commit 6a84d4ed6),
        ``running`` = 0, ``submitted`` = the episodes that ended for good; ``rejected``,
        ``failed`` and ``dropped_stale`` continue from ``saved``."""
        with self._lock:
            s = self.stat
            s.rejected, s.failed, s.dropped_stale = saved.rejected, saved.failed, saved.dropped_stale
            s.accepted, s.running = trained, 0
            s.submitted = trained + saved.rejected + saved.failed + saved.dropped_stale
