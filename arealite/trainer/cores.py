"""Core sharing on one machine: the trainer takes the cores the generation servers leave idle.

With a static split (:func:`arealite.launcher.local.trainer_threads`) a CPU run gives each local
server ``rollout.server_threads`` cores and the trainer ranks the rest. In asynchronous RL the
servers idle most of a training step: with η = 1 the next batch is generated in the first part of
the step, then the staleness gate closes until the new weights arrive (the timeline of a default
run: the server busy ≈ 13 s of a 58 s step). :class:`CoreSharing` lets each trainer rank run
``base + extra`` intra-op threads while its rollout client has no request in flight, and ``base``
threads while one is.

Why switch threads and not run ``base + extra`` threads with generation at a higher OS
priority: torch's OpenMP kernels split every op into equal chunks and wait for the slowest, so a
trainer thread preempted by the server stalls the whole op (measured here: 2 trainer threads
beside a busy 1-thread server were 4.4× slower than 1 thread).

The thread count is re-checked before the forward of every transformer block and before the
backward of every block (a gradient hook on the block's output), always on the training thread
(OpenMP's thread count is per calling thread). Going down takes effect at once; going up waits
until the client has been idle for ``idle_s`` seconds, so a multi-turn episode's short pause
between two requests does not make the trainer grab the core back and forth. A request that
starts while the trainer runs ``base + extra`` threads shares the core with it until the next
block boundary (milliseconds to a second, by block size).

The other direction: while the trainer blocks on generation (the first batches, a synchronous
run's every step, the held-out evaluations before and after training) its own cores would sit
idle. :meth:`CoreSharing.waiting` wraps such a wait; once it has lasted ``idle_s`` the servers run
with the trainer's threads as well (our server's ``POST /set_num_threads``, applied between two
scheduler iterations), and they get their own count back before the trainer computes again.
Only our server (``rollout.backend=local``) has that control; SGLang and vLLM keep theirs.

Only for servers this process launched on this machine (not ``rollout.addresses``) and a CPU
trainer: GPU runs and remote servers keep the static split. ``rollout.share_idle_cores=false``
turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from arealite.inference.remote import RemoteInferenceEngine

logger = logging.getLogger("arealite.cores")


class CoreSharing:
    """Switch this process's torch intra-op threads between ``base`` and ``base + extra``.

    Args:
        base: threads while generation runs (the static split; ≥ 1).
        extra: cores the servers leave when idle (≥ 0; 0 disables switching).
        busy: returns True while a generation request of this rank is in flight (e.g.
            :meth:`arealite.inference.remote.RemoteInferenceEngine.requests_in_flight` > 0); called
            from the training thread, so it must be cheap and thread-safe to read.
        idle_s: seconds ``busy`` must stay False before the extra threads are taken, and
            seconds a :meth:`waiting` block lasts before the trainer's threads are lent [s].
        clock: monotonic clock (tests pass a fake one).
        lend: ``lend(True)`` gives the servers the trainer's cores, ``lend(False)`` takes them
            back (both return once the servers applied it); None: :meth:`waiting` lends nothing.

    Attributes:
        shared_s: seconds spent with ``base + extra`` threads so far (``cpu/shared_cores_s``
            per step).
        lent_s: seconds the servers held the trainer's cores so far (``cpu/lent_cores_s``).
        switches: number of thread-count changes.

    Raises:
        ValueError: ``base < 1``, ``extra < 0`` or ``idle_s < 0``.
    """

    def __init__(self, base: int, extra: int, busy: Callable[[], bool], idle_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic, lend: Callable[[bool], object] | None = None):
        if base < 1 or extra < 0 or idle_s < 0:
            raise ValueError(f"CoreSharing: base={base} must be >= 1, extra={extra} >= 0, idle_s={idle_s} >= 0")
        self.base, self.extra, self.busy, self.idle_s, self.clock = base, extra, busy, idle_s, clock
        self.lend = lend
        self.threads = base
        self.shared_s = 0.0
        self.lent_s = 0.0
        self._lent_since: float | None = None
        self.switches = 0
        self._idle_since: float | None = None
        self._shared_since: float | None = None
        self._handles: list = []
        torch.set_num_threads(base)

    def adjust(self) -> int:
        """Re-check ``busy`` and set the thread count; returns the count now in use."""
        now = self.clock()
        if self.busy():
            self._idle_since = None
            want = self.base
        else:
            if self._idle_since is None:
                self._idle_since = now
            want = self.base + self.extra if now - self._idle_since >= self.idle_s else self.threads
        if want != self.threads:
            if want > self.base:
                self._shared_since = now
            elif self._shared_since is not None:
                self.shared_s += now - self._shared_since
                self._shared_since = None
            torch.set_num_threads(want)
            self.threads = want
            self.switches += 1
        return self.threads

    def release(self) -> None:
        """Back to ``base`` threads (e.g. before generation is resumed after a weight update)."""
        if self.threads != self.base:
            if self._shared_since is not None:
                self.shared_s += self.clock() - self._shared_since
                self._shared_since = None
            torch.set_num_threads(self.base)
            self.threads = self.base
            self.switches += 1
        self._idle_since = None

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Wrap a block in which this thread only waits for generation (the next batch, a
        held-out evaluation). The trainer drops to ``base`` threads at once; if the block lasts
        ``idle_s`` seconds, ``lend(True)`` gives the servers the trainer's cores (from a timer
        thread), and on leaving ``lend(False)`` takes them back before the caller computes again.
        A wait shorter than ``idle_s`` sends nothing. A failing ``lend`` is logged, never raised."""
        self.release()
        if self.lend is None:
            yield
            return
        timer = threading.Timer(self.idle_s, self._lend_now)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            timer.join()
            if self._lent_since is not None:
                self._call_lend(False)
                self.lent_s += self.clock() - self._lent_since
                self._lent_since = None

    def _lend_now(self) -> None:
        self._lent_since = self.clock()
        self._call_lend(True)

    def _call_lend(self, on: bool) -> None:
        try:
            self.lend(on)
        except Exception:  # noqa: BLE001 - a thread count is an optimisation, never a failure
            logger.exception("core sharing: lend(%s) failed", on)

    def install(self, model: torch.nn.Module) -> int:
        """Hook the forward and backward of every transformer block of ``model`` (the children of
        each ``nn.ModuleList``, e.g. ``model.model.layers``) and the model itself. Returns the
        number of hooked modules. The backward check is a gradient hook on the block's first
        output tensor (no module backward hook, which would wrap the outputs)."""
        blocks = [model] + [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]

        def pre(_module, _args):
            self.adjust()

        def post(_module, _args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._grad_hook)

        for b in blocks:
            self._handles.append(b.register_forward_pre_hook(pre))
            self._handles.append(b.register_forward_hook(post))
        return len(blocks)

    def _grad_hook(self, grad: torch.Tensor) -> None:
        self.adjust()

    def remove(self) -> None:
        """Remove the hooks and go back to ``base`` threads."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.release()


def core_sharing_for(rollout_config, num_threads: int, engine, world_size: int, device: torch.device,
                     cpu_count: int | None = None) -> CoreSharing | None:
    """The :class:`CoreSharing` of a trainer rank, or None where the static split stays.

    Sharing applies when ``rollout.share_idle_cores`` is on, the servers were launched here
    (``rollout.addresses`` empty) for a CPU trainer (``device`` is CPU), ``actor.num_threads`` is 0
    (an explicit thread count is kept), there is one trainer rank (a rank sees only its own
    requests, so with several ranks one rank's idle client would not mean idle servers), and the
    engine is the servers' HTTP client (:class:`~arealite.inference.remote.RemoteInferenceEngine`, which
    reports ``requests_in_flight``). ``base`` is the static split
    (:func:`arealite.launcher.local.trainer_threads`), ``extra`` the servers' threads, capped at the
    cores of the machine. With our server (``rollout.backend=local``) ``lend`` gives each server
    ``server_threads + base // n_servers`` threads while the trainer waits (none when that adds 0).
    """
    from arealite.launcher.local import trainer_threads

    if (not rollout_config.share_idle_cores or rollout_config.addresses or num_threads or world_size != 1
            or device.type != "cpu" or not isinstance(engine, RemoteInferenceEngine)):
        return None
    base = trainer_threads(rollout_config, world_size)
    cores = cpu_count or os.cpu_count() or 1
    extra = min(rollout_config.n_servers * rollout_config.server_threads, cores - base)
    if extra <= 0:
        return None
    own, add = rollout_config.server_threads, base // rollout_config.n_servers

    def lend(on: bool) -> None:  # only our server changes its thread count on request
        engine.set_server_threads(own + add if on else own)

    return CoreSharing(base, extra, lambda: engine.requests_in_flight() > 0,
                       lend=lend if rollout_config.backend == "local" and add > 0 else None)
