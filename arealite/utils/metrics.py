"""Sampling-based evaluation metrics: pass@k (unbiased estimator) and maj@k (majority vote).

* **pass@k** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
  arXiv 2107.03374, Eq. 1 and its numerically stable form in Fig. 3): with ``n`` samples of
  which ``c`` are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, computed as the product
  ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no huge binomials). ``pass@1`` is then ``c / n``, the
  mean accuracy over the samples. A data set's pass@k is the mean over its problems.
* **maj@k**: the most frequent extracted final answer among the first ``k`` samples (ties: the
  answer seen first wins) is correct when the samples giving it were scored correct. Samples with
  no extractable answer do not vote; if none has one, the problem counts as wrong.

Answers are extracted by :func:`extract_final_answer` (last ``\\boxed{}`` content, else the last
number, the same conventions as :func:`arealite.reward.math.math_reward`) and canonicalised
(spaces, ``$``, thousands separators; plain numbers as exact fractions, so "2.50" and "5/2"
vote together) before voting.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

from arealite.reward.math import extract_last_number, strip_thousands_separators


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples, ``c`` of them correct.

    ``1 - C(n-c, k)/C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (Chen et al. 2021, Eq. 1);
    1.0 when ``n - c < k`` (every k-subset holds a correct sample).

    Raises:
        ValueError: ``k`` not in ``1..n`` or ``c`` not in ``0..n`` (pass ``--n-samples >= k``).
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: correct samples c={c} must be in 0..n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in 1..n_samples={n}; raise --n-samples or lower k")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def extract_final_answer(completion: str) -> str | None:
    """The final answer of a completion, canonicalised for voting, or None.

    The content of the last ``\\boxed{...}`` (braces matched by depth), else the last number
    literal (:func:`~arealite.reward.math.extract_last_number`). Canonical form: spaces and
    ``$`` removed, real thousands separators removed, a plain decimal or ``a/b`` as its exact
    reduced fraction (``"2.50"`` → ``"5/2"``, ``"4"`` → ``"4"``).
    """
    if not isinstance(completion, str) or not completion:
        return None
    text = None
    start = completion.rfind("\\boxed")
    if start >= 0:
        i = completion.find("{", start)
        if i >= 0:
            depth, j = 0, i
            while j < len(completion):
                depth += {"{": 1, "}": -1}.get(completion[j], 0)
                if depth == 0:
                    text = completion[i + 1 : j]
                    break
                j += 1
    if text is None:
        text = extract_last_number(completion)
    if text is None:
        return None
    text = strip_thousands_separators(text.replace("$", "").replace(" ", "").strip())
    if text.startswith("\\frac{") and text.count("{") == 2 and text.endswith("}"):
        text = text[len("\\frac{"):-1].replace("}{", "/")
    try:
        return str(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return text or None


def majority_correct(answers: list[str | None], correct: list[bool], k: int) -> bool:
    """maj@k of one problem: whether the most frequent answer among ``answers[:k]`` is correct.

    Args:
        answers: extracted (canonical) answers of the samples, None = no answer.
        correct: per-sample correctness (same length); the majority answer is correct when the
            first sample giving it is (samples with the same canonical answer agree).
        k: samples voting (the first ``k``).

    Ties are broken by first occurrence. Raises ``ValueError`` when ``k`` is not in
    ``1..len(answers)`` or the lists differ in length.
    """
    if len(answers) != len(correct):
        raise ValueError(f"majority_correct: {len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@k: k={k} must be in 1..n_samples={len(answers)}; raise --n-samples or lower k")
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return False
    best = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == best)
    return bool(correct[answers.index(winner)])


def summarize(per_problem: list[dict], ks: list[int]) -> dict[str, float]:
    """Data-set metrics from per-problem records ``{"correct": [bool]*n, "answers": [str|None]*n}``:
    ``pass@1`` (mean accuracy over all samples), ``pass@k`` and ``maj@k`` for each ``k`` in
    ``ks`` (means over problems), ``n_problems`` and ``n_samples``."""
    if not per_problem:
        raise ValueError("summarize: no problems to evaluate")
    n = len(per_problem[0]["correct"])
    out: dict[str, float] = {"n_problems": float(len(per_problem)), "n_samples": float(n)}
    for k in sorted(set([1, *ks])):
        out[f"pass@{k}"] = sum(pass_at_k(len(p["correct"]), sum(p["correct"]), k) for p in per_problem) / len(per_problem)
        if k > 1:
            out[f"maj@{k}"] = sum(majority_correct(p["answers"], p["correct"], k) for p in per_problem) / len(per_problem)
    return out
