"""Attention of the prefix-shared layout (:func:`arealite.train_engine.packing.shared_prompt_layout`)
by segments, instead of one dense masked attention over each packed row.

In a packed row ``[prompt | suffix 1 | ... | suffix G]`` every suffix token attends to the
prompt and, causally, to its own suffix; a prompt token attends causally to the prompt. A dense
``[C, C]`` mask makes SDPA compute all ``C² = (p + Σ n_i)²`` query-key pairs of the row (torch's
CPU flash kernel cannot skip masked blocks), while only ``p²/2 + Σ n_i (p + n_i/2)`` are used:
for a 100-token prompt and 8 completions of 200 tokens 5.9x more than needed, and the gap grows
with the group size and the completion length. Here each
*segment* (a prompt with its prompt as keys; a suffix with its prompt and itself as keys) is
gathered into a batch of short sequences of similar length, attended with SDPA (causal without a
mask for prompts and unshared rows; a ``[n, p + n]`` mask for suffixes), and scattered back.
The result is the masked attention's to fp32 rounding (the same softmax over the same keys;
``tests/test_prefix_sharing.py``); autograd differentiates the gathers, so a prompt key's
gradient is summed over the suffixes that read it.

Used through transformers' attention registry: :data:`NAME` is registered as an attention
implementation that runs segments when the model's forward gets ``arealite_segments=`` and
the dense mask otherwise; each attention call is transformers' SDPA or, for short CPU rows,
:func:`arealite.train_engine.short_attention.short_attention`. The engine loads its models with
it where it would use sdpa, and passes segments where :func:`worthwhile` says they pay:
completions of 64 tokens or more on average, and on the CPU wherever the dense mask would
compute at least 2.5x the (query, key) pairs (README command 1's rows included).
"""

from __future__ import annotations

import dataclasses

import torch

from arealite.train_engine import short_attention

NAME = "arealite_sdpa"  # the attention implementation registered with transformers
MIN_SUFFIX_TOKENS = 64  # mean completion length from which segments beat the dense mask (flash kernel)
MIN_PAIR_RATIO = 2.5  # on the CPU: dense-mask (query, key) pairs per segment pair from which segments pay


def worthwhile(spans: list[tuple[int, int, int, int]], dense_pairs: int, device_type: str = "cpu") -> bool:
    """Whether attending ``spans`` (:func:`build_segments`' input) by segments is expected to
    be faster than the dense mask over rows holding ``dense_pairs`` = R·C² (query, key) pairs,
    when some prompt is shared: where the completions average at least
    :data:`MIN_SUFFIX_TOKENS` tokens, or, on the CPU (where both paths attend short rows with
    :func:`arealite.train_engine.short_attention.short_attention`), where ``dense_pairs`` is at
    least :data:`MIN_PAIR_RATIO` times the segments' ``Σ n (prefix + n)`` pairs.

    Measured on the 2-core Xeon with AMX, bf16, 2 threads, SmolLM2-135M's heads (prompt, G,
    completion). With torch's flash kernel on both paths (per layer, forward + backward, dense
    vs segments; 2026-12-05): 40, 8, 24: 22 vs 45 ms; 40, 16, 24: 54 vs 81; 40, 8, 64: 104 vs
    93; 100, 8, 64: 118 vs 110; 40, 8, 128: 232 vs 170; 200, 4, 128: 145 vs 133; 100, 8, 200:
    530 vs 283; 150, 8, 256: 814 vs 370 ms. With short attention (the whole LoRA GRPO update,
    the two paths alternating in one process, night of 2026-12-05; pair ratio, segments'
    speed-up): 40, 8, 24 (README command 1): 3.9, 1.12x; 40, 16, 24: 6.9, 1.21x; 110, 4, 16:
    1.5, 0.86x."""
    suffixes = [n for _, pl, _, n in spans if pl]
    if not suffixes:
        return False
    if sum(suffixes) >= MIN_SUFFIX_TOKENS * len(suffixes):
        return True
    return device_type == "cpu" and dense_pairs >= MIN_PAIR_RATIO * sum(n * (pl + n) for _, pl, _, n in spans)


@dataclasses.dataclass
class SegmentGroup:
    """Segments of one kind and similar length, attended as one SDPA batch.

    Attributes:
        q_idx: [S, Lq] int64 flat positions (into the [R·C] tokens of the packed rows) of each
            segment's queries; padding points to position R·C, a zero row.
        k_idx: [S, Lk] int64 flat positions of each segment's keys (its prompt, then itself),
            padded the same way.
        mask: [S, 1, Lq, Lk] bool (True = attend) for suffix segments; None for self-causal
            segments (prompts, unshared rows: ``q_idx == k_idx``, SDPA's ``is_causal``).
        dest: [n] int64 flat positions of the real queries, in the order of ``src``.
        src: [n] int64 indices of those queries in the flattened [S·Lq] output.
    """

    q_idx: torch.Tensor
    k_idx: torch.Tensor
    mask: torch.Tensor | None
    dest: torch.Tensor
    src: torch.Tensor


@dataclasses.dataclass
class Segments:
    """The attention of a packed layout as :class:`SegmentGroup` batches; ``size`` = R·C."""

    groups: list[SegmentGroup]
    size: int


def build_segments(segments: list[tuple[int, int, int, int]], size: int, device: torch.device) -> Segments:
    """Group segments for :func:`segment_attention`.

    Args:
        segments: ``(prefix_start, prefix_len, start, length)`` per segment, in flat [R·C]
            positions: its queries are ``[start, start + length)``; its keys the prefix
            ``[prefix_start, prefix_start + prefix_len)`` (all visible) and then its own
            positions (causal). ``prefix_len = 0`` for a prompt or an unshared row.
        size: R·C, the number of flat positions (filler included).
        device: where the index tensors go.

    Returns:
        :class:`Segments`: segments bucketed by kind and by the power of two above their key
        count (padding at most doubles a bucket's work, and one long unshared row does not pad
        every short suffix to its length).
    """
    buckets: dict[tuple[bool, int], list[tuple[int, int, int, int]]] = {}
    for seg in segments:
        if seg[3] > 0:
            n_keys = seg[1] + seg[3]
            buckets.setdefault((seg[1] > 0, 1 << (n_keys - 1).bit_length()), []).append(seg)
    groups = []
    for (suffix, _), segs in sorted(buckets.items()):
        lq = max(s[3] for s in segs)
        lk = max(s[1] + s[3] for s in segs)
        q_idx = torch.full((len(segs), lq), size, dtype=torch.long)
        k_idx = torch.full((len(segs), lk), size, dtype=torch.long)
        for i, (ps, pl, st, n) in enumerate(segs):
            q_idx[i, :n] = torch.arange(st, st + n)
            k_idx[i, :pl] = torch.arange(ps, ps + pl)
            k_idx[i, pl:pl + n] = torch.arange(st, st + n)
        mask = None
        if suffix:  # key j: in the prefix (j < p), or in its own part up to the query (p <= j <= p + i)
            p = torch.tensor([s[1] for s in segs])[:, None, None, None]  # [S, 1, 1, 1]
            j = torch.arange(lk)[None, None, None, :]
            i = torch.arange(lq)[None, None, :, None]
            mask = ((j < p) | (j - p <= i)).to(device)  # [S, 1, Lq, Lk]; padded queries: finite rows
        real = q_idx.view(-1) < size
        groups.append(SegmentGroup(q_idx.to(device), k_idx.to(device), mask,
                                   q_idx.view(-1)[real].to(device), real.nonzero().squeeze(-1).to(device)))
    return Segments(groups, size)


def for_layout(spans: list[tuple[int, int, int, int]], rows: torch.Tensor, attn_implementation: str) -> Segments | None:
    """:func:`build_segments` of a prefix-shared layout (its ``spans`` over the flat positions of
    ``rows`` [R, C], on its device) where the model attends with :data:`NAME` and
    :func:`worthwhile` says segments pay; None (attend through the mask) otherwise."""
    if attn_implementation != NAME or not worthwhile(spans, rows.shape[0] * rows.shape[1] ** 2, rows.device.type):
        return None
    return build_segments(spans, rows.numel(), rows.device)


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      arealite_segments: Segments | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function (the ``sdpa`` signature).

    Args:
        module: the attention module (its ``num_key_value_groups`` for GQA).
        query: [R, H, C, d]; key, value: [R, H_kv, C, d] (after rotary embeddings).
        attention_mask: the 4D mask; used only without ``arealite_segments``.
        arealite_segments: :class:`Segments` of this layout (flat positions over [R·C]), or
            None: transformers' SDPA attention with ``attention_mask``.

    Returns:
        ``(out [R, C, H, d], None)``; filler positions (in no segment) get zeros.
    """
    if arealite_segments is None:
        return _attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    r, h, c, d = query.shape
    if arealite_segments.size != r * c:
        raise ValueError(f"arealite_segments cover {arealite_segments.size} positions, the rows {r} x {c}")

    def flat(x):  # [R, h, C, d] -> [R·C + 1, h, d], a zero row last (padding's position)
        x = x.transpose(1, 2).reshape(r * c, x.shape[1], d)
        return torch.cat([x, x.new_zeros(1, x.shape[1], d)])

    def rows(x, idx):  # x[idx] [*idx.shape, h, d]. On the CPU as index_select, whose gradient is
        # one index_add_ (x[idx]'s is index_put_ with accumulate, 3-4x slower fwd + bwd there,
        # 2026-12-05); elsewhere x[idx], whose CUDA gradient is deterministic (index_add_'s atomics are not)
        if x.device.type != "cpu":
            return x[idx]
        return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])

    qf, kf, vf = flat(query), flat(key), flat(value)
    out = query.new_zeros(r * c, h, d)
    for g in arealite_segments.groups:
        q = rows(qf, g.q_idx).transpose(1, 2)  # [S, H, Lq, d]
        k, v = rows(kf, g.k_idx).transpose(1, 2), rows(vf, g.k_idx).transpose(1, 2)  # [S, H_kv, Lk, d]
        o, _ = _attend(module, q, k, v, g.mask, dropout=dropout, scaling=scaling,
                       is_causal=g.mask is None)  # [S, Lq, H, d]
        out = out.index_copy(0, g.dest, rows(o.reshape(-1, h, d), g.src))
    return out.view(r, c, h, d), None


def _attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (its signature and result, ``[R, Lq, H, d]``), computed by
    :func:`arealite.train_engine.short_attention.short_attention` where that fits (CPU rows of at
    most 256 keys, no dropout, a bool mask or none: 1.1-3.4x faster forward + backward than the
    flash kernel, ``benchmarks/attention_bench.py``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = query.shape[2] > 1 and mask is None and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True))
    plain_mask = mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                                  and mask.shape[2:] == (query.shape[2], key.shape[2]))
    if (plain_mask and not kwargs.get("softcap") and kwargs.get("position_bias") is None
            and not (causal and key.shape[2] != query.shape[2]) and short_attention.fits(query, key, dropout, value)):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = short_attention.short_attention(query, key, value, mask, scale, is_causal=causal)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def resolve_attn_implementation(config, precision: str) -> str:
    """``attn_implementation="auto"`` of a train engine ``config`` whose compute precision
    (:func:`arealite.train_engine.fsdp.compute_precision`) is ``precision``: flash-attention 2
    (packed rows become varlen ``cu_seqlens`` calls) on CUDA with bf16 compute when the
    ``flash_attn`` package is installed, else sdpa (packed rows get a block-diagonal causal mask;
    the engine then registers :data:`NAME`)."""
    import importlib.util

    if config.attn_implementation != "auto":
        return config.attn_implementation
    half = precision == "bf16" or config.dtype == "bfloat16"
    if torch.cuda.is_available() and half and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def register() -> str:
    """Register :data:`NAME` with transformers (attention and mask functions; idempotent) and
    return it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, segment_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
