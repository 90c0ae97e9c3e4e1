"""A reward function whose module appends the importing process's pid to
``$AREALITE_TEST_IMPORT_LOG`` (when set): the RewardWorker prewarm test reads it to see where and
how often the module was imported."""

import os

_LOG = os.environ.get("AREALITE_TEST_IMPORT_LOG")
if _LOG:
    with open(_LOG, "a") as f:
        f.write(f"{os.getpid()}\n")


def one(*_):
    return 1.0
