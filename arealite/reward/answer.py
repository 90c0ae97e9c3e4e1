"""The final answer of a text, taken whole, and when two answers are the same: the one module that
the math reward (:mod:`arealite.reward.math`), the evaluator (:mod:`arealite.evaluate`) and majority
voting (:mod:`arealite.reward.metrics`) share.

**Extraction** (:func:`extract_final_answer`). The final answer is the expression after the *last*
answer marker — ``\\boxed{...}`` / ``\\fbox{...}`` (its braces matched), ``####``, or "answer is /
answer: / final answer is" — so a self-corrected solution ("\\boxed{5} ... wait, that's wrong ...
\\boxed{6}") answers 6. Without a marker it is the last expression of the text. Either way it is a
*whole* expression, never a fragment of one: a fraction (``\\frac{2}{7}``, ``2/7``), a power
(``7^2``), a mixed number (``3\\frac{1}{2}``, ``3 1/2``), a tuple / interval / list, a
percentage, and the right-hand side of a last ``=`` (``48+24 = 72`` answers 72). Around a number,
currency signs, ``\\text{...}`` and unit words — with their powers (``5 cm^2`` answers 5) — are
dropped; anywhere else a word ends the answer. Values joined by "and" alone, or boxes joined by
"and", ``,`` or ``;``, are a list ("2 and -3", "\\boxed{2} and \\boxed{-3}" answer ``2, -3``).
Two expressions joined by a hedge ("6 or 7", "either 6 or 7", "between 6 and 7",
"\\boxed{6} or \\boxed{7}", "$x = \\boxed{2}$ or $x = \\boxed{3}$"), and a box or a textual
answer with a value offered in words beside it ("\\boxed{2}, although it could be 3",
"\\boxed{2}. Or maybe 3.", "Answer: 3 or \\boxed{2}", "The answer is 2, although it could be
3.") are one compound answer, equal to no single value. A list of
solutions of one unknown (``x = 1, x = 2``, ``x = 1 \\mid x = 2``, and in a box numbered roots
``x_1 = 1, x_2 = 2``) answers the list of its distinct values
(``1, 2``), equal to no single one of them; working (``x = 10/2, x = 5``, ``x^2 = 25, x = 5``)
answers its last right-hand side.

**Equivalence** and votes: :mod:`arealite.reward.equivalence` (:func:`answers_equivalent`,
:func:`group_answers`, re-exported here).

math-verify's own signal timeouts are disabled (they work only in the main thread); run the
reward under :class:`arealite.reward.worker.RewardWorker`, which bounds its time.
"""

from __future__ import annotations

import re

from arealite.reward.equivalence import (  # noqa: F401 - answers_equivalent and group_answers are re-exported
    EQUALS_RE,
    LOGIC_OR,
    MAX_ANSWER_CHARS,
    answers_equivalent,
    group_answers,
    math_verify_equal,
)
from arealite.reward.forms import ascii_forms
from arealite.reward.latex import matching_brace, nested_boxes, top_level, top_level_split
from arealite.reward.numbers import (  # noqa: F401 - parse_number and strip_thousands_separators are re-exported
    number_candidates,
    numbers_equal,
    parse_number,
    strip_thousands_separators,
)
from arealite.reward.sentences import (
    EQ_BEFORE_RE,
    GREEK,
    NAMED_EQ_RE,
    first_sentence,
    hedged_value_after,
    hedged_value_before,
    hedged_word_after,
    named_equations,
    qualifier,
    same_angle,
    unindexed_list,
)


# Only the tail of very long completions is parsed: final answers live at the end.
MAX_PARSE_CHARS = 20_000

# ------------------------------------------------------------------------------------ extraction
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Textual markers: "####", "final answer is / :", "the answer is / was / would be", and "Answer:"
# at the start of a line ("check our answer: ..." is not one).
_TEXT_MARKER_RE = re.compile(
    r"####|\bfinal\s+answer\b\s*(?:is\b|:|=)\s*:?"
    r"|\bthe\s+(?:final\s+)?answer\s+(?:is|was|would\s+be|will\s+be)\b\s*:?"
    r"|^[ \t*#>_-]*answer\s*[*_]*\s*[:=]\s*[*_]*", re.I | re.M)
# Words that join values: a hedge makes one compound answer ("6 or 7", "between 6 and 7"); "and"
# alone makes a list ("6 and 7" reads "6, 7").
_CONNECTORS = {"or", "and", "either", "between", "maybe", "perhaps", "possibly"}
# Between an answer and another value it is hedged with, within one sentence: spaces, commas,
# semicolons, slashes, bars, brackets, LaTeX spacing and "or" symbols, hedge words
# ("\boxed{2} (or maybe 3)", "\boxed{2}, 3", "\boxed{3} / \boxed{2}", "\boxed{3}\boxed{2}").
_HEDGE_WORD = r"\b(?:or|maybe|perhaps|possibly|alternatively|either)\b"
_GAP_TOKEN = rf"[ \t,;/|()*]|\\[()]|\\(?:quad|qquad|lor|vee)(?![A-Za-z])|{_HEDGE_WORD}"
_VALUE_AFTER_RE = re.compile(rf"(?:{_GAP_TOKEN}|[{{}}])*(?=[-+]?\d|\\(?:[dt]?frac|sqrt|boxed|fbox)(?![A-Za-z])|[A-Za-z]\s*=)", re.I)
_GAP_BEFORE_RE = re.compile(rf"(?:{_GAP_TOKEN}|\band\b)*$", re.I)
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
# A \text{} that is only a connector and values ("1.5 \text{ (or 2)}"): its words are the answer's.
_TEXT_HEDGE_RE = re.compile(r"\\(?:text|textrm|mathrm|mbox)\s*\{(\s*(?:[,(]\s*)?(?:(?:or|either|maybe|perhaps|possibly)\b\s*)+[^A-Za-z{}]*)\}")
# A run of math: numbers, LaTeX commands, single letters, operators, brackets, commas, semicolons
# (a list's: "x = 1; x = 2"), spaces.
_TOKEN_RE = re.compile(r"""
    (?P<text>\\(?:text|textbf|textrm|mathrm|mbox|operatorname)\s*\{[^{}]*\})
  | (?P<num>\d+(?:\.\d+)?|\.\d+)
  | (?P<cmd>\\(?:begin|end)\s*\{[a-zA-Z*]+\}|\\[a-zA-Z]+|\\[%{}\\&])
  | (?P<word>[A-Za-z]{2,})
  | (?P<math>[A-Za-z+\-*/^_=<>()\[\]{}%,;|!&×·÷−]|\s+)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
# LaTeX spacing/sizing commands and markup dropped before anything else, with the environments
# that only lay out rows (aligned, cases, array; a piecewise "\left\{ \begin{array}{ll} ... \end{array} \right."
# entirely): their rows and cells are compared one by one (:mod:`arealite.reward.equivalence`).
_NOISE_RE = re.compile(r"(?P<keep>\\\\)|\\left\s*\\\{\s*\\begin\s*\{array\}\s*\{[^{}]*\}|\\end\s*\{array\}\s*\\right\s*\."
                       r"|\\(?:left|right|big|Big|bigg|Bigg|displaystyle|textstyle)\b|\\[,;:! ]|\\\$|\$|\*\*|~"
                       r"|\^\s*\{?\s*\\circ\s*\}?|°|\\(?:begin|end)\s*\{(?:aligned|align|gathered|gather|split|[dr]?cases)\*?\}"
                       r"|\\begin\s*\{array\}\s*\{[^{}]*\}|\\end\s*\{array\}")
# A textual answer without a value: a choice letter ("(C)", "C") or one capitalised word ("Sunday").
_WORD_ANSWER_RE = re.compile(r"[\s*$]*(?:(\([A-Z]\)|[A-Z])|([A-Z][a-z]+))[\s*$]*[.!]?\s*")
_THIN_SPACE_IN_NUMBER_RE = re.compile(r"(?<=\d)(?:(,)\s*\\!\s*|\\[,!])(?=\d{3}(?!\d))")  # not ",\,": a list's space
_NUMBER_TOKEN = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")
_UNIT_POWER_RE = re.compile(r"\s*[\^_]\s*(?:\{\s*-?\d+\s*\}|-?\d+)")
# A number, a space, a one-letter unit (5 m, 3 g, 2 h) and its power: the answer is the number.
_LETTER_UNIT_RE = re.compile(r"^([-+]?(?:\d+(?:\.\d+)?|\.\d+))\s+[mgshlLKVWJNA](?:\s*\^\s*(?:\{\s*\d+\s*\}|\d+))?$")


def _denoise(text: str) -> str:
    """:data:`_NOISE_RE` matches replaced by a space; a LaTeX row break ``\\\\`` is kept, and a thin
    space inside a number is deleted (MATH's ``10,\\!080`` and ``10\\,080`` are 10,080)."""
    text = _THIN_SPACE_IN_NUMBER_RE.sub(r"\1", text)
    return _NOISE_RE.sub(lambda m: m.group(0) if m.group("keep") else " ", text)


# A factorial's "!": right after a number, a letter or a closing bracket ("5!", "n!", "(2n)!"), and
# not "!=". In prose it must be followed by more math ("10!/2", "5! \cdot 2", "3!!" is a double
# factorial); "The answer is 5!" and "5! Great." end a sentence. In a box or a gold answer
# (``whole``) every such "!" is a factorial ("\boxed{5!}" is 120, never 5).
_FACTORIAL_BEFORE_RE = re.compile(r"[\d)\]}A-Za-z!]$")
_FACTORIAL_AFTER_RE = re.compile(r"!*\s*(?:[-+*/^)\]}\d]|\\(?:cdot|times|div|frac)(?![A-Za-z]))")


def _factorial(text: str, at: int, whole: bool) -> bool:
    """Whether the ``!`` at ``text[at]`` is a factorial (:data:`_FACTORIAL_BEFORE_RE`)."""
    if not _FACTORIAL_BEFORE_RE.search(text[max(0, at - 1):at]) or text.startswith("!=", at):
        return False
    return whole or bool(_FACTORIAL_AFTER_RE.match(text, at + 1))


def _segments(text: str, whole: bool = False) -> list[tuple[str, str]]:
    """Split ``text`` into ``("math", s)`` runs and ``("word", w)`` / ``("stop", c)`` separators.

    A multi-letter word (or ``\\text{...}``) ends a run; a ``^``/``_`` right after a word, with its
    exponent (``cm^2``, ``\\text{m}^{3}``), belongs to the word (a unit's power). Sentence
    punctuation (``.`` not inside a number, ``:?``, a ``!`` that is not a factorial
    (:func:`_factorial`; ``whole``: ``text`` is all answer), quotes, other symbols) is a ``stop``."""
    out: list[tuple[str, str]] = []
    cur: list[str] = []

    def flush():
        if cur:
            out.append(("math", "".join(cur)))
            cur.clear()

    pos = 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        kind, tok = m.lastgroup, m.group(0)
        pos = m.end()
        if kind == "text" and re.fullmatch(r"[\s,;]*", tok[tok.index("{") + 1:-1]):
            cur.append(tok[tok.index("{") + 1:-1] + "  ")  # "\text{, }", "\text{ }": the math's punctuation, a wide space
        elif kind in ("text", "word"):
            flush()
            word = tok[tok.index("{") + 1:-1].strip().lower() if kind == "text" else tok.lower()
            power = _UNIT_POWER_RE.match(text, pos)
            if power:  # cm^2, \text{m}^{3}: the unit's own power, never the answer
                word, pos = word + power.group(0), power.end()
            out.append(("word", word or "text"))
        elif kind == "other" or (tok == "!" and not _factorial(text, pos - 1, whole)):
            flush()
            out.append(("stop", tok))
        else:
            cur.append(tok)
    flush()
    return out


def _has_value(run: str) -> bool:
    return bool(re.search(r"\d|\\(?:frac|dfrac|tfrac|sqrt|pi|infty|emptyset)", run))


# What may trail a listed value before the next "x =": separators, bars, LaTeX spaces, "and".
_LIST_TAIL_RE = re.compile(r"(?:[\s,;|&~$]|\\[\\&]|\\(?:mid|vert|lvert|rvert|quad|qquad)(?![A-Za-z])"
                           r"|\\(?:text|mbox|textrm|mathrm)\s*\{[\s,;]*(?:and)?[\s,;]*\})+$")
# Working between two equations: a chain, not a list ("x = 10/2 \implies x = 5").
_WORKING_RE = re.compile(r"\\(?:implies|impliedby|iff|Rightarrow|Longrightarrow|rightarrow|longrightarrow|to|"
                         r"therefore|because|Leftrightarrow)(?![A-Za-z])")


def _same_value(a: str, b: str) -> bool:
    """Whether two values of one unknown are the same number or expression, a calculation
    included (``10/2`` and ``5``, ``12 - 4`` and ``8``, ``2`` and ``2.0``): math-verify."""
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
        return False
    try:
        return math_verify_equal(a, b)
    except Exception:
        return False


def _listed_values(s: str) -> list[str] | None:
    """The values of the unknown named last in ``s`` when ``s`` names it (the same name, subscript
    included) before two or more top-level ``=`` (``x = 1, x = 2``, ``x = 1 \\quad x = 2``,
    ``x = 1 \\mid x = 2``, ``\\theta = 30, \\theta = 150``, ``y = 0, x = 1, x = 2``), each value
    followed only by separators (:data:`_LIST_TAIL_RE`): the distinct values in order — a list —
    or, when all are the same value, the last alone (``x = 10/2, x = 5`` is 5). None otherwise:
    the name given once (``x^2 = 25, x = 5``, ``a = 1, b = 2``; ``x_1 = 1, x_2 = 2`` and a
    sequence ``S_1 = 1, S_2 = 3`` too, unless a box holds them: :func:`unindexed_list`), working in a value (``b = 100 - 20 = 80, b = 80 - 30 =
    50``, ``x = 10/2 \\implies x = 5``), an empty or long value, or a value holding the unknown
    (``x = 1, x = 2x - 1``)."""
    names = named_equations(s)
    if len(names) < 2:
        return None
    name = names[-1].group(1)
    letter = re.match(r"\\[A-Za-z]+|[A-Za-z]", name).group(0)
    values = []
    for m, nxt in zip(names, names[1:] + [None]):
        if m.group(1) != name:
            continue
        raw = s[m.end():nxt.start() if nxt else len(s)]
        if len(raw) > 200:
            return None
        value = _LIST_TAIL_RE.sub("", raw).strip() if nxt else raw.strip()
        if (not value or _WORKING_RE.search(value) or "=" in value
                or re.search(rf"(?<![A-Za-z\\]){re.escape(letter)}(?![A-Za-z])", value)):
            return None
        values.append(_clean_run(value))
    if len(values) < 2:
        return None
    distinct: list[str] = []
    if len(values) > 6:  # many values: equal text or equal plain numbers, one pass (no math-verify)
        keys = {}
        for v in values:
            n = number_candidates(v)
            keys.setdefault(n[0][0] if n else v.replace(" ", ""), v)
        distinct = list(keys.values())
    for v in values if len(values) <= 6 else ():
        if not any(_same_value(v, d) for d in distinct):
            distinct.append(v)
    return distinct if len(distinct) > 1 else values[-1:]


def _other_unknown(rest: str, content: str, before: str) -> bool:
    """Whether ``rest`` (after a box) opens with an equation of an unknown other than the box's,
    named in the box (``\\boxed{x = 2}``) or right before it (``x = \\boxed{2}``)."""
    nxt = NAMED_EQ_RE.match(rest.lstrip())
    own = NAMED_EQ_RE.match(_denoise(content).lstrip()) or re.search(rf"(?:{NAMED_EQ_RE.pattern})\s*$", _denoise(before))
    return bool(nxt and own) and nxt.group(1) != own.group(1)


def _same_number(value: str, answer: str) -> bool:
    """Whether a plain number offered beside a box equals the box's answer as a plain number, or
    is the same angle in degrees and in radians (:func:`same_angle`); no math-verify: extraction
    stays linear."""
    if value.replace(" ", "") == answer.replace(" ", "") or same_angle(value, answer):
        return True
    a, b = number_candidates(value), number_candidates(answer)
    return bool(a and b) and any(numbers_equal(x, xt, y, yt) for x, xt in a for y, yt in b)


def _clean_run(run: str) -> str:
    """Trim a math run to its expression: outer spaces, dangling operators/commas/brackets; the
    right-hand side of the last top-level ``=`` / ``\\approx``; a unit's power after a number."""
    s = run.strip()
    parts = re.split(LOGIC_OR, s)
    if len(parts) > 1:  # "x = -1 \\lor x = 2": each alternative trimmed (its right-hand side), the hedge kept
        return " \\lor ".join(_clean_run(p) for p in parts)
    s = re.sub(r"\\(?:approx|simeq|equiv|in)\b", "=", s)  # "x \in [-2, 7]": the set
    values = _listed_values(s)
    if values:  # "x=1, x=2", "x=1 \\mid x=2": the values as a list (one value: itself)
        return ", ".join(_clean_run(v) for v in values)
    parts = [p.strip() for p in top_level_split(s)]
    if len(parts) > 1 and all(len(eq := top_level(p, EQUALS_RE)) == 1 and _variable_expression(p[:eq[0].start()])
                              for p in parts):
        return ", ".join(parts)  # "x + y = 5, x - y = 1": a system of equations is answered whole, never by its last
    depth, last_eq, lhs_start, start, eq_start = 0, -1, 0, 0, 0
    for i, c in enumerate(s):
        depth += c in "([{"
        depth -= c in ")]}"
        if c in ",;" and depth == 0:
            start = lhs_start = i + 1
        if c == "=" and depth == 0 and s[i - 1:i] not in ("<", ">", "!"):
            last_eq, lhs_start, eq_start = i, last_eq + 1 if last_eq >= start else start, start
    if last_eq >= 0 and not re.search(r"&(?!\s*=)", s):  # "5 & x = 0 \\ 0 & x \neq 0": a piecewise answer's conditions
        # The right-hand side answers after a name or a calculation ("x = 5", "3n = 12", "48 + 24 = 72");
        # an equation of an expression in unknowns is the answer ("20x + 23y + 26z - 69 = 0", "a + b = 8").
        s = s[eq_start:] if _variable_expression(s[lhs_start:last_eq]) else s[last_eq + 1:]
    s = s.strip().strip(",;").strip()
    s = re.sub(r"^[*/^_=,;]+|[-+*/^_=<>,;(\[]+$", "", s).strip()  # a leading "<" / ">" is a bound: kept
    # Unbalanced closing brackets at the end (a sentence's "(... 72)") are not the answer's; "(" and
    # "[" open one class, so an interval keeps its mixed brackets ("(1, 4]", "(-\infty, 2] \cup (5, 7]").
    while s and s[-1] in ")]}" and _unbalanced(s, s[-1]):
        s = s[:-1].rstrip()
    while s and s[0] in "([{" and _unbalanced(s, s[0]):
        s = s[1:].lstrip()
    return s


def _variable_expression(lhs: str) -> bool:
    """Whether an equation's left-hand side is an expression in unknowns (a letter or a Greek
    letter and an operator: ``x^2 + y^2``, ``\\frac{x}{2} - y``), not a name (``x``, ``f(x)``,
    ``3n``, ``m\\angle ABC``) or a calculation (``48 + 24``)."""
    t = re.sub(r"\\(?:d|t)?frac|\\(?:cdot|times|div|sqrt|pm|mp)(?![A-Za-z])", "*", lhs)
    t = re.sub(rf"\\(?:{GREEK})(?![A-Za-z])", " v ", t)
    t = re.sub(r"\\[A-Za-z]+", " ", t).strip().lstrip("-+ ")
    return bool(re.search(r"[A-Za-z]", t) and re.search(r"[-+*/^]", t))


def _unbalanced(s: str, bracket: str) -> bool:
    """Whether ``s`` holds more brackets of ``bracket``'s side than of the other: "(" and "[" count
    as one kind, "{" as another."""
    if bracket in "{}":
        return s.count(bracket) > s.count("}" if bracket == "{" else "{")
    opened = s.count("(") + s.count("[")
    closed = s.count(")") + s.count("]")
    return closed > opened if bracket in ")]" else opened > closed


def _expression(segs: list[tuple[str, str]], last: bool, whole: bool = False) -> str | None:
    """The answer expression of a segment list: the first (``last=False``, after a marker) or the
    last (``last=True``) math run that holds a value, joined with its neighbours when a hedge
    (:data:`_CONNECTORS`) or a comma links them; with the words that qualify it, when some do
    (:func:`arealite.reward.sentences.qualifier`: "at least 5", "5 or more"), so that it equals
    no plain value."""
    idx = [i for i, (k, s) in enumerate(segs) if k == "math" and _has_value(s)]
    if not idx:
        return None
    i = idx[-1] if last else idx[0]

    def is_value(j: int) -> bool:
        return 0 <= j < len(segs) and segs[j][0] == "math" and _has_value(segs[j][1])

    def is_connector(j: int) -> bool:  # a hedge word, or the blank between two ("or maybe")
        return 0 <= j < len(segs) and ((segs[j][0] == "word" and segs[j][1] in _CONNECTORS)
                                       or (segs[j][0] == "math" and not segs[j][1].strip()))

    lo = hi = i
    while True:  # "<value> or <value>" to the left
        j = lo - 1
        while is_connector(j):
            j -= 1
        if j < lo - 1 and is_value(j):
            lo = j
            continue
        break
    while True:  # and to the right
        j = hi + 1
        while is_connector(j):
            j += 1
        if j > hi + 1 and is_value(j):
            hi = j
            continue
        break
    if (words := qualifier(segs, lo, hi, whole)) is not None:
        after = [j for j in range(hi + 1, min(hi + 5, len(segs))) if segs[j][0] != "math" or segs[j][1].strip()]
        if words.endswith("not") and after[:1] and segs[after[0]] == ("word", "but") and is_value(after[1] if after[1:] else -1):
            return _clean_run(segs[after[1]][1])  # "not 4 but 5" answers 5
        return f"{words} {_clean_run(''.join(s for k, s in segs[lo:hi + 1] if k == 'math'))}"
    if lo == hi:
        run = _clean_run(segs[i][1])
        unit = _LETTER_UNIT_RE.match(run)
        return (unit.group(1) if unit else run) or None
    if is_connector(lo - 1):
        lo -= 1  # "either 6 or 7", "between 6 and 7"
    if {s for k, s in segs[lo:hi + 1] if k == "word"} == {"and"}:  # "2 and -3", "x = 2 \text{ and } x = -3": a list
        return ", ".join(_clean_run(s) for k, s in segs[lo:hi + 1] if k == "math" and _has_value(s))
    parts = [(_clean_run(s) if k == "math" else s) for k, s in segs[lo:hi + 1]]
    return " ".join(p for p in parts if p)


def _after_box(text: str, start: int) -> tuple[str | None, int]:
    """The content of the ``\\boxed{`` whose brace is at ``start`` and the index after it."""
    j = matching_brace(text, start)
    if j < 0:
        return None, len(text)
    return text[start + 1:j], j + 1


def extract_final_answer(text: str) -> str | None:
    """The final answer of ``text`` as one whole expression (see the module docstring), or None.

    Args:
        text: a completion or a solution (only its last ``MAX_PARSE_CHARS`` characters are read).

    Returns:
        The expression's text with ``$``, thousands separators, currency, ``\\text{}`` / unit words
        around a number, spacing commands and a leading ``x =`` removed, e.g. ``"\\frac{2}{7}"``,
        ``"3\\frac{1}{2}"``, ``"(1, 2)"``, ``"50%"``, ``"6 or 7"`` (a hedge: compound); None when
        the text holds no value. Never raises on a string; non-strings give None.
    """
    if not isinstance(text, str) or not text.strip():
        return None
    text = ascii_forms(text[-MAX_PARSE_CHARS:])
    # The last marker: a box, or a textual one (its span runs to the end of the sentence).
    # Answer markers, the last first; a marker whose span holds no value ("our answer is
    # correct") gives way to the one before it, and with none the last expression answers.
    marks = sorted([*_BOX_RE.finditer(text), *_TEXT_MARKER_RE.finditer(text)], key=lambda m: -m.start())
    nested = nested_boxes(text, [m for m in marks if m.group(0).startswith("\\")])
    end = len(text)  # a textual marker's span ends at the next marker (linear in the markers)
    for mark in marks:
        if mark.group(0).startswith("\\"):
            if mark.start() in nested:
                continue  # "\boxed{3 or \boxed{2}}": the outer box answers
            answer = _boxed_answer(text, mark)
        else:
            span = text[mark.end():]
            if _BOX_RE.search(span) is not None:
                continue  # "The answer is \boxed{5}": the box inside the span answers
            span = text[mark.end():min(end, mark.end() + 2 * MAX_ANSWER_CHARS)]
            if mark.group(0) == "####":
                span = span.split("\n", 1)[0]
            else:
                span = first_sentence(span)
            answer = _normalise(span, last=False)
            if answer is None:  # "The answer is (C).", "The answer is Sunday."
                word = _WORD_ANSWER_RE.fullmatch(_TEXT_WRAP_RE.sub(r"\1", span))
                answer = word and (word.group(1) or word.group(2))
                offered = answer and hedged_word_after(text[mark.end() + len(span):], answer)  # "Or maybe (D)."
                answer = f"{answer} or {offered}" if offered else answer
            hedged = answer is None or re.search(_HEDGE_WORD + "|" + LOGIC_OR, answer)  # "The answer is 2, although it could be 3."
            offered = None if hedged else hedged_value_after(_denoise(text[mark.end():mark.end() + 300]))
            if offered is not None and not _same_number(offered, answer):
                answer = f"{answer} or {offered}"
        end = mark.start()
        if answer is not None:
            return answer
    return _normalise(text, last=True)


def normalise_gold(answer: str) -> str | None:
    """A reference answer normalised as the completion's answer is: the whole of it, as if it
    were the content of a ``\\boxed{}`` (``"\\text{June 20}"`` -> ``"June 20"``, ``"x = 5"`` ->
    ``"5"``, ``"18 \\text{ cm}"`` -> ``"18"``). None when it is empty or not a string."""
    if not isinstance(answer, str) or not answer.strip():
        return None
    return extract_final_answer("\\boxed{" + answer.strip()[-MAX_ANSWER_CHARS:] + "}")


def _boxed_answer(text: str, box: re.Match) -> str | None:
    """The answer of the ``\\boxed{`` matched by ``box``. A value hedged with it in the same
    sentence makes it compound: another box after it, or a value after a hedge word or symbol
    or a list separator when no word follows in the sentence (``\\boxed{2} or 3``,
    ``\\boxed{2} (maybe 3)``, ``\\boxed{2} \\lor 3``, ``\\boxed{2}, 3.``; not "\\boxed{7} (or 420
    minutes)", "\\boxed{70} / 100 points" or "$N = \\boxed{6}$, $30N + 7 = 187$ is composite"),
    a box before it (``\\boxed{6} or \\boxed{7}``,
    ``\\boxed{3} / \\boxed{2}``, ``\\boxed{3}\\boxed{2}``, ``\\boxed{3}. Or maybe \\boxed{2}``);
    only punctuation that does not end a sentence, LaTeX spacing and hedge words
    (:data:`_GAP_TOKEN`) may sit between them, and a stop before a hedge word. A value offered in
    words (:func:`hedged_value_after`, :func:`hedged_value_before`: ``\\boxed{2}, although it
    could be 3``, ``Answer: 3 or \\boxed{2}``) makes it compound unless it equals the box's. A
    plain value before the box without an answer marker is not read: "equals $50 \\cdot 12$, or
    $\\boxed{600}$" is MATH's "that is", not a hedge."""
    content, after = _after_box(text, box.end() - 1)
    if content is None:
        return None
    for _ in range(8):  # "\boxed{\boxed{2}}": the boxes' content (a few levels)
        inner = _BOX_RE.search(content)
        if inner is None:
            break
        j = matching_brace(content, inner.end() - 1)
        if j < 0:
            break
        content = content[:inner.start()] + content[inner.end():j] + content[j + 1:]
    answer = _normalise(unindexed_list(_denoise(content)), last=False, whole=True)
    if answer is None:  # a boxed word answer ("\boxed{\text{Monday}}"): its text
        word = re.sub(r"\s+", " ", _denoise(_TEXT_WRAP_RE.sub(r"\1", content))).strip() or None
        offered = word and hedged_word_after(text[after:], word)  # "\boxed{C}. Or maybe D."
        return f"{word} or {offered}" if offered else word
    tail = _TEXT_WRAP_RE.sub(r" \1 ", _denoise(text[after:after + 300]))
    gap = _VALUE_AFTER_RE.match(tail)
    if gap:
        rest = tail[gap.end():]
        if _BOX_RE.match(rest):  # "\boxed{3} / \boxed{2}" read from the first: both
            return f"{answer} or {_boxed_answer(rest, _BOX_RE.match(rest)) or '?'}"
        sentence = first_sentence(rest)
        other = _normalise(sentence, last=False)
        hedged = re.search(_HEDGE_WORD + r"|\\(?:lor|vee)|\|", gap.group(0), re.I)
        listed = re.search(r"[,;|]", gap.group(0))
        alone = not re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", "", sentence))  # no unit, no words
        if not hedged and _other_unknown(rest, content, text[max(0, box.start() - 60):box.start()]):
            other = None  # "$x = \boxed{2}$, $y = 3$": the next unknown's value, not a second answer
        explains = not hedged and re.match(rf"\s*{re.escape(answer)}\s*=[^,;]*$", sentence) and not (
            number_candidates(other or "") and not _same_number(other, answer))  # "\boxed{6}; 6 = 2 \cdot 3"
        if (explains or _same_number(other or "", answer)) and not rest[len(sentence):].startswith(";"):
            other = None  # explains or restates the box ("\boxed{30^\circ}, or \frac{\pi}{6}", "\boxed{50\%}, or \frac12")
        if other is not None and re.search(r"\d", other) and (hedged or listed) and alone:
            return f"{answer} or {other}"  # "\boxed{2} (or maybe 3)", "\boxed{2}, 3."
    offered = hedged_value_after(tail)  # "\boxed{2}, although it could be 3"
    if offered is not None and not _same_number(offered, answer):
        return f"{answer} or {offered}"
    before = _TEXT_WRAP_RE.sub(r" \1 ", _denoise(text[max(0, box.start() - 300):box.start()]))
    cut = _GAP_BEFORE_RE.search(before)
    stem, gap = before[:cut.start()].rstrip(), before[cut.start():]
    offered = hedged_value_before(stem, gap)  # "Answer: 3 or \boxed{2}"
    if offered is not None and not _same_number(offered, answer):
        return f"{offered} or {answer}"
    firsts, hedge = _boxes_before(before)
    if hedge:
        return f"{firsts[-1]} or {answer}"  # "\boxed{6} or \boxed{7}", "\boxed{3}\boxed{2}"
    return _distinct([*firsts, answer])  # "\boxed{2} and \boxed{-3}": a list of its distinct values


def _distinct(values: list[str]) -> str:
    """``values`` joined as a list, each value once (boxes: ``\\boxed{2} and \\boxed{2.0}`` is 2)."""
    distinct: list[str] = []
    for v in values:
        if not any(_same_number(v, d) for d in distinct):
            distinct.append(v)
    return ", ".join(distinct)



def _boxes_before(before: str) -> tuple[list[str], bool]:
    """The answers of the boxes that end right before a box (``before``: the de-noised text before
    it), in order, and whether a hedge joins them: boxes linked by ``,``, ``;`` or "and" form a
    list (``\boxed{1}, \boxed{2} and \boxed{3}``), other gaps (:data:`_GAP_BEFORE_RE`: a hedge
    word, ``/``, ``|``, nothing) make the last two a hedge. ``x =`` before each box of one unknown
    is part of the gap (``$x = \boxed{2}$ or $x = \boxed{3}$``); another unknown's ends the chain."""
    firsts: list[str] = []
    while len(firsts) < 8:
        eq = EQ_BEFORE_RE.search(before)
        body = before[:eq.start()] if eq else before
        cut = _GAP_BEFORE_RE.search(body)
        stem, gap = body[:cut.start()].rstrip(), body[cut.start():]
        hedge = bool(re.search(_HEDGE_WORD + r"|[/|]|\\(?:lor|vee)", gap, re.I)) or not re.search(r"[,;]|\band\b", gap)
        if re.search(_HEDGE_WORD, gap, re.I):  # "\boxed{2}. Or maybe \boxed{3}."
            stem = stem.rstrip(".!?;").rstrip()
        prev = None
        for m in _BOX_RE.finditer(stem[-300:]) if stem.endswith("}") else ():
            prev = m
        start = len(stem) - len(stem[-300:]) + prev.end() if prev else -1
        if prev is None or matching_brace(stem, start - 1) != len(stem) - 1:
            break
        prev_eq = EQ_BEFORE_RE.search(stem[:start - len(prev.group(0))]) or NAMED_EQ_RE.match(stem[start:].lstrip())
        if eq and not (prev_eq and prev_eq.group(1) == eq.group(1)):
            break  # "$x = \boxed{2}$, $y = \boxed{3}$": two unknowns' values
        first = _normalise(stem[start:-1], last=False, whole=True)
        if first is None:
            break
        firsts.insert(0, first)
        if hedge:
            return firsts, True
        before = stem[:start - len(prev.group(0))]
    return firsts, False


def _word_listed(segs: list[tuple[str, str]]) -> bool:
    """Whether a word other than a hedge is listed beside a value, a ``,`` or ``;`` between them
    (``\\text{unknown}, 5``, ``5, \\text{none}``): a list, equal to no single value."""
    def listed(j: int, edge: int) -> bool:  # a run with a value and a separator at its ``edge`` (0: first, -1: last)
        return 0 <= j < len(segs) and segs[j][0] == "math" and _has_value(segs[j][1]) and segs[j][1].strip()[edge] in ",;"
    return any(k == "word" and v not in _CONNECTORS and (listed(i + 1, 0) or listed(i - 1, -1)) for i, (k, v) in enumerate(segs))


def _normalise(span: str, last: bool, whole: bool = False) -> str | None:
    """The answer expression of ``span`` (:func:`_expression` on its segments), spaces collapsed.

    ``whole``: ``span`` is all answer (a box's content, a gold answer): when words or stops sit
    *between* two of its values other than a hedge ("3qr + 6q", "3:1", "4:30 p.m."), the whole
    text is the answer, not its first value."""
    text = strip_thousands_separators(_denoise(span))
    text = _TEXT_HEDGE_RE.sub(lambda m: " " + re.sub(r"\b(?:(?:or|either|maybe|perhaps|possibly)\b\s*)+", "or ", m.group(1)) + " ", text)
    # "1.5 \text{ (or 2)}" -> "1.5 (or 2)", "\text{, maybe 3}" -> ", or 3": a hedge, not a unit
    text = re.sub(r"!=|\\not\s*=", r" \\neq ", text)  # "x != 3", "x \not= 3" say x is not 3 (never the answer 3)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", text)  # \frac12
    text = re.sub(r"(?<=\S)\s+(?=\\%)", "", text).replace("\\%", "%")  # "50 \\%" (linear on long blanks)
    text = re.sub(r"(\d)\s*(?:percent|per\s+cent)\b", r"\1%", text)
    segs = _segments(text, whole)
    values = [i for i, (k, v) in enumerate(segs) if k == "math" and _has_value(v)]
    rows = values and len(segs) > 1 and re.search(r"\\\\|&", text)  # rows and cells with words: a piecewise answer
    if whole and (rows or _word_listed(segs) or len(values) > 1 and any(
            k == "stop" or (k == "word" and v not in _CONNECTORS) for k, v in segs[values[0]:values[-1]])):
        return re.sub(r"\s+", " ", _clean_run(text)).strip() or None
    expr = _expression(segs, last, whole)
    if expr is None:
        return None
    return re.sub(r"\s+", " ", expr).strip() or None

