"""Math prompt datasets: the embedded arithmetic task, GSM8K and MATH (a .jsonl file, a folder
written by ``datasets``' ``save_to_disk`` or a Hugging Face hub name such as ``openai/gsm8k`` or
``HuggingFaceH4/MATH-500``: :mod:`arealite.dataset.sources`).

Every row is a dict::

    {"messages": [{"role": "user", "content": str}], "answer": str, "question": str}

``question`` is the raw problem text, ``messages`` is the chat prompt (question
plus an answer-format instruction), and ``answer`` is the reference final answer
to score with :func:`arealite.reward.math.math_reward`.

The instruction is the format's default (``ARITHMETIC_INSTRUCTION``, ``GSM8K_INSTRUCTION``,
``MATH_INSTRUCTION``) unless ``instruction=`` is given (config: ``train_dataset.instruction`` /
``valid_dataset.instruction``): that text is appended to the question verbatim, so it carries its
own separator (``"\\nThink step by step."``) and ``""`` gives the bare question. Benchmarks set
it so that every system they compare sees the same prompt text.
"""

from __future__ import annotations

import hashlib
import random

from arealite.dataset.sources import read_rows
from arealite.reward.math import extract_gsm8k_answer

# ---------------------------------------------------------------- constants
# Difficulty of the embedded arithmetic task: both operands are drawn from this
# inclusive range.  Change it here and everything (pools, tests) follows.
ARITHMETIC_OPERAND_RANGE: tuple[int, int] = (10, 99)
# Fraction of (a, b) pairs assigned to the test split (by a hash of the pair).
ARITHMETIC_TEST_FRACTION: float = 0.1
ARITHMETIC_DEFAULT_SIZE: dict[str, int] = {"train": 1000, "test": 200}

ARITHMETIC_INSTRUCTION = "\nAnswer with just the number."
GSM8K_INSTRUCTION = "\nAnswer with just the number at the end."
MATH_INSTRUCTION = "\nPut the final answer in \\boxed{}."

SPLITS = ("train", "test")
_FORMATS_HELP = (
    "accepted formats: 'arithmetic' (or None) for the embedded task; a .jsonl "
    "file, a datasets save_to_disk folder or a Hugging Face hub name in GSM8K format "
    "(fields question/answer, answer ending in '#### N') or MATH format (fields problem/answer)"
)


def _instruction(instruction: str | None, default: str) -> str:
    """``instruction``, or ``default`` when it is None.

    Raises:
        ValueError: ``instruction`` is not a string (names the config field).
    """
    if instruction is None:
        return default
    if not isinstance(instruction, str):
        raise ValueError(f"instruction must be a string appended to each question (e.g. "
                         f"'\\nAnswer with just the number.'; '' = none) or None for the format's default, "
                         f"got {instruction!r}; set train_dataset.instruction / valid_dataset.instruction")
    return instruction


def _row(question: str, instruction: str, answer: str) -> dict:
    return {
        "messages": [{"role": "user", "content": question + instruction}],
        "answer": answer,
        "question": question,
    }


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got split={split!r}")


# ---------------------------------------------------------------- arithmetic
def _pair_split(a: int, b: int) -> str:
    """Deterministic (process-independent) split assignment of a pair."""
    h = int.from_bytes(hashlib.sha256(f"{a}+{b}".encode()).digest()[:8], "big")
    return "test" if h / 2**64 < ARITHMETIC_TEST_FRACTION else "train"


def arithmetic_pool(split: str) -> list[tuple[int, int]]:
    """All (a, b) operand pairs belonging to ``split``, in sorted order.

    Train and test pools are disjoint and together cover every pair in
    ``ARITHMETIC_OPERAND_RANGE`` x ``ARITHMETIC_OPERAND_RANGE`` (about
    ``ARITHMETIC_TEST_FRACTION`` of pairs go to test).

    Raises:
        ValueError: if ``split`` is not "train" or "test".
    """
    _check_split(split)
    lo, hi = ARITHMETIC_OPERAND_RANGE
    return [
        (a, b)
        for a in range(lo, hi + 1)
        for b in range(lo, hi + 1)
        if _pair_split(a, b) == split
    ]


def make_arithmetic_dataset(split: str, size: int, seed: int = 0, instruction: str | None = None) -> list[dict]:
    """The embedded, seeded arithmetic task: two-digit additions ``a + b``.

    Operands come from ``ARITHMETIC_OPERAND_RANGE`` (10..99).  Question text is
    ``"What is {a} + {b}?"``; the user message is the question followed by
    ``ARITHMETIC_INSTRUCTION`` ("\\nAnswer with just the number."); the answer is
    ``str(a + b)``.  Each pair belongs to exactly one split (by a hash of the
    pair, ~10% test), so train and test never share a problem; ``size`` distinct
    pairs are sampled from the split's pool with ``random.Random(seed)``.

    As a calibration point, SmolLM2-135M-Instruct starts around 12-20% greedy
    accuracy on this task, leaving room for RL to show improvement.

    Args:
        split: "train" or "test".
        size: number of distinct problems (0 < size <= pool size; the train pool
            has ~7300 pairs and the test pool ~800).
        seed: sampling seed; same (split, size, seed) -> identical rows.
        instruction: appended to each question; None = ``ARITHMETIC_INSTRUCTION``.

    Returns:
        List of row dicts (see module docstring).

    Raises:
        ValueError: on an unknown split, size < 1 or larger than the pool, or a
            non-string instruction.
    """
    instruction = _instruction(instruction, ARITHMETIC_INSTRUCTION)
    pool = arithmetic_pool(split)
    if not isinstance(size, int) or size < 1 or size > len(pool):
        raise ValueError(
            f"size={size!r} is invalid for the arithmetic {split!r} split: it must "
            f"be between 1 and the pool size {len(pool)}"
        )
    pairs = random.Random(seed).sample(pool, size)
    return [_row(f"What is {a} + {b}?", instruction, str(a + b)) for a, b in pairs]


# ---------------------------------------------------------------- jsonl
def _read_jsonl(path: str, split: str = "train") -> list[tuple[int, dict]]:
    """(1-based row number, object) for each row of ``path``: a .jsonl file, a ``save_to_disk``
    folder or a hub name (:func:`arealite.dataset.sources.read_rows`, which raises)."""
    return read_rows(path, split)


def _field(path: str, lineno: int, obj: dict, name: str, fix: str) -> str:
    if name not in obj:
        raise ValueError(f"{path}: row {lineno} is missing field {name!r}; {fix}")
    val = obj[name]
    if isinstance(val, (int, float)) and not isinstance(val, bool):
        val = str(val)
    if not isinstance(val, str) or not val.strip():
        raise ValueError(
            f"{path}: row {lineno} field {name!r} must be a non-empty string, "
            f"got {val!r}; {fix}"
        )
    return val


def load_gsm8k_jsonl(path: str, instruction: str | None = None, split: str = "train",
                     rows: list[tuple[int, dict]] | None = None) -> list[dict]:
    """Load GSM8K-format rows (fields ``question``, ``answer``) from a jsonl file, a
    ``save_to_disk`` folder or a hub name (``openai/gsm8k``; ``split`` picks its split), or from
    ``rows`` already read.

    The reference answer is the text after the last ``####`` of the ``answer``
    solution (commas removed).  The user message is the question followed by
    ``instruction`` (None = ``GSM8K_INSTRUCTION``).

    Args:
        path: path to the .jsonl file.
        instruction: appended to each question; None = ``GSM8K_INSTRUCTION``.

    Returns:
        List of row dicts in file order.

    Raises:
        FileNotFoundError: if ``path`` does not exist (message names the path).
        ValueError: naming the file, the 1-based row (line) number and the
            missing/malformed field (invalid JSON, missing ``question``/``answer``,
            or an ``answer`` without ``#### N``).
    """
    fix = "pass a jsonl with fields question/answer (answer ending in '#### N')"
    instruction = _instruction(instruction, GSM8K_INSTRUCTION)
    out = []
    for lineno, obj in (rows if rows is not None else _read_jsonl(path, split)):
        question = _field(path, lineno, obj, "question", fix)
        solution = _field(path, lineno, obj, "answer", fix)
        try:
            answer = extract_gsm8k_answer(solution)
        except ValueError as e:
            raise ValueError(
                f"{path}: row {lineno} field 'answer' is malformed: {e}; {fix}"
            ) from None
        out.append(_row(question, instruction, answer))
    return out


def load_math_jsonl(path: str, instruction: str | None = None, split: str = "train",
                    rows: list[tuple[int, dict]] | None = None) -> list[dict]:
    """Load MATH-format rows (fields ``problem``, ``answer``), e.g. MATH-500, from a jsonl file, a
    ``save_to_disk`` folder or a hub name (``HuggingFaceH4/MATH-500``, split ``test``), or from
    ``rows`` already read.

    The user message is the problem followed by ``instruction`` (None = ``MATH_INSTRUCTION``,
    "Put the final answer in \\boxed{}."); ``question`` is the problem text.

    Args:
        path: path to the .jsonl file.
        instruction: appended to each problem; None = ``MATH_INSTRUCTION``.

    Returns:
        List of row dicts in file order.

    Raises:
        FileNotFoundError: if ``path`` does not exist (message names the path).
        ValueError: naming the file, the 1-based row (line) number and the
            missing/malformed field.
    """
    fix = "pass a jsonl with fields problem/answer"
    instruction = _instruction(instruction, MATH_INSTRUCTION)
    out = []
    for lineno, obj in (rows if rows is not None else _read_jsonl(path, split)):
        problem = _field(path, lineno, obj, "problem", fix)
        answer = _field(path, lineno, obj, "answer", fix).strip()
        out.append(_row(problem, instruction, answer))
    return out


def _format_of(path: str, rows: list[tuple[int, dict]]) -> str:
    """``"gsm8k"`` (a ``question`` field) or ``"math"`` (a ``problem`` field), from the first row."""
    lineno, obj = rows[0]
    if "question" in obj:
        return "gsm8k"
    if "problem" in obj:
        return "math"
    raise ValueError(f"{path}: cannot tell the dataset format from row {lineno} (fields: {sorted(obj)}); {_FORMATS_HELP}")


def load_dataset(
    path: str | None, split: str = "train", size: int | None = None, seed: int = 0,
    instruction: str | None = None,
) -> list[dict]:
    """Load a math prompt dataset by path.

    Args:
        path: None or "arithmetic" for the embedded arithmetic task; otherwise a
            ``.jsonl`` file, a folder written by ``datasets``' ``save_to_disk`` or a Hugging
            Face hub name (``openai/gsm8k``, ``HuggingFaceH4/MATH-500``; see
            :mod:`arealite.dataset.sources`), whose first row decides the format:
            a ``question`` field -> GSM8K loader, a ``problem`` field -> MATH loader.
        split: "train" or "test".  Selects the arithmetic split and the split of a saved
            ``DatasetDict`` or hub set; a jsonl file (or a saved single ``Dataset``) is
            itself the split.
        size: number of rows.  Arithmetic: defaults to 1000 (train) / 200 (test).
            Files and sets: None keeps all rows in order; an int returns the first
            ``size`` rows after a shuffle with ``random.Random(seed)``.
        seed: seed for arithmetic sampling / jsonl shuffling.
        instruction: text appended to each question; None = the format's default
            (see the module docstring).

    Returns:
        List of row dicts (see module docstring).

    Raises:
        ValueError: unknown split; unsupported path/format (the message lists the
            accepted formats); ``size`` < 1 or larger than the dataset; malformed
            rows (see the loaders); a non-string instruction.
        FileNotFoundError: the jsonl file does not exist.
        ImportError: a saved folder or hub name without ``datasets`` installed.
    """
    _check_split(split)
    _instruction(instruction, "")  # a bad instruction fails before any file is read
    if path is None or path == "arithmetic":
        if size is None:
            size = ARITHMETIC_DEFAULT_SIZE[split]
        return make_arithmetic_dataset(split, size, seed, instruction)
    raw = _read_jsonl(path, split)
    loader = load_gsm8k_jsonl if _format_of(path, raw) == "gsm8k" else load_math_jsonl
    rows = loader(path, instruction, rows=raw)
    if size is None:
        return rows
    if not isinstance(size, int) or size < 1 or size > len(rows):
        raise ValueError(
            f"size={size!r} is invalid for {path}: it must be between 1 and the "
            f"number of rows {len(rows)}"
        )
    random.Random(seed).shuffle(rows)
    return rows[:size]
