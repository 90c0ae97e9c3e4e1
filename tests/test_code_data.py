"""Code datasets (arealite/dataset/code_data.py) and their evaluation: every synthetic problem's
hidden tests accept a hand-written solution and reject a wrong one; the splits are disjoint;
HumanEval's 164 canonical solutions pass in the sandbox and a corrupted one fails (all 164 here:
≈ 20 s on 2 cores); `python -m arealite.evaluate --dataset humaneval` reports pass@k."""

import asyncio
import dataclasses
import json
import os

import pytest

from arealite.dataset import code_data as D
from arealite.evaluate import main as evaluate_main, score_code_rows
from arealite.reward.code import CODE_SANDBOX, ascore_code, problem_answer
from arealite.reward.metrics import summarize

from conftest import save_tiny_model

# A hand-written solution per family: {k} is the constant (repr for strings).
SOLUTIONS = {
    "plus_k": "def plus_k(x):\n    return x + {k}", "minus_k": "def minus_k(x):\n    return x - {k}",
    "times_k": "def times_k(x):\n    return x * {k}", "mod_k": "def mod_k(n):\n    return n % {k}",
    "is_multiple": "def is_multiple(n):\n    return n % {k} == 0",
    "square_plus_k": "def square_plus_k(x):\n    return x ** 2 + {k}",
    "clip_k": "def clip_k(x):\n    return x if x < {k} else {k}",
    "repeat_k": "def repeat_k(s):\n    return ''.join(s for _ in range({k}))",
    "first_k": "def first_k(s):\n    return s[0:{k}]",
    "count_char": "def count_char(s):\n    return sum(1 for c in s if c == {k!r})",
    "replace_char": "def replace_char(s):\n    return ''.join('_' if c == {k!r} else c for c in s)",
    "sum_plus_k": "def sum_plus_k(items):\n    return sum(items) + {k}",
    "max_times_k": "def max_times_k(items):\n    return sorted(items)[-1] * {k}",
    "add_each": "def add_each(items):\n    return [v + {k} for v in items]",
    "count_above": "def count_above(items):\n    return len([v for v in items if v > {k}])",
    "last_k": "def last_k(items):\n    return items[len(items) - {k}:] if len(items) > {k} else list(items)",
}


def _const(task_id: str, family: D.Family):
    raw = task_id.split("/", 2)[2]
    return next(k for k in family.consts if str(k) == raw)


def _score_all(pairs):
    # The verdicts, not the speed, are under test: a wall-clock limit 4x the default, so that a
    # canonical solution on a loaded machine is not judged a timeout.
    config = dataclasses.replace(CODE_SANDBOX, timeout=4 * CODE_SANDBOX.timeout)

    async def run():
        sem = asyncio.Semaphore(4)

        async def one(text, answer):
            async with sem:
                return await ascore_code(text, answer, config=config)

        return await asyncio.gather(*[one(t, a) for t, a in pairs])

    return asyncio.run(run())


def test_families_have_solutions_and_the_splits_are_disjoint_and_seeded():
    assert set(SOLUTIONS) == {f.entry for f in D.FAMILIES}
    train, test = D.all_problems("train"), D.all_problems("test")
    assert len(train) + len(test) == sum(len(f.consts) for f in D.FAMILIES)
    assert not {p["task_id"] for p in train} & {p["task_id"] for p in test}
    assert {p["task_id"].split("/")[1] for p in test} == set(SOLUTIONS)  # every family is in the test split
    for p in train[:20] + test[:20]:
        assert len(p["tests"]) == D.TESTS_PER_PROBLEM == len(set(p["tests"]))
    assert D.make_code_dataset("train", 10, seed=3) == D.make_code_dataset("train", 10, seed=3)
    assert D.make_code_dataset("train", 10, seed=3) != D.make_code_dataset("train", 10, seed=4)
    row = D.make_code_dataset("test", 1)[0]
    assert row["messages"][0]["content"] == row["question"] + D.INSTRUCTION
    assert set(json.loads(row["answer"])) == {"tests", "entry_point"}
    with pytest.raises(ValueError, match=f"has {len(test)} problems"):
        D.make_code_dataset("test", len(test) + 1)
    with pytest.raises(ValueError, match="'code'.*'humaneval'"):
        D.load_code("gsm8k", "train")


@pytest.mark.parametrize("split", ["test", "train"])
def test_every_problem_accepts_its_solution_and_rejects_an_off_by_one(split):
    """The hidden tests are right: the hand-written solution (written differently from the
    reference) passes, the same solution with the constant off by one fails."""
    rows = D.make_code_dataset(split)
    fam = {f.entry: f for f in D.FAMILIES}
    pairs, wrong = [], []
    for r in rows:
        f = fam[json.loads(r["answer"])["entry_point"]]
        k = _const(r["task_id"], f)
        pairs.append((f"```python\n{SOLUTIONS[f.entry].format(k=k)}\n```", r["answer"]))
        off = chr(ord(k) + 1) if isinstance(k, str) else k + 1
        wrong.append((f"```python\n{SOLUTIONS[f.entry].format(k=off)}\n```", r["answer"]))
    good, bad = _score_all(pairs), _score_all(wrong)
    assert [g.outcome for g in good] == ["pass"] * len(rows), [(r["task_id"], g.detail) for r, g in zip(rows, good)
                                                              if g.outcome != "pass"]
    # The tests separate the constant from its neighbours (make_problem): an off-by-one never passes.
    assert not [r["task_id"] for r, b in zip(rows, bad) if b.outcome == "pass"]


def test_humaneval_canonical_solutions_pass_and_corrupted_ones_fail_for_all_164():
    problems = D.humaneval_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    good = _score_all([(p["canonical_solution"], problem_answer(p)) for p in problems])
    assert [g.outcome for g in good] == ["pass"] * 164, [(p["task_id"], g.detail) for p, g in zip(problems, good)
                                                         if g.outcome != "pass"]
    bad = _score_all([("    return None\n", problem_answer(p)) for p in problems])
    assert not [p["task_id"] for p, b in zip(problems, bad) if b.outcome == "pass"]
    rows = D.load_humaneval()
    assert [r["task_id"] for r in rows] == [p["task_id"] for p in problems]
    assert rows[0]["messages"][0]["content"].endswith(f"```python\n{problems[0]['prompt']}```")
    assert len(D.load_humaneval(size=5, seed=1)) == 5


def test_pass_at_k_of_code_records():
    """Two samples per problem, the canonical solution and a wrong one: pass@1 = 1/2, pass@2 = 1
    (Chen et al. 2021, Eq. 1 with n = 2, c = 1: 1 − C(1,1)/C(2,1) = 1/2; k = 2: 1 − 0 = 1)."""
    problems = D.humaneval_problems()[:3]
    rows = [{"messages": [{"role": "user", "content": "x"}], "answer": problem_answer(p), "task_id": p["task_id"]}
            for p in problems]
    completions = [[p["canonical_solution"], "    return None\n"] for p in problems]
    records = score_code_rows(rows, completions)
    assert [r["correct"] for r in records] == [[True, False]] * 3
    assert records[0]["outcomes"] == ["pass", "wrong_answer"] and records[0]["programs"][1] == "    return None\n"
    m = summarize(records, [1, 2])
    assert (m["pass@1"], m["pass@2"]) == (0.5, 1.0)


def test_evaluate_cli_on_humaneval_writes_records_and_reports_pass_at_k(tmp_path):
    model = save_tiny_model(str(tmp_path / "tiny"))
    out = tmp_path / "eval.jsonl"
    res = evaluate_main(["--model-path", model, "--dataset", "humaneval,code", "--size", "3", "--n-samples", "2",
                         "--temperature", "1.0", "--k", "1,2", "--max-new-tokens", "8", "--output", str(out)])
    for name in ("humaneval", "code"):
        m = res[name]
        assert (m["n_problems"], m["n_samples"]) == (3.0, 2.0)
        assert "pass@2" in m and not any(k.startswith("maj@") for k in m)
        assert sum(v for k, v in m.items() if k.startswith("outcome/")) == pytest.approx(1.0)
    lines = [json.loads(line) for line in open(out)]
    assert sorted((r["dataset"], r["index"]) for r in lines) == [(d, i) for d in ("code", "humaneval") for i in range(3)]
    assert all(len(r["outcomes"]) == 2 and len(r["programs"]) == 2 for r in lines)
    assert os.path.getsize(out) > 0
