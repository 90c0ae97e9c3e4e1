"""Rule-based rewards for math answers (GSM8K, MATH, the embedded arithmetic task).

All reward functions here are pure, picklable, module-level functions so they can
be run in a :class:`arealite.reward.worker.RewardWorker` (spawned process with a
timeout).  ``math_verify`` is called with its own signal-based timeouts disabled
(they only work in the main thread); the worker enforces the timeout instead.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

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


# Real thousands separators only: 1-3 digits, then groups of exactly 3 ("1,234", "-12,345,678"),
# not inside a longer run of digit groups ("1,234,5" is a list; "1,000, 2,000" two numbers). "1,2", "(3,4)" or "1,23" are lists/tuples and keep
# their commas.
_THOUSANDS_RE = re.compile(r"(?<![\d.])(?<!\d,)-?\d{1,3}(?:,\d{3})+(?!\d|,\d)")
# The text before a number ends in "<digit>," (optionally one space): that number ends a
# comma-separated list ("1, 2, 3", "(0,5)"), not a scalar answer.
_LIST_TAIL_RE = re.compile(r"\d\s?,\s?$")


def strip_thousands_separators(text: str) -> str:
    """Remove the commas of real thousands separators (``-?\\d{1,3}(,\\d{3})+``) only.

    ``"1,234,567"`` -> ``"1234567"``, ``"-1,000.5"`` -> ``"-1000.5"``; ``"1,2"``, ``"(1,2)"``,
    ``"[0,10]"`` and ``"1,23"`` are unchanged, so a comma-separated answer (tuple, list,
    interval) never turns into an unrelated number."""
    return _THOUSANDS_RE.sub(lambda m: m.group(0).replace(",", ""), text)


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


def _to_fraction(s: str | None) -> Fraction | None:
    """The exact value of a plain decimal literal ("-1,234.50" -> -2469/2), or None for anything
    else (a list such as "1,2", words, inf/nan)."""
    if not isinstance(s, str):
        return None
    s = strip_thousands_separators(s.strip())
    if "," in s or not s:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _to_float(s: str | None) -> float | None:
    v = _to_fraction(s)
    return None if v is None else float(v)


def _last_scalar(completion: str) -> Fraction | None:
    """The completion's last number, or None when there is none or it ends a comma-separated
    list (the completion's final answer is then a tuple/list, never equal to a scalar)."""
    if not isinstance(completion, str):
        return None
    last = None
    for m in _NUMBER_RE.finditer(completion):
        if m.group(0) and m.group(0) != "-":
            last = m
    if last is None or _LIST_TAIL_RE.search(completion[: last.start()]):
        return None
    return _to_fraction(last.group(0))


# Relative tolerance of the numeric fallback for non-integers (a last-digit rounding of a long
# decimal); integers compare exactly. Relative, so tiny values never match by magnitude alone.
NUMERIC_REL_TOL = 1e-9


def _numeric_fallback(completion: str, answer: str) -> float:
    """1.0 when the completion's last scalar number equals the plain-number ``answer``: exactly
    for integers, else within ``NUMERIC_REL_TOL`` relative (decimal literals are exact
    fractions: "2.50" == "2.5", "1e-30" != "2e-30"); 0.0 when either is not a single number
    (e.g. the answer "1,2" is a pair: math_verify's job)."""
    gold = _to_fraction(answer.strip().strip("$").strip())
    pred = _last_scalar(completion)
    if pred is None or gold is None:
        return 0.0
    if pred == gold:
        return 1.0
    if pred.denominator == 1 and gold.denominator == 1:
        return 0.0
    return 1.0 if abs(pred - gold) <= Fraction(NUMERIC_REL_TOL) * max(abs(pred), abs(gold)) else 0.0


# Relative tolerances of the check that vetoes math_verify's numeric equality: exact numbers
# (integers, rationals, surds) must agree to 1e-12 relative at 50 significant digits; with a
# decimal literal on either side (0.333333 vs 1/3, which math_verify accepts by rounding to 6
# places) to 1e-4 relative, so rounding never equates values that differ in magnitude.
_EXACT_REL_TOL = 1e-12
_FLOAT_REL_TOL = 1e-4


def _numerically_distinct(a, b) -> bool:
    """True when sympy numbers ``a`` and ``b`` (no free symbols) differ by more than the relative
    tolerance above. math_verify compares ``(a - b).evalf(chop=True) == 0`` with an absolute chop,
    so 2^-99 and 2^-100 (factor 2 apart) would be "equal"; this catches that class. Anything
    that is not a plain real number (sets, intervals, relations, matrices, strings,
    percentages) is left to math_verify (returns False)."""
    try:
        import sympy

        if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
            return False
        if a.free_symbols or b.free_symbols or a.has(sympy.UnevaluatedExpr) or b.has(sympy.UnevaluatedExpr):
            return False
        if not (a.is_number and b.is_number):
            return False
        x, y = sympy.N(a, 50), sympy.N(b, 50)
        if not (x.is_real and y.is_real and x.is_finite and y.is_finite):
            return False
        tol = _FLOAT_REL_TOL if (a.has(sympy.Float) or b.has(sympy.Float)) else _EXACT_REL_TOL
        return bool(abs(x - y) > tol * max(abs(x), abs(y)))
    except Exception:  # a comparison we cannot judge: keep math_verify's verdict
        return False


def verify_answer(gold: list, pred: list) -> bool:
    """math_verify's ``verify`` (its own timeout off) over every (gold, pred) candidate pair, each
    ``True`` checked by :func:`_numerically_distinct` so that tiny but different numbers do not
    match; equal rationals (2/6 vs 1/3) and equal decimal forms (0.5 vs 1/2) still do."""
    from math_verify import verify

    for g in gold:
        for p in pred:
            if verify([g], [p], timeout_seconds=None) and not _numerically_distinct(g, p):
                return True
    return False


def math_reward(completion: str, answer: str) -> float:
    """Score a completion against a reference final answer.

    * A numeric ``answer`` and no ``\\boxed{}`` in the completion: the last number
      literal of the completion (:func:`extract_last_number`) must equal the answer
      (integers exactly, other decimals to 1e-9 relative), and must not end a comma-separated list.
      Expressions are not evaluated, so restating the question ("23 + 50") earns nothing.
      Only real thousands separators are removed (:func:`strip_thousands_separators`):
      the answer ``"1,2"`` is a pair, not 12.
    * Otherwise ``math_verify``: the gold answer is parsed from ``"$" + answer + "$"``
      and the completion with math_verify's default extraction (``\\boxed{}`` first,
      LaTeX, ``1,000`` == ``1000``, ``\\frac{1}{2}`` == ``0.5``). If it extracts
      nothing from either side, or raises, the numeric comparison above is used. A
      numeric match must also hold to a relative tolerance (:func:`verify_answer`):
      math_verify alone calls 2^-99 and 2^-100 equal. math_verify's own timeouts are
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
            from math_verify import parse

            gold = parse("$" + answer + "$", parsing_timeout=None)
            pred = parse(completion, parsing_timeout=None)
            if gold and pred:
                return 1.0 if verify_answer(gold, pred) else 0.0
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
