"""Module-level reward functions for the RewardWorker tests.

They live in their own small module (not in the test module) so the spawn start
method can pickle them by reference under any pytest import mode: the test adds
this folder to sys.path, spawned workers inherit sys.path and import
``reward_fns`` by name.
"""

import os
import time


def add(a, b):
    return a + b


def sleep_forever(seconds=30.0):
    time.sleep(seconds)
    return 1.0


def hard_exit():
    os._exit(1)


def raise_error():
    raise ZeroDivisionError("boom in reward fn")


def not_a_number():
    return "not a float"


def nan_reward(*_):
    return float("nan")


def inf_reward(*_):
    return float("-inf")


_LEAK = []


def leak_memory(mb=64):
    """Keeps ``mb`` MiB alive in the worker after every call (a leak across calls)."""
    _LEAK.append(bytearray(int(mb) << 20))
    for chunk in _LEAK[-1:]:
        chunk[::4096] = b"x" * len(chunk[::4096])  # touch every page: resident, not just mapped
    return float(len(_LEAK))


def memory_bomb():
    chunks = []
    while True:
        chunks.append(b"x" * (32 << 20))


def length_parity_reward(completion: str, answer: str) -> float:
    """A reward that a random model's samples do not all share (the completion's length mod 3,
    over 2), so GRPO's advantages are not all 0 and a step changes the weights."""
    return (len(completion) % 3) / 2
