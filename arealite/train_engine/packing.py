"""Micro-batch layout for the train engines (:mod:`arealite.train_engine.fsdp`): balanced
micro-batches, first-fit-decreasing packing of sequences into rows, and prefix sharing (rows with
the same prompt run it once, :func:`shared_prompt_layout`). Pure tensor/index bookkeeping: no
model and no process group."""

from __future__ import annotations

import torch


def split_microbatches(lengths: list[int], n_mbs: int) -> list[list[int]]:
    """Partition row indices into ``n_mbs`` groups with balanced token counts.

    Longest-first greedy: each row goes to the group with the fewest tokens so far. Groups keep
    ascending row order. Some groups are empty when there are fewer rows than ``n_mbs``.
    """
    groups: list[list[int]] = [[] for _ in range(n_mbs)]
    load = [0] * n_mbs
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = min(range(n_mbs), key=lambda g: load[g])
        groups[g].append(i)
        load[g] += lengths[i]
    return [sorted(g) for g in groups]


def pack_sequences(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequences into rows of ``capacity`` tokens.

    Returns bins of sequence indices (each in ascending order); a sequence longer than
    ``capacity`` gets a row of its own. Zero-length sequences are left out.
    """
    bins: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] == 0:
            continue
        for r in range(len(bins)):
            if fill[r] + lengths[i] <= capacity:
                bins[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            bins.append([i])
            fill.append(lengths[i])
    return [sorted(b) for b in bins]


def packed_layout(ids: torch.Tensor, lengths: list[int], bins: list[list[int]]):
    """Lay the concatenated sequences ``ids`` [N] (sequence after sequence, ``lengths``) out as
    packed rows, one per bin.

    Returns ``(input_ids [R, C], position_ids [R, C], where [N])``: position ids restart at 0
    per sequence; the tail of a short row is filler with position id 0 (each filler token is a
    sequence of its own, so it is never attended to); ``where[j]`` is the flattened [R·C]
    position of real token j.
    """
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    C = max(sum(lengths[i] for i in b) for b in bins)
    input_ids = ids.new_zeros(len(bins), C)
    position_ids = torch.zeros(len(bins), C, dtype=torch.long, device=ids.device)
    where = torch.empty(ids.shape[0], dtype=torch.long, device=ids.device)
    for r, b in enumerate(bins):
        c = 0
        for i in b:
            n, o = lengths[i], starts[i]
            input_ids[r, c:c + n] = ids[o:o + n]
            position_ids[r, c:c + n] = torch.arange(n, device=ids.device)
            where[o:o + n] = torch.arange(r * C + c, r * C + c + n, device=ids.device)
            c += n
    return input_ids, position_ids, where


def prompt_units(keys: list[tuple], lengths: list[int], cap: int) -> list[tuple[int, list[int]]]:
    """Rows that start with the same prompt, as the units that share one forward of it.

    Args:
        keys: per row, its prompt: the token ids before its first ``loss_mask = 1`` token
            (``()`` = nothing to share).
        lengths: per row, its real tokens.
        cap: at most this many packed tokens per unit (prompt once + every row's suffix); a
            larger group of rows with the same prompt is split into several units, in row order.

    Returns:
        ``(p, rows)`` units covering every row once, in order of their first row: ``p`` tokens
        (the prompt) are computed once for all ``rows``; ``p = 0`` for a unit of one row. A
        unit's packed length is ``p + Σ_rows (length − p)``.
    """
    groups: dict[tuple, list[int]] = {}
    units: list[tuple[int, list[int]]] = []
    for i, k in enumerate(keys):
        if k:
            groups.setdefault(k, []).append(i)
        else:
            units.append((0, [i]))
    for k, rows in groups.items():
        p = len(k)
        cur: list[int] = []
        fill = p
        for i in rows:
            if cur and fill + lengths[i] - p > cap:
                units.append((p if len(cur) > 1 else 0, cur))
                cur, fill = [], p
            cur.append(i)
            fill += lengths[i] - p
        units.append((p if len(cur) > 1 else 0, cur))
    return sorted(units, key=lambda u: u[1][0])


def unit_length(unit: tuple[int, list[int]], lengths: list[int]) -> int:
    """Packed tokens of a :func:`prompt_units` unit: its prompt once plus each row's suffix."""
    p, rows = unit
    return p + sum(lengths[i] - p for i in rows)


def shared_prompt_layout(ids: torch.Tensor, lengths: list[int], units: list[tuple[int, list[int]]],
                         bins: list[list[int]]):
    """Lay rows out as packed rows in which each unit's prompt appears once (prefix sharing).

    ``ids`` [N]: the real tokens, row after row (``lengths``). Unit ``(p, rows)`` occupies
    ``p`` prompt tokens (positions 0..p−1) followed by each row's suffix (positions p..len−1);
    ``bins`` pack unit indices into packed rows. A suffix token attends to its unit's prompt and,
    causally, to its own suffix; a prompt token attends causally to the prompt. This is exactly
    the attention of each row run on its own, so the hidden states (and their gradients, summed
    over the rows) are those of the unshared rows. (The same idea: "Prefix Grouper", Liu et al.
    2025, arXiv:2506.05433.)

    Returns:
        ``(input_ids [R, C], position_ids [R, C], where [N], allowed [R, 1, C, C] bool,
        segments)``: ``where[j]`` is the flattened [R·C] position holding row token j (a prompt
        token of a shared unit: the one shared copy); ``allowed[r, 0, q, k]`` = query q may
        attend to key k. Filler at the tail of a short row attends only to itself.
        ``segments``: the same attention as ``(prefix_start, prefix_len, start, length)`` flat
        spans, one per prompt, suffix and unshared row (filler in none), for
        :func:`arealite.train_engine.segment_attention.build_segments`.
    """
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    sizes = [unit_length(u, lengths) for u in units]
    C = max(sum(sizes[u] for u in b) for b in bins)
    R = len(bins)
    input_ids = ids.new_zeros(R, C)
    position_ids = torch.zeros(R, C, dtype=torch.long, device=ids.device)
    seg = -1 - torch.arange(R * C, device=ids.device).view(R, C)  # filler: a segment of its own
    branch = torch.zeros(R, C, dtype=torch.long, device=ids.device)  # 0 = shared prompt
    where = torch.empty(ids.shape[0], dtype=torch.long, device=ids.device)
    segments = []
    for r, b in enumerate(bins):
        c = 0
        for u in b:
            p, rows = units[u]
            prompt_at = r * C + c
            if p:
                segments.append((prompt_at, 0, prompt_at, p))
                o = starts[rows[0]]
                input_ids[r, c:c + p] = ids[o:o + p]
                position_ids[r, c:c + p] = torch.arange(p, device=ids.device)
                seg[r, c:c + p] = u
                for i in rows:
                    where[starts[i]:starts[i] + p] = torch.arange(r * C + c, r * C + c + p, device=ids.device)
                c += p
            for k, i in enumerate(rows, start=1):
                n, o = lengths[i] - p, starts[i] + p
                input_ids[r, c:c + n] = ids[o:o + n]
                position_ids[r, c:c + n] = torch.arange(p, p + n, device=ids.device)
                seg[r, c:c + n] = u
                branch[r, c:c + n] = k
                where[o:o + n] = torch.arange(r * C + c, r * C + c + n, device=ids.device)
                segments.append((prompt_at, p, r * C + c, n))
                c += n
    causal = torch.ones(C, C, dtype=torch.bool, device=ids.device).tril()
    same_seg = seg[:, :, None] == seg[:, None, :]  # [R, C(q), C(k)]
    visible_branch = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    allowed = (same_seg & visible_branch & causal)[:, None]  # [R, 1, C, C]
    return input_ids, position_ids, where, allowed, segments
