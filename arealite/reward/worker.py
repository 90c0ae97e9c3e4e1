"""Run reward functions in a separate process with a timeout.

A reward function that hangs (sympy blow-up), crashes the interpreter, leaks or
bombs memory, raises, or returns NaN must not kill or stall the RL loop.
:class:`RewardWorker` runs it in a ``ProcessPoolExecutor`` using the *spawn*
start method (the trainer has torch threads running, so fork is unsafe) and turns
every failure into a reward of 0.0, a warning on the ``"arealite.reward"`` logger
and a count in :attr:`RewardWorker.stats` (for the training loop's logs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import math
import multiprocessing
import os
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

logger = logging.getLogger("arealite.reward")


# Exit status of a worker whose resident memory went over ``max_memory_mb`` (its watchdog ends it).
MEMORY_EXIT_CODE = 87
# Counter names of :attr:`RewardWorker.stats`.
STAT_KEYS = ("calls", "ok", "timeout", "crash", "memory", "error", "bad_type", "non_finite")


def _rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _worker_init(parent_pid: int, max_rss_bytes: int | None, memory_killed: Any = None,
                 poll_s: float = 0.02) -> None:
    """Worker start-up: exit when the trainer dies, and, with ``max_rss_bytes``, a watchdog
    thread that ends the worker with :data:`MEMORY_EXIT_CODE` as soon as its resident memory
    exceeds that many bytes (polled every ``poll_s`` s; a leak across calls or a bomb inside
    one call). RSS, not RLIMIT_AS: a worker that imported torch maps gigabytes it never uses.
    Before it ends the worker, the watchdog sets ``memory_killed.value = 1`` (a shared-memory
    int of the pool, :class:`_WatchedPool`)."""
    from arealite.utils.proc import exit_when_parent_dies

    exit_when_parent_dies(parent_pid)
    if not max_rss_bytes:
        return

    def watch() -> None:
        while True:
            if _rss_bytes() > max_rss_bytes:
                if memory_killed is not None:
                    memory_killed.value = 1
                os._exit(MEMORY_EXIT_CODE)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="reward-memory-watch", daemon=True).start()


class _WatchedPool(concurrent.futures.ProcessPoolExecutor):
    """A process pool whose workers run :func:`_worker_init`. ``memory_killed`` (a shared-memory
    int, 0 or 1) is set by a worker's memory watchdog before it ends that worker, so a broken pool
    is classified from it, not from exit statuses: the pool's manager thread may reap a dead
    worker first, and ``Process.exitcode`` then reads None in every other thread (seen as a
    memory kill logged as a crash, about 1 run in 6)."""

    def __init__(self, max_workers: int, mp_context: Any, max_rss_bytes: int | None):
        self.memory_killed = mp_context.RawValue("i", 0)
        super().__init__(max_workers=max_workers, mp_context=mp_context, initializer=_worker_init,
                         initargs=(os.getpid(), max_rss_bytes, self.memory_killed))


def _short(args: tuple, limit: int = 300) -> str:
    text = ", ".join(repr(a) for a in args)
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2:]


def _import_module(name: str) -> bool:
    """Worker-side warm-up: import the module that defines the reward function."""
    if name and name != "__main__":
        importlib.import_module(name)
    return True


def _fn_name(fn: Any) -> str:
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if qual is None:
        return repr(fn)
    return f"{mod}.{qual}" if mod else qual


class RewardWorker:
    """Computes rewards in worker processes with a per-call timeout.

    Failure handling (every failure returns 0.0, logs a WARNING on the
    ``"arealite.reward"`` logger naming the function and the (shortened) arguments,
    and counts one in :attr:`stats`):

    * **timeout** (``fn`` runs longer than ``timeout`` seconds): the pool's worker
      processes are killed and a fresh pool is created, so a hung worker cannot
      block later calls.
    * **worker crash** (``BrokenProcessPool``, e.g. ``fn`` calls ``os._exit(1)``
      or segfaults): a fresh pool is created.
    * **memory** (a worker's resident memory exceeds ``max_memory_mb``: a leak that
      grows across calls or a bomb inside one): its watchdog ends it (exit status
      :data:`MEMORY_EXIT_CODE`) and a fresh pool is created — the leaked memory is
      returned to the system.
    * **exception raised by fn** (``error``), a result that is not convertible to
      float (``bad_type``), or a NaN/±inf result (``non_finite``): the pool is kept.
      A non-finite reward never reaches the batch (group normalisation would turn
      the whole step into NaN).

    :attr:`stats` counts, since construction, ``calls`` (every acompute), ``ok``
    (a finite float came back) and one counter per failure kind above
    (``timeout``, ``crash``, ``memory``, ``error``, ``bad_type``, ``non_finite``);
    ``ok`` + the failures == ``calls`` once every call returned.

    The timeout clock starts when the call is submitted to a free worker slot:
    calls beyond ``max_workers`` wait (per event loop) for a slot without the
    clock running, and the first call of a function on a fresh pool first imports
    the function's module in a worker (bounded by ``startup_timeout``), so
    process start-up and import time are not charged to the reward call.

    When a pool is killed or breaks, other calls that were running on that same
    pool (only possible with ``max_workers > 1``) are retried once on the new
    pool if the breakage was a timeout-kill by another call, within what is left
    of their own ``timeout`` (total time across both attempts never exceeds
    ``timeout``); if the pool broke for another reason they also return 0.0.

    ``acompute`` may be called concurrently from one asyncio event loop, which may
    run in a background thread; pool replacement is guarded by a lock so that
    simultaneous failures create exactly one new pool.

    Args:
        timeout: per-call limit in seconds (wall clock) for ``fn(*args)``.
        max_workers: number of worker processes.
        startup_timeout: limit in seconds for spawning a worker and importing the
            reward function's module on a fresh pool.
        max_memory_mb: resident-memory limit of each worker process [MiB]; None: no limit.

    Raises:
        ValueError: a non-positive ``timeout``/``startup_timeout``/``max_memory_mb`` or
            ``max_workers < 1`` (named).
    """

    def __init__(
        self, timeout: float = 10.0, max_workers: int = 1, startup_timeout: float = 120.0,
        max_memory_mb: float | None = 4096,
    ):
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"reward timeout must be > 0 seconds, got {timeout!r}")
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"reward max_workers must be an int >= 1, got {max_workers!r}")
        if not (isinstance(startup_timeout, (int, float)) and startup_timeout > 0):
            raise ValueError(f"reward startup_timeout must be > 0 seconds, got {startup_timeout!r}")
        if max_memory_mb is not None and not (isinstance(max_memory_mb, (int, float)) and max_memory_mb > 0):
            raise ValueError(f"reward max_memory_mb must be > 0 MiB or None (no limit), got {max_memory_mb!r}")
        self.max_memory_mb = max_memory_mb
        self.stats: dict[str, int] = {k: 0 for k in STAT_KEYS}
        self.timeout = float(timeout)
        self.max_workers = int(max_workers)
        self.startup_timeout = float(startup_timeout)
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._closed = False
        self._generation = 0
        self._killed_generations: set[int] = set()
        self._warm_modules: set[str] = set()
        self._warming: dict[str, concurrent.futures.Future] = {}  # imports in flight (this pool)
        self._pool = self._new_pool()
        # one slot semaphore per event loop (asyncio primitives are loop-bound)
        self._sems: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ pool
    def _new_pool(self) -> _WatchedPool:
        # Workers exit by themselves if this process is SIGKILLed (no orphans).
        limit = None if self.max_memory_mb is None else int(self.max_memory_mb * (1 << 20))
        return _WatchedPool(self.max_workers, self._ctx, limit)

    def _current(self) -> tuple[_WatchedPool, int]:
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardWorker is closed")
            return self._pool, self._generation

    @staticmethod
    def _kill_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        for p in procs:
            try:
                if p.is_alive():
                    p.kill()
            except Exception:  # already gone
                pass
        try:
            pool.shutdown(wait=False, cancel_futures=True)
        except Exception:
            pass
        for p in procs:
            try:
                p.join(timeout=1.0)
            except Exception:
                pass

    def _replace_pool(self, generation: int, kill: bool) -> None:
        """Replace the pool of ``generation`` (no-op if already replaced)."""
        with self._lock:
            if self._closed or generation != self._generation:
                return
            old = self._pool
            if kill:
                self._killed_generations.add(generation)
            self._pool = self._new_pool()
            self._generation += 1
            self._warm_modules = set()
            self._warming = {}
        self._kill_pool(old)

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self._lock:
            sem = self._sems.get(loop)
            if sem is None:
                sem = asyncio.Semaphore(self.max_workers)
                self._sems[loop] = sem
            return sem

    def _start_warm(self, module: str) -> concurrent.futures.Future | None:
        """The import of ``module`` in the current pool's worker (submitted once per pool, so a
        :meth:`prewarm` and the first calls share it); None once it has succeeded."""
        pool, gen = self._current()
        with self._lock:
            if module in self._warm_modules:
                return None
            fut = self._warming.get(module)
            if fut is not None:
                return fut
            fut = self._warming[module] = pool.submit(_import_module, module)

        def done(f: concurrent.futures.Future) -> None:
            with self._lock:
                if gen != self._generation:
                    return
                self._warming.pop(module, None)  # a failed import is tried again by the next call
                if not f.cancelled() and f.exception() is None:
                    self._warm_modules.add(module)

        fut.add_done_callback(done)
        return fut

    async def _warm(self, module: str) -> None:
        """Wait (up to ``startup_timeout``, not charged to the call's timeout) until a worker has
        imported ``module``. A failure is not raised here: it surfaces in the real call."""
        try:  # shield: a caller's timeout must not cancel the import other callers share
            fut = self._start_warm(module)
            if fut is not None:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.startup_timeout)
        except RuntimeError:
            if self._closed:
                raise
        except Exception:  # noqa: BLE001 - e.g. a broken pool: the real call handles it
            return

    # ------------------------------------------------------------------ API
    def prewarm(self, fn: Callable[..., Any]) -> None:
        """Spawn a worker and import ``fn``'s module there now, without waiting, so that the
        first :meth:`acompute` does not pay the start-up (a spawned interpreter importing e.g.
        math-verify and sympy: about 5 s on the 2-core development machine, measured as the
        first batch's wait in the default run, 19.6 → 12.6 s). Call it early, e.g. while the
        trainer loads its model.
        Idempotent; an import failure surfaces (with a warning) in the first real call.

        Raises:
            RuntimeError: if the worker has been closed.
        """
        self._start_warm(getattr(fn, "__module__", "") or "")

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def stats_snapshot(self, prefix: str = "reward/") -> dict[str, int]:
        """A copy of :attr:`stats` with ``prefix`` on each name (``reward/timeout``, ...)."""
        with self._lock:
            return {prefix + k: v for k, v in self.stats.items()}

    async def acompute(self, fn: Callable[..., Any], *args: Any) -> float:
        """Run picklable ``fn(*args)`` in a worker process and return ``float(result)``.

        Args:
            fn: a module-level (picklable by reference) function.
            *args: picklable arguments.

        Returns:
            ``float(fn(*args))`` when finite, or 0.0 (with a logged warning naming ``fn``
            and its arguments, and a count in :attr:`stats`) if ``fn`` times out after
            ``self.timeout`` seconds, crashes its worker process, exceeds
            ``max_memory_mb``, raises, or returns something not convertible to float
            or NaN/±inf.

        Raises:
            RuntimeError: if the worker has been closed.
        """
        self._count("calls")
        value, kind = await self._acompute(fn, args)
        self._count(kind)
        if kind == "ok" and not math.isfinite(value):
            with self._lock:
                self.stats["ok"] -= 1
                self.stats["non_finite"] += 1
            logger.warning("reward fn %s returned %r (not finite) for args (%s); reward=0.0",
                           _fn_name(fn), value, _short(args))
            return 0.0
        if kind != "ok":
            logger.warning("reward failure (%s) of %s for args (%s)", kind, _fn_name(fn), _short(args))
        return value

    async def _acompute(self, fn: Callable[..., Any], args: tuple) -> tuple[float, str]:
        """(reward, kind): kind "ok" or the :attr:`stats` failure name (reward 0.0). At most two
        attempts within one ``timeout``: the second only when the pool broke under the first
        without ``fn`` being at fault (see :meth:`_attempt`)."""
        name = _fn_name(fn)
        async with self._semaphore():
            await self._warm(getattr(fn, "__module__", "") or "")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout
            for attempt in range(2):
                remaining = deadline - loop.time()
                if remaining <= 0:  # retry budget used up by the killed attempt
                    logger.warning("reward fn %s timed out after %.1f s (its pool was killed by another call's "
                                   "timeout); reward=0.0", name, self.timeout)
                    return 0.0, "timeout"
                outcome = await self._attempt(fn, args, name, remaining, retry=attempt == 0)
                if outcome is not None:
                    return outcome
            return 0.0, "error"

    async def _attempt(self, fn: Callable[..., Any], args: tuple, name: str, remaining: float,
                       retry: bool) -> tuple[float, str] | None:
        """Run ``fn(*args)`` once in the current pool, waiting at most ``remaining`` s.

        Returns: (reward, kind) as :meth:`_acompute`, or None (only when ``retry``) after
        replacing a pool that was already broken at submission or that another call's timeout
        killed: the caller tries again.

        Raises:
            RuntimeError: the worker is closed.
            asyncio.CancelledError: the caller was cancelled (the call is cancelled too).
        """
        pool, gen = self._current()
        try:
            cfut = pool.submit(fn, *args)
        except (BrokenProcessPool, RuntimeError) as e:
            # pool broke/shut down between _current() and submit
            if retry:
                self._replace_pool(gen, kill=False)
                return None
            logger.warning("reward fn %s could not be submitted (%r); reward=0.0", name, e)
            return 0.0, "error"
        except Exception as e:  # e.g. unpicklable arguments
            logger.warning("reward fn %s could not be submitted (%r); reward=0.0", name, e)
            return 0.0, "error"
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(cfut), remaining)
        except asyncio.TimeoutError:
            logger.warning("reward fn %s timed out after %.1f s; killing reward worker processes and starting "
                           "a fresh pool; reward=0.0", name, self.timeout)
            self._replace_pool(gen, kill=True)
            return 0.0, "timeout"
        except BrokenProcessPool as e:
            return self._broken_pool(gen, pool, name, e, retry)
        except asyncio.CancelledError:
            cfut.cancel()
            raise
        except Exception as e:
            logger.warning("reward fn %s raised %r; reward=0.0", name, e)
            return 0.0, "error"
        try:
            return float(result), "ok"
        except Exception as e:
            logger.warning("reward fn %s returned %r, not convertible to float (%r); reward=0.0", name, result, e)
            return 0.0, "bad_type"

    def _broken_pool(self, gen: int, pool: _WatchedPool, name: str, e: BaseException,
                     retry: bool) -> tuple[float, str] | None:
        """``pool`` (generation ``gen``) broke while running ``name``: replace it. Returns None
        (retry) when another call's timeout killed it and ``retry``, else (0.0, "memory") when a
        worker's memory watchdog ended it, else (0.0, "crash")."""
        with self._lock:
            killed_by_other = gen in self._killed_generations
        if killed_by_other and retry:
            self._replace_pool(gen, kill=False)
            return None
        # Set by the worker before it exited, and the pool breaks only after the exit is seen.
        if pool.memory_killed.value:
            logger.warning("reward worker exceeded max_memory_mb=%s MiB while running %s; starting a fresh pool; "
                           "reward=0.0", self.max_memory_mb, name)
            self._replace_pool(gen, kill=False)
            return 0.0, "memory"
        logger.warning("reward worker process crashed while running %s (%r); starting a fresh pool; reward=0.0",
                       name, e)
        self._replace_pool(gen, kill=False)
        return 0.0, "crash"

    def compute(self, fn: Callable[..., Any], *args: Any) -> float:
        """Synchronous :meth:`acompute` for evaluation scripts.

        Runs its own event loop (in a helper thread if the calling thread already
        runs one).  Same return value and failure handling as :meth:`acompute`.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.acompute(fn, *args))
        out: list[float] = []
        err: list[BaseException] = []

        def _run() -> None:
            try:
                out.append(asyncio.run(self.acompute(fn, *args)))
            except BaseException as e:  # pragma: no cover - re-raised below
                err.append(e)

        t = threading.Thread(target=_run, name="RewardWorker.compute")
        t.start()
        t.join()
        if err:
            raise err[0]
        return out[0]

    def close(self) -> None:
        """Kill the worker processes and release the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool = self._pool
        self._kill_pool(pool)

    def __enter__(self) -> "RewardWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
