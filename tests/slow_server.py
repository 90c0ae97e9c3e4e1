"""Our generation server with a sleep after every decode step, for the tests that need a
generation to last long enough to pause it, update weights under it or kill a server under it
(the tiny test model decodes a token in about a millisecond).

Run::

    python tests/slow_server.py DELAY_S <the arguments of python -m arealite.server>

It patches :meth:`arealite.server.scheduler.Scheduler._decode_step` in this process only and
then runs the server's own ``main``: the production server has no delay option.
"""

from __future__ import annotations

import os
import sys
import time

PATH = os.path.abspath(__file__)


def command(delay_s: float, *server_args: str) -> list[str]:
    """The argv that starts a slowed server: ``[python, this file, delay_s, *server_args]``."""
    return [sys.executable, PATH, str(delay_s), *server_args]


def slow_down(delay_s: float) -> None:
    """Make every decode step of every :class:`Scheduler` of this process sleep ``delay_s``
    seconds after it ran (requests keep joining, leaving and pausing between steps)."""
    from arealite.server.scheduler import Scheduler

    decode_step = Scheduler._decode_step

    def slowed(self, *args, **kwargs):
        out = decode_step(self, *args, **kwargs)
        time.sleep(delay_s)
        return out

    Scheduler._decode_step = slowed


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/slow_server.py DELAY_S <python -m arealite.server arguments>")
    slow_down(float(sys.argv[1]))
    from arealite.server.__main__ import main

    main(sys.argv[2:])
