"""Where a dataset's rows come from: a ``.jsonl`` file, a folder written by ``datasets``'
``save_to_disk``, or a Hugging Face hub name read by ``datasets.load_dataset``.

:func:`read_rows` gives ``(1-based row number, row dict)`` pairs for each; the math, SFT and
preference loaders parse those rows the same way whatever the source
(:func:`arealite.api.cli.dataset_source` tells the kinds apart, for the config check too):

* ``data/train.jsonl`` — one JSON object per line; the file is the split.
* ``my_gsm8k/`` — ``Dataset.save_to_disk`` (the folder is the split) or
  ``DatasetDict.save_to_disk`` (the ``split`` argument picks ``train`` / ``test``).
* ``openai/gsm8k``, ``HuggingFaceH4/MATH-500`` — a hub name, optionally with a config after
  ``:`` (``openai/gsm8k:socratic``); GSM8K's config defaults to ``main``
  (:data:`HUB_DEFAULT_CONFIGS`). This downloads (once, into the ``datasets`` cache) and needs
  the network, or ``HF_DATASETS_OFFLINE=1`` with the cache already filled.
"""

from __future__ import annotations

import json
import os

from arealite.api.cli import dataset_source

HUB_DEFAULT_CONFIGS = {"openai/gsm8k": "main", "gsm8k": "main"}  # hub sets that need a config name


def read_rows(path: str, split: str = "train") -> list[tuple[int, dict]]:
    """``(1-based row number, object)`` for each row of ``path`` (see the module doc); ``split``
    picks the split of a saved ``DatasetDict`` or a hub set (a jsonl file is its own split).

    Raises:
        FileNotFoundError: a ``.jsonl`` path that does not exist.
        ValueError: a path that is none of the accepted sources; invalid JSON or a non-object row
            (names the 1-based row); no rows; a split the saved/hub set lacks (lists those it has);
            a hub set that cannot be loaded (the cause, and what to pass instead).
        ImportError: a saved folder or hub name without the ``datasets`` package installed.
    """
    if isinstance(path, str) and path.endswith(".jsonl") and not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path!r}")
    kind = dataset_source(path)
    rows = _read_jsonl_file(path) if kind == "jsonl" else _read_datasets(path, split, kind)
    if not rows:
        raise ValueError(f"{path}: file has no rows; pass a non-empty dataset" if kind == "jsonl"
                         else f"{path}: split {split!r} has no rows; pass a non-empty dataset")
    return rows


def _read_jsonl_file(path: str) -> list[tuple[int, dict]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: row {lineno} is not valid JSON ({e.msg}); "
                                 "pass a jsonl file with one JSON object per line") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: row {lineno} is a {type(obj).__name__}, not a JSON object; "
                                 "pass a jsonl file with one JSON object per line")
            rows.append((lineno, obj))
    return rows


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ImportError("reading a saved dataset folder or a Hugging Face hub name needs the `datasets` "
                          "package (pip install datasets), or pass a .jsonl file") from None
    return datasets


def _read_datasets(path: str, split: str, kind: str) -> list[tuple[int, dict]]:
    datasets = _datasets()
    if kind == "disk":
        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"{path}: the saved DatasetDict has no split {split!r} (it has {sorted(data)}); "
                                 "save one with that name or pass the split's own folder")
            data = data[split]
    else:
        name, _, config = path.partition(":")
        config = config or HUB_DEFAULT_CONFIGS.get(name)
        try:
            data = datasets.load_dataset(name, config, split=split)
        except Exception as e:  # not found, no network, no such split or config: one message with the cause
            cause = " ".join(str(e).split())[:300]
            raise ValueError(f"{path}: cannot load split {split!r} (config {config!r}) from the Hugging Face hub "
                             f"({type(e).__name__}: {cause}); check the name, or pass a local .jsonl file or a "
                             "folder written by datasets' save_to_disk") from None
    return [(i, dict(row)) for i, row in enumerate(data, start=1)]
