"""A task where a tool is necessary: multiplying two 3–4 digit numbers.

SmolLM2-135M cannot multiply ``4821 × 376`` in its head (greedy accuracy ≈ 0, docs/custom_agent.md
has the measurement) but can write ``print(4821 * 376)`` for a Python tool and copy the output.
Every row::

    {"messages": [{"role": "user", "content": question + "\\nAnswer with just the number."}],
     "question": "What is 4821 * 376?", "answer": "1812696"}

Splits are disjoint by construction: a pair ``(a, b)`` belongs to ``test`` when a hash of it
falls under :data:`TEST_FRACTION`, so a seeded sample of either split never meets the other.
The reward is exact correctness (:func:`multiplication_reward`).
"""

from __future__ import annotations

import hashlib
import random
import re

from arealite.dataset.math_data import SPLITS, load_dataset

DIGITS = (3, 4)  # each operand has 3 or 4 digits (equally likely)
TEST_FRACTION = 0.2  # share of (a, b) pairs in the test split (by a hash of the pair)
DEFAULT_SIZE = {"train": 2000, "test": 200}
INSTRUCTION = "\nAnswer with just the number."
DATASET_NAME = "multiplication"  # the dataset path that selects this task in load_multiplication


def pair_split(a: int, b: int) -> str:
    """``"test"`` or ``"train"`` for the pair, by a process-independent hash."""
    h = int.from_bytes(hashlib.sha256(f"{a}*{b}".encode()).digest()[:8], "big")
    return "test" if h / 2**64 < TEST_FRACTION else "train"


def make_multiplication_dataset(split: str, size: int, seed: int = 0, instruction: str = INSTRUCTION) -> list[dict]:
    """``size`` distinct problems ``a * b`` of ``split`` (3–4 digit operands), sampled with
    ``random.Random(seed)``: same arguments → identical rows.

    Raises:
        ValueError: unknown ``split`` or ``size < 1``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got split={split!r}")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size={size!r}: need at least one problem")
    rng, seen, rows = random.Random(f"{seed}-{split}"), set(), []
    while len(rows) < size:
        a, b = (rng.randrange(10 ** (d - 1), 10**d) for d in (rng.choice(DIGITS), rng.choice(DIGITS)))
        if (a, b) in seen or pair_split(a, b) != split:
            continue
        seen.add((a, b))
        question = f"What is {a} * {b}?"
        rows.append({"messages": [{"role": "user", "content": question + instruction}], "question": question,
                     "answer": str(a * b)})
    return rows


def multiplication_reward(completion: str, answer: str) -> float:
    """1.0 if the last integer in ``completion`` (thousands separators ``,`` allowed) equals
    ``answer`` exactly, else 0.0."""
    numbers = re.findall(r"-?\d[\d,]*", completion or "")
    return float(bool(numbers) and numbers[-1].replace(",", "").rstrip(",") == str(answer))


def load_multiplication(path: str | None, split: str = "train", size: int | None = None, seed: int = 0,
                        instruction: str | None = None) -> list[dict]:
    """A ``dataset_loader`` for :func:`arealite.trainer.rl_loop.run_rl`: ``path ==
    "multiplication"`` gives this task (``size`` default 2000 train / 200 test); any other path
    goes to :func:`arealite.dataset.math_data.load_dataset`. ``instruction``: appended to each
    question (None = :data:`INSTRUCTION`)."""
    if path == DATASET_NAME:
        return make_multiplication_dataset(split, size or DEFAULT_SIZE[split], seed,
                                           INSTRUCTION if instruction is None else instruction)
    return load_dataset(path, split, size, seed, instruction)
