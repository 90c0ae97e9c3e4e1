"""Rule-based rewards for math answers (GSM8K, MATH, the embedded arithmetic task).

All reward functions here are pure, picklable, module-level functions so they can
be run in a :class:`arealite.reward.worker.RewardWorker` (spawned process with a
timeout).  ``math_verify`` is called with its own signal-based timeouts disabled
(they only work in the main thread); the worker enforces the timeout instead.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger("arealite.reward")
# math_verify warns on every call that its signal timeouts are disabled: our worker enforces one.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# Only the tail of very long completions is parsed: final answers live at the end,
# and regex/sympy work on megabytes of text would be needlessly slow.
MAX_PARSE_CHARS = 20_000
# Reference answers longer than this are not given to math_verify (its parser is
# superlinear on long garbage); they are compared numerically only.
MAX_ANSWER_CHARS = 1_000

# A number: optional sign (not when it is a binary minus like "3-4"), either
# comma-grouped thousands ("1,234,567") or plain digits, then an optional decimal
# part.  The decimal part needs digits after the point, so the full stop ending a
# sentence ("... is 57.") is not included.
_NUMBER_RE = re.compile(
    r"""
    (?:(?<![\w.])-)?                 # sign, unless preceded by a word char / digit
    (?:
        \d{1,3}(?:,\d{3})+(?!\d)     # 1,234 / 1,234,567
      | \d+                          # 1234
      | (?=\.\d)                     # .5
    )
    (?:\.\d+)?                       # decimals
    """,
    re.VERBOSE,
)


def extract_gsm8k_answer(solution: str) -> str:
    """Return the final answer of a GSM8K reference solution.

    Args:
        solution: a GSM8K ``answer`` field, e.g. ``"... so 48+24=72.\\n#### 72"``.

    Returns:
        The text after the LAST ``####``, stripped, with thousands commas removed
        (``"#### 1,000"`` -> ``"1000"``).

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
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError("GSM8K solution has an empty answer after the last '####'")
    return answer


def extract_last_number(text: str) -> str | None:
    """Return the last number in free text, normalised, or None.

    Integers, decimals and negatives are recognised, with optional thousands
    commas (``"-1,234.5"`` -> ``"-1234.5"``).  A sentence-ending full stop is not
    part of the number (``"is 57."`` -> ``"57"``).

    Args:
        text: any string (non-strings return None).

    Returns:
        The number as a string with commas removed, or None if there is none.
    """
    if not isinstance(text, str) or not text:
        return None
    last = None
    for m in _NUMBER_RE.finditer(text):
        if m.group(0) and m.group(0) != "-":
            last = m.group(0)
    if last is None:
        return None
    return last.replace(",", "")


def _to_float(s: str | None) -> float | None:
    if s is None:
        return None
    try:
        v = float(s.replace(",", "").strip())
    except (ValueError, AttributeError):
        return None
    if v != v or v in (float("inf"), float("-inf")):
        return None
    return v


def _numeric_fallback(completion: str, answer: str) -> float:
    pred = _to_float(extract_last_number(completion))
    gold = _to_float(answer.strip().strip("$").strip())
    if gold is None:
        gold = _to_float(extract_last_number(answer))
    if pred is None or gold is None:
        return 0.0
    return 1.0 if abs(pred - gold) < 1e-6 else 0.0


def math_reward(completion: str, answer: str) -> float:
    """Score a completion against a reference final answer.

    * A numeric ``answer`` and no ``\\boxed{}`` in the completion: the last number
      literal of the completion (:func:`extract_last_number`) must equal the answer
      (absolute difference < 1e-6). Expressions are not evaluated, so restating the
      question ("23 + 50") earns nothing.
    * Otherwise ``math_verify``: the gold answer is parsed from ``"$" + answer + "$"``
      and the completion with math_verify's default extraction (``\\boxed{}`` first,
      LaTeX, ``1,000`` == ``1000``, ``\\frac{1}{2}`` == ``0.5``). If it extracts
      nothing from either side, or raises, the numeric comparison above is used.  math_verify's own timeouts are
    disabled (they only work in the main thread); run this under
    :class:`arealite.reward.worker.RewardWorker` to bound its runtime.

    Args:
        completion: the model's generated text (only its last
            ``MAX_PARSE_CHARS`` characters are parsed).
        answer: the reference final answer, e.g. ``"72"`` or ``"\\frac{1}{2}"``
            (answers over ``MAX_ANSWER_CHARS`` characters are compared
            numerically only).

    Returns:
        1.0 if the final answer matches, else 0.0.  Never raises: any error or
        non-string input gives 0.0.
    """
    try:
        if not isinstance(completion, str) or not isinstance(answer, str):
            return 0.0
        if not answer.strip() or not completion.strip():
            return 0.0
        completion = completion[-MAX_PARSE_CHARS:]
        if len(answer) > MAX_ANSWER_CHARS:
            return _numeric_fallback(completion, answer[-MAX_ANSWER_CHARS:])
        if "\\boxed" not in completion and _to_float(answer.strip().strip("$")) is not None:
            # A numeric answer and no \boxed{}: the last number literal must equal it.
            # math_verify would evaluate a restated question ("23 + 50") as its answer,
            # which a policy quickly learns to exploit.
            return _numeric_fallback(completion, answer)
        try:
            from math_verify import parse, verify

            gold = parse("$" + answer + "$", parsing_timeout=None)
            pred = parse(completion, parsing_timeout=None)
            if gold and pred:
                return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
        except Exception as e:  # math_verify failure -> numeric fallback
            logger.debug("math_verify failed (%r); using numeric fallback", e)
        return _numeric_fallback(completion, answer)
    except Exception as e:  # never raise into the RL loop
        logger.warning("math_reward failed on input, returning 0.0: %r", e)
        return 0.0


def gsm8k_reward(completion: str, answer: str) -> float:
    """GSM8K reward: identical to :func:`math_reward`.

    ``answer`` must already be extracted (see :func:`extract_gsm8k_answer`).
    """
    return math_reward(completion, answer)
