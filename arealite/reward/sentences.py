"""Sentences and named unknowns around a final answer, for the math reward
(:mod:`arealite.reward.answer`): where the answer's sentence ends, which ``<name> =`` begin an
equation, indexed names of one unknown in a box (``x_1 = 1, x_2 = 2``), and a second value
offered in words beside a box (``\\boxed{2}, although it could be 3``; ``Answer: 3 or
\\boxed{2}``). Plain functions of (de-noised) strings; none raises on a string."""

from __future__ import annotations

import re

from arealite.reward.latex import top_level

# An unknown's name: a letter or a Greek letter, then primes, a subscript or a bracketed index
# (x, x_1, x_{12}, x', x^{(2)}, \theta_1); group 1 is the letter, shared by x_1 and x_2.
_GREEK = ("alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu|xi|"
          "pi|rho|sigma|tau|upsilon|phi|varphi|chi|psi|omega")
_NAME = rf"((?:[A-Za-z]|\\(?:{_GREEK}))(?![A-Za-z])'*(?:_\{{?\w+\}}?|\^\{{\(\w+\)\}})?)"
# A named unknown before its "=" (or aligned "&="); :func:`named_equations` keeps those that
# start an equation (at the start, or after a separator, a row break or a LaTeX command).
NAMED_EQ_RE = re.compile(rf"{_NAME}\s*&?\s*=(?!=)")
_EQ_START_RE = re.compile(r"(?:^|[,;|&~$]|\\\\|\\[A-Za-z]+)$")
_LETTER_RE = re.compile(r"\\[A-Za-z]+|[A-Za-z]")

# A plain value: an integer, a decimal, a/b or a \frac of two plain parts.
_VALUE = r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?|[-+]?\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"
# A second value offered in words at the end of a sentence: a modal after its subject anywhere in
# the sentence ("although it could be 3", "but the answer might also be 3"), or a hedge word that
# opens the sentence ("Or maybe 3.", ", though perhaps 3"; not "divided by 2, 3, 4, or 6"); then
# nothing but brackets and a stop after the value.
_HEDGED_VALUE_RE = re.compile(
    r"(?:\b(?:it|this|that|answer|result|value)\s+(?:could|might|may|can)\s+(?:also\s+|well\s+|instead\s+|even\s+)?be"
    r"|^[\s,;:(]*(?:(?:but|though|although|and)\s+)?(?:or\s+)?(?:or|maybe|perhaps|possibly|alternatively)\b)"
    rf"[\s:=(]*(?P<value>{_VALUE})[\s)]*[.!?]?\s*$", re.I)
_SENTENCE_END_RE = re.compile(r"(?<=[.!?])\s+|\n")
# A hedge between a value and the box after it: "3 or \boxed{2}", "3 \lor \boxed{2}".
_HEDGE_GAP_RE = re.compile(r"\b(?:or|maybe|perhaps|possibly|alternatively)\b|\\(?:lor|vee)(?![A-Za-z])", re.I)
# The plain value that ends a text, not an operand ("3", "x = 3"; not "50 \cdot 12").
_VALUE_END_RE = re.compile(rf"(?:^|(?<=[\s:=(]))(?P<value>{_VALUE})\s*$")
_OPERATOR_END_RE = re.compile(r"(?:[-+*/^×·÷]|\\(?:cdot|times|div|pm|mp))\s*$")


def named_equations(s: str) -> list[re.Match]:
    """The top-level ``<name> =`` of ``s`` that begin an equation: ``x = 1, x = 2`` and
    ``x = 1 \\; x = 2`` (LaTeX spacing leaves two or more spaces) have two; ``a + b = 8``,
    ``p q = 6`` and ``3 n = 12`` have none (their left-hand side is more than a name)."""
    starts = []
    for m in top_level(s, NAMED_EQ_RE):
        before = s[max(0, m.start() - 30):m.start()]
        if _EQ_START_RE.search(before.rstrip()) or before.endswith("  "):  # a separator, or a wide space
            starts.append(m)
    return starts


def unindexed_list(content: str) -> str:
    """A box's ``content`` with indexed names of one letter made that letter when the box names
    two or more of them (``x_1 = 1, x_2 = 2`` -> ``x = 1, x = 2``: the roots of one unknown, read
    as a list), else ``content`` unchanged (``S_5 = 31``, ``x = 1, y = 2``). In a box the
    equations are the answer, so indexed names list values; outside one they may be working."""
    names = named_equations(content)
    indexed = [m for m in names if m.group(1) != _LETTER_RE.match(m.group(1)).group(0)]
    letters = {_LETTER_RE.match(m.group(1)).group(0) for m in indexed}
    if len(indexed) < 2 or len(letters) != 1 or len({m.group(1) for m in indexed}) < 2:
        return content
    letter = letters.pop()
    for m in reversed(indexed):
        content = content[:m.start(1)] + letter + content[m.end(1):]
    return content


def first_sentence(span: str) -> str:
    """``span`` up to its first sentence end outside ``$...$`` / ``$$...$$`` / ``\\(...\\)``
    (an escaped ``\\$`` is currency, not math): a newline, ``.!?`` before a space, a ``.`` not in
    a number, a ``;`` — unless the unknown named before the ``;`` is named again right after it
    ("is x = 1; x = 2." and "is $x = 1$; $x = 2$." list two values; "is 12; x = 3 was the
    width" and "is x = 4; y = 5" end at the ``;``)."""
    masked = re.sub(r"(?<!\\)\$\$.*?(?<!\\)\$\$|(?<!\\)\$(?=\S)(?:[^$\n\\]|\\.)*(?<![\s\\])\$|\\\((?:.|\n)*?\\\)",
                    lambda m: "_" * len(m.group(0)), span, flags=re.S)
    for end in re.finditer(r"\n|[.!?](?=\s|$)|;|(?<!\d)\.(?!\d)", masked):
        if end.group(0) == ";":
            after = NAMED_EQ_RE.match(re.sub(r"^[\s;,$]*", "", span[end.end():end.end() + 100]))
            before = named_equations(span[max(0, end.start() - 100):end.start()])
            if after and before and before[-1].group(1) == after.group(1):
                continue
        return span[:end.start()]
    return span


def hedged_value_after(tail: str) -> str | None:
    """The value that a hedge in words offers after a box, in the rest of the box's sentence or
    in the next sentence of ``tail`` (the de-noised text after the box): ``, although it could be
    3``, ``. But it might also be 3.``, ``. Or maybe 3.``; the value must end its sentence
    (``(or 420 minutes)`` restates the box in a unit and offers nothing). None when there is none."""
    for sentence in _SENTENCE_END_RE.split(tail[:300], maxsplit=2)[:2]:
        m = _HEDGED_VALUE_RE.search(sentence)
        if m:
            return m.group("value")
    return None


def hedged_value_before(stem: str, gap: str) -> str | None:
    """The plain value that ends ``stem`` when ``gap`` (between it and a box) holds a hedge word
    or symbol and no comma: ``Answer: 3`` + `` or `` -> ``3``. None otherwise: MATH writes
    "…, or" for "that is" ("the negative reciprocal of $\\frac{5}{4}$, or $\\boxed{-\\frac{4}{5}}$",
    "half of $1,$ or $\\boxed{\\frac{1}{2}}$"), and an operand is no value ("$50 \\cdot 12$ or")."""
    if "," in gap or not _HEDGE_GAP_RE.search(gap):
        return None
    m = _VALUE_END_RE.search(stem[-80:])
    if m is None or _OPERATOR_END_RE.search(stem[-80:][:m.start()]):
        return None
    return m.group("value")
