"""Plain numbers of an extracted answer as exact rationals: :func:`parse_number` (integers,
decimals, ``a/b``, ``\\frac``, mixed numbers, integer powers, percentages) and the comparisons
:mod:`arealite.reward.answer` makes of them (decimal rounding, percentages, tuples of numbers)."""

from __future__ import annotations

import re
from fractions import Fraction

# Real thousands separators only: 1-3 digits, then groups of exactly 3 ("1,234", "-12,345,678"),
# not inside a longer run of digit groups ("1,234,5" is a list; "(1,2)" a pair).
_THOUSANDS_RE = re.compile(r"(?<![\d.])(?<!\d,)-?\d{1,3}(?:,\d{3})+(?!\d|,\d)")


def strip_thousands_separators(text: str) -> str:
    """Remove the commas of real thousands separators (``-?\\d{1,3}(,\\d{3})+``) only.

    ``"1,234,567"`` -> ``"1234567"``, ``"-1,000.5"`` -> ``"-1000.5"``; ``"1,2"``, ``"(1,2)"``,
    ``"[0,10]"``, ``"1,23"`` and a number alone in brackets (``"(1,125)"``, ``"[0,360)"``: a pair,
    an interval) are unchanged, so a comma-separated answer (tuple, list,
    interval) never turns into an unrelated number."""
    def strip(m: re.Match) -> str:  # "(1,125)", "[0,360)": a pair or an interval, not 1125
        inside = re.search(r"[(\[]\s*$", text[max(0, m.start() - 20):m.start()]) and re.match(r"\s*[)\]]", text[m.end():])
        return m.group(0) if inside else m.group(0).replace(",", "")

    return _THOUSANDS_RE.sub(strip, text)


_FRAC_RE = re.compile(r"^\\frac\{\s*([-+]?\d+)\s*\}\{\s*([-+]?\d+)\s*\}$")
_SLASH_RE = re.compile(r"^([-+]?\d+)\s*/\s*([-+]?\d+)$")
_MIXED_RE = re.compile(r"^([-+]?)(\d+)\s*(?:\\frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}|\s(\d+)\s*/\s*(\d+))$")
_DECIMAL_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d+)?|\.\d+)$")
_POWER_RE = re.compile(r"^([-+]?)(\d+)\s*\^\s*(?:\{\s*([-+]?\d+)\s*\}|(\d))$")
_TUPLE_RE = re.compile(r"^([(\[])(.*)([)\]])$")


def parse_number(expr: str) -> tuple[Fraction, bool] | None:
    """The exact value of a plain-number answer, or None when ``expr`` is anything else.

    Plain numbers: integers, decimals, ``a/b``, ``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``,
    ``\\frac12``), integer powers of integers (``2^{10}``, ``10^{-3}``; exponents up to 64, bases
    up to 4 digits), proper mixed numbers (``3\\frac{1}{2}``, ``3 1/2``; the sign applies to the
    whole) and percentages (``50%``).

    Returns:
        ``(value, is_percent)`` — for ``"50%"`` the value is 50 and ``is_percent`` True; None for
        an expression that is not one plain number (a root, a calculation, a tuple, words), a zero denominator, or a non-string.
    """
    if not isinstance(expr, str):
        return None
    s = re.sub(r"\\[dt]frac", r"\\frac", expr.strip())
    s = re.sub(r"\\frac\s*(\d)\s*(\d)$", r"\\frac{\1}{\2}", s)
    s = strip_thousands_separators(s).replace("−", "-")
    pct = s.endswith("%")
    if pct:
        s = s[:-1].strip()
    s = re.sub(r"^\(\s*([-+]?[^(),]+?)\s*\)$", r"\1", s)  # "(-5)"
    try:
        if _DECIMAL_RE.match(s):
            return Fraction(s), pct
        m = _FRAC_RE.match(s) or _SLASH_RE.match(s)
        if m:
            return Fraction(int(m.group(1)), int(m.group(2))), pct
        m = _POWER_RE.match(s)
        if m and abs(int(m.group(3) or m.group(4))) <= 64 and len(m.group(2)) <= 4:  # 2^{10}, 10^{-3}
            v = Fraction(int(m.group(2))) ** int(m.group(3) or m.group(4))
            return (-v if m.group(1) == "-" else v), pct
        m = _MIXED_RE.match(s)
        if m:
            sign, whole = m.group(1), int(m.group(2))
            num, den = (int(m.group(3)), int(m.group(4))) if m.group(3) else (int(m.group(5)), int(m.group(6)))
            if 0 < num < den:
                v = whole + Fraction(num, den)
                return (-v if sign == "-" else v), pct
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _terminates(q: Fraction) -> bool:
    d = q.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _decimal_places(expr: str) -> int:
    m = re.search(r"\.(\d+)\s*%?\s*$", expr.strip())
    return len(m.group(1)) if m else 0


# Relative tolerance between two decimal literals (0.3333333334 vs 0.3333333333).
NUMERIC_REL_TOL = Fraction(1, 10**9)


def numbers_equal(x: Fraction, x_text: str, y: Fraction, y_text: str) -> bool:
    """Exact equality; two decimal literals within ``NUMERIC_REL_TOL`` relative (a last-digit
    rounding of a long decimal: relative, so tiny values never match by magnitude); or a decimal literal with >= 2 places standing for a rational that no
    decimal writes exactly, as its rounding or truncation (0.33 / 0.333333 for 1/3)."""
    if x == y:
        return True
    if _decimal_places(x_text) and _decimal_places(y_text):  # two decimals: last-digit rounding
        return abs(x - y) <= NUMERIC_REL_TOL * max(abs(x), abs(y))
    for dec, dec_text, q, q_text in ((x, x_text, y, y_text), (y, y_text, x, x_text)):
        k = _decimal_places(dec_text)
        if k >= 2 and _decimal_places(q_text) == 0 and not _terminates(q):
            scale = 10 ** k
            if dec * scale in (round(q * scale), int(q * scale)):  # half to even, or truncation
                return True
    return False


def number_candidates(expr: str) -> list[tuple[Fraction, str]] | None:
    """The values ``expr`` may stand for, each with its text: ``[(v, expr)]``, and ``v / 100``
    as well for a percentage (``50%`` is 50 or 1/2); None when it is no plain number."""
    p = parse_number(expr)
    if p is None:
        return None
    v, pct = p
    return [(v, expr), (v / 100, expr)] if pct else [(v, expr)]


def number_tuple(expr: str) -> tuple[str, list] | None:
    """``"(1, \\frac12)"`` -> ``("()", [candidates of 1, candidates of 1/2])``: a bracketed tuple
    or interval of plain numbers, or None."""
    m = _TUPLE_RE.match(expr.strip())
    if not m or "(" in m.group(2) or "[" in m.group(2):
        return None
    items = [number_candidates(x) for x in m.group(2).split(",")]
    if len(items) < 2 or any(i is None for i in items):
        return None
    return m.group(1) + m.group(3), items
