"""Sentences and named unknowns around a final answer, for the math reward
(:mod:`arealite.reward.answer`): where the answer's sentence ends, which ``<name> =`` begin an
equation, indexed names of one unknown in a box (``x_1 = 1, x_2 = 2``), and a second value
offered in words beside a box (``\\boxed{2}, although it could be 3``; ``Answer: 3 or
\\boxed{2}``). Plain functions of (de-noised) strings; none raises on a string."""

from __future__ import annotations

import re
from fractions import Fraction

from arealite.reward.latex import top_level

# An unknown's name: a letter or a Greek letter, then primes, a subscript or a bracketed index
# (x, x_1, x_{12}, x', x^{(2)}, \theta_1); group 1 is the letter, shared by x_1 and x_2.
GREEK = ("alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu|xi|"
          "pi|rho|sigma|tau|upsilon|phi|varphi|chi|psi|omega")
_NAME = rf"((?:[A-Za-z]|\\(?:{GREEK}))(?![A-Za-z])'*(?:_\{{?\w+\}}?|\^\{{\(\w+\)\}})?)"
# A named unknown before its "=" (or aligned "&="); :func:`named_equations` keeps those that
# start an equation (at the start, or after a separator, a row break or a LaTeX command).
NAMED_EQ_RE = re.compile(rf"{_NAME}\s*(?:&\s*)?=(?!=)")
# A name and "=" (or "\approx") right before a box: "$x = \boxed{3}$", "$x \approx \boxed{3}$".
EQ_BEFORE_RE = re.compile(rf"{_NAME}\s*(?:&\s*)?(?:=|\\approx(?![A-Za-z]))\s*$")
_EQ_START_RE = re.compile(r"(?:^|[,;|&~$]|\\\\|\\[A-Za-z]+)$")
# The unknowns whose numbered names list roots or solutions in a box (x_1, x_{2}, \theta_1).
_ROOT_NAME_RE = re.compile(r"(x|y|z|t|r|\\theta)_\{?([1-9])\}?")  # x_0, t_0: an initial value

# A plain value: an integer, a decimal, a/b, a \frac of two integers, or a rational multiple of pi.
_VALUE = (r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?|[-+]?\\[dt]?frac\s*\{\s*-?\d+\s*\}\s*\{\s*\d+\s*\}"
          r"|[-+]?\\[dt]?frac\s*\{\s*\d*\s*\\pi\s*\}\s*\{\s*\d+\s*\}|[-+]?(?:\\[dt]?frac\s*\{\s*\d+\s*\}\s*\{\s*\d+\s*\}|\d*)\s*\\pi"
          r"(?:\s*/\s*\d+)?(?![A-Za-z])")
_VALUE_TAIL = r"[\s)]*[.!?]?[\s)]*$"  # after the value: nothing but brackets and a stop
_MODAL = (r"\b(?:it|this|the\s+(?:answer|result|value)|answer)\s+(?:could|might|may|should)\s+"
          r"(?:(?:also|well|instead|even|potentially|possibly|perhaps|actually)\s+)?be")
# A second value offered in words in the rest of the box's sentence: a modal after its subject
# (", although it could be 3", ", but the result might also be 3") or a hedge word right after
# the box (", though perhaps 3"; not "divided by 2, 3, 4, or 6").
_HEDGE_OPENER = r"^[\s,;:(]*(?:(?:but|though|although|and)\s+)?(?:or\s+)?(?:or|maybe|perhaps|possibly|alternatively)\b"
_SAME_SENTENCE_RE = re.compile(rf"(?:{_MODAL}|{_HEDGE_OPENER})[\s:=(]*(?P<value>{_VALUE}){_VALUE_TAIL}", re.I)
# A condition or a reason before the modal makes it an explanation ("but if order mattered it
# could be 24", "since otherwise it could be 0", "(for negative x this could be -10)").
_CONDITION_RE = re.compile(r"\b(?:if|since|because|for|when|whenever|otherwise|unless|without|whereas|where)\b", re.I)
# ... or a next sentence that opens with the hedge, after interjections ("But it might also be
# 3.", "Or maybe 3.", "Alternatively, the answer could be 3.", "Wait, it might be 3.", "(It may
# also be 3.)"; not "If order mattered, the result might be 24.").
_OPENER = r"(?i:(?:(?:but|though|although|however|or|alternatively|actually|wait|hmm|then\s+again|i\s+think)\s*,?\s+)*)"
_HEDGE = rf"(?i:{_MODAL}|(?:maybe|perhaps|possibly|alternatively|or)\b(?:\s+(?:it|this|the\s+answer)(?:'s|\s+is))?)"
_NEXT_SENTENCE_RE = re.compile(rf"^[\s(]*{_OPENER}{_HEDGE}[\s:=(,]*(?P<value>{_VALUE}){_VALUE_TAIL}", re.I)
_INLINE_MATH_RE = re.compile(r"\\[()\[\]]")  # \( \) \[ \]: math delimiters, read as blanks
_SENTENCE_END_RE = re.compile(r"(?<=[.!?])\s+|\n")
_BLANK_RE = re.compile(r"(?:\\[\])]|[$.!?\s])*")  # a piece of only math delimiters and stops
# An answer marker, a plain value, a hedge, then the box: "Answer: 3 or \boxed{2}", "The answer is
# 3, or maybe \boxed{2}" (a comma needs a hedge word that is no "that is": maybe, perhaps, ...).
_MARKED_VALUE_RE = re.compile(
    rf"(?:\banswer\s*(?:is|:|=)|\banswer\s+(?:would|will|could|might|should|must)\s+be)\s*"
    rf"(?:(?:either|probably|maybe|perhaps|possibly|likely)\s+)?(?:[a-z]\s*=\s*)?(?P<value>{_VALUE})\s*$", re.I)
_HEDGE_GAP_RE = re.compile(r"^\s*(?:or\b|\\(?:lor|vee)(?![A-Za-z]))|^\s*,?\s*(?:or\s+)?(?:maybe|perhaps|possibly)\b", re.I)


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
    """A box's ``content`` with numbered roots made one unknown when the box holds two or more
    equations that all name one of x, y, z, t, r or ``\\theta`` with an index 1-9 (``x_1 = 1,
    x_2 = 2`` -> ``x = 1, x = 2``: the roots of one unknown, read as a list), else ``content``
    unchanged (``S_5 = 31``, ``x = 1, y = 2``, ``a_1 = 3, a_{20} = 60``, ``v_i = 0, v_f = 20``,
    ``d_1 = 3, d_2 = 4, d = 5``, iterates from ``x_0``). Outside a box numbered names may be a
    sequence's working.
    Boxes over 300 characters are left as they are."""
    if len(content) > 300:
        return content
    names = named_equations(content)
    roots = [_ROOT_NAME_RE.fullmatch(m.group(1)) for m in names]
    if len(names) < 2 or not all(roots) or len({r.group(1) for r in roots}) != 1:
        return content
    for m, r in zip(reversed(names), reversed(roots)):
        content = content[:m.start(1)] + r.group(1) + content[m.end(1):]
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
    """The value that a hedge in words offers after a box, in ``tail`` (the de-noised text after
    it): in the rest of the box's sentence (``, although it could be 3``, ``, though perhaps 3``)
    or in the next sentence when that sentence opens with the hedge (``. But it might also be
    3.``, ``.\\n\\nOr maybe 3.``; blank lines and math delimiters are skipped). The value must end
    its sentence: ``(or 420 minutes)`` restates the box in a unit, and words after the value
    ("could be 3 as well") are not read. None when there is none."""
    tail = _INLINE_MATH_RE.sub(" ", tail[:300])  # "\\(3\\)" is 3
    pieces = [p for p in _SENTENCE_END_RE.split(tail) if not _BLANK_RE.fullmatch(p)]
    first_is_rest = bool(pieces) and not re.match(r"\s*\$*\s*[.!?\n]", tail) and tail[:1] not in "\n"
    for i, sentence in enumerate(pieces[:2]):
        same = i == 0 and first_is_rest
        m = (_SAME_SENTENCE_RE if same else _NEXT_SENTENCE_RE).search(sentence)
        if m and not (same and _CONDITION_RE.search(sentence[:m.start()])):
            return m.group("value")
        if not same:
            break
    return None


def hedged_value_before(stem: str, gap: str) -> str | None:
    r"""The plain value that an answer marker gives right before a box with a hedge between
    (``stem`` + ``gap`` + box): ``Answer: 3`` + `` or ``, ``The answer is either 3`` + `` or ``,
    ``The answer is 3`` + ``, or maybe `` -> ``3``. None otherwise: without a marker, "…, or" and
    "… or" before a box often mean "that is" ("the negative reciprocal of $\frac{5}{4}$, or
    $\boxed{-\frac{4}{5}}$", "$30^\circ$ or $\boxed{\frac{\pi}{6}}$", "3 times 4 or \boxed{12}")."""
    stem, gap = _INLINE_MATH_RE.sub(" ", stem[-80:]), _INLINE_MATH_RE.sub(" ", gap)
    if not _HEDGE_GAP_RE.search(gap):
        return None
    m = _MARKED_VALUE_RE.search(stem.rstrip())
    return m.group("value") if m else None


_DEGREES_RE = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*")
_PI_MULTIPLE_RE = re.compile(r"\s*(-)?\s*(?:\\frac\s*\{\s*(\d*)\s*\\pi\s*\}\s*\{\s*(\d+)\s*\}|(\d*)\s*\\pi(?:\s*/\s*(\d+))?"
                             r"|\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}\s*\\pi)\s*")


def same_angle(a: str, b: str) -> bool:
    r"""Whether one of two de-noised answers (degree signs removed) is a number of degrees and the
    other the same angle as a rational multiple of pi: ``30`` and ``\frac{\pi}{6}``, ``180`` and
    ``\pi``, ``-90`` and ``-\pi/2`` (a restatement in radians, not a second answer)."""
    for deg, rad in ((a, b), (b, a)):
        d, r = _DEGREES_RE.fullmatch(deg), _PI_MULTIPLE_RE.fullmatch(rad)
        if d and r:
            sign, frac_num, frac_den, num, den, coef_num, coef_den = r.groups()
            frac_num, frac_den = frac_num or coef_num, frac_den or coef_den
            if int(frac_den or den or 1) == 0:
                continue
            turns = Fraction(int(frac_num or num or 1), int(frac_den or den or 1)) * (-1 if sign else 1)
            if Fraction(d.group(1)) == 180 * turns:
                return True
    return False


# A choice letter or a one-word answer offered in words after a textual or boxed word answer: after
# a hedge ("Or maybe (D).", "The answer could also be Monday."), as a line of its own ("(D)"), or
# with "also possible / correct" ("Though (D) is also possible.").
_WORD_VALUE = r"\([A-Z]\)|\b[B-HJ-Z]\b|\b[A-Z][a-z]+\b"  # "A" and "I" only in brackets: an article, a pronoun
_WORD_HEDGE_RE = re.compile(
    rf"^[\s(]*{_OPENER}{_HEDGE}\b[\s:=(,]*(?P<value>{_WORD_VALUE})"
    rf"|^[\s(]*(?P<alone>\([A-Z]\)|[A-Z])[\s).]*$"
    rf"|^[\s(;,]*{_OPENER}(?P<also>{_WORD_VALUE})\s+(?i:is|are|would\s+be|could\s+be|seems)?\s*"
    rf"(?i:also|too)\s+(?i:possible|correct|valid|right|plausible)\b")


def hedged_word_after(tail: str, answer: str) -> str | None:
    """The other choice letter or word that ``tail`` (the text after a word answer) offers in the
    rest of the answer's sentence or the next one (:data:`_WORD_HEDGE_RE`), when it differs from
    ``answer``; None otherwise."""
    tail = _INLINE_MATH_RE.sub(" ", tail[:300]).replace("$", " ")
    key = answer.strip("() ").lower()
    for sentence in [p for p in _SENTENCE_END_RE.split(tail) if not _BLANK_RE.fullmatch(p)][:2]:
        m = _WORD_HEDGE_RE.search(sentence.strip(" \t"))
        if m:
            value = m.group("value") or m.group("alone") or m.group("also")
            if value.strip("() ").lower() != key and value.lower() not in ("it", "this", "the"):
                return value
    return None


# Words that make a value something other than itself, right before it or right after it: a
# negation, a bound, a near miss or a verdict ("not 5", "at least 5", "up to 5", "more than 5", "almost 5",
# "5 or more", "5 (wrong)", "5 is incorrect"). In a box (``whole``) also "but", "over", "under",
# "above", "below" and "beyond" before it ("anything but 5", "over 5"); in prose those often
# introduce the answer itself ("not 4 but 5").
_QUALIFIER_BEFORE = {"not", "least", "most", "than", "nearly", "almost", "except", "excluding", "never"}
_QUALIFIER_BEFORE_WHOLE = {"but", "over", "under", "above", "below", "beyond"}
_QUALIFIER_AFTER_RE = re.compile(r"(?:or|and) (?:more|less|fewer|greater|higher|lower|above|below|over|under|so)\b"
                                 r"|(?:(?:is|was|are) )?(?:wrong|incorrect|false)\b|(?:is|was|are) not\b")
# Any of those words anywhere in an answer (:func:`arealite.reward.equivalence.answers_equivalent`).
_WORDS = sorted((_QUALIFIER_BEFORE - {"least", "most"}) | _QUALIFIER_BEFORE_WHOLE | {"at least", "at most", "up to"})
QUALIFIER_RE = re.compile(rf"\b(?:{'|'.join(_WORDS)})\b|\b(?:{_QUALIFIER_AFTER_RE.pattern})", re.I)


def qualifier(segs: list[tuple[str, str]], lo: int, hi: int, whole: bool) -> str | None:
    """The qualifying words (:data:`QUALIFIER_RE`) right before ``segs[lo]`` or right after
    ``segs[hi]`` (blank math runs skipped), e.g. ``"at least"``, ``"or more"``; None when there
    are none. ``segs``: :func:`arealite.reward.answer._segments`' ``(kind, text)`` list."""
    def words(indices) -> list[str]:
        out = []
        for j in indices:
            kind, text = segs[j]
            if kind == "math" and not text.strip():
                continue
            if kind != "word":
                break
            out.append(re.sub(r"[^a-z ]", "", text).strip())
            if len(out) == 2:
                break
        return [w for w in out if w]
    before = " ".join(reversed(words(range(lo - 1, -1, -1))))
    last = before.split()[-1] if before else ""
    if last in _QUALIFIER_BEFORE or (whole and last in _QUALIFIER_BEFORE_WHOLE) or re.search(r"\bup to$", before):
        return before
    after = " ".join(words(range(hi + 1, len(segs))))
    return after if _QUALIFIER_AFTER_RE.match(after) else None
