"""Process helpers shared by the processes arealite starts (servers, reward workers)."""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger("arealite.proc")


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
