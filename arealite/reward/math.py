"""Rule-based rewards for math answers (GSM8K, MATH, the embedded arithmetic task).

All reward functions here are pure, picklable, module-level functions so they can
be run in a :class:`arealite.reward.worker.RewardWorker` (spawned process with a
timeout).  ``math_verify`` is called with its own signal-based timeouts disabled
(they only work in the main thread); the worker enforces the timeout instead.
"""

from __future__ import annotations

import logging

# The answer extraction and equivalence: one module, shared with the evaluator and the votes.
from arealite.reward.answer import (
    MAX_ANSWER_CHARS,
    MAX_PARSE_CHARS,
    answers_equivalent,
    extract_final_answer,
    normalise_gold,
    strip_thousands_separators,
)

__all__ = ["MAX_PARSE_CHARS", "extract_final_answer", "extract_gsm8k_answer", "gsm8k_reward", "math_reward",
           "strip_thousands_separators"]
logger = logging.getLogger("arealite.reward")


def extract_gsm8k_answer(solution: str) -> str:
    """Return the final answer of a GSM8K reference solution.

    Args:
        solution: a GSM8K ``answer`` field, e.g. ``"... so 48+24=72.\\n#### 72"``.

    Returns:
        The text after the LAST ``####``, stripped, with thousands separators removed
        (``"#### 1,000"`` -> ``"1000"``; other commas, as in ``"#### 1,2"``, are kept).

    Raises:
        ValueError: if ``solution`` is not a string, has no ``####`` marker, or the
            text after it is empty.
    """
    if not isinstance(solution, str):
        raise ValueError(
            f"GSM8K solution must be a string, got {type(solution).__name__}"
        )
    if "####" not in solution:
        snippet = solution[-80:].replace("\n", "\\n")
        raise ValueError(
            "GSM8K solution has no '####' final-answer marker "
            f"(expected '... #### <number>'); solution ends with: {snippet!r}"
        )
    answer = strip_thousands_separators(solution.rsplit("####", 1)[1].strip())
    if not answer:
        raise ValueError("GSM8K solution has an empty answer after the last '####'")
    return answer


def math_reward(completion: str, answer: str) -> float:
    """Score a completion against a reference final answer.

    The completion's final answer is one whole expression taken from its last answer marker
    (``\\boxed{}``, ``####``, "the answer is"), else its last expression — never a fragment such
    as a fraction's denominator or a unit's power; it is compared with the reference by
    :func:`arealite.reward.answer.answers_equivalent` (exact rationals for plain numbers,
    math-verify with a relative-precision check for the rest; a calculation such as "23 + 50"
    never equals a number). The rules, with examples: :mod:`arealite.reward.answer`.

    math-verify's own timeouts are disabled (they only work in the main thread); run this under
    :class:`arealite.reward.worker.RewardWorker` to bound its runtime.

    Args:
        completion: the model's generated text (only its last ``MAX_PARSE_CHARS`` characters
            are read).
        answer: the reference final answer, e.g. ``"72"``, ``"\\frac{1}{2}"``, ``"(1, 2)"``
            (normalised like the completion's; only its last ``MAX_ANSWER_CHARS`` are read).

    Returns:
        1.0 if the final answer matches, else 0.0. Never raises: any error or non-string input
        gives 0.0.
    """
    try:
        if not isinstance(completion, str) or not isinstance(answer, str):
            return 0.0
        if not answer.strip() or not completion.strip():
            return 0.0
        gold = normalise_gold(answer) or answer.strip()[-MAX_ANSWER_CHARS:]
        return 1.0 if answers_equivalent(extract_final_answer(completion), gold) else 0.0
    except Exception as e:  # never raise into the RL loop
        logger.warning("math_reward failed on input, returning 0.0: %r", e)
        return 0.0


def gsm8k_reward(completion: str, answer: str) -> float:
    """GSM8K reward: identical to :func:`math_reward`.

    ``answer`` must already be extracted (see :func:`extract_gsm8k_answer`).
    """
    return math_reward(completion, answer)
