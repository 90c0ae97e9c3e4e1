"""Tests for arealite.dataset.math_data."""

import json
import os
import re

import pytest

from arealite.dataset.math_data import (
    ARITHMETIC_INSTRUCTION,
    ARITHMETIC_OPERAND_RANGE,
    GSM8K_INSTRUCTION,
    MATH_INSTRUCTION,
    arithmetic_pool,
    load_dataset,
    load_gsm8k_jsonl,
    load_math_jsonl,
    make_arithmetic_dataset,
)
from arealite.reward.math import math_reward

# Byte-for-byte slices of the public files, committed with the tests (tests/data/README.md: source, MIT licences)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GSM8K_TRAIN = os.path.join(DATA, "gsm8k", "train.jsonl")  # first 64 rows of GSM8K train
GSM8K_TEST = os.path.join(DATA, "gsm8k", "test.jsonl")  # first 64 rows of GSM8K test
MATH500 = os.path.join(DATA, "math", "math500.jsonl")  # first 32 rows of MATH-500


def _check_schema(row):
    assert set(row) == {"messages", "answer", "question"}
    assert len(row["messages"]) == 1
    assert row["messages"][0]["role"] == "user"
    assert isinstance(row["messages"][0]["content"], str)
    assert isinstance(row["answer"], str) and row["answer"]
    assert row["messages"][0]["content"].startswith(row["question"])


# ---------------------------------------------------------------- arithmetic
def test_arithmetic_deterministic_and_seed_dependent():
    a = make_arithmetic_dataset("train", 100, seed=3)
    b = make_arithmetic_dataset("train", 100, seed=3)
    c = make_arithmetic_dataset("train", 100, seed=4)
    assert a == b
    assert a != c
    assert load_dataset(None, "test", 50, 7) == make_arithmetic_dataset("test", 50, 7)


def test_arithmetic_answers_correct_and_format():
    lo, hi = ARITHMETIC_OPERAND_RANGE
    rows = make_arithmetic_dataset("test", 300, seed=1)
    for row in rows:
        _check_schema(row)
        m = re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["question"])
        assert m, row["question"]
        x, y = int(m.group(1)), int(m.group(2))
        assert lo <= x <= hi and lo <= y <= hi
        assert row["answer"] == str(eval(f"{x} + {y}"))
        assert row["messages"][0]["content"] == row["question"] + ARITHMETIC_INSTRUCTION
        assert row["messages"][0]["content"].endswith("\nAnswer with just the number.")
    assert len({r["question"] for r in rows}) == 300  # distinct problems


def test_arithmetic_train_test_disjoint_over_full_pools():
    lo, hi = ARITHMETIC_OPERAND_RANGE
    train, test = arithmetic_pool("train"), arithmetic_pool("test")
    assert set(train).isdisjoint(test)
    assert len(train) + len(test) == (hi - lo + 1) ** 2 == 8100
    assert 0.07 < len(test) / 8100 < 0.13  # ~10% test
    full_train = {r["question"] for r in make_arithmetic_dataset("train", len(train))}
    full_test = {r["question"] for r in make_arithmetic_dataset("test", len(test))}
    assert len(full_train) == len(train) and len(full_test) == len(test)
    assert full_train.isdisjoint(full_test)


def test_arithmetic_defaults_and_errors():
    assert len(load_dataset(None, "train", None, 0)) == 1000
    assert len(load_dataset("arithmetic", "test", None, 0)) == 200
    with pytest.raises(ValueError, match="size=100000.*pool size"):
        make_arithmetic_dataset("test", 100000)
    with pytest.raises(ValueError, match="size"):
        make_arithmetic_dataset("train", 0)
    with pytest.raises(ValueError, match="split='valid'"):
        make_arithmetic_dataset("valid", 10)
    with pytest.raises(ValueError, match="split='dev'"):
        load_dataset(None, "dev", 10, 0)


# ---------------------------------------------------------------- GSM8K
def test_gsm8k_train_real_file():
    rows = load_gsm8k_jsonl(GSM8K_TRAIN)
    assert len(rows) == 64
    assert rows[0]["answer"] == "72"
    assert rows[0]["question"].startswith("Natalia sold clips to 48 of her friends")
    assert rows[0]["messages"][0]["content"] == rows[0]["question"] + GSM8K_INSTRUCTION
    for r in rows:
        _check_schema(r)
        assert "####" not in r["answer"] and "," not in r["answer"]
    assert load_dataset(GSM8K_TRAIN, "train", None, 0) == rows


def test_gsm8k_test_answers_are_scorable():
    """Every GSM8K test answer is recognised by math_reward in a plain completion."""
    rows = load_dataset(GSM8K_TEST, "test", None, 0)
    assert len(rows) == 64 and rows[0]["answer"] == "18"  # Janet's ducks
    bad = [r["answer"] for r in rows if math_reward(f"so the total is {r['answer']}.", r["answer"]) != 1.0]
    assert bad == []


def test_jsonl_size_is_seeded_shuffle():
    a = load_dataset(GSM8K_TRAIN, "train", 32, 5)
    b = load_dataset(GSM8K_TRAIN, "train", 32, 5)
    c = load_dataset(GSM8K_TRAIN, "train", 32, 6)
    assert a == b and a != c and len(a) == 32
    assert a != load_dataset(GSM8K_TRAIN, "train", None, 0)[:32]  # shuffled
    with pytest.raises(ValueError, match="number of rows 64"):
        load_dataset(GSM8K_TRAIN, "train", 65, 0)


# ---------------------------------------------------------------- MATH
def test_math500_real_file():
    rows = load_math_jsonl(MATH500)
    assert len(rows) == 32
    for r in rows:
        _check_schema(r)
        assert r["messages"][0]["content"] == r["question"] + MATH_INSTRUCTION
    assert rows[0]["question"].startswith("Convert the point $(0,3)$")
    assert load_dataset(MATH500, "test", None, 0) == rows
    # every reference answer is recognised when boxed
    bad = [r["answer"] for r in rows if math_reward("\\boxed{" + r["answer"] + "}", r["answer"]) != 1.0]
    assert bad == []


# ---------------------------------------------------------------- malformed
def _write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_malformed_gsm8k_rows(tmp_path):
    good = json.dumps({"question": "q1", "answer": "x\n#### 3"})
    p = _write(tmp_path, "missing.jsonl", [good, json.dumps({"question": "q2"})])
    with pytest.raises(ValueError) as e:
        load_gsm8k_jsonl(p)
    msg = str(e.value)
    assert p in msg and "row 2" in msg and "'answer'" in msg and "question/answer" in msg

    p = _write(tmp_path, "nomarker.jsonl", [good, good, json.dumps({"question": "q", "answer": "42"})])
    with pytest.raises(ValueError, match=r"row 3 field 'answer' is malformed.*####"):
        load_dataset(p, "train", None, 0)

    p = _write(tmp_path, "badjson.jsonl", [good, "{not json"])
    with pytest.raises(ValueError, match="row 2 is not valid JSON"):
        load_gsm8k_jsonl(p)

    p = _write(tmp_path, "noq.jsonl", [json.dumps({"answer": "#### 1"})])
    with pytest.raises(ValueError, match="row 1 is missing field 'question'"):
        load_gsm8k_jsonl(p)

    rows = load_gsm8k_jsonl(_write(tmp_path, "ok.jsonl", [good, "", json.dumps({"question": "q", "answer": "#### 1,200"})]))
    assert [r["answer"] for r in rows] == ["3", "1200"]


def test_malformed_math_rows_and_format_sniffing(tmp_path):
    good = json.dumps({"problem": "p", "answer": "\\frac{1}{2}"})
    p = _write(tmp_path, "m.jsonl", [good, json.dumps({"problem": "p2", "answer": ""})])
    with pytest.raises(ValueError, match="row 2 field 'answer' must be a non-empty string.*problem/answer"):
        load_dataset(p, "test", None, 0)
    p = _write(tmp_path, "m2.jsonl", [good, json.dumps({"answer": "1"})])
    with pytest.raises(ValueError, match="row 2 is missing field 'problem'"):
        load_math_jsonl(p)

    p = _write(tmp_path, "other.jsonl", [json.dumps({"prompt": "x", "label": "1"})])
    with pytest.raises(ValueError, match=r"fields: \['label', 'prompt'\].*GSM8K.*MATH"):
        load_dataset(p, "train", None, 0)
    with pytest.raises(ValueError, match="is not a hub name; pass a .jsonl file, a folder written by datasets"):
        load_dataset(str(tmp_path / "data.csv"), "train", None, 0)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_dataset(str(tmp_path / "nope.jsonl"), "train", None, 0)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_gsm8k_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="no rows"):
        load_dataset(_write(tmp_path, "empty.jsonl", [""]), "train", None, 0)


# ---------------------------------------------------------------- datasets: save_to_disk folders, hub names
def _gsm8k_dict(n):
    """The first ``n`` rows of the committed GSM8K slices as a ``datasets.DatasetDict`` (train, test)."""
    datasets = pytest.importorskip("datasets", reason="datasets is a dependency of arealite (setup.py)")

    def split(path):
        rows = [json.loads(line) for line in open(path)][:n]
        return datasets.Dataset.from_list(rows)
    return datasets.DatasetDict({"train": split(GSM8K_TRAIN), "test": split(GSM8K_TEST)})


def test_a_folder_saved_by_datasets_loads_like_the_jsonl(tmp_path):
    """``DatasetDict.save_to_disk``: the split argument picks train/test; ``Dataset.save_to_disk``:
    the folder is the split; rows equal those of the same jsonl rows; the config check accepts it."""
    from arealite.api.cli import ConfigError, validate_config
    from arealite.api.config import DatasetConfig, GRPOConfig

    _gsm8k_dict(8).save_to_disk(str(tmp_path / "gsm8k"))
    jsonl_test = load_dataset(GSM8K_TEST, "test", None, 0)[:8]
    assert load_dataset(str(tmp_path / "gsm8k"), "test", None, 0) == jsonl_test
    assert load_dataset(str(tmp_path / "gsm8k"), "train", None, 0) == load_dataset(GSM8K_TRAIN, "train", None, 0)[:8]
    assert len(load_dataset(str(tmp_path / "gsm8k"), "train", 4, 1)) == 4
    _gsm8k_dict(8)["test"].save_to_disk(str(tmp_path / "test_only"))
    assert load_dataset(str(tmp_path / "test_only"), "train", None, 0) == jsonl_test  # a Dataset folder is its split
    validate_config(GRPOConfig(train_dataset=DatasetConfig(path=str(tmp_path / "gsm8k"))))
    (tmp_path / "not_saved").mkdir()
    with pytest.raises(ConfigError, match=r"^train_dataset\.path: .*not written by datasets' save_to_disk"):
        validate_config(GRPOConfig(train_dataset=DatasetConfig(path=str(tmp_path / "not_saved"))))


def test_a_saved_math_set_and_a_missing_split(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is a dependency of arealite (setup.py)")
    rows = [json.loads(line) for line in open(MATH500)][:5]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "math500"))
    assert load_dataset(str(tmp_path / "math500"), "test", None, 0) == load_math_jsonl(MATH500)[:5]
    with pytest.raises(ValueError, match=r"has no split 'train' \(it has \['test'\]\)"):
        load_dataset(str(tmp_path / "math500"), "train", None, 0)


def test_hub_names_go_to_datasets_load_dataset_with_config_and_split(monkeypatch):
    """A hub name is passed to ``datasets.load_dataset`` (GSM8K's config defaults to ``main``; an
    explicit ``:config`` wins); the rows are parsed by format as a file's. No network: the hub is a stub."""
    datasets = pytest.importorskip("datasets", reason="datasets is a dependency of arealite (setup.py)")
    from arealite.api.cli import dataset_source
    from arealite.dataset.sft_data import load_sft_dataset

    calls, saved = [], _gsm8k_dict(4)

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if name != "openai/gsm8k":
            raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")
        return saved[split]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert dataset_source("openai/gsm8k") == "hub" and dataset_source("HuggingFaceH4/MATH-500") == "hub"
    assert load_dataset("openai/gsm8k", "test", None, 0) == load_dataset(GSM8K_TEST, "test", None, 0)[:4]
    assert len(load_sft_dataset("openai/gsm8k:socratic", "train")) == 4
    with pytest.raises(ValueError, match=r"nobody/nothing: cannot load split 'test' .*FileNotFoundError.*local \.jsonl"):
        load_dataset("nobody/nothing", "test", None, 0)
    assert calls == [("openai/gsm8k", "main", "test"), ("openai/gsm8k", "socratic", "train"),
                     ("nobody/nothing", None, "test")]
