"""When two final answers (:func:`arealite.reward.answer.extract_final_answer`) are the same answer,
for the math reward, the evaluator and majority voting.

**Equivalence** (:func:`answers_equivalent`). Plain numbers (integers, decimals, ``a/b``,
``\\frac``/``\\dfrac``/``\\tfrac``/``\\frac12``, mixed numbers, percentages) compare as exact
rationals (:func:`parse_number`): ``2.50 == 5/2 == 2\\frac{1}{2}``; ``p%`` equals ``p`` and
``p/100``; a decimal stands for a non-terminating rational only as its rounding to >= 2 places
(``0.33`` for 1/3). Against a plain-number gold, an unevaluated calculation (``23 + 50``,
``3 \\cdot 4``) is not an answer. Everything else goes to math-verify's ``parse``/``verify`` on the
two whole expressions (``$...$``), with its numeric verdict checked to a relative tolerance
(:func:`_numerically_distinct`: math-verify alone calls 2^-99 and 2^-100 equal).

**Votes** (:func:`group_answers`): answers are grouped by that equivalence, so ``\\dfrac{1}{2}``,
``\\frac12``, ``0.5`` and ``1/2`` vote together.

math-verify's own signal timeouts are disabled (they work only in the main thread); run the
reward under :class:`arealite.reward.worker.RewardWorker`, which bounds its time.
"""

from __future__ import annotations

import itertools
import logging
import re

from arealite.reward.latex import top_level, top_level_split
from arealite.reward.numbers import number_candidates, number_tuple, numbers_equal, parse_number
from arealite.reward.sentences import QUALIFIER_RE

# math_verify warns on every call that its signal timeouts are disabled: our worker enforces one.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# Answers (extracted, or gold) longer than this are not given to math-verify (its parser is
# superlinear on long garbage): they are then equal only when their text is.
MAX_ANSWER_CHARS = 1_000

# LaTeX commands that join two values into something that is not one number ("1000 \cup 7",
# "3 \to 2", "\cancel{1000} 7"): against a plain-number gold, an answer with two numbers and one
# of them is no answer.
_JOINING_COMMANDS = {"cup", "cap", "setminus", "to", "rightarrow", "Rightarrow", "leftarrow", "Leftarrow",
                     "mapsto", "implies", "iff", "parallel", "perp", "land", "wedge", "sim", "simeq", "ne", "neq",
                     "le", "leq", "ge", "geq", "lt", "gt", "pm", "mp", "oplus", "otimes", "atop", "choose", "tag",
                     "cancel", "bcancel", "xcancel", "sout", "not", "ldots", "cdots", "dots", "vdots", "therefore",
                     "because", "longrightarrow", "Longrightarrow", "leftrightarrow", "Leftrightarrow", "vee", "lor"}
# A disjunction: "6 or 7", "1.5 \\lor 2", "1.5 \\vee 2" (a hedge in words or logic symbols): an answer
# holding one equals only another holding one, or a single answer equal to all its alternatives.
LOGIC_OR = r"\\(?:lor|vee)(?![A-Za-z])"
_OR_RE = re.compile(LOGIC_OR + r"|\bor\b")
# "1.5 | 2", "1.5 \\mid 2": against a plain-number gold no answer (| also writes |x| and set-builder
# notation, so against any other gold math-verify judges).
_BAR_RE = re.compile(r"\||\\(?:mid|vert|lvert|rvert)(?![A-Za-z])")
# A calculation: an arithmetic operator between two operands (not a leading sign, not in an exponent).
_CALCULATION_RE = re.compile(r"(?<=[\w)}\]])\s*(?:[-+*×·÷−]|\\times|\\cdot|\\div)\s*(?=[\w(\\{.])")


def _numerically_distinct(a, b) -> bool:
    """True when sympy numbers ``a`` and ``b`` (no free symbols) differ by more than a relative
    tolerance: 1e-12 for exact numbers at 50 digits, 1e-4 with a float on either side.
    math-verify compares ``(a - b).evalf(chop=True) == 0`` with an absolute chop, so 2^-99 and
    2^-100 would be "equal". Non-numbers (sets, intervals, relations, strings) return False."""
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
        tol = 1e-4 if (a.has(sympy.Float) or b.has(sympy.Float)) else 1e-12
        return bool(abs(x - y) > tol * max(abs(x), abs(y)))
    except Exception:  # a comparison we cannot judge: keep math-verify's verdict
        return False


def math_verify_equal(pred: str, gold: str) -> bool:
    """Whether math-verify's ``verify`` holds on ``pred`` and ``gold`` (each parsed as ``$...$``,
    its first parsed object only) and :func:`_numerically_distinct` does not veto it. Unbounded
    in time (no signal timeouts): call it under the reward worker. May raise what math-verify
    raises; callers catch."""
    from math_verify import parse, verify

    g = parse("$" + gold + "$", parsing_timeout=None)
    p = parse("$" + pred + "$", parsing_timeout=None)
    if not g or not p:
        return False
    # Only the parsed objects (index 0), not math-verify's fallback strings: a string match of
    # "6 or 7" against "7" must never count.
    return bool(verify([g[0]], [p[0]], timeout_seconds=None)) and not _numerically_distinct(g[0], p[0])


def _same_cells(pred: str, gold: str) -> bool:
    """Rows (``\\\\``) and cells (``&``) of a piecewise answer (its ``cases`` environment
    removed), compared cell by cell with :func:`answers_equivalent`: the same shape and every cell
    equal, the rows in order or (up to 4 rows) in any order; a row without ``&`` splits at a
    ``\\quad`` or an "if"; "if", "when", "is" and ``\\text{}`` wrappers and trailing commas are
    dropped from cells, the prediction's "otherwise" ("else") in the last row stands for any
    condition and the gold's, in two rows, for the first row's complement (``x < 0`` / ``x \\ge 0``) (math-verify alone calls any two piecewise answers equal); at most 16 rows."""
    def cell(c: str) -> str:  # "if x<0," -> "x<0"; "else", "elsewhere" -> "otherwise"
        c = " ".join(re.sub(r"\b(?:if|for|when|where|is|are)\b", " ", c).split()).strip(" ,.;")
        return "otherwise" if c in ("else", "elsewhere") else c

    def same_row(a: list[str], b: list[str], last: bool) -> bool:  # the prediction's "otherwise" ends it
        return len(a) == len(b) and all(x == y or answers_equivalent(x, y) or (last and j and x == "otherwise")
                                        for j, (x, y) in enumerate(zip(a, b)))

    def cells(s: str) -> list[list[str]]:  # cells split by "&", or by a \quad or an "if" in a row without "&"
        out = []
        for row in re.split(r"\\\\", s):
            row = re.sub(r"\\(?:text|textrm|mathrm|mbox)\s*\{([^{}]*)\}", r" \1 ", row)
            if row.strip():
                parts = row.split("&") if "&" in row else re.split(
                    r"\\q?quad(?![A-Za-z])|,?\s*\b(?:if|when)\b|,\s*(?=otherwise\b|else)", row, maxsplit=1)
                out.append([cell(c) for c in parts])
        return out

    p, g = cells(pred), cells(gold)
    if not len(p) == len(g) <= 16:
        return False
    if len(g) == 2 and len(g[1]) == 2 and g[1][1] == "otherwise" and len(g[0]) == 2:  # the other row's complement
        g = [g[0], [g[1][0], _negated(g[0][1]) or "otherwise"]]
    if all(same_row(a, b, i == len(p) - 1) for i, (a, b) in enumerate(zip(p, g))):
        return True
    if len(p) > 4:
        return False
    match = [[same_row(a, b, False) for b in g] for a in p]  # rows in another order
    return any(all(match[i][j] for i, j in enumerate(order)) for order in itertools.permutations(range(len(g))))


_NEGATED = {"<": "\\ge", ">": "\\le", "\\le": ">", "\\leq": ">", "\\ge": "<", "\\geq": "<", "=": "\\neq",
            "\\neq": "=", "\\ne": "="}


def _negated(condition: str) -> str | None:
    """``x < 0`` -> ``x \\ge 0``: one relation's complement, or None."""
    ops = re.findall(r"\\(?:leq?|geq?|neq?)(?![A-Za-z])|[<>=]", condition)
    if len(ops) != 1:
        return None
    return condition.replace(ops[0], " " + _NEGATED[ops[0]] + " ", 1)


def _one_value(a: str, b: str) -> bool:
    """Two alternatives of a hedge that are one value: equivalent, and a percentage only as its
    value / 100 (``75% or 0.75``; ``50 or 50%`` are two values)."""
    if ("%" in a) != ("%" in b):
        pct, other = (a, b) if "%" in a else (b, a)
        p, q = number_candidates(pct.replace("%", "")), number_candidates(other)
        return bool(p and q) and any(x / 100 == y for x, _ in p for y, _ in q)
    return answers_equivalent(a, b)


# An "=" that is not part of "<=", ">=" or "!=".
EQUALS_RE = re.compile(r"(?<![<>!])=")


def _last_equals(s: str) -> int:
    """Index of the last ``=`` outside brackets (not in ``<=``, ``>=``, ``!=``), or -1. Extraction
    keeps an equation only when its left-hand side is an expression in unknowns."""
    eqs = top_level(s, EQUALS_RE)
    return eqs[-1].start() if eqs else -1


def _top_level_commas(s: str) -> int:
    """Commas of ``s`` outside brackets and braces."""
    return len(top_level_split(s)) - 1


def _bracketed(s: str) -> bool:
    """Whether ``s`` is one bracketed group, "(" or "[" to ")" or "]": ``(1, 4]`` is, ``(1,2),(3,4)``
    and ``(A), (C)`` are lists of groups."""
    s = s.strip()
    if s[:1] not in ("(", "[") or s[-1:] not in (")", "]"):
        return False
    depth = 0
    for i, c in enumerate(s):
        depth += (c in "([") - (c in ")]")
        if depth == 0:
            return i == len(s) - 1
    return False


_REL = r"(<|>|≤|≥|\\l(?:e|eq|eqslant)(?![A-Za-z])|\\g(?:e|eq|eqslant)(?![A-Za-z]))"
_ONE_SIDED_RE = re.compile(r"([A-Za-z])\s*" + _REL + r"\s*([^<>≤≥=,]+)")
_ONE_SIDED_FLIPPED_RE = re.compile(r"([^<>≤≥=,]+?)\s*" + _REL + r"\s*([A-Za-z])")
_TWO_SIDED_RE = re.compile(r"([^<>≤≥=,]+?)\s*" + _REL + r"\s*([A-Za-z])\s*" + _REL + r"\s*([^<>≤≥=,]+)")
_HAS_REL_RE = re.compile(_REL + "|=")
_REPEATING_RE = re.compile(r"(?<![\d.])(\d*)\.(\d*)\\(?:overline|bar)\s*\{\s*(\d+)\s*\}(?!\s*_)")
# a decimal of >= 2 places, which the rounding rule may read as a rational (0.27, .33; not 1.5, 0.2\overline{7})
_FINITE_DECIMAL_RE = re.compile(r"(?<![\d.])\d*\.\d{2,}(?!\d|\s*\\(?:overline|bar))")
_PLUS_MINUS_RE = re.compile(r"\\(pm|mp)(?![A-Za-z])")
# A negation anywhere ("x \\neq 5", "\\neg 5"), or a relation that starts the answer with nothing
# on its left ("< 5", "\\ge 5"): a bound or an exclusion, never the value itself.
_NEGATION_RE = re.compile(r"\\(?:ne|neq|not|neg|lnot|notin|nless|ngtr|nleq|ngeq)(?![A-Za-z])|≠")
_LEADING_REL_RE = re.compile(r"^\s*(?:[<>≤≥]|\\(?:le|leq|ge|geq|leqslant|geqslant|lt|gt|ll|gg)(?![A-Za-z]))")


def _qualified(s: str) -> tuple[bool, bool, bool]:
    """Whether ``s`` negates (:data:`_NEGATION_RE`), starts with a relation, or holds a qualifying
    word (:data:`arealite.reward.sentences.QUALIFIER_RE`: "at least 5", "5 or more")."""
    return (bool(_NEGATION_RE.search(s)), bool(_LEADING_REL_RE.match(s)),
            bool(QUALIFIER_RE.search(re.sub(r"\\[A-Za-z]+", " ", s))))


def _repeating_decimals(s: str) -> str:
    """``0.1\\overline{6}`` (also ``\\bar``) as the exact fraction it denotes,
    ``\\frac{1}{6}``: I.N(R) = (INR - IN) / (10^|N| (10^|R| - 1)). Only digits under the bar
    (``\\overline{CD}`` is a segment and stays), in base 10 (``0.\\overline{4}_7`` stays), at
    most 200 digits (Python's int <-> str conversion refuses 4,300)."""
    s = re.sub(r"(\\(?:overline|bar)\s*\{\s*\d+\s*\})\s*_\s*(?:10|\{\s*10\s*\})", r"\1", s)  # base 10 said

    def frac(m: re.Match) -> str:
        whole, fixed, rep = m.group(1) or "0", m.group(2), m.group(3)
        if len(whole + fixed + rep) > 200:
            return m.group(0)
        num = int(whole + fixed + rep) - int(whole + fixed)
        return "\\frac{%d}{%d}" % (num, 10 ** len(fixed) * (10 ** len(rep) - 1))
    return _REPEATING_RE.sub(frac, s)


def _plus_minus(s: str) -> str:
    """An answer with one ``\\pm`` (``\\mp``) as the list of its two values: ``\\pm 4`` -> ``4, -4``;
    ``\\frac{3 \\pm \\sqrt{5}}{2}`` -> ``\\frac{3 + \\sqrt{5}}{2}, \\frac{3 - \\sqrt{5}}{2}``; an
    equation splits into two (``x + y = \\pm 4`` -> ``x + y = 4, x + y = -4``, which equals no
    equation of one sign); a trailing ``5 \\pm`` reads ``5+, 5-``, no single value. One bracketed
    tuple is the list of its two tuples (``(\\pm 1, 2)`` -> ``(1, 2), (-1, 2)``); in a list or a set
    each member with one ``\\pm`` is its two values (``\\{1 \\pm \\sqrt{5}, -2\\}`` -> ``1 + \\sqrt{5},
    1 - \\sqrt{5}, -2``). Unchanged: an answer with an "or", a member with two ``\\pm``, and a
    measurement of two plain numbers (``5.0 \\pm 0.1`` is not the pair 4.9, 5.1)."""
    n = len(_PLUS_MINUS_RE.findall(s))
    t = s.strip()
    if n == 0 or _OR_RE.search(s):
        return s
    if n == 1 and _bracketed(t):  # a tuple: the tuple's commas hidden, its one \pm split
        inner = _plus_minus(t[1:-1].replace(",", "\x00"))
        return ", ".join(t[0] + half.replace("\x00", ",") + t[-1] for half in inner.split(", ")) if "," in inner else s
    body = t[2:-2] if t.startswith("\\{") and t.endswith("\\}") else t  # a set: its members
    members = top_level_split(body)
    if len(members) > 1:  # a list
        if any(len(_PLUS_MINUS_RE.findall(m)) > 1 for m in members):
            return s
        return ", ".join(_plus_minus(m).strip() for m in members)
    if n != 1 or re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*\\(?:pm|mp)\s*\d+(?:\.\d+)?\s*", s):  # "5.0 \pm 0.1": a measurement
        return s
    first, second = ("+", "-") if "\\pm" in s else ("-", "+")
    return ", ".join(re.sub(r"^\s*\+\s*", "", _PLUS_MINUS_RE.sub(sign, s)) for sign in (first, second))


def _interval(s: str) -> str | None:
    """A one-variable inequality as its interval: ``x > 3`` -> ``(3, \\infty)``, ``-2 \\le x < 5``
    -> ``[-2, 5)``, ``4 \\ge x`` -> ``(-\\infty, 4]``. None for anything else (a union, an
    equation, two variables)."""
    def op(rel: str) -> tuple[bool, bool]:  # (points up: x > a, strict)
        return rel in (">", "≥") or rel.startswith("\\g"), rel in ("<", ">")
    s = s.strip()
    if len(s) > 200 or _OR_RE.search(s) or "\\text" in s or s.count("^") > 1:
        return None  # (a power tower as a bound: sympy may try to evaluate 9^{9^{9}})
    if m := _TWO_SIDED_RE.fullmatch(s):
        (up1, strict1), (up2, strict2) = op(m.group(2)), op(m.group(4))
        if up1 != up2:
            return None
        lo, hi, lo_strict, hi_strict = m.group(1), m.group(5), strict1, strict2
        if up1:  # b > x > a
            lo, hi, lo_strict, hi_strict = hi, lo, strict2, strict1
        bounds = parse_number(lo.strip()), parse_number(hi.strip())
        if None not in bounds and bounds[0][0] >= bounds[1][0]:
            return None  # "5 < x < 3" is empty, not the pair (5, 3)
        return f"{'(' if lo_strict else '['}{lo.strip()}, {hi.strip()}{')' if hi_strict else ']'}"
    if m := _ONE_SIDED_RE.fullmatch(s):
        (up, strict), bound = op(m.group(2)), m.group(3).strip()
    elif m := _ONE_SIDED_FLIPPED_RE.fullmatch(s):  # a < x is x > a
        (down, strict), bound = op(m.group(2)), m.group(1).strip()
        up = not down
    else:
        return None
    if not re.search(r"\d|\\pi|\\sqrt|\\frac", bound):
        return None  # "x > y": no number to bound it
    return f"{'(' if strict else '['}{bound}, \\infty)" if up else f"(-\\infty, {bound}{')' if strict else ']'}"


def _inequality_as_interval(pred: str, gold: str) -> tuple[str, str]:
    """The side that is a one-variable inequality (:func:`_interval`) as its interval, when the
    other side holds no relation (an interval, a number); otherwise both unchanged (two
    inequalities go to math-verify as they are)."""
    for i, (a, b) in enumerate(((pred, gold), (gold, pred))):
        if not _HAS_REL_RE.search(b) and (interval := _interval(a)) is not None:
            return (interval, gold) if i == 0 else (pred, interval)
    return pred, gold


def _rewritten(pred: str, gold: str) -> tuple[str, str]:
    """The pair :func:`answers_equivalent` compares instead of ``(pred, gold)`` (the same pair when
    no rule applies): a predicted ``a + b = \\pm 4`` with one plain left side against a gold
    with no relation is its right-hand side; a repeating decimal is its fraction
    (:func:`_repeating_decimals`) when the other side writes no decimal of >= 2 places (the
    rounding rule would pay 0.27 for 0.\\overline{27}, or 0.\\overline{3} for a rounded 0.33);
    one ``\\pm`` is a list (:func:`_plus_minus`); an inequality is an interval
    (:func:`_inequality_as_interval`)."""
    eq_at = _last_equals(pred)
    if (eq_at >= 0 and _PLUS_MINUS_RE.search(pred[eq_at + 1:]) and not _HAS_REL_RE.search(gold)
            and re.fullmatch(r"[\w\s+\-*/^(){}]+", pred[:eq_at])  # one plain left side: no list or relation,
            and not re.search(r"[A-Za-z]{2,}", pred[:eq_at])):  # no word ("6 or a + b = \pm 4" is a hedge)
        return pred[eq_at + 1:].strip(), gold
    rep_pred = _repeating_decimals(pred) if not _FINITE_DECIMAL_RE.search(gold) else pred
    rep_gold = _repeating_decimals(gold) if not _FINITE_DECIMAL_RE.search(pred) else gold
    return _inequality_as_interval(_plus_minus(rep_pred), _plus_minus(rep_gold))


def answers_equivalent(pred: str | None, gold: str | None) -> bool:
    """Whether two *extracted* answers (:func:`extract_final_answer`) are the same answer.
    First :func:`_rewritten`: a repeating decimal is its fraction (unless the other side writes a
    decimal of >= 2 places), one ``\\pm`` a list (``\\pm 4`` = ``-4, 4``, never 4 alone), and a
    one-variable inequality its interval (``x > 3`` = ``(3, \\infty)``).

    Args:
        pred: the model's final answer, e.g. ``"\\frac{1}{2}"``; None never matches.
        gold: the reference final answer, normalised the same way.

    Returns:
        True when both are plain numbers with equal exact values (:func:`parse_number`; a percentage also
        equals its value / 100), or, for anything else, when math-verify's ``verify`` holds on the whole
        expressions and no relative-precision check vetoes it. A calculation (``23 + 50``) never equals a
        plain-number gold; a compound hedge never equals anything but the same text, and an answer with a
        disjunction (``or``, ``\\lor``, ``\\vee``) never equals one without, unless every alternative equals
        it (``"x+11 or 11+x"`` against ``"11+x"``) or all alternatives are one value (``"75% or 0.75"``
        against 75); a negation, a bound or a qualifying word on one side only (:func:`_qualified`: ``\\neq
        5``, ``\\ge 5``, ``at least 5``) never; against a plain number, an answer with ``|`` or ``\\mid``
        never counts (``1.5 | 2``, ``|-3|``); answers with different numbers of commas (a list against a
        scalar, a pair against a triple) are never equal, nor a bare list and a bracketed tuple or interval
        (``1, 4`` against ``(1, 4)``). An equation (extraction keeps one whose left-hand side is an expression
        in unknowns) equals an equation only (math-verify), or, as the prediction against a gold that is none,
        by its right-hand side (``a + b = 8`` answers 8; ``0`` never answers ``x + y + z = 0``). Never raises
        (a failing comparison is False).
    """
    if not isinstance(pred, str) or not isinstance(gold, str) or not pred or not gold:
        return False
    if pred.replace(" ", "") == gold.replace(" ", "") or _qualified(pred) != _qualified(gold):
        return pred.replace(" ", "") == gold.replace(" ", "")  # "\neq 5", "\ge 5", "at least 5" are not 5
    normal = _rewritten(pred, gold)
    if normal != (pred, gold):  # "\pm 4" is the list "4, -4"; 0.1\overline{6} is 1/6; x > 3 is (3, \infty)
        return answers_equivalent(*normal)
    letters = re.fullmatch(r"\(?([A-Za-z])\)?", pred.strip()), re.fullmatch(r"\(?([A-Za-z])\)?", gold.strip())
    if all(letters):  # a choice letter with or without brackets ("(C)" and "C"); "E" is not e
        return letters[0].group(1) == letters[1].group(1)
    if re.search(r"\\\\|&", pred + gold) and "\\begin" not in pred + gold:  # a piecewise function: "2x & x<0 \\ 3 & x \ge 0"
        return max(len(pred), len(gold)) <= MAX_ANSWER_CHARS and _same_cells(pred, gold)
    if pred.count(",") != gold.count(","):
        return False  # a list / tuple / interval never equals a scalar, nor one of another length
    if "," in pred and _bracketed(pred) != _bracketed(gold):
        return False  # the solutions "1, 4" are neither the interval nor the point (1, 4)
    if bool(_OR_RE.search(pred)) != bool(_OR_RE.search(gold)):
        # a hedge never equals a single answer, unless its alternatives all are that answer
        # ("x+11 or 11+x" against "11+x")
        hedge, single = (pred, gold) if _OR_RE.search(pred) else (gold, pred)
        members = [m.strip() for m in _OR_RE.split(hedge)]
        if 1 < len(members) <= 6 and all(a and b and _one_value(a, b) for a, b in itertools.combinations(members, 2)):
            return any(answers_equivalent(m, single) for m in members)  # "75% or 0.75": one value twice
        return len(members) > 1 and all(m and answers_equivalent(m, single) for m in members)
    pred_eq, gold_eq = _last_equals(pred), _last_equals(gold)  # after the hedge and list checks
    if gold_eq >= 0 and pred_eq < 0:
        return False  # "0" never answers the plane "20x + 23y + 26z - 69 = 0"
    if pred_eq >= 0 and gold_eq < 0:
        if _top_level_commas(pred[:pred_eq]) != _top_level_commas(pred[pred_eq + 1:]):
            return False  # "0, x + y = \pm 4": a list ending in an equation, not "x, y = 3, 4"
        return answers_equivalent(pred[pred_eq + 1:].strip(), gold)  # "a + b = 8" answers 8
    try:
        g, p = number_candidates(gold), number_candidates(pred)
        if g is not None:
            if p is not None:
                return any(numbers_equal(a, at, b, bt) for a, at in p for b, bt in g)
            if (_CALCULATION_RE.search(pred) or _BAR_RE.search(pred) or re.search(r"\\\\|&", pred)
                    or re.search(r"\d[{}]*\s+[{}]*\d", pred)  # two numbers side by side: "}{1000} 7"
                    or (len(re.findall(r"\d+", pred)) > 1  # two values joined by an operator or a stand-in
                        and (set(re.findall(r"\\([a-zA-Z]+)", pred)) & _JOINING_COMMANDS
                             or any(ord(c) > 127 and c not in "−×·÷" for c in pred)))
                    or re.search(r"[A-Za-z]{2,}", re.sub(r"\\[a-zA-Z]+", "", pred))):
                return False  # "23 + 50" / "6 or 7" / "1.5 | 2" / "|-3|" against a number: not an answer
        elif p is not None and re.search(r"[A-Za-z]{2,}", re.sub(r"\\[a-zA-Z]+", "", gold)):
            return False
        gt, pt = number_tuple(gold), number_tuple(pred)
        if gt is not None and pt is not None:  # (1, 2) vs (1,2): brackets and values, in order
            return gt[0] == pt[0] and len(gt[1]) == len(pt[1]) and all(
                any(numbers_equal(x, xt, y, yt) for x, xt in a for y, yt in b) for a, b in zip(pt[1], gt[1]))
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return False
        return math_verify_equal(pred, gold)
    except Exception:
        return False


def group_answers(answers: list[str | None]) -> list[int | None]:
    """Group extracted answers by :func:`answers_equivalent`: one group id per answer (the index of
    the group's first member), None for a missing answer. ``["\\frac{1}{2}", "0.5", "3", "1/2"]``
    -> ``[0, 0, 2, 0]``. Each answer joins the first earlier group whose first member it equals.

    Cost: one comparison per (answer, group) pair."""
    reps: list[int] = []
    out: list[int | None] = []
    for i, a in enumerate(answers):
        if a is None:
            out.append(None)
            continue
        for r in reps:
            if answers_equivalent(a, answers[r]) or answers_equivalent(answers[r], a):
                out.append(r)
                break
        else:
            reps.append(i)
            out.append(i)
    return out
