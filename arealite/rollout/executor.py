"""The asynchronous rollout executor: an asyncio loop in a background thread.

The trainer thread calls :meth:`WorkflowExecutor.submit` / :meth:`~WorkflowExecutor.wait`
or :meth:`~WorkflowExecutor.prepare_batch` (synchronous RL is ``max_head_offpolicyness = 0``:
no episode of the next batch starts before the trainer's version moves on); the loop thread starts episodes
(``RolloutWorkflow.arun_episode``) whenever the staleness rule of
:mod:`arealite.rollout.staleness` admits them, runs them concurrently, and queues their
trajectories. Generation therefore keeps going while the trainer trains: with
``max_head_offpolicyness = η`` it runs at most η batches ahead.

Failure policy: an exception inside one episode is logged with its traceback and counted
(``stat.failed``); the loop goes on. If every episode keeps failing (``max_consecutive_failures``
in a row, e.g. the servers died) or the loop thread itself dies, the next ``wait`` raises
instead of waiting forever.

The executor takes any :class:`~arealite.api.engine.InferenceEngine` (it only calls
``agenerate`` through the workflows, ``get_version`` for the staleness rule and ``aclose`` when
its loop ends); it knows nothing of HTTP.

Resume (:meth:`WorkflowExecutor.state_dict` / :meth:`~WorkflowExecutor.load_state_dict`): the
executor remembers every data row it was given until the trainer receives its trajectory
(or the episode is rejected, fails or is dropped as stale). A recover checkpoint stores those
*pending* rows (queued, generating, or finished but not yet trained on) in submission order
and the staleness counters; the data position itself is the
:class:`~arealite.dataset.loader.EpochLoader`'s, saved beside it. After a resume the pending
rows are submitted first, then the loader continues where it stood: the sequence of prompts entering the pipeline is the one of an uninterrupted
run, minus the prompts already trained on, so no prompt is skipped or trained twice. Not
reproduced: the samples themselves (generation is asynchronous and sampled; an episode that
was half-generated restarts from scratch under the resumed weights) and the order in which
episodes finish.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from arealite.api.cli import check_divisible
from arealite.api.config import InferenceEngineConfig
from arealite.api.io_struct import RolloutStat
from arealite.rollout.staleness import StalenessManager
from arealite.utils.data import concat_padded
from arealite.dataset.loader import EpochLoader

if TYPE_CHECKING:
    from arealite.api.engine import InferenceEngine
    from arealite.api.workflow import RolloutWorkflow

logger = logging.getLogger("arealite.rollout")


class WorkflowExecutor:
    """Runs rollout episodes for one trainer rank.

    Args:
        config: the ``rollout`` config; batch sizes there are over all ranks and are divided
            by ``world_size`` here (per-rank rule, as in AReaL).
        engine: passed to every ``arun_episode`` (it generates); its ``get_version()`` is the
            trainer version v of the staleness rule.
        world_size: number of data-parallel trainer ranks.
        group_size: rows of one group of the algorithm (GRPO's ``gconfig.n_samples``; 1 = no
            groups). Every episode must return a whole number of groups: the group baselines
            normalise over consecutive rows, so an episode of 3 rows in groups of 4 would mix
            two prompts in one group. The RL loop sets it from ``algorithm.group_size``.
    """

    group_size: int = 1

    def __init__(self, config: InferenceEngineConfig, engine: "InferenceEngine", world_size: int = 1):
        check_divisible("rollout.consumer_batch_size", config.consumer_batch_size, world_size)  # as validate_config
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
        # Resume bookkeeping: rows given to submit() and not yet trained on / discarded, by a
        # submission counter (their order); trajectories handed to the trainer so far.
        self._rows_lock = threading.Lock()
        self._pending: dict[int, dict[str, Any]] = {}
        self._next_seq = 0
        self._returned = 0
        self._wrapped: tuple[Any, EpochLoader] | None = None  # a plain dataloader given to prepare_batch
        self._resubmit: list[dict[str, Any]] = []  # restored pending rows, submitted first
        # Every episode failing (e.g. the servers are gone) must end in an error, not a hang.
        self.max_consecutive_failures = max(8, 4 * batch)
        self._consecutive_failures = 0
        self._last_error: BaseException | None = None

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
        workflows: dict[int, "RolloutWorkflow"] = {}  # run on this loop: closed with it
        try:
            while not self._exiting.is_set():
                while (
                    not self._paused.is_set()
                    and not self._input.empty()
                    and self.staleness.capacity(self.engine.get_version()) > 0
                ):
                    seq, data, workflow = self._input.get_nowait()
                    workflows[id(workflow)] = workflow
                    self.staleness.on_start()
                    task = asyncio.create_task(self._run_episode(seq, data, workflow))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(0.005)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for workflow in workflows.values():  # e.g. a reward source's HTTP sessions
                close = getattr(workflow, "aclose", None)  # a duck-typed workflow may have none
                try:
                    if close is not None:
                        await close()
                except Exception:  # noqa: BLE001 - closing must not hide the loop's own outcome
                    logger.exception("closing a workflow's event-loop resources failed")
            aclose = getattr(self.engine, "aclose", None)  # e.g. HTTP sessions bound to this loop
            if aclose is not None:
                await aclose()

    async def _run_episode(self, seq: int, data: dict[str, Any], workflow: "RolloutWorkflow") -> None:
        start = time.time()
        try:
            traj = await workflow.arun_episode(self.engine, data)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("rollout episode failed (counted in rollout/failed; the loop goes on)")
            self.staleness.on_finish(accepted=False, failed=True)
            self._discard(seq)
            self._consecutive_failures += 1
            self._last_error = e
            return
        self._consecutive_failures = 0
        if traj is None:
            self.staleness.on_finish(accepted=False)
            self._discard(seq)
            return
        n = traj["input_ids"].shape[0]
        traj["rollout_start_time"] = torch.full((n,), start, dtype=torch.float64)
        traj["rollout_end_time"] = torch.full((n,), time.time(), dtype=torch.float64)
        self.staleness.on_finish(accepted=True)
        self._output.put((seq, traj))

    def _discard(self, seq: int) -> None:
        """The row of episode ``seq`` is done with (trained on, rejected, failed or stale)."""
        with self._rows_lock:
            self._pending.pop(seq, None)

    # -- pausing ---------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop starting new episodes (and resubmitting interrupted generations)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    # -- producer / consumer API -----------------------------------------------------------------
    def submit(self, data: dict[str, Any], workflow: "RolloutWorkflow") -> None:
        """Queue one episode. Raises ``RuntimeError`` if the input queue is full."""
        with self._rows_lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self._pending[seq] = data
        try:
            self._input.put_nowait((seq, data, workflow))
        except queue.Full:
            self._discard(seq)
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
        version = self.engine.get_version()
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
                seq, traj = self._output.get(timeout=remaining)
            except queue.Empty:
                continue
            rows = traj["versions"].shape[0]
            if rows % max(1, self.group_size):
                raise ValueError(
                    f"a rollout episode returned {rows} rows, not a whole number of groups of {self.group_size} "
                    "(gconfig.n_samples): the algorithm normalises rewards over consecutive groups, so this would "
                    "mix prompts; make RolloutWorkflow.arun_episode return gconfig.n_samples rows per prompt "
                    "(or None to drop the episode)")
            generated = traj["versions"][traj["versions"] >= 0]
            min_version = int(generated.min()) if generated.numel() else -1
            if self.staleness.is_fresh(min_version, version):
                self._ready.append((seq, traj))
            else:
                self._discard(seq)
                logger.warning(
                    "dropping a stale trajectory: oldest token version %d < %d - η(%d)",
                    min_version, version, self.staleness.eta,
                )
                self.staleness.on_drop_stale()
        taken = [self._ready.popleft() for _ in range(count)]
        for seq, _ in taken:
            self._discard(seq)
        self._returned += count
        return concat_padded([traj for _, traj in taken])

    def prepare_batch(self, loader: "EpochLoader | Iterable", workflow: "RolloutWorkflow") -> dict[str, torch.Tensor]:
        """Asynchronous mode: keep the executor fed from ``loader`` (an :class:`EpochLoader`, which
        owns the data position; a plain dataloader is wrapped in one, cycling over epochs) and
        return the next ``consumer_batch_size / world_size`` episodes of this rank.

        Episodes keep running after this returns, up to the staleness bound, so generation
        for the next steps overlaps training of this one.
        """
        batch = self.staleness.batch_size
        while True:
            self._feed(loader, workflow)
            try:
                result = self.wait(batch, timeout=0.5)
            except TimeoutError:
                continue
            self._feed(loader, workflow)  # so generation continues while the caller trains
            return result

    def _feed(self, loader: "EpochLoader | Iterable", workflow: "RolloutWorkflow") -> None:
        """Keep ``(η + 1) · B`` episodes waiting in the input queue (what admission can use):
        rows restored from a checkpoint first, then the loader (cycling over epochs, a new
        shuffle order each via ``sampler.set_epoch``)."""
        if not isinstance(loader, EpochLoader):
            if self._wrapped is None or self._wrapped[0] is not loader:
                self._wrapped = (loader, EpochLoader(loader))
            loader = self._wrapped[1]
        target = (self.staleness.eta + 1) * self.staleness.batch_size
        while self._input.qsize() < target:
            if self._resubmit:
                self.submit(self._resubmit.pop(0), workflow)
                continue
            try:
                rows = loader.next()
            except ValueError as e:
                raise ValueError(f"prepare_batch: {e}") from None
            for row in rows:
                self.submit(row, workflow)

    # -- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a recover checkpoint needs to continue this rank's data stream exactly (see the
        module docstring): ``pending_rows`` (submission order), ``stat`` (the ``RolloutStat``
        counters) and ``returned`` (trajectories handed to the trainer). The data position is the
        loader's own ``state_dict()``. Call it from the trainer thread between steps."""
        with self._rows_lock:
            pending = [self._pending[s] for s in sorted(self._pending)] + list(self._resubmit)
        return {"pending_rows": pending, "stat": dataclasses.asdict(self.staleness.stat),
                "returned": self._returned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a fresh executor (nothing submitted yet). The pending
        rows are resubmitted before anything new is read by :meth:`prepare_batch`; the counters
        are restored by :meth:`StalenessManager.on_resume`."""
        with self._rows_lock:
            if self._pending or self._next_seq:
                raise RuntimeError("WorkflowExecutor.load_state_dict: call it before submitting anything")
        self._resubmit = list(state["pending_rows"])
        self._returned = int(state["returned"])
        self.staleness.on_resume(RolloutStat(**state["stat"]), trained=self._returned)
