"""SFT datasets: (prompt messages, response text) rows, and their tokenized, padded batches.

Row format after loading::

    {"messages": [{"role": "user", "content": str}, ...], "response": str}

Sources:

* jsonl with ``messages`` (chat list whose last message is the assistant's response: it becomes
  ``response``, the earlier messages the prompt);
* jsonl with ``question`` / ``answer`` (GSM8K: the prompt is the question plus
  ``GSM8K_INSTRUCTION``, the response is the worked solution without the ``<<a*b=c>>`` calculator
  annotations, ending in ``#### N``);
* ``None`` / ``"arithmetic"``: the embedded arithmetic task, response = the number.

Rows with those fields may also come from a folder written by ``datasets``' ``save_to_disk`` or a
Hugging Face hub name (``openai/gsm8k``): :mod:`arealite.dataset.sources`.

Tokenization (:class:`SFTCollator`): prompt = chat template with the assistant generation prompt
(the same ids the rollout workflow sends to the server), response = the text's tokens plus
EOS — exactly what a sampled answer looks like, so SFT, DPO and RL all score the same tokens.
"""

from __future__ import annotations

import random
import re
from typing import Any

import torch

from arealite.dataset.math_data import GSM8K_INSTRUCTION, _read_jsonl, load_dataset
from arealite.utils.data import pad_and_stack
from arealite.utils.hf import tokenize_chat

_SFT_HELP = ("pass a jsonl whose rows have 'messages' (chat list ending with the assistant's reply) or "
             "'question'/'answer'")
_CALC = re.compile(r"<<[^>]*>>")


def check_messages(path: str, lineno: int, messages: Any, field: str, help: str) -> list[dict[str, str]]:
    """Validate a chat list (dicts with string ``role``/``content``); errors name row and field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{path}: row {lineno} field {field!r} must be a non-empty list of messages; {help}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{path}: row {lineno} field {field!r} message {j} needs string 'role' and "
                             f"'content', got {m!r}; {help}")
    return messages


def text_field(path: str, lineno: int, obj: dict, name: str, help: str) -> str:
    """``obj[name]`` as a non-empty string; ValueError naming the row and the field otherwise."""
    if name not in obj:
        raise ValueError(f"{path}: row {lineno} is missing field {name!r}; {help}")
    val = obj[name]
    if isinstance(val, (int, float)) and not isinstance(val, bool):
        val = str(val)
    if not isinstance(val, str) or not val.strip():
        raise ValueError(f"{path}: row {lineno} field {name!r} must be a non-empty string, got {val!r}; {help}")
    return val


def load_sft_jsonl(path: str, split: str = "train") -> list[dict]:
    """Rows ``{"messages", "response"}`` from rows with ``messages`` or ``question``/``answer``: a
    jsonl file, a ``save_to_disk`` folder or a hub name such as ``openai/gsm8k`` (``split`` picks
    the split of the last two; :mod:`arealite.dataset.sources`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: invalid JSON, or a row missing/malforming a field (names the 1-based row
            number and the field).
    """
    out = []
    for lineno, obj in _read_jsonl(path, split):
        if "messages" in obj:
            msgs = check_messages(path, lineno, obj["messages"], "messages", _SFT_HELP)
            if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
                raise ValueError(f"{path}: row {lineno} field 'messages' must end with an 'assistant' message "
                                 f"after at least one prompt message; {_SFT_HELP}")
            out.append({"messages": msgs[:-1], "response": msgs[-1]["content"]})
        elif "question" in obj or "answer" in obj:
            question = text_field(path, lineno, obj, "question", _SFT_HELP)
            answer = _CALC.sub("", text_field(path, lineno, obj, "answer", _SFT_HELP))
            out.append({"messages": [{"role": "user", "content": question + GSM8K_INSTRUCTION}], "response": answer})
        else:
            raise ValueError(f"{path}: row {lineno} is missing field 'messages' (or 'question'/'answer'); "
                             f"fields present: {sorted(obj)}; {_SFT_HELP}")
    return out


def load_sft_dataset(path: str | None, split: str = "train", size: int | None = None, seed: int = 0) -> list[dict]:
    """SFT rows from ``path`` (see the module doc); ``size`` rows after a seeded shuffle.

    Raises:
        FileNotFoundError / ValueError: as :func:`load_sft_jsonl`; ``size`` out of range.
    """
    if path is None or path == "arithmetic":
        return [{"messages": r["messages"], "response": r["answer"]} for r in load_dataset(None, split, size, seed)]
    rows = load_sft_jsonl(path, split)
    return select(rows, size, seed, path)


def select(rows: list, size: int | None, seed: int, path: str) -> list:
    """All rows (``size`` None) or ``size`` of them after a ``random.Random(seed)`` shuffle."""
    if size is None:
        return rows
    if not isinstance(size, int) or size < 1 or size > len(rows):
        raise ValueError(f"size={size!r} is invalid for {path}: it must be between 1 and the number of rows {len(rows)}")
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[:size]


def tokenize_example(tokenizer, messages: list[dict[str, str]], response: str, max_length: int) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of prompt + response + EOS, cut to ``max_length`` tokens from the
    right (a cut response loses its EOS and tail; a prompt longer than the limit leaves no loss
    token). ``loss_mask`` is 1 on the response tokens only."""
    prompt = tokenize_chat(tokenizer, messages)
    resp = list(tokenizer.encode(response, add_special_tokens=False)) + [tokenizer.eos_token_id]
    ids = (prompt + resp)[:max_length]
    mask = ([0] * len(prompt) + [1] * len(resp))[:max_length]
    return ids, mask


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` [B, T] int64, ``attention_mask`` [B, T] bool, ``loss_mask``
    [B, T] int32 from (ids, loss_mask) lists."""
    return {
        "input_ids": pad_and_stack([e[0] for e in examples], pad_id, torch.int64),
        "attention_mask": pad_and_stack([[1] * len(e[0]) for e in examples], 0, torch.bool),
        "loss_mask": pad_and_stack([e[1] for e in examples], 0, torch.int32),
    }


class SFTCollator:
    """``collate_fn`` for a DataLoader over SFT rows: tokenizes and pads (see :func:`pad_batch`).

    Args:
        tokenizer: HF tokenizer with a chat template. max_length: [tokens] per row (> 0).

    Raises:
        ValueError: ``max_length`` ≤ 0 (names ``train_dataset.max_length``).
    """

    def __init__(self, tokenizer, max_length: int):
        if max_length <= 0:
            raise ValueError(f"train_dataset.max_length must be > 0, got {max_length}")
        self.tokenizer, self.max_length = tokenizer, max_length
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return pad_batch([tokenize_example(self.tokenizer, r["messages"], r["response"], self.max_length)
                          for r in rows], self.pad_id)
