"""The configurable prompt instruction of the math loaders (train_dataset.instruction /
valid_dataset.instruction): defaults unchanged, a given text used verbatim on every format, bad
values rejected naming the field."""

import json

import pytest

from arealite.api.cli import ConfigError, load_config, validate_config
from arealite.api.config import GRPOConfig, SFTConfig
from arealite.dataset import math_data as M
from arealite.dataset.loader import load_rows
from arealite.dataset.sft_data import load_sft_dataset


@pytest.fixture
def jsonl_files(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("\n".join(json.dumps({"question": f"Q{i}?", "answer": f"work\n#### {i}"}) for i in range(3)))
    mth = tmp_path / "math.jsonl"
    mth.write_text("\n".join(json.dumps({"problem": f"P{i}?", "answer": str(i)}) for i in range(3)))
    return str(gsm), str(mth)


def test_default_instruction_is_the_formats_own_text(jsonl_files):
    gsm, mth = jsonl_files
    row = M.load_dataset(None, "train", 1, seed=0)[0]
    assert row["messages"][0]["content"] == row["question"] + "\nAnswer with just the number."
    assert M.load_dataset(gsm)[0]["messages"][0]["content"] == "Q0?\nAnswer with just the number at the end."
    assert M.load_dataset(mth)[0]["messages"][0]["content"] == "P0?\nPut the final answer in \\boxed{}."


def test_given_instruction_replaces_it_verbatim_and_changes_nothing_else(jsonl_files):
    gsm, mth = jsonl_files
    for path in (None, gsm, mth):
        base = M.load_dataset(path, "train", 2, seed=3)
        for text in ("\nThink step by step.", ""):
            rows = M.load_dataset(path, "train", 2, seed=3, instruction=text)
            assert [r["messages"][0]["content"] for r in rows] == [r["question"] + text for r in base]
            assert [(r["question"], r["answer"]) for r in rows] == [(r["question"], r["answer"]) for r in base]
    with pytest.raises(ValueError, match="instruction must be a string"):
        M.load_dataset(None, "train", 2, instruction=5)
    with pytest.raises(ValueError, match="instruction must be a string"):
        M.load_gsm8k_jsonl(gsm, instruction=["x"])


def test_load_rows_passes_the_config_field_and_rejects_loaders_without_it():
    cfg = GRPOConfig().train_dataset
    cfg.size, cfg.instruction = 2, "\nSolve it."
    rows = load_rows("train_dataset", cfg, "train", 0, M.load_dataset)
    assert all(r["messages"][0]["content"].endswith("?\nSolve it.") for r in rows)
    with pytest.raises(ValueError, match="train_dataset.instruction is set .* 'load_sft_dataset'"):
        load_rows("train_dataset", cfg, "train", 0, load_sft_dataset)
    cfg.instruction = None  # unset: loaders without the parameter work as before
    assert len(load_rows("train_dataset", cfg, "train", 0, load_sft_dataset)) == 2


def test_config_validation_and_command_line():
    c = load_config(GRPOConfig, ["--train_dataset.instruction", "\nBe brief.", "--valid_dataset.instruction", ""])
    assert (c.train_dataset.instruction, c.valid_dataset.instruction) == ("\nBe brief.", "")
    assert load_config(GRPOConfig, []).train_dataset.instruction is None
    c.valid_dataset.instruction = 3
    with pytest.raises(ConfigError, match="^valid_dataset.instruction: 3"):
        validate_config(c)
    s = SFTConfig()
    s.train_dataset.instruction = "\nx"
    with pytest.raises(ConfigError, match="^train_dataset.instruction: .*SFT/preference data take none"):
        validate_config(s)
