"""The asynchronous rollout executor: an asyncio loop in a background thread.

The trainer thread calls :meth:`WorkflowExecutor.submit` / :meth:`~WorkflowExecutor.wait`
(or :meth:`~WorkflowExecutor.prepare_batch` in asynchronous mode and
:meth:`~WorkflowExecutor.rollout_batch` in synchronous mode); the loop thread starts episodes
(``RolloutWorkflow.arun_episode``) whenever the staleness rule of
:mod:`arealite.rollout.staleness` admits them, runs them concurrently, and queues their
trajectories. Generation therefore keeps going while the trainer trains: with
``max_head_offpolicyness = η`` it runs at most η batches ahead.

Failure policy: an exception inside one episode is logged with its traceback and counted
(``stat.failed``); the loop goes on. If every episode keeps failing (``max_consecutive_failures``
in a row, e.g. the servers died) or the loop thread itself dies, the next ``wait`` raises
instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from arealite.api.config import InferenceEngineConfig
from arealite.rollout.staleness import StalenessManager
from arealite.utils.data import concat_padded

if TYPE_CHECKING:
    from arealite.api.engine import InferenceEngine
    from arealite.api.workflow import RolloutWorkflow

logger = logging.getLogger("arealite.rollout")


class WorkflowExecutor:
    """Runs rollout episodes for one trainer rank.

    Args:
        config: the ``rollout`` config; batch sizes there are over all ranks and are divided
            by ``world_size`` here (per-rank rule, as in AReaL).
        engine: passed to every ``arun_episode`` (it generates).
        world_size: number of data-parallel trainer ranks.
    """

    def __init__(self, config: InferenceEngineConfig, engine: "InferenceEngine", world_size: int = 1):
        if config.consumer_batch_size % world_size != 0:
            raise ValueError(
                f"rollout.consumer_batch_size={config.consumer_batch_size} must be divisible by the "
                f"number of trainer ranks ({world_size})"
            )
        self.config, self.engine = config, engine
        batch = config.consumer_batch_size // world_size
        max_conc = max(1, (config.max_concurrent_rollouts or config.consumer_batch_size) // world_size)
        self.staleness = StalenessManager(batch, max_conc, config.max_head_offpolicyness)
        qsize = config.queue_size or 16 * max_conc
        self._input: queue.Queue = queue.Queue(maxsize=qsize)
        self._output: queue.Queue = queue.Queue()
        self._ready: collections.deque = collections.deque()  # fresh, drained, not yet returned
        self._paused = threading.Event()
        self._exiting = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._data_iter = None
        self._epoch = 0
        # Every episode failing (e.g. the servers are gone) must end in an error, not a hang.
        self.max_consecutive_failures = max(8, 4 * batch)
        self._consecutive_failures = 0
        self._last_error: BaseException | None = None
        self._version = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def initialize(self) -> None:
        """Start the background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._thread_main, name="arealite-rollout", daemon=True)
            self._thread.start()

    def destroy(self) -> None:
        """Stop the loop; running episodes are cancelled."""
        self._exiting.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._loop())
        except BaseException as e:  # surfaced by wait(); an episode error never gets here
            self._thread_error = e
            logger.exception("rollout thread died")

    async def _loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while not self._exiting.is_set():
                while (
                    not self._paused.is_set()
                    and not self._input.empty()
                    and self.staleness.capacity(self._version) > 0
                ):
                    data, workflow = self._input.get_nowait()
                    self.staleness.on_start()
                    task = asyncio.create_task(self._run_episode(data, workflow))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(0.005)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            aclose = getattr(self.engine, "aclose", None)  # e.g. HTTP sessions bound to this loop
            if aclose is not None:
                await aclose()

    async def _run_episode(self, data: dict[str, Any], workflow: "RolloutWorkflow") -> None:
        start = time.time()
        try:
            traj = await workflow.arun_episode(self.engine, data)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("rollout episode failed (counted in rollout/failed; the loop goes on)")
            self.staleness.on_finish(accepted=False, failed=True)
            self._consecutive_failures += 1
            self._last_error = e
            return
        self._consecutive_failures = 0
        if traj is None:
            self.staleness.on_finish(accepted=False)
            return
        n = traj["input_ids"].shape[0]
        traj["rollout_start_time"] = torch.full((n,), start, dtype=torch.float64)
        traj["rollout_end_time"] = torch.full((n,), time.time(), dtype=torch.float64)
        self.staleness.on_finish(accepted=True)
        self._output.put(traj)

    # -- versions and pausing -------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """Set the trainer version v (completed weight updates) used by both staleness rules."""
        self._version = version

    def get_version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Stop starting new episodes (and resubmitting interrupted generations)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def is_paused(self) -> bool:
        return self._paused.is_set()

    # -- producer / consumer API -----------------------------------------------------------------
    def submit(self, data: dict[str, Any], workflow: "RolloutWorkflow") -> None:
        """Queue one episode. Raises ``RuntimeError`` if the input queue is full."""
        try:
            self._input.put_nowait((data, workflow))
        except queue.Full:
            raise RuntimeError(
                "rollout input queue is full; raise rollout.queue_size or call wait() more often"
            ) from None

    def wait(self, count: int, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Return ``count`` finished episodes (oldest first) concatenated into one padded batch.

        Trajectories older than the staleness bound are dropped here (``stat.dropped_stale``)
        and do not count towards ``count``.

        Raises:
            TimeoutError: fewer than ``count`` fresh episodes after ``timeout`` seconds (those
                already finished stay queued for the next call).
            RuntimeError: the rollout thread died, or ``max_consecutive_failures`` episodes in a
                row raised (the last exception is chained).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._ready) < count:
            if self._thread_error is not None:
                raise RuntimeError("the rollout thread died; see the log above") from self._thread_error
            if self._thread is None:
                raise RuntimeError("WorkflowExecutor.initialize() was not called")
            if self._consecutive_failures >= self.max_consecutive_failures:
                raise RuntimeError(
                    f"{self._consecutive_failures} rollout episodes in a row failed (are the inference "
                    f"servers alive?); last error: {self._last_error!r}"
                ) from self._last_error
            remaining = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if remaining <= 0:
                raise TimeoutError(f"only {len(self._ready)}/{count} rollouts ready after {timeout} s")
            try:
                traj = self._output.get(timeout=remaining)
            except queue.Empty:
                continue
            generated = traj["versions"][traj["versions"] >= 0]
            min_version = int(generated.min()) if generated.numel() else -1
            if self.staleness.is_fresh(min_version, self._version):
                self._ready.append(traj)
            else:
                logger.warning(
                    "dropping a stale trajectory: oldest token version %d < %d - η(%d)",
                    min_version, self._version, self.staleness.eta,
                )
                self.staleness.on_drop_stale()
        return concat_padded([self._ready.popleft() for _ in range(count)])

    def rollout_batch(self, data: list[dict[str, Any]], workflow: "RolloutWorkflow") -> dict[str, torch.Tensor]:
        """Synchronous mode: run one episode per row of ``data`` and wait for all of them."""
        for row in data:
            self.submit(row, workflow)
        return self.wait(len(data))

    def prepare_batch(self, dataloader: Iterable, workflow: "RolloutWorkflow") -> dict[str, torch.Tensor]:
        """Asynchronous mode: keep the executor fed from ``dataloader`` (cycling over epochs) and
        return the next ``consumer_batch_size / world_size`` episodes of this rank.

        Episodes keep running after this returns, up to the staleness bound, so generation
        for the next steps overlaps training of this one.
        """
        batch = self.staleness.batch_size
        while True:
            self._feed(dataloader, workflow)
            try:
                result = self.wait(batch, timeout=0.5)
            except TimeoutError:
                continue
            self._feed(dataloader, workflow)  # so generation continues while the caller trains
            return result

    def _feed(self, dataloader: Iterable, workflow: "RolloutWorkflow") -> None:
        """Keep ``(η + 1) · B`` episodes waiting in the input queue (what admission can use)."""
        target = (self.staleness.eta + 1) * self.staleness.batch_size
        while self._input.qsize() < target:
            fresh_epoch = self._data_iter is None
            if fresh_epoch:
                sampler = getattr(dataloader, "sampler", None)
                if hasattr(sampler, "set_epoch"):  # a new shuffle order every epoch
                    sampler.set_epoch(self._epoch)
                self._epoch += 1
                self._data_iter = iter(dataloader)
            try:
                rows = next(self._data_iter)
            except StopIteration:  # new epoch
                self._data_iter = None
                if fresh_epoch:
                    raise ValueError("prepare_batch: the dataloader yields no batches (empty dataset?)")
                continue
            for row in rows:
                self.submit(row, workflow)
