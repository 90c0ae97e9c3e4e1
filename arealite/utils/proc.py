"""Process helpers shared by the processes arealite starts (servers, reward workers, launchers)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

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
    CPU or memory. Polls every ``poll_s`` seconds."""

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
