"""Preference-pair datasets for DPO and their batches (row 2i chosen, row 2i+1 rejected).

Row format after loading::

    {"messages": [{"role": "user", "content": str}, ...], "chosen": str, "rejected": str}

jsonl input: the prompt is ``prompt`` (a string, sent as one user message) or ``messages`` (a
chat list); ``chosen`` / ``rejected`` are the response texts, or chat lists ending with the
assistant's reply (TRL's conversational format; the last message's content is used).
``None`` / ``"arithmetic"``: pairs built from the embedded arithmetic task (chosen = the correct
sum, rejected = the sum off by ±1 or ±10, seeded) — a no-download offline DPO task.
"""

from __future__ import annotations

import random

import torch

from arealite.algorithms.reward_model import reward_batch
from arealite.dataset.math_data import _read_jsonl, load_dataset
from arealite.dataset.sft_data import SFTCollator, check_messages, pad_batch, select, text_field, tokenize_example

_PREF_HELP = "pass a jsonl whose rows have 'prompt' (or 'messages'), 'chosen' and 'rejected'"


def _response(path: str, lineno: int, obj: dict, name: str) -> str:
    if isinstance(obj.get(name), list):
        msgs = check_messages(path, lineno, obj[name], name, _PREF_HELP)
        if msgs[-1]["role"] != "assistant":
            raise ValueError(f"{path}: row {lineno} field {name!r} must end with an 'assistant' message; {_PREF_HELP}")
        return msgs[-1]["content"]
    return text_field(path, lineno, obj, name, _PREF_HELP)


def load_preference_jsonl(path: str) -> list[dict]:
    """Rows ``{"messages", "chosen", "rejected"}`` from a preference jsonl (see the module doc).

    Raises:
        FileNotFoundError: no such file.
        ValueError: invalid JSON or a missing/malformed field (names the 1-based row number and
            the field).
    """
    out = []
    for lineno, obj in _read_jsonl(path):
        if "messages" in obj:
            messages = check_messages(path, lineno, obj["messages"], "messages", _PREF_HELP)
        elif "prompt" in obj:
            messages = [{"role": "user", "content": text_field(path, lineno, obj, "prompt", _PREF_HELP)}]
        else:
            raise ValueError(f"{path}: row {lineno} is missing field 'prompt' (or 'messages'); "
                             f"fields present: {sorted(obj)}; {_PREF_HELP}")
        out.append({"messages": messages, "chosen": _response(path, lineno, obj, "chosen"),
                    "rejected": _response(path, lineno, obj, "rejected")})
    return out


def make_arithmetic_pairs(split: str, size: int | None = None, seed: int = 0) -> list[dict]:
    """Preference pairs on the embedded arithmetic task: chosen ``str(a + b)``, rejected the sum
    plus one of ±1, ±10 (``random.Random(seed)``). Same rows/prompts as ``load_dataset(None, ...)``."""
    rng = random.Random(seed)
    rows = load_dataset(None, split, size, seed)
    return [{"messages": r["messages"], "chosen": r["answer"],
             "rejected": str(int(r["answer"]) + rng.choice((-10, -1, 1, 10)))} for r in rows]


def load_preference_dataset(path: str | None, split: str = "train", size: int | None = None,
                            seed: int = 0) -> list[dict]:
    """Pairs from ``path`` (jsonl) or the embedded arithmetic pairs (None); ``size`` rows after a
    seeded shuffle. Raises FileNotFoundError / ValueError as :func:`load_preference_jsonl`."""
    if path is None or path == "arithmetic":
        return make_arithmetic_pairs(split, size, seed)
    if not str(path).endswith(".jsonl"):
        raise ValueError(f"unsupported preference dataset path {path!r}; {_PREF_HELP} (or None for the embedded task)")
    return select(load_preference_jsonl(path), size, seed, path)


class PreferenceCollator(SFTCollator):
    """``collate_fn`` for pairs: rows ``[chosen_0, rejected_0, chosen_1, ...]``, each prompt +
    response + EOS cut to ``max_length``; ``input_ids`` [2P, T] int64, ``attention_mask``
    [2P, T] bool, ``loss_mask`` [2P, T] int32 (1 on response tokens only).

    Raises:
        ValueError: ``max_length`` ≤ 0 (names ``train_dataset.max_length``).
    """

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        examples = []
        for r in rows:
            for key in ("chosen", "rejected"):
                examples.append(tokenize_example(self.tokenizer, r["messages"], r[key], self.max_length))
        return pad_batch(examples, self.pad_id)


class RewardPairCollator(SFTCollator):
    """``collate_fn`` for reward-model training on pairs: rows ``[chosen_0, rejected_0, ...]``,
    each prompt + response + EOS cut to ``max_length``, in the scoring layout of
    :func:`arealite.algorithms.reward_model.reward_batch` (one extra pad token per row carries the
    only ``loss_mask`` = 1). ``input_ids`` [2P, T] int64, ``attention_mask`` [2P, T] bool,
    ``loss_mask`` [2P, T] int32.

    Raises:
        ValueError: ``max_length`` ≤ 0 (names ``train_dataset.max_length``).
    """

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        seqs = [tokenize_example(self.tokenizer, r["messages"], r[key], self.max_length)[0]
                for r in rows for key in ("chosen", "rejected")]
        return reward_batch(seqs, self.pad_id)
