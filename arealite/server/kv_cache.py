"""The server's KV cache: one preallocated row per running request (:class:`SlotKVCache`), the
KV of finished requests kept for later ones with the same prefix (:class:`PrefixStore`), and
the attention function that reads and writes the cache from inside the unchanged HF model code
(:func:`slot_attention`, registered in transformers' ``AttentionInterface`` as
``"arealite_slots"``; the scheduler sets each forward's layout with :func:`attention_step`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager

import torch

from arealite import native

ATTN_IMPLEMENTATION = "arealite_slots"


class SlotKVCache:
    """The server's KV cache: per layer, key and value buffers ``[rows, kv_heads, capacity,
    head_dim]`` in the model's dtype. Running request ``i`` owns row ``i``; its cached tokens
    are left-aligned at positions ``[0, kv_len_i)`` (no padding), so a row's own position ids
    are its column indices. Rows are kept contiguous (``0..n-1``): a finished row is replaced
    by the last row (one row copy), a new row is appended. Buffers grow by reallocation
    (rows: powers of two up to ``max_rows``; capacity: x1.5, rounded up to 128 tokens) and
    shrink when they hold over 4x what the running rows need. Memory is dense: every row is
    as long as the longest one (``rows x capacity x kv_heads x head_dim`` per layer for keys
    and for values), unlike SGLang's/vLLM's paged caches.

    Unlike HF's ``DynamicCache`` nothing is concatenated per step (appending one token is one
    indexed write per layer) and rows of different lengths need no left padding.
    """

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype, device, max_rows: int):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device, self.max_rows = dtype, device, max_rows
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def rows(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def ensure(self, rows: int, length: int, live_rows: int, live_len: int) -> None:
        """Make room for ``rows`` rows of ``length`` tokens, keeping the first ``live_rows``
        rows' first ``live_len`` tokens."""
        if rows <= self.rows and length <= self.capacity:
            return
        new_rows = max(self.rows, self._rows_for(rows))
        new_cap = self.capacity
        if length > new_cap:
            new_cap = -(-max(length, int(new_cap * 1.5)) // 128) * 128
        self._realloc(new_rows, new_cap, live_rows, live_len)

    def shrink(self, rows: int, length: int) -> None:
        """Reallocate smaller when the buffers hold over 4x what ``rows`` rows of ``length``
        tokens need (after long requests left), keeping those rows' first ``length`` tokens."""
        want_rows = self._rows_for(rows)
        want_cap = -(-int(length * 1.5) // 128) * 128
        if self.rows * self.capacity > 4 * want_rows * want_cap:
            self._realloc(want_rows, want_cap, rows, min(length, self.capacity))

    def _rows_for(self, rows: int) -> int:  # the next power of two, at most max_rows
        return max(rows, min(self.max_rows, 1 << max(rows - 1, 0).bit_length()))

    def _realloc(self, new_rows: int, new_cap: int, live_rows: int, live_len: int) -> None:
        shape = (new_rows, self.kv_heads, new_cap, self.head_dim)
        for buffers in (self.k, self.v):
            for layer in range(self.n_layers):
                # zeros, not empty: masked-out slots still enter q.k (NaN garbage would poison it)
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if buffers and live_rows and live_len:
                    new[:live_rows, :, :live_len] = buffers[layer][:live_rows, :, :live_len]
                if len(buffers) < self.n_layers:
                    buffers.append(new)
                else:
                    buffers[layer] = new

    def read_row(self, row: int, length: int) -> tuple[list, list]:
        """Views of row ``row``'s first ``length`` cached tokens: per layer, keys and values
        ``[kv_heads, length, head_dim]`` (clone them to keep them past the next write)."""
        return [k[row, :, :length] for k in self.k], [v[row, :, :length] for v in self.v]

    def write_row(self, row: int, k_layers: list, v_layers: list) -> None:
        """Put per-layer keys/values ``[kv_heads, n, head_dim]`` at positions ``[0, n)`` of
        row ``row`` (the buffers must already hold ``n`` positions)."""
        for buf, kv in zip(self.k + self.v, k_layers + v_layers):
            buf[row, :, :kv.shape[1]] = kv

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached tokens of row ``src`` into row ``dst``."""
        if length:
            for buffers in (self.k, self.v):
                for buf in buffers:
                    buf[dst, :, :length] = buf[src, :, :length]

    def release(self) -> None:
        self.k, self.v = [], []


class PrefixStore:
    """KV of finished requests, kept for later requests that start with the same tokens (the
    next turn of a multi-turn episode, a sample of a group that arrives after its siblings left;
    not the resubmission after a pause, since that pause is for a weight update, which empties
    the store).

    Entries are indexed per block of ``block`` tokens by a chained hash (block ``i``'s key
    covers tokens ``[0, (i+1)·block)``), so a lookup walks the new prompt's blocks once and finds
    the longest block-aligned prefix held by any entry; the tokens are compared before use (no
    trust in hashes). Each entry holds per-layer ``[kv_heads, n, head_dim]`` key/value copies.
    Least recently used entries are evicted beyond ``max_tokens`` cached tokens; everything is
    dropped at a weight update (the scheduler calls :meth:`clear`).
    """

    BLOCK = 16  # tokens per hashed block

    def __init__(self, max_tokens: int, block: int = BLOCK):
        self.max_tokens, self.block = max_tokens, block
        self._entries: OrderedDict = OrderedDict()  # id -> (tokens tuple, k list, v list, hashes)
        self._index: dict = {}  # chained block hash -> {entry id: tokens covered}, oldest first
        self._tokens = 0
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _hashes(self, tokens):
        h = 0
        for end in range(self.block, len(tokens) + 1, self.block):
            h = hash((h, tuple(tokens[end - self.block:end])))
            yield h, end

    def insert(self, tokens, k_layers, v_layers) -> None:
        """Keep ``k_layers``/``v_layers`` (per layer ``[kv_heads, len(tokens), head_dim]``, owned
        by the store from now on) as the KV of ``tokens``. Prefixes shorter than one block, or
        longer than ``max_tokens``, are not kept."""
        n = len(tokens) // self.block * self.block
        if n == 0 or n > self.max_tokens:
            return
        eid, self._next_id = self._next_id, self._next_id + 1
        hashes = []
        for h, end in self._hashes(tokens[:n]):
            self._index.setdefault(h, {})[eid] = end
            hashes.append(h)
        self._entries[eid] = (tuple(tokens[:n]), [k[:, :n] for k in k_layers],
                              [v[:, :n] for v in v_layers], hashes)
        self._tokens += n
        while self._tokens > self.max_tokens:
            self._evict(next(iter(self._entries)))

    def _evict(self, eid) -> None:
        tokens, _, _, hashes = self._entries.pop(eid)
        self._tokens -= len(tokens)
        for h in hashes:
            holders = self._index[h]
            del holders[eid]
            if not holders:
                del self._index[h]

    def lookup(self, tokens, limit: int):
        """The longest block-aligned cached prefix of ``tokens`` of at most ``limit`` tokens:
        ``(n, k_layers, v_layers)`` with views of ``n`` positions, or ``(0, None, None)``."""
        best = None
        for h, end in self._hashes(tokens[:limit]):
            holders = self._index.get(h)
            if not holders:
                break
            best = (next(reversed(holders)), end)  # the newest entry holding this prefix
        if best is None:
            return 0, None, None
        eid, n = best
        entry = self._entries[eid]
        if entry[0][:n] != tuple(tokens[:n]):  # a hash collision
            return 0, None, None
        self._entries.move_to_end(eid)
        return n, [k[:, :n] for k in entry[1]], [v[:, :n] for v in entry[2]]

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._tokens = 0


class _StepContext:
    """What the attention function needs for one forward: either a decode step (``rows``
    query tokens, one per row, at positions ``pos``) or a packed prefill (``segments``)."""

    def __init__(self, cache: SlotKVCache, pos=None, kv_len: int = 0, mask=None, segments=()):
        self.cache, self.pos, self.kv_len, self.mask, self.segments = (
            cache, pos, kv_len, mask, segments)
        self.lens = None if pos is None else pos + 1  # positions each row attends
        if pos is not None and kv_len > cache.capacity:
            raise ValueError(f"decode step attends {kv_len} positions, the cache holds {cache.capacity}")


_CONTEXT = threading.local()


@contextmanager
def attention_step(cache: SlotKVCache, pos=None, kv_len: int = 0, mask=None, segments=()):
    """Within the block, :func:`slot_attention` runs one server forward over ``cache`` (this
    thread only): a decode step (``pos`` ``[rows]`` long: each row's position; ``kv_len``: the
    positions attended; ``mask`` ``[rows, 1, 1, kv_len]`` bool) or, with ``segments``
    (``(row, start, offset, n)`` per packed prompt piece), a packed prefill."""
    _CONTEXT.step = _StepContext(cache, pos=pos, kv_len=kv_len, mask=mask, segments=segments)
    try:
        yield
    finally:
        _CONTEXT.step = None



def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over :class:`SlotKVCache`, registered in transformers' ``AttentionInterface``
    as ``"arealite_slots"`` (``query`` ``[B, Hq, T, D]``, ``key``/``value`` ``[B, Hkv, T, D]``
    after RoPE; returns ``([B, T, Hq, D], None)`` like transformers' sdpa function).

    Decode (``B`` rows, ``T = 1``): writes each row's new key/value at its own position, then
    attends over that row's positions ``[0, pos]``: the native kernel
    (:func:`arealite.native.decode_attention`, reading each row's own length) where it
    runs, else SDPA over the first ``kv_len`` positions with a per-row length mask; the query
    heads of one KV head are packed as a length-``Hq/Hkv`` query, so GQA needs no repeat.
    Prefill (``B = 1``, the prompts packed along ``T``): for each segment ``(row, start, off,
    n)`` writes tokens ``off:off+n`` at positions ``start:start+n`` of ``row`` and attends
    causally over that row's positions ``[0, start+n)`` (earlier chunks of the same prompt).

    Outside a server step (no context set, e.g. a test calling the model directly) this is
    transformers' own sdpa attention.
    """
    ctx = getattr(_CONTEXT, "step", None)
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    k_buf, v_buf = ctx.cache.k[module.layer_idx], ctx.cache.v[module.layer_idx]
    if not ctx.segments:  # decode
        b, hq, _, d = query.shape
        hkv = key.shape[1]
        q = query.reshape(b, hkv, hq // hkv, d)
        out = native.decode_attention(q, k_buf, v_buf, ctx.lens, d ** -0.5 if scaling is None else scaling,
                                      key[:, :, 0], value[:, :, 0])  # the kernel writes the new KV too
        if out is None:
            rows = torch.arange(b, device=query.device)
            k_buf[rows, :, ctx.pos] = key[:, :, 0]
            v_buf[rows, :, ctx.pos] = value[:, :, 0]
            out = sdpa(q, k_buf[:b, :, :ctx.kv_len], v_buf[:b, :, :ctx.kv_len], attn_mask=ctx.mask,
                       scale=scaling)
        return out.reshape(b, hq, 1, d).transpose(1, 2), None
    out = torch.empty_like(query)
    gqa = query.shape[1] != key.shape[1]
    for row, start, off, n in ctx.segments:
        k_buf[row, :, start:start + n] = key[0, :, off:off + n]
        v_buf[row, :, start:start + n] = value[0, :, off:off + n]
        q = query[:, :, off:off + n]
        k, v = k_buf[row:row + 1, :, :start + n], v_buf[row:row + 1, :, :start + n]
        if start == 0:
            out[:, :, off:off + n] = sdpa(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            causal = (torch.arange(n, device=q.device)[:, None] + start
                      >= torch.arange(start + n, device=q.device)[None, :])
            out[:, :, off:off + n] = sdpa(q, k, v, attn_mask=causal, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2), None


def register_attention():
    """Register :func:`slot_attention`, with sdpa's mask builder (masks are ignored inside a
    server step, but a direct call of the model with padding still gets its mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])

