"""Text forms the math reward reads as what they stand for, before it extracts an answer
(:func:`ascii_forms`, called by :func:`arealite.reward.answer.extract_final_answer`): Unicode
stand-ins for ASCII and LaTeX ("72，73" is a list, "7²" a power, "3½" a mixed number, "72–73" a
calculation, "72 ∨ 73" a hedge) and typography around a value ("\\mathbf{18}", "\\large 18")."""

from __future__ import annotations

import re

# Unicode stand-ins read as their ASCII / LaTeX forms before extraction ("72，73" is a list, "7²"
# a power, "3½" a mixed number, "72–73" a calculation, "72 ∨ 73" a hedge).
_SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
_VULGAR = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅖": (2, 5),
           "⅗": (3, 5), "⅘": (4, 5), "⅙": (1, 6), "⅚": (5, 6), "⅛": (1, 8), "⅜": (3, 8), "⅝": (5, 8),
           "⅞": (7, 8)}
_LOOKALIKE = str.maketrans({"⁄": "/", "∕": "/", "∨": " \\lor ", "∧": " \\land "})
# Typography read as its content: bold, underline, sizes, colours ("\mathbf{18}", "\large 18").
_FORMAT_RE = re.compile(r"\\(?:mathbf|boldsymbol|bm|underline|mathit|mathsf|mathtt|emph|textit)\s*\{([^{}]*)\}")
_SWITCH_RE = re.compile(r"\\(?:bf|it|rm|sf|tt|large|Large|LARGE|small|normalsize|huge|Huge|tiny|scriptsize|"
                        r"footnotesize)(?![A-Za-z])|\\(?:text)?color\s*\{[^{}]*\}")


def ascii_forms(text: str) -> str:
    """Full-width ASCII forms, superscript digits (``^{...}``), vulgar fractions (``\\frac``),
    dashes (a minus between two digits, a break elsewhere), fraction slashes, the logic symbols ∨ / ∧ and LaTeX's ``{,}`` in their ASCII or LaTeX
    form; bold, underline, size and colour commands dropped around their content.

    Args:
        text: a completion or a reference answer.

    Returns:
        The text with those forms replaced (``"7²"`` -> ``"7^{2}"``, ``"3½"`` ->
        ``"3\\frac{1}{2}"``, ``"\\mathbf{18}"`` -> ``"18"``); everything else unchanged.
    """
    text = re.sub(r"[\uff01-\uff5e]", lambda m: chr(ord(m.group(0)) - 0xFEE0), text)
    text = re.sub(r"[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+", lambda m: "^{" + m.group(0).translate(_SUPERSCRIPT) + "}", text)
    text = re.sub("[" + "".join(_VULGAR) + "]", lambda m: "\\frac{%d}{%d}" % _VULGAR[m.group(0)], text)
    text = _SWITCH_RE.sub(" ", _FORMAT_RE.sub(r"\1", text))
    text = re.sub(r"(?<=\d)[–‒](?=\d)", "-", text)  # "72–73": a minus (a range is no answer)
    text = re.sub(r"[–—‒]", " ; ", text)  # "18 — 6 from Monday": a break, as a semicolon
    return text.translate(_LOOKALIKE).replace("{,}", ",")  # "1{,}000": LaTeX's thousands comma
