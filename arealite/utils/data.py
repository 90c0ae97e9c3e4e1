"""Tensor helpers for padded trajectory batches (token-aligned layout, right padding)."""

from __future__ import annotations

import torch


def pad_and_stack(rows: list[list], pad_value, dtype: torch.dtype) -> torch.Tensor:
    """Right-pad variable-length lists to a [N, max_len] tensor of ``dtype``."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


# Padding value per key where 0 would be a meaningful value (version 0 is a real version).
PAD_VALUES = {"versions": -1}


def concat_padded(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate trajectory dicts along dim 0, right-padding [N, T] tensors to the longest T.

    Every dict must have the same keys; [N] tensors are concatenated as they are and [N, T]
    tensors are padded with ``PAD_VALUES[key]``, default 0 (so padding has
    ``attention_mask = loss_mask = 0`` and ``versions = -1``).

    Raises:
        ValueError: the dicts have different keys (names them).
    """
    if not batches:
        raise ValueError("concat_padded: no trajectories to concatenate")
    keys = set(batches[0])
    for b in batches[1:]:
        if set(b) != keys:
            raise ValueError(f"concat_padded: trajectories have different keys: {sorted(keys)} vs {sorted(b)}")
    out = {}
    for k in batches[0]:
        ts = [b[k] for b in batches]
        if ts[0].dim() >= 2:
            width = max(t.shape[1] for t in ts)
            value = PAD_VALUES.get(k, 0)
            ts = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in ts]
        out[k] = torch.cat(ts, dim=0)
    return out


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop trailing columns where ``attention_mask`` is 0 for every row."""
    width = int(batch["attention_mask"].sum(1).max())
    return {k: (v[:, :width] if v.dim() >= 2 else v) for k, v in batch.items()}
