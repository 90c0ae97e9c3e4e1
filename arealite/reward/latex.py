"""Brace structure of LaTeX text for the math reward (:mod:`arealite.reward.answer`): the brace
that closes an opening one, the matches of a pattern outside all brackets, and the boxes that
open inside another box. Plain functions of strings; none raises on a string."""

from __future__ import annotations

import re


def matching_brace(text: str, i: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``text[i]``, or -1."""
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{" and (j == 0 or text[j - 1] != "\\"):
            depth += 1
        elif c == "}" and (j == 0 or text[j - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return j
    return -1


def top_level(s: str, pattern: re.Pattern) -> list[re.Match]:
    """The matches of ``pattern`` in ``s`` outside any bracket pair."""
    depth, depths = 0, []
    for c in s:
        depths.append(depth)
        depth += (c in "([{") - (c in ")]}")
    return [m for m in pattern.finditer(s) if depths[m.start()] == 0]


_COMMA_RE = re.compile(",")


def top_level_split(s: str) -> list[str]:
    """``s`` split at its commas outside any bracket pair: ``"(1, 2), 3"`` -> ``["(1, 2)", " 3"]``."""
    cuts = [m.start() for m in top_level(s, _COMMA_RE)]
    return [s[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(s)])]


def nested_boxes(text: str, boxes: list[re.Match]) -> set[int]:
    """Start offsets of the ``boxes`` that open inside another box's braces (one pass)."""
    if len(boxes) < 2:
        return set()
    opening = {m.end() - 1 for m in boxes}
    starts = {m.start() for m in boxes}
    stack: list[bool] = []  # open braces: True for a box's own
    nested: set[int] = set()
    for i, c in enumerate(text):
        if i in starts and any(stack):
            nested.add(i)
        if c == "{" and (i == 0 or text[i - 1] != "\\"):
            stack.append(i in opening)
        elif c == "}" and (i == 0 or text[i - 1] != "\\") and stack:
            stack.pop()
    return nested
