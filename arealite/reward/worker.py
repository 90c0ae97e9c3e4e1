"""Run reward functions in a separate process with a timeout.

A reward function that hangs (sympy blow-up), crashes the interpreter, or raises
must not kill or stall the RL loop.  :class:`RewardWorker` runs it in a
``ProcessPoolExecutor`` using the *spawn* start method (the trainer has torch
threads running, so fork is unsafe) and turns every failure into a reward of 0.0
plus a warning on the ``"arealite.reward"`` logger.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import multiprocessing
import os
import threading
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

logger = logging.getLogger("arealite.reward")


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

    Failure handling (every failure returns 0.0 and logs a WARNING on the
    ``"arealite.reward"`` logger naming the function):

    * **timeout** (``fn`` runs longer than ``timeout`` seconds): the pool's worker
      processes are killed and a fresh pool is created, so a hung worker cannot
      block later calls.
    * **worker crash** (``BrokenProcessPool``, e.g. ``fn`` calls ``os._exit(1)``
      or segfaults): a fresh pool is created.
    * **exception raised by fn**, or a result that is not convertible to float:
      the pool is kept.

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
    """

    def __init__(
        self, timeout: float = 10.0, max_workers: int = 1, startup_timeout: float = 120.0
    ):
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.timeout = float(timeout)
        self.max_workers = int(max_workers)
        self.startup_timeout = float(startup_timeout)
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._closed = False
        self._generation = 0
        self._killed_generations: set[int] = set()
        self._warm_modules: set[str] = set()
        self._pool = self._new_pool()
        # one slot semaphore per event loop (asyncio primitives are loop-bound)
        self._sems: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ pool
    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # Workers exit by themselves if this process is SIGKILLed (no orphans).
        from arealite.utils.proc import exit_when_parent_dies

        return concurrent.futures.ProcessPoolExecutor(
            max_workers=self.max_workers, mp_context=self._ctx,
            initializer=exit_when_parent_dies, initargs=(os.getpid(),),
        )

    def _current(self) -> tuple[concurrent.futures.ProcessPoolExecutor, int]:
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
        self._kill_pool(old)

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self._lock:
            sem = self._sems.get(loop)
            if sem is None:
                sem = asyncio.Semaphore(self.max_workers)
                self._sems[loop] = sem
            return sem

    async def _warm(self, module: str) -> None:
        """Spawn a worker and import ``module`` there (not charged to the timeout)."""
        pool, gen = self._current()
        with self._lock:
            if module in self._warm_modules:
                return
        try:
            fut = pool.submit(_import_module, module)
            await asyncio.wait_for(asyncio.wrap_future(fut), self.startup_timeout)
        except Exception:
            # Import failures etc. surface (with a warning) in the real call.
            return
        with self._lock:
            if gen == self._generation:
                self._warm_modules.add(module)

    # ------------------------------------------------------------------ API
    async def acompute(self, fn: Callable[..., Any], *args: Any) -> float:
        """Run picklable ``fn(*args)`` in a worker process and return ``float(result)``.

        Args:
            fn: a module-level (picklable by reference) function.
            *args: picklable arguments.

        Returns:
            ``float(fn(*args))``, or 0.0 (with a logged warning) if ``fn`` times
            out after ``self.timeout`` seconds, crashes its worker process, raises,
            or returns something not convertible to float.

        Raises:
            RuntimeError: if the worker has been closed.
        """
        name = _fn_name(fn)
        async with self._semaphore():
            await self._warm(getattr(fn, "__module__", "") or "")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout
            for attempt in range(2):
                remaining = deadline - loop.time()
                if remaining <= 0:  # retry budget used up by the killed attempt
                    logger.warning(
                        "reward fn %s timed out after %.1f s (its pool was killed by "
                        "another call's timeout); reward=0.0",
                        name,
                        self.timeout,
                    )
                    return 0.0
                pool, gen = self._current()
                try:
                    cfut = pool.submit(fn, *args)
                except (BrokenProcessPool, RuntimeError) as e:
                    # pool broke/shut down between _current() and submit
                    if attempt == 0:
                        self._replace_pool(gen, kill=False)
                        continue
                    logger.warning("reward fn %s could not be submitted (%r); reward=0.0", name, e)
                    return 0.0
                except Exception as e:  # e.g. unpicklable arguments
                    logger.warning("reward fn %s could not be submitted (%r); reward=0.0", name, e)
                    return 0.0
                try:
                    result = await asyncio.wait_for(asyncio.wrap_future(cfut), remaining)
                except asyncio.TimeoutError:
                    logger.warning(
                        "reward fn %s timed out after %.1f s; killing reward worker "
                        "processes and starting a fresh pool; reward=0.0",
                        name,
                        self.timeout,
                    )
                    self._replace_pool(gen, kill=True)
                    return 0.0
                except BrokenProcessPool as e:
                    with self._lock:
                        killed_by_other = gen in self._killed_generations
                    if killed_by_other and attempt == 0:
                        # another call's timeout killed our pool: retry once
                        self._replace_pool(gen, kill=False)
                        continue
                    logger.warning(
                        "reward worker process crashed while running %s (%r); "
                        "starting a fresh pool; reward=0.0",
                        name,
                        e,
                    )
                    self._replace_pool(gen, kill=False)
                    return 0.0
                except asyncio.CancelledError:
                    cfut.cancel()
                    raise
                except Exception as e:
                    logger.warning("reward fn %s raised %r; reward=0.0", name, e)
                    return 0.0
                try:
                    return float(result)
                except Exception as e:
                    logger.warning(
                        "reward fn %s returned %r, not convertible to float (%r); reward=0.0",
                        name,
                        result,
                        e,
                    )
                    return 0.0
            return 0.0

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
