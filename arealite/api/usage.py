"""A bad value on the command line: one line on stderr and exit status 2, not a traceback.

:func:`arealite.api.cli.load_config` (the command-line entry of every recipe) calls
:func:`install_exit_hook`. From then on an exception marked as a usage error — a
:class:`~arealite.api.cli.ConfigError` (``usage_error = True``), or a missing ``--config`` file —
that nobody catches ends the process the way argparse/tyro end it for an unknown flag::

    grpo_math.py: error: actor.optimizer.lr: must be > 0, got -1.0; e.g. 1e-5     (exit status 2)

Code that catches the error (tests, a launcher reading a recipe's config) still gets the
exception; every other exception keeps its traceback.

Under ``torchrun`` only rank 0 prints the line (every rank exits 2), and the message also goes
to the error file torchrun's elastic agent gives each worker (``$TORCHELASTIC_ERROR_FILE``), so
the failure report torchrun itself prints after a worker exits nonzero names the field as its
root cause (``traceback : actor.optimizer.lr: must be > 0 ...``) instead of pointing at the
PyTorch docs. That report (and torchrun's own exit status 1) cannot be suppressed from the
worker; ``python recipes/X.py`` prints the one line only.
"""

from __future__ import annotations

import json
import os
import sys
import time


class ConfigError(ValueError):
    """A bad config value (:mod:`arealite.api.cli` raises it; import it from there). ``field`` is
    its dotted path (``gconfig.n_samples``); the message starts with it and says what is
    accepted. Uncaught after ``load_config``, it prints one line and exits 2 (``usage_error``)."""

    usage_error = True

    def __init__(self, field_path: str, message: str):
        self.field = field_path
        super().__init__(f"{field_path}: {message}")


def is_usage_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a bad-input error the user fixes on the command line or in the YAML."""
    return bool(getattr(exc, "usage_error", False))


def usage_line(exc: BaseException) -> str:
    """``PROG: error: MESSAGE`` on one line (newlines inside the message become spaces)."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "arealite"
    return f"{prog}: error: {' '.join(str(exc).split())}"


def report_usage_error(exc: BaseException) -> None:
    """Print :func:`usage_line` to stderr (rank 0 only under torchrun) and, under torchrun,
    write the message to this worker's ``$TORCHELASTIC_ERROR_FILE`` (torchrun's report shows it)."""
    if os.environ.get("RANK", "0") in ("", "0"):
        sys.stdout.flush()
        print(usage_line(exc), file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                msg = " ".join(str(exc).split())  # the format torch's @record writes (no warnings)
                json.dump({"message": {"message": msg, "extraInfo": {"py_callstack": msg,
                                                                     "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass  # the report then lacks the message; the line above was printed


def install_exit_hook() -> None:
    """Make an uncaught usage error (:func:`is_usage_error`) print one line and exit with status 2
    (``sys.excepthook``; idempotent, other exceptions go to the previous hook unchanged)."""
    previous = sys.excepthook
    if getattr(previous, "_arealite_usage", False):
        return

    def hook(tp, value, tb):
        if not is_usage_error(value):
            return previous(tp, value, tb)
        report_usage_error(value)
        raise SystemExit(2)  # an excepthook that raises SystemExit sets the exit status

    hook._arealite_usage = True  # type: ignore[attr-defined]
    sys.excepthook = hook
