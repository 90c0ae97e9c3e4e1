"""Process helpers shared by the processes arealite starts (servers, reward workers, launchers).

Children that die with their parent, so a SIGKILLed trainer or launcher (whose atexit hooks never
run) leaves no orphan holding CPU, memory or a GPU. Two tools, because the two cases differ:

* :func:`exit_when_parent_dies`, a polling thread inside the child, for arealite's own Python
  children: the local generation server (``python -m arealite.server --parent-pid``) and the
  reward workers. It works whichever thread of the parent started the child, which matters here:
  reward workers are spawned by ``ProcessPoolExecutor.submit`` from the short-lived
  ``RewardWorker.compute`` thread, and a crashed local server is restarted from the
  ``ServerWatcher`` thread. ``multiprocessing`` also offers no ``preexec_fn`` hook.
* :func:`die_with_parent`, a ``preexec_fn`` that sets Linux ``PR_SET_PDEATHSIG``, for commands
  arealite does not write (the recipe a Ray trainer actor runs, SGLang/vLLM servers): a thread
  cannot survive ``exec``, so the child cannot poll; the kernel signal is set between fork and
  exec instead. It fires when the parent *thread* that forked the child exits, not only when the
  parent process does, so it is used only from threads that live as long as their process (a Ray
  actor's task thread).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")
logger = logging.getLogger("arealite.proc")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it by binding port 0).

    A server that will listen on one address passes that address. A torch.distributed master
    (``MASTER_PORT`` of :func:`~arealite.train_engine.fsdp.init_distributed`, the weight-update
    group of :mod:`arealite.weights.sync`) passes the wildcard address ``""``: its TCPStore binds
    every interface, so the port must be free on all of them, not only on loopback.

    The port is released before returning, so another process may take it first (the usual race
    of this idiom; callers that bind it right away rarely lose it).

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_when_parent_dies(parent_pid: int, poll_s: float = 1.0) -> None:
    """Start a daemon thread that ends this process (``os._exit(0)``) once ``parent_pid`` is
    gone, e.g. when the trainer was SIGKILLed and its atexit hooks never ran, so no orphan keeps
    CPU or memory. Called by the child itself (see the module docstring for when to use
    :func:`die_with_parent` instead).

    Args:
        parent_pid: the process to outlive by at most ``poll_s`` seconds.
        poll_s: seconds between two checks (``os.kill(parent_pid, 0)``).
    """

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                logger.warning("parent process %d is gone; exiting", parent_pid)
                os._exit(0)
            except PermissionError:  # alive, owned by another user
                pass

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """``preexec_fn`` of ``subprocess.Popen``: the child gets SIGKILL when the thread that
    started it exits (Linux ``PR_SET_PDEATHSIG``; a thread of a long-lived process, see the
    module docstring), so a killed launcher actor or step leaves no orphan behind. A no-op where
    the C library has no ``prctl`` (not Linux); raises nothing (an exception in a
    ``preexec_fn`` would fail the ``Popen``)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def exit_without_teardown(code: int = 0) -> None:
    """End this process now with exit status ``code``: flush stdout/stderr, then ``os._exit``,
    skipping the interpreter's finalisation and C++ static destructors.

    For multi-rank ``torchrun`` scripts whose results are already written and whose process group
    is already destroyed: under load, a background C++ thread of torch.distributed (gloo) has
    aborted that finalisation ("terminate called without an active exception", SIGABRT) after
    everything was on disk — seen in CI in 2-rank FSDP test scripts, even after a barrier and
    ``destroy_process_group``; torchrun then reports the whole job failed. Never call it before the
    process's files are closed: buffered writes of open file objects are lost.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to keep
            pass
    os._exit(code)


def return_free_heap_to_os() -> bool:
    """Give the C heap's free pages back to the operating system (glibc ``malloc_trim(0)``: every
    arena, free pages in the middle included); returns False where the C library is not glibc.

    A long-running CPU torch process that allocates tensors of ever-changing sizes from several
    threads (the generation server: KV buffers sized to the running rows, activations of each
    batch) leaves freed memory in glibc's per-thread arenas, so its resident memory climbs for
    dozens of rounds before it levels off (measured with ``benchmarks/server_load.py`` rounds on
    the tiny test model: +420 MiB over 11 rounds, against +60 MiB when trimmed at each idle
    point). A trim costs about 1 ms after heavy churn and 15 µs when there is nothing to return;
    call it where the process has just freed a batch's memory and waits for work.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, looked up once; None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def run_in_short_lived_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` in a new thread that ends when it returns; its result, or its
    exception re-raised here.

    For torch CPU work done once before a long-lived compute thread takes over (a server's model
    load, weight packing and self-check before its scheduler thread decodes). libgomp, PyTorch's
    CPU thread pool on Linux, keeps a pool of worker threads for every thread that ran a parallel
    region, until that thread ends; once it manages more threads than there are CPUs, every pool
    stops spinning between parallel regions and sleeps instead (its "throttled" spin count), and
    each of the hundreds of short ops of a decode step then waits for its workers to wake up.
    Measured (SmolLM2-135M, bf16, 32 rows, 2 threads, 2 cores): a decode step in the scheduler
    thread took 78.5 ms when the main thread had built the model (both cores busy 74 % of the
    time) and 58.5 ms when a thread that then ended had (99 %). The thread's end frees its pool.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="build") as pool:
        return pool.submit(fn, *args, **kwargs).result()
