"""The math reward on real reference solutions: every GSM8K / MATH gold solution should score 1
against its own answer, and (almost) never against another problem's answer.

    python benchmarks/reward_gold.py [--data DIR]      # DIR holds gsm8k/test.jsonl, math/test.jsonl

Prints, per data set: solutions scored, the share that score 1 against their own answer (GSM8K:
the solution as written with its '####' line, then with the line replaced by "The answer is X."
and by a \\boxed{X}; MATH: the solution, and each gold that is a plain number as a model would
box it, ``\\boxed{p/q}``), the misses with what was extracted, and the share of (solution i, answer
i+shift) pairs whose answers differ in value that score 1 (false positives), and the time taken.
Needs the data files (not shipped with arealite); exits with a message when they are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from arealite.reward.answer import answers_equivalent, extract_final_answer, normalise_gold, parse_number
from arealite.reward.math import extract_gsm8k_answer, math_reward


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _report(name: str, pairs: list[tuple[str, str]], shift: int = 1, show: int = 10) -> None:
    t0 = time.time()
    misses = [(c, a) for c, a in pairs if math_reward(c, a) != 1.0]
    own_s = time.time() - t0
    t0 = time.time()
    cross = [(pairs[i][0], pairs[(i + shift) % len(pairs)][1]) for i in range(len(pairs))]
    cross = [(c, a) for (c, a), (_, own) in zip(cross, pairs)  # answers that differ in value
             if not answers_equivalent(normalise_gold(a), normalise_gold(own))]
    fooled = [(c, a) for c, a in cross if math_reward(c, a) == 1.0]
    cross_s = time.time() - t0
    print(f"{name}: own answer {len(pairs) - len(misses)}/{len(pairs)} = {1 - len(misses) / len(pairs):.4f} "
          f"({own_s:.1f} s); another problem's answer scored 1: {len(fooled)}/{len(cross)} ({cross_s:.1f} s)")
    for c, a in misses[:show]:
        print(f"  miss: gold {a!r:.60} extracted {extract_final_answer(c)!r:.60}")
    for c, a in fooled[:show]:
        print(f"  fooled: gold {a!r:.60} extracted {extract_final_answer(c)!r:.60}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--data", default=os.path.join(here, "..", "..", "shared", "data"))
    args = p.parse_args()
    gsm, math = os.path.join(args.data, "gsm8k", "test.jsonl"), os.path.join(args.data, "math", "test.jsonl")
    if not (os.path.isfile(gsm) and os.path.isfile(math)):
        sys.exit(f"benchmarks/reward_gold.py: {gsm} / {math} not found; pass --data DIR")
    pairs = []
    for r in _rows(gsm):
        gold, reasoning = extract_gsm8k_answer(r["answer"]), r["answer"].rsplit("####", 1)[0]
        pairs += [(r["answer"], gold), (reasoning + f"\nThe answer is {gold}.", gold),
                  (reasoning + f"\\boxed{{{gold}}}", gold)]
    _report("GSM8K test (3 forms each)", pairs, shift=3)
    rows = _rows(math)
    _report("MATH test", [(r["solution"], r["answer"]) for r in rows])
    # Golds that are plain numbers, answered as a model writes them: "\boxed{10080}" for MATH's
    # "10,\!080", "\boxed{7/2}" for "\frac72" (a gold the reward cannot read pays no one).
    plain = [(r["answer"], parse_number(normalise_gold(r["answer"]) or "")) for r in rows]
    plain = [(a, v[0]) for a, v in plain if v is not None]
    _report("MATH test, plain-number golds as \\boxed{p/q}",
            [(f"So the answer is $\\boxed{{{v.numerator}{'/' + str(v.denominator) if v.denominator > 1 else ''}}}$.", a)
             for a, v in plain])


if __name__ == "__main__":
    main()
