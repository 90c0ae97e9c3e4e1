"""Sampling-based evaluation metrics: pass@k (unbiased estimator) and maj@k (majority vote).

* **pass@k** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
  arXiv 2107.03374, Eq. 1 and its numerically stable form in Fig. 3): with ``n`` samples of
  which ``c`` are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, computed as the product
  ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (no huge binomials). ``pass@1`` is then ``c / n``, the
  mean accuracy over the samples. A data set's pass@k is the mean over its problems.
* **maj@k**: the most frequent final answer among the first ``k`` samples (ties: the answer
  seen first wins) is correct when the samples giving it were scored correct. Samples with no
  extractable answer do not vote; if none has one, the problem counts as wrong.

Answers are extracted and compared by the reward's own module (:mod:`arealite.reward.answer`:
:func:`extract_final_answer` takes the last answer whole, :func:`group_answers` groups answers
that :func:`answers_equivalent` judges equal), so ``\\dfrac{1}{2}``, ``\\frac12``, ``0.5`` and
``1/2`` are one vote, exactly as the reward scores them.
"""

from __future__ import annotations

from collections import Counter

from arealite.reward.answer import answers_equivalent, extract_final_answer, group_answers

__all__ = ["answers_equivalent", "extract_final_answer", "majority_correct", "pass_at_k", "summarize"]


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


def majority_correct(answers: list[str | None], correct: list[bool], k: int) -> bool:
    """maj@k of one problem: whether the most frequent answer among ``answers[:k]`` is correct.

    Args:
        answers: extracted answers of the samples (:func:`extract_final_answer`), None = no
            answer; equivalent answers (:func:`group_answers`) are one vote.
        correct: per-sample correctness (same length); the majority answer is correct when the
            first sample giving it is.
        k: samples voting (the first ``k``).

    Ties are broken by first occurrence. Raises ``ValueError`` when ``k`` is not in
    ``1..len(answers)`` or the lists differ in length.
    """
    if len(answers) != len(correct):
        raise ValueError(f"majority_correct: {len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@k: k={k} must be in 1..n_samples={len(answers)}; raise --n-samples or lower k")
    groups = group_answers(answers[:k])
    votes = Counter(g for g in groups if g is not None)
    if not votes:
        return False
    best = max(votes.values())
    winner = next(g for g in groups if g is not None and votes[g] == best)  # a group's first member
    return bool(correct[winner])


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
