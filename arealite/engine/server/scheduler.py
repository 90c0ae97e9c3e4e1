"""A small transformers-based generation server speaking a subset of SGLang's HTTP protocol.

It lets arealite's rollout side run without SGLang (CPU-only machines, tests, tiny models)
while talking to it with the same client code.  The server works on token ids only, like
SGLang launched with ``--skip-tokenizer-init``; the model folder needs no tokenizer.

Run::

    python -m arealite.engine.server --model-path DIR --host 127.0.0.1 --port 30000 \
        --num-threads 1 --max-batch-size 64 --dtype float32 --seed 1 [--weight-version 0]

Implemented subset of SGLang's protocol (JSON in, JSON out):

- ``POST /generate`` -- one sequence per request (``n`` must be 1), ``input_ids`` only
  (no text), ``sampling_params`` with ``temperature``, ``top_p``, ``top_k``,
  ``max_new_tokens``, ``stop_token_ids``, ``stop`` (strings; needs a tokenizer in the model
  folder) and ``ignore_eos``; ``return_logprob`` adds ``meta_info.output_token_logprobs`` as
  ``[[logprob, token_id, null], ...]``.
- ``GET /health``, ``GET /get_model_info``, ``GET /get_server_info`` (scheduler counters).
- ``POST /pause_generation`` / ``POST /continue_generation`` (abort-on-pause semantics).
- ``POST /update_weights_from_disk`` (safetensors, applied between decode steps).
- ``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``,
  ``POST /destroy_weights_update_group``: weights broadcast by the trainer (gloo on CPU, NCCL on
  GPU), see :mod:`arealite.engine.weight_sync`.

Not implemented: text prompts, streaming, ``n > 1``, penalties, min_p, LoRA, input logprobs,
tensor parallelism, sliding-window attention (refused at start-up), sharing KV blocks in
place between rows (prefixes are copied; SGLang's radix cache and vLLM's paged blocks share).

Design: the model lives in ONE scheduler thread.  HTTP handlers (aiohttp, event-loop thread)
put messages on a thread-safe queue and await an asyncio future that the scheduler resolves
with ``loop.call_soon_threadsafe``.  The scheduler does continuous batching (``Scheduler``):
between decode steps it drains its queue and admits waiting requests; finished requests leave.
The KV cache (``SlotKVCache``) is one preallocated row per running request with its tokens
left-aligned, written in place by an attention function registered in transformers'
``AttentionInterface`` (``slot_attention``), so the HF model code runs unchanged while the
server owns the cache: prefill is packed without padding, decode attends over each row's own
length, nothing is concatenated per step, and requests with the same prompt (the samples of
a GRPO group) share one prefill.  Finished requests leave their KV in a ``PrefixStore`` (LRU,
``--prefix-cache-tokens``), so the next turn of a multi-turn episode prefills only its new
tokens.  Position ids are each row's own token positions, so a row computes what it would
compute alone (up to float rounding).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from aiohttp import web

logger = logging.getLogger("arealite.server")

ABORT_BY_PAUSE = "Abort by pause_generation"
ABORT_BEFORE_PREFILL = "Abort before prefill"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- validation


class RequestError(ValueError):
    """A malformed request; rendered as HTTP 400 ``{"error": {"message", "field"}}``."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name
        self.message = message


@dataclass
class SamplingParams:
    """Per-request sampling parameters (SGLang names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 or >= vocab size: disabled
    max_new_tokens: int = 128
    stop_token_ids: frozenset = frozenset()
    ignore_eos: bool = False
    stop: tuple = ()  # stop strings


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_version(v):
    """A ``weight_version`` field: an integer, or a string of one (SGLang's type); None stays
    None. Raises ``ValueError`` for anything else."""
    if v is None or _is_int(v):
        return v
    if isinstance(v, str) and v.lstrip("-").isdigit():
        return int(v)
    raise ValueError(f"weight_version must be an integer (or a string of one), got {v!r}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_generate_request(body, vocab_size: int, max_positions: int | None,
                           has_tokenizer: bool = True):
    """Validate a ``/generate`` body; return ``(input_ids, SamplingParams, return_logprob, rid)``.

    Raises ``RequestError`` naming the offending field and how to fix it.
    Unknown keys in ``sampling_params`` are ignored, as SGLang does for most of them.
    """
    if not isinstance(body, dict):
        raise RequestError("body", "request body must be a JSON object")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids", "input_ids must be a non-empty list of token ids "
                           "(text prompts are not supported; tokenize on the client)")
    if not all(_is_int(t) for t in ids):
        raise RequestError("input_ids", "input_ids must contain only integers")
    if not all(0 <= t < vocab_size for t in ids):
        raise RequestError("input_ids", f"token ids must be in [0, {vocab_size}) for this model")
    sp = body.get("sampling_params", {})
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError("sampling_params", "sampling_params must be a JSON object")
    for where, holder in (("n", body), ("sampling_params.n", sp)):
        if "n" in holder and holder["n"] != 1:
            raise RequestError(where, "n must be 1: send one request per sample")
    p = SamplingParams()
    t = sp.get("temperature", p.temperature)
    if not _is_number(t) or not math.isfinite(t) or t < 0:
        raise RequestError("sampling_params.temperature",
                           "temperature must be a number >= 0 (0 means greedy)")
    top_p = sp.get("top_p", p.top_p)
    if not _is_number(top_p) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise RequestError("sampling_params.top_p", "top_p must be a number in (0, 1]")
    top_k = sp.get("top_k", p.top_k)
    if not _is_int(top_k):
        raise RequestError("sampling_params.top_k", "top_k must be an integer (-1 disables it)")
    if top_k <= 0 or top_k >= vocab_size:
        top_k = -1  # disabled (also keeps huge values out of the batch's int64 tensor)
    max_new = sp.get("max_new_tokens", p.max_new_tokens)
    if not _is_int(max_new) or max_new < 0:
        raise RequestError("sampling_params.max_new_tokens",
                           "max_new_tokens must be an integer >= 0")
    stop = sp.get("stop_token_ids", [])
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(_is_int(s) for s in stop):
        raise RequestError("sampling_params.stop_token_ids",
                           "stop_token_ids must be a list of integers")
    stop_str = sp.get("stop", [])
    if stop_str is None:
        stop_str = []
    if isinstance(stop_str, str):
        stop_str = [stop_str]
    if not isinstance(stop_str, list) or not all(isinstance(x, str) and x for x in stop_str):
        raise RequestError("sampling_params.stop",
                           "stop must be a non-empty string or a list of non-empty strings")
    if stop_str and not has_tokenizer:
        raise RequestError("sampling_params.stop",
                           "stop strings need a tokenizer in the server's model folder; save "
                           "one there or use stop_token_ids")
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError("sampling_params.ignore_eos", "ignore_eos must be true or false")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise RequestError("return_logprob", "return_logprob must be true or false")
    if max_positions is not None and len(ids) + max_new > max_positions:
        raise RequestError(
            "sampling_params.max_new_tokens",
            f"len(input_ids) + max_new_tokens = {len(ids)} + {max_new} exceeds the model's "
            f"max_position_embeddings ({max_positions}); lower max_new_tokens to at most "
            f"{max(max_positions - len(ids), 0)} or shorten the prompt")
    rid = body.get("rid")
    rid = str(rid) if rid is not None else uuid.uuid4().hex
    params = SamplingParams(float(t), float(top_p), top_k, max_new, frozenset(stop), ignore_eos,
                            tuple(stop_str))
    return ids, params, return_logprob, rid


# ----------------------------------------------------------------------------- sampling


def sample_next_tokens(logits, temperature, top_p, top_k, generator):
    """Pick one token per row; return ``(tokens [B] long, logprobs [B] float32)``.

    ``logits`` is ``[B, V]``; ``temperature``/``top_p`` are float ``[B]``, ``top_k`` long ``[B]``.
    Rows with temperature 0 are greedy (argmax, logprob from ``log_softmax(logits)``).  Other
    rows sample from ``softmax(logits / T)`` filtered by top-k then top-p (nucleus: smallest
    set with cumulative probability >= top_p, top token always kept).  As in SGLang, the
    returned logprob is ``log_softmax(logits / T)[token]``: after temperature, before the
    top-k/top-p filtering, which is what the trainer recomputes.
    """
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    plain = (~greedy & ~filtered).nonzero().squeeze(1)
    if plain.numel():  # no top-k/top-p: sample the tempered softmax directly (no sort)
        tokens[plain] = _sample_rows(logprobs_all[plain].exp(), generator)
    rows = (~greedy & filtered).nonzero().squeeze(1)
    if rows.numel():
        probs = logprobs_all[rows].exp()
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        k = top_k[rows]
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        drop = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop |= mass_before >= top_p[rows][:, None]
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        choice = _sample_rows(sorted_p, generator)
        tokens[rows] = sorted_idx.gather(1, choice[:, None]).squeeze(1)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


def _sample_rows(weights, generator):
    """One index per row of ``weights`` ``[B, V]`` (non-negative, unnormalised), drawn with
    probability proportional to the weight by inverse-CDF sampling: ``searchsorted(cumsum(w),
    u * sum(w))``, ``u ~ U[0, 1)``. Same distribution as ``torch.multinomial(weights, 1)``, which
    takes ~3x as long on CPU for a 49k vocabulary (16 rows: 17 ms vs 6 ms). Zero-weight entries are never picked."""
    cdf = weights.cumsum(dim=-1)
    u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device,
                   dtype=cdf.dtype) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    # u * total can round up to total; a zero-weight tail must not be picked, so step back to
    # the last index with weight (cdf strictly increases there).
    last = weights.shape[1] - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(idx, last)


# ----------------------------------------------------------------------------- weights


def load_weights_from_disk(model: torch.nn.Module, path: str) -> int:
    """Copy safetensors weights from folder ``path`` into ``model`` in place.

    Accepts a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
    Every tensor is validated (known key, same shape) and every expected parameter must be
    present -- except ones tied to a present parameter, e.g. ``lm_head.weight`` with
    ``tie_word_embeddings`` -- before anything is copied, so on error the old weights stay.
    Tensors the model does not know are ignored (``strict=False``).
    Returns ``(num_loaded, unexpected_keys)``; raises ``ValueError`` with a readable message.
    """
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise ValueError(f"model_path {path!r} is not a directory")
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r}")
    loaded = {}
    for name in files:
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise ValueError(f"missing weight shard {file_path!r}")
        loaded.update(load_file(file_path))

    expected = model.state_dict()
    unexpected = [k for k in loaded if k not in expected]  # ignored, like strict=False
    loaded = {k: v for k, v in loaded.items() if k in expected}
    for key, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(f"shape mismatch for {key!r}: file has {tuple(tensor.shape)}, "
                             f"model expects {tuple(expected[key].shape)}")
    # Parameters sharing storage (tied weights) count as present if any alias is loaded.
    by_storage: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(key)
    missing = [keys[0] for keys in by_storage.values() if not any(k in loaded for k in keys)]
    if missing:
        raise ValueError(f"{len(missing)} expected tensors missing from {path!r}, "
                         f"e.g. {missing[:3]}")
    with torch.no_grad():
        model.load_state_dict({k: v.to(expected[k].dtype) for k, v in loaded.items()},
                              strict=False)
    return len(loaded), unexpected


def load_named_tensors(model: torch.nn.Module, tensors: dict) -> int:
    """Copy a subset of parameters ``{name: tensor}`` into ``model`` in place (one bucket of a
    distributed update). Names must be known and shapes equal; all are checked before anything
    is copied. Tied parameters update together (shared storage). Values are cast to the
    model's dtype. Returns the number of tensors; raises ``ValueError`` naming the first bad one.
    """
    expected = model.state_dict()
    for key, tensor in tensors.items():
        if key not in expected:
            raise ValueError(f"unknown parameter {key!r} (the trainer's model architecture "
                             f"differs from the server's?); e.g. known: {list(expected)[:3]}")
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(f"shape mismatch for {key!r}: sent {tuple(tensor.shape)}, "
                             f"model expects {tuple(expected[key].shape)}")
    with torch.no_grad():
        for key, tensor in tensors.items():
            expected[key].copy_(tensor.to(device=expected[key].device, dtype=expected[key].dtype))
    return len(tensors)


# ----------------------------------------------------------------------------- KV cache


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


_CONTEXT = threading.local()


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over :class:`SlotKVCache`, registered in transformers' ``AttentionInterface``
    as ``"arealite_slots"`` (``query`` ``[B, Hq, T, D]``, ``key``/``value`` ``[B, Hkv, T, D]``
    after RoPE; returns ``([B, T, Hq, D], None)`` like transformers' sdpa function).

    Decode (``B`` rows, ``T = 1``): writes each row's new key/value at its own position, then
    attends over the first ``kv_len`` cached positions with a per-row length mask; the query
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
        rows = torch.arange(b, device=query.device)
        k_buf[rows, :, ctx.pos] = key[:, :, 0]
        v_buf[rows, :, ctx.pos] = value[:, :, 0]
        q = query.reshape(b, hkv, hq // hkv, d)
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


def _register_attention():
    """Register :func:`slot_attention`, with sdpa's mask builder (masks are ignored inside a
    server step, but a direct call of the model with padding still gets its mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


# ----------------------------------------------------------------------------- scheduler


@dataclass
class Request:
    """One /generate request as seen by the scheduler thread."""

    rid: str
    input_ids: list
    params: SamplingParams
    return_logprob: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    output_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finished: bool = False
    kv_len: int = 0  # tokens in this request's KV-cache row
    last: int = -1  # the next token to feed (not yet in the cache)
    kv_epoch: int = -1  # Scheduler._weights_epoch when its prompt KV was computed


@dataclass
class _Message:
    kind: str  # "generate" | "pause" | "update_weights" | "load_tensors"
    payload: object
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _resolve(loop, future, value):
    def _set():
        if not future.done():
            future.set_result(value)
    loop.call_soon_threadsafe(_set)


class Scheduler:
    """Owns the model; runs prefill and decode in one thread with continuous batching.

    Every loop iteration: handle queued messages; admit waiting requests while their prefill
    fits ``max_prefill_tokens`` (at least one request per iteration) and the batch has fewer
    than ``max_batch_size`` rows; then one decode step over all rows. Requests join and leave
    between decode steps. A prompt longer than ``max_prefill_tokens`` is staged: one chunk per
    iteration into a one-row cache, then copied into a row, so decoding never waits for more
    than one budget of prefill.

    Prefill is packed (no padding) and computes only the KV cache of ``input_ids[:-1]``; the
    last prompt token is the row's first decode input, so a new row's first token is sampled
    in the same batched step as everyone else's. Prefix sharing: a request whose
    ``input_ids[:-1]`` equal those of a running row (or of an earlier request of the same
    admission, e.g. the ``n`` samples of a GRPO group) copies that row's KV instead of
    recomputing it, provided the KV was computed with the current weights. A request that
    starts with the tokens of a finished one (prompt + output, whole 16-token blocks) takes
    that KV from the :class:`PrefixStore` and prefills only the rest. A weight load empties
    the store.
    """

    def __init__(self, model, max_batch_size: int = 64, seed: int = 1, weight_version: int = 0,
                 decode_step_delay: float = 0.0, tokenizer=None, max_prefill_tokens: int = 1024,
                 prefix_cache_tokens: int = 8192):
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch_size and max_prefill_tokens must be >= 1")
        if prefix_cache_tokens != 0 and prefix_cache_tokens < PrefixStore.BLOCK:
            raise ValueError(f"prefix_cache_tokens={prefix_cache_tokens}: use 0 (off) or at least "
                             f"{PrefixStore.BLOCK} (one block)")
        self.model = model
        self.tokenizer = tokenizer  # optional: stop strings and the reply's "text"
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_step_delay = decode_step_delay
        self.weight_version = weight_version
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.device = model.device
        cfg = model.config.get_text_config()
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            raise ValueError(f"{type(model).__name__} has sliding-window or other non-full "
                             "attention layers, which arealite's server does not support; use "
                             "rollout.backend=sglang or vllm for this model")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        self.cache = SlotKVCache(cfg.num_hidden_layers, kv_heads, head_dim, dtype, self.device,
                                 max_batch_size)
        self._max_positions = getattr(cfg, "max_position_embeddings", None)
        self._logits_kw = ({"logits_to_keep": 1}
                           if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
        _register_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self._weights_epoch = 0  # +1 at every weight load: KV computed before is not shared
        self.prefix_store = PrefixStore(prefix_cache_tokens) if prefix_cache_tokens else None
        self._queue: queue.Queue = queue.Queue()
        self._waiting: list[Request] = []
        self._rows: list[Request] = []  # running requests; row i of the KV cache is _rows[i]
        # A prompt longer than max_prefill_tokens is prefilled into its own one-row cache, one
        # chunk per iteration (decode goes on meanwhile), then copied into a row.
        self._staged: Request | None = None
        self._staged_done = 0  # prompt tokens of _staged already in _staging_cache
        self._staging_cache = SlotKVCache(cfg.num_hidden_layers, kv_heads, head_dim, dtype,
                                          self.device, 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.stats = {"prefill_tokens": 0, "shared_prefix_tokens": 0, "cached_prefix_tokens": 0,
                      "decode_steps": 0}
        self._self_check()

    def _self_check(self):
        """Decode 3 tokens through the slot cache and compare with a plain forward, so that a
        model whose attention ignores transformers' ``AttentionInterface`` fails at start-up
        instead of producing wrong logprobs."""
        ids = [1, 2, 3]
        with torch.inference_mode():
            ref = self.model(input_ids=torch.tensor([ids], device=self.device),
                             use_cache=False).logits[0].float()
            req = Request("self-check", ids, SamplingParams(), False, None, None)
            req.kv_len, req.last, req.kv_epoch = 0, ids[0], 0
            self._rows = [req]
            got = []
            for _ in range(3):
                got.append(self._forward_decode()[0].float())
                req.last = ids[min(req.kv_len, 2)]
            self._rows = []
            self.cache.release()
        err = (torch.stack(got) - ref).abs().max().item()
        tol = 1e-3 if ref.dtype == torch.float32 and next(self.model.parameters()).dtype == torch.float32 else 0.1
        if not err <= tol * max(1.0, ref.abs().max().item()):
            raise RuntimeError(f"{type(self.model).__name__}: decoding through the server's KV "
                               f"cache differs from a plain forward by {err:.3g}; this model "
                               "does not use transformers' AttentionInterface")

    # -- called from the event loop thread
    def start(self):
        self._thread.start()

    def shutdown(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def submit(self, kind: str, payload=None) -> asyncio.Future:
        """Hand a message to the scheduler thread; await the returned future for its answer."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Message(kind, payload, future, loop))
        return future

    def submit_nowait(self, kind: str, payload=None) -> None:
        """A message without an answer (``"abort"``: payload = the abandoned request's future)."""
        self._queue.put(_Message(kind, payload, None, None))

    # -- scheduler thread
    def _loop(self):
        while not self._stop.is_set():
            try:
                self.step(block=True)
                if self.decode_step_delay and self._rows:
                    time.sleep(self.decode_step_delay)
            except Exception as exc:  # keep serving; fail what was in flight
                logger.exception("scheduler step failed")
                self._fail_all(exc)

    def step(self, block: bool = False) -> None:
        """One scheduler iteration: handle every queued message, admit waiting requests, run
        one decode step. The scheduler thread calls it in a loop (``block``: wait up to 0.2 s
        for a message when idle); tests call it directly to drive the server deterministically."""
        self._drain(block=block and not self._rows and not self._waiting and self._staged is None)
        with torch.inference_mode():
            self._admit()
            if self._rows:
                self._decode_step()

    def _drain(self, block: bool):
        try:
            msg = self._queue.get(timeout=0.2) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: _Message):
        if msg.kind == "generate":
            req = Request(*msg.payload, future=msg.future, loop=msg.loop)
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
            else:
                self._waiting.append(req)
        elif msg.kind == "pause":
            _resolve(msg.loop, msg.future, self._abort_all())
        elif msg.kind == "abort":  # its client is gone: drop it without a reply
            self._waiting = [r for r in self._waiting if r.future is not msg.payload]
            if self._staged is not None and self._staged.future is msg.payload:
                self._clear_staged()
            for i in range(len(self._rows) - 1, -1, -1):
                if self._rows[i].future is msg.payload:
                    self._remove_row(i)
        elif msg.kind == "load_tensors":
            tensors, version = msg.payload
            try:
                n = load_named_tensors(self.model, tensors)
            except Exception as exc:
                _resolve(msg.loop, msg.future, (400, {"success": False, "message": str(exc)}))
                return
            self._new_weights()
            if version is not None:
                self.weight_version = version
            _resolve(msg.loop, msg.future, (200, {
                "success": True, "message": f"Succeeded to update {n} parameters."}))
        elif msg.kind == "update_weights":
            path, version, abort = msg.payload
            if abort:
                self._abort_all()
            try:
                n, unexpected = load_weights_from_disk(self.model, path)
            except Exception as exc:
                _resolve(msg.loop, msg.future, (400, {"success": False, "message": str(exc)}))
                return
            self._new_weights()
            if version is not None:
                self.weight_version = version
            message = f"Succeeded to update model weights ({n} tensors from {path})."
            if unexpected:
                message += f" Ignored {len(unexpected)} unknown tensors, e.g. {unexpected[:3]}."
            _resolve(msg.loop, msg.future, (200, {
                "success": True, "message": message, "num_paused_requests": 0}))
        else:
            raise ValueError(f"unknown message kind {msg.kind!r}")

    def _new_weights(self) -> None:
        """KV computed with the old weights must not be reused from now on."""
        self._weights_epoch += 1
        if self.prefix_store is not None:
            self.prefix_store.clear()
        self._staged_done = 0  # a staged prompt is prefilled again with the new weights

    def _clear_staged(self) -> None:
        self._staged, self._staged_done = None, 0
        self._staging_cache.release()

    def _abort_all(self) -> int:
        n = 0
        for req in self._rows:
            self._finish(req, {"type": "abort", "message": ABORT_BY_PAUSE})
            n += 1
        for req in self._waiting + ([self._staged] if self._staged else []):
            self._finish(req, {"type": "abort", "message": ABORT_BEFORE_PREFILL})
            n += 1
        self._rows, self._waiting = [], []
        self._clear_staged()
        self.cache.release()
        return n

    def _fail_all(self, exc: Exception):
        reqs = self._rows + self._waiting + ([self._staged] if self._staged else [])
        self._rows, self._waiting = [], []
        self._clear_staged()
        self.cache.release()
        for req in reqs:
            _resolve(req.loop, req.future, exc)

    def _admit(self):
        """Move waiting requests into the running rows: share or prefill their prompt KV.

        Takes requests in arrival order while there is a free row and the prefill budget
        (``max_prefill_tokens``, counting only tokens that must be computed) is not exceeded;
        the first request is always taken. A prompt that needs more than the whole budget is
        staged instead: prefilled one budget-sized chunk per iteration into its own cache, while
        the running rows keep decoding, and copied into a row when done (one staged at a time)."""
        budget = self.max_prefill_tokens - self._advance_staged()
        free = self.max_batch_size - len(self._rows)
        if not self._waiting or free <= 0:
            return
        owners = {tuple(r.input_ids[:-1]): i for i, r in enumerate(self._rows)
                  if r.kv_epoch == self._weights_epoch}
        first_new = len(self._rows)
        segments, copies, restores = [], [], []
        while self._waiting and len(self._rows) < self.max_batch_size:
            req = self._waiting[0]
            key = tuple(req.input_ids[:-1])
            cached, k_layers, v_layers = 0, None, None
            if key and key not in owners and self.prefix_store is not None:
                cached, k_layers, v_layers = self.prefix_store.lookup(key, len(key))
            need = 0 if key in owners else len(key) - cached
            if need > self.max_prefill_tokens:
                if self._staged is not None:
                    break  # one staged prompt at a time; later requests wait behind it
                self._waiting.pop(0)
                self._stage(req, cached, k_layers, v_layers)
                continue
            if need > budget and len(self._rows) > first_new:
                break
            self._waiting.pop(0)
            row = len(self._rows)
            req.kv_len, req.last, req.kv_epoch = len(key), req.input_ids[-1], self._weights_epoch
            if key in owners:
                copies.append((owners[key], row, len(key)))
                self.stats["shared_prefix_tokens"] += len(key)
            elif key:
                owners[key] = row
                if cached:
                    restores.append((row, k_layers, v_layers))
                    self.stats["cached_prefix_tokens"] += cached
                if need:
                    segments.append((row, cached, key[cached:]))
                    budget -= need
            self._rows.append(req)
        if len(self._rows) == first_new:  # only staged
            return
        self.cache.ensure(len(self._rows), max(r.kv_len for r in self._rows) + 1,
                          first_new, max((r.kv_len for r in self._rows[:first_new]), default=0))
        for row, k_layers, v_layers in restores:  # before the prefill, which attends over them
            self.cache.write_row(row, k_layers, v_layers)
        self._prefill(segments)
        for src, dst, length in copies:  # after the prefill: sources may be new rows
            self.cache.copy_row(src, dst, length)
        logger.debug("admitted %d requests (%d prefilled, %d from the prefix store, %d shared); "
                     "%d running", len(self._rows) - first_new, len(segments), len(restores),
                     len(copies), len(self._rows))

    def _stage(self, req: Request, cached: int, k_layers, v_layers) -> None:
        """Make ``req`` the staged request; its first ``cached`` prompt tokens come from the
        prefix store (``k_layers``/``v_layers``)."""
        self._staged, self._staged_done = req, cached
        req.kv_epoch = self._weights_epoch
        self._staging_cache.ensure(1, len(req.input_ids), 0, 0)
        if cached:
            self._staging_cache.write_row(0, k_layers, v_layers)
        self.stats["cached_prefix_tokens"] += cached

    def _advance_staged(self) -> int:
        """Prefill the next chunk (at most ``max_prefill_tokens``) of the staged prompt; once it
        is complete and a row is free, copy its KV into a new row. Returns the tokens computed."""
        req = self._staged
        if req is None:
            return 0
        if req.kv_epoch != self._weights_epoch:  # new weights since it was staged: start over
            req.kv_epoch, self._staged_done = self._weights_epoch, 0
        key = req.input_ids[:-1]
        n = min(self.max_prefill_tokens, len(key) - self._staged_done)
        if n:
            self._prefill([(0, self._staged_done, key[self._staged_done:self._staged_done + n])],
                          self._staging_cache)
            self._staged_done += n
        if self._staged_done == len(key) and len(self._rows) < self.max_batch_size:
            row = len(self._rows)
            live = max((r.kv_len for r in self._rows), default=0)
            self.cache.ensure(row + 1, max(live, len(key)) + 1, row, live)
            self.cache.write_row(row, *self._staging_cache.read_row(0, len(key)))
            req.kv_len, req.last = len(key), req.input_ids[-1]
            self._rows.append(req)
            self._clear_staged()
        return n

    def _prefill(self, segments, cache: SlotKVCache | None = None):
        """Compute the KV of ``segments`` (``(row, start, token ids)``: the ids go to positions
        ``start, start+1, ...`` of the row, whose positions before ``start`` are already cached),
        packed into forwards of at most ``max_prefill_tokens`` tokens; a longer segment is split
        into chunks that continue at the right positions."""
        pieces = []  # (row, start, ids)
        for row, first, ids in segments:
            for off in range(0, len(ids), self.max_prefill_tokens):
                pieces.append((row, first + off, list(ids[off:off + self.max_prefill_tokens])))
        while pieces:
            chunk, total = [], 0
            while pieces and (not chunk or total + len(pieces[0][2]) <= self.max_prefill_tokens):
                piece = pieces.pop(0)
                if any(p[0] == piece[0] for p in chunk):  # a row's next chunk: next forward
                    pieces.insert(0, piece)
                    break
                chunk.append(piece)
                total += len(piece[2])
            ids, positions, ctx_segments = [], [], []
            for row, start, piece_ids in chunk:
                ctx_segments.append((row, start, len(ids), len(piece_ids)))
                ids.extend(piece_ids)
                positions.extend(range(start, start + len(piece_ids)))
            _CONTEXT.step = _StepContext(cache or self.cache, segments=ctx_segments)
            try:
                self.model(input_ids=torch.tensor([ids], device=self.device),
                           position_ids=torch.tensor([positions], device=self.device),
                           use_cache=False, **self._logits_kw)
            finally:
                _CONTEXT.step = None
            self.stats["prefill_tokens"] += len(ids)

    def _forward_decode(self):
        """One forward of every row's ``last`` token at position ``kv_len``; returns the
        next-token logits ``[rows, vocab]``."""
        rows = self._rows
        pos = torch.tensor([r.kv_len for r in rows], device=self.device)
        kv_len = max(r.kv_len for r in rows) + 1
        self.cache.ensure(len(rows), kv_len, len(rows), kv_len - 1)
        mask = (torch.arange(kv_len, device=self.device)[None, :] <= pos[:, None])[:, None, None]
        _CONTEXT.step = _StepContext(self.cache, pos=pos, kv_len=kv_len, mask=mask)
        try:
            out = self.model(input_ids=torch.tensor([[r.last] for r in rows], device=self.device),
                             position_ids=pos[:, None], use_cache=False, **self._logits_kw)
        finally:
            _CONTEXT.step = None
        for r in rows:
            r.kv_len += 1
        return out.logits[:, -1]

    def _decode_step(self):
        logits = self._forward_decode()
        self.stats["decode_steps"] += 1
        tokens = self._sample_and_append(self._rows, logits)
        for req, tok in zip(self._rows, tokens.tolist()):
            req.last = tok
        for i in range(len(self._rows) - 1, -1, -1):
            if self._rows[i].finished:
                self._keep_prefix(i)
                self._remove_row(i)
        if not self._rows and not self._waiting and self._staged is None:
            self.cache.release()
        else:
            self.cache.shrink(len(self._rows), max((r.kv_len for r in self._rows), default=0) + 1)

    def _remove_row(self, i: int) -> None:
        """Drop row ``i``; the last row moves into the hole (one row copy)."""
        last = len(self._rows) - 1
        if i != last:
            self.cache.copy_row(last, i, self._rows[last].kv_len)
            self._rows[i] = self._rows[last]
        self._rows.pop()

    def _keep_prefix(self, row: int) -> None:
        """Copy a finished row's KV (prompt + output but the last token, whole blocks only)
        into the prefix store, for a later request that continues this conversation."""
        req, store = self._rows[row], self.prefix_store
        n = req.kv_len // store.block * store.block if store is not None else 0
        if n == 0 or n > store.max_tokens or req.kv_epoch != self._weights_epoch:
            return
        tokens = (req.input_ids + req.output_ids)[:n]
        k_layers, v_layers = self.cache.read_row(row, n)
        store.insert(tokens, [k.clone() for k in k_layers], [v.clone() for v in v_layers])

    def _sample_and_append(self, reqs, logits):
        """Sample a token for each row, record it and finish rows that hit a stop condition."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in reqs], device=dev)
        top_ps = torch.tensor([r.params.top_p for r in reqs], device=dev)
        top_ks = torch.tensor([r.params.top_k for r in reqs], device=dev)
        tokens, logprobs = sample_next_tokens(logits, temps, top_ps, top_ks, self.generator)
        for req, tok, lp in zip(reqs, tokens.tolist(), logprobs.tolist()):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            p = req.params
            matched = self._match_stop_string(req) if p.stop else None
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                self._finish(req, {"type": "stop", "matched": tok})
            elif matched is not None:
                self._finish(req, {"type": "stop", "matched": matched})
            elif len(req.output_ids) >= p.max_new_tokens:
                self._finish(req, {"type": "length", "length": p.max_new_tokens})
        return tokens

    def _match_stop_string(self, req: Request) -> str | None:
        """The first stop string that the decoded output now contains, else None.

        Checked after every token, so only the tail that can hold a newly completed match is
        decoded (each token decodes to >= 1 character; 8 tokens of slack for byte pieces)."""
        window = max(len(x) for x in req.params.stop) + 8
        text = self.tokenizer.decode(req.output_ids[-window:])
        for stop in req.params.stop:
            if stop in text:
                return stop
        return None

    def _finish(self, req: Request, reason: dict):
        req.finished = True
        meta = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "weight_version": self.weight_version,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(req.logprobs, req.output_ids)]
        reply = {"output_ids": list(req.output_ids), "meta_info": meta}
        if self.tokenizer is not None:
            # Like SGLang: the text ends before a matched stop string, while output_ids and the
            # logprobs keep every sampled token (including the one completing the stop string).
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            cut = text.find(reason["matched"]) if isinstance(reason.get("matched"), str) else -1
            if cut >= 0:
                text = text[:cut]
            reply["text"] = text
        _resolve(req.loop, req.future, reply)


# ----------------------------------------------------------------------------- HTTP


def _error(field_name: str, message: str, status: int = 400):
    return web.json_response({"error": {"message": message, "field": field_name}}, status=status)


class Server:
    """aiohttp handlers; all model work is delegated to the ``Scheduler`` thread."""

    def __init__(self, scheduler: Scheduler, model_path: str):
        self.scheduler = scheduler
        self.model_path = model_path
        cfg = scheduler.model.config.get_text_config()
        self.vocab_size = cfg.vocab_size
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self._resumed: asyncio.Event | None = None  # set = not paused
        self.groups: dict = {}  # group_name -> (process group, backend) for weight broadcasts

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_model_info", self.get_model_info)
        app.router.add_get("/get_server_info", self.get_server_info)
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post("/init_weights_update_group", self.init_weights_update_group)
        app.router.add_post("/update_weights_from_distributed",
                            self.update_weights_from_distributed)
        app.router.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        app.router.add_post("/get_weights_by_name", self.get_weights_by_name)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app):
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.scheduler.start()

    async def _on_cleanup(self, app):
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.shutdown)

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate``: ``{"input_ids": [int], "sampling_params": {...},
        "return_logprob": bool, "rid": str}`` -> ``{"output_ids": [int], "meta_info": {"id",
        "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
        "output_token_logprobs": [[logprob (nats), token_id, null], ...]}}``.

        ``finish_reason`` is ``{"type": "stop", "matched": id}`` (matched id included in the
        output), ``{"type": "length", "length": max_new_tokens}`` or ``{"type": "abort",
        "message": ...}`` after ``/pause_generation``.  Requests arriving while paused are held
        until ``/continue_generation``.  Malformed requests get 400 before any model work.
        """
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error("body", "request body must be valid JSON")
        try:
            ids, params, return_logprob, rid = parse_generate_request(
                body, self.vocab_size, self.max_positions, self.scheduler.tokenizer is not None)
        except RequestError as e:
            return _error(e.field, e.message)
        while not self._resumed.is_set():
            await self._resumed.wait()
        future = self.scheduler.submit("generate", (rid, ids, params, return_logprob))
        try:
            result = await future
        except asyncio.CancelledError:  # the client went away (handler_cancellation): free the row
            self.scheduler.submit_nowait("abort", future)
            raise
        if isinstance(result, Exception):
            return _error("", f"generation failed: {result}", status=500)
        return web.json_response(result)

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health`` -> ``{"status": "ok"}`` (the model is loaded before we listen)."""
        return web.json_response({"status": "ok"})

    async def get_model_info(self, request: web.Request) -> web.Response:
        """``GET /get_model_info`` -> model path, current weight version, vocab and batch size."""
        return web.json_response({
            "model_path": self.model_path,
            "weight_version": self.scheduler.weight_version,
            "is_generation": True,
            "vocab_size": self.vocab_size,
            "max_batch_size": self.scheduler.max_batch_size,
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        """``GET /get_server_info`` -> scheduler counters since start: ``prefill_tokens``
        (prompt tokens run through the model), ``shared_prefix_tokens`` (prompt tokens whose KV
        was copied from a running row instead), ``cached_prefix_tokens`` (copied from the
        prefix store of finished requests), ``decode_steps``; plus ``running_requests``,
        ``waiting_requests`` and ``max_prefill_tokens``. Read without locking (a snapshot)."""
        sched = self.scheduler
        return web.json_response({**sched.stats, "running_requests": len(sched._rows),
                                  "waiting_requests": len(sched._waiting) + (sched._staged is not None),
                                  "max_prefill_tokens": sched.max_prefill_tokens})

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``POST /pause_generation`` (body ignored), SGLang's abort mode: running requests are
        aborted at the next decode-step boundary with their partial output, waiting ones
        with zero tokens; new ``/generate`` calls are held.  Replies once nothing is in flight:
        ``{"status": "ok", "message": ..., "num_aborted_requests": N}``."""
        self._resumed.clear()
        n = await self.scheduler.submit("pause")
        return web.json_response({"status": "ok", "message": "Generation paused successfully.",
                                  "num_aborted_requests": n})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``POST /continue_generation``: release held ``/generate`` requests."""
        self._resumed.set()
        return web.json_response({"status": "ok",
                                  "message": "Generation continued successfully."})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk`` ``{"model_path": str, "weight_version": int?}``.

        Loads safetensors from the folder into the live model between decode steps. With
        ``abort_all_requests: true`` (SGLang's flag, sent by arealite's client) running and
        waiting requests are first aborted with their partial output, so every token is tagged
        with the version that produced it; otherwise running requests continue with the new
        weights (attending over KV of the old ones) and their reply reports the new version.
        200 ``{"success": true, "message", "num_paused_requests": 0}``; 400 ``{"success":
        false, "message"}`` with old weights kept.
        """
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return web.json_response(
                {"success": False, "message": "body must be {\"model_path\": str}"}, status=400)
        try:
            version = _parse_version(body.get("weight_version"))
        except ValueError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        status, result = await self.scheduler.submit(
            "update_weights", (body["model_path"], version, bool(body.get("abort_all_requests"))))
        return web.json_response(result, status=status)


    # -- distributed weight updates (SGLang request shapes; see arealite.engine.weight_sync)

    @staticmethod
    async def _json_object(request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return body if isinstance(body, dict) else None

    @staticmethod
    def _fail(message: str, status: int = 400):
        return web.json_response({"success": False, "message": message}, status=status)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group`` ``{"master_address": str, "master_port": int
        (or a numeric string, as AReaL sends), "rank_offset": int, "world_size": int,
        "group_name": str = "weight_update_group", "backend": "gloo" | "nccl"}``.

        Joins the trainer's weight-update group at rank ``rank_offset`` (no tensor
        parallelism here) and replies once every rank has joined: ``{"success": true,
        "message"}``; 400 ``{"success": false, "message"}`` on bad fields or a failed join.
        A group of the same name is replaced (a restarted trainer).
        """
        from arealite.api.weight_update import DEFAULT_GROUP_NAME
        from arealite.engine.weight_group import new_weight_update_group

        body = await self._json_object(request)
        if body is None:
            return self._fail("body must be a JSON object")
        try:
            address = body["master_address"]
            port = int(body["master_port"])
            rank, world = body["rank_offset"], body["world_size"]
        except (KeyError, TypeError, ValueError) as e:
            return self._fail(f"need master_address, master_port, rank_offset, world_size: {e!r}")
        name = body.get("group_name", DEFAULT_GROUP_NAME)
        backend = body.get("backend", "nccl" if self.scheduler.device.type == "cuda" else "gloo")
        if not (_is_int(rank) and _is_int(world) and 1 <= rank < world):
            return self._fail("rank_offset and world_size must be integers with "
                              "1 <= rank_offset < world_size (rank 0 is the trainer)")
        if backend == "nccl" and self.scheduler.device.type != "cuda":
            return self._fail("backend 'nccl' needs a GPU server; use 'gloo' on CPU")
        if self.groups.pop(name, None) is not None:
            # A restarted trainer re-creates its group under the same name: the old one is dead.
            # A receive still blocked in the old group fails once the old trainer's connections
            # close (it exited) or at that group's timeout; it does not block the new group.
            logger.warning("replacing weight-update group %r (a new trainer joined)", name)
        loop = asyncio.get_running_loop()
        try:
            pg = await loop.run_in_executor(None, new_weight_update_group, address, port, rank,
                                            world, name, backend)
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            logger.exception("joining weight-update group failed")
            return self._fail(f"joining group {name!r} at {address}:{port} failed: {e}")
        self.groups[name] = (pg, backend)
        return web.json_response({"success": True,
                                  "message": f"Joined {name!r} as rank {rank}/{world}."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed`` ``{"names": [str], "dtypes": [str],
        "shapes": [[int]], "group_name": str, "weight_version": int?, "flush_cache": bool?}``.

        Receives one broadcast (from rank 0 of the group) per name, in order, into tensors of
        the declared dtype and shape, then loads them between decode steps. The tensors are
        always received (so the group's collectives stay aligned) before anything is checked
        against the model; a bad name or shape gives 400 and leaves the weights untouched.
        ``flush_cache`` is accepted and ignored: loading new weights always empties the prefix
        store and stops prefix sharing with rows computed under the old weights.
        """
        from arealite.api.weight_update import parse_dtype
        from arealite.engine.weight_group import broadcast_tensor

        body = await self._json_object(request)
        if body is None:
            return self._fail("body must be a JSON object")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        name = body.get("group_name", "weight_update_group")
        version = body.get("weight_version")
        if name not in self.groups:
            return self._fail(f"no weight-update group {name!r}; call /init_weights_update_group")
        ok = (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
              and len(names) == len(dtypes) == len(shapes)
              and all(isinstance(s, list) and all(_is_int(d) for d in s) for s in shapes))
        if not ok:
            return self._fail("names, dtypes and shapes must be lists of equal length "
                              "(shapes: lists of integers)")
        try:
            version = _parse_version(version)
            torch_dtypes = [parse_dtype(d) for d in dtypes]
        except (ValueError, AttributeError) as e:
            return self._fail(str(e))
        pg, backend = self.groups[name]
        device = self.scheduler.device if backend == "nccl" else torch.device("cpu")

        def receive():
            out = {}
            for n, dt, shape in zip(names, torch_dtypes, shapes):
                t = torch.empty(shape, dtype=dt, device=device)
                broadcast_tensor(pg, t)
                out[n] = t
            return out

        try:
            tensors = await asyncio.get_running_loop().run_in_executor(None, receive)
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            logger.exception("receiving weights failed")
            return self._fail(f"receiving {len(names)} tensors failed (weights may be partly "
                              f"updated; push again): {e}")
        status, result = await self.scheduler.submit("load_tensors", (tensors, version))
        return web.json_response(result, status=status)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """``POST /get_weights_by_name`` ``{"name": str, "truncate_size": int = 100,
        "digest": bool = false}`` -> SGLang's reply, the parameter's first ``truncate_size``
        rows as nested lists; with ``digest`` instead ``{"name", "shape", "dtype", "sha256"}``
        (sha256 of the float32 bytes, C order) to compare whole tensors cheaply."""
        import hashlib

        body = await self._json_object(request) or {}
        state = self.scheduler.model.state_dict()
        name = body.get("name")
        if name not in state:
            return _error("name", f"unknown parameter {name!r}; e.g. {list(state)[:3]}")
        t = state[name].detach().float().cpu().contiguous()
        if body.get("digest"):
            return web.json_response({"name": name, "shape": list(t.shape),
                                      "dtype": str(state[name].dtype).removeprefix("torch."),
                                      "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()})
        size = body.get("truncate_size", 100)
        if not _is_int(size) or size < 0:
            return _error("truncate_size", "truncate_size must be an integer >= 0")
        return web.json_response(t[:size].tolist() if t.dim() else t.item())

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        """``POST /destroy_weights_update_group`` ``{"group_name": str}``: leave the group."""
        body = await self._json_object(request) or {}
        entry = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if entry is None:
            return self._fail("no such group")
        return web.json_response({"success": True, "message": "Group destroyed."})


# ----------------------------------------------------------------------------- entry point


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF causal-LM folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-batch-size", type=int, default=64, help="most running requests")
    p.add_argument("--max-prefill-tokens", type=int, default=1024,
                   help="prompt tokens prefilled per scheduler iteration (and per forward)")
    p.add_argument("--prefix-cache-tokens", type=int, default=8192,
                   help="KV of finished requests kept for later requests with the same prefix "
                        "(e.g. the next turn of an episode) [tokens]; 0 = off")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--parent-pid", type=int, default=0,
                   help="exit when this process is gone (set by arealite's launcher); 0 = never")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--decode-step-delay", type=float, default=0.0,
                   help="testing aid: seconds to sleep after each decode step, so that "
                        "pause/update timing can be exercised with tiny, fast models")
    return p.parse_args(argv)


def main(argv=None):
    """Load the model, start the scheduler thread and serve HTTP until interrupted."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.num_threads)
    if args.parent_pid:
        from arealite.utils.proc import exit_when_parent_dies

        exit_when_parent_dies(args.parent_pid)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=DTYPES[args.dtype])
    model.to(args.device).eval()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    except Exception:  # noqa: BLE001 - token ids only; stop strings are then rejected
        tokenizer = None
    scheduler = Scheduler(model, args.max_batch_size, args.seed, args.weight_version,
                          args.decode_step_delay, tokenizer, args.max_prefill_tokens,
                          args.prefix_cache_tokens)
    server = Server(scheduler, args.model_path)
    logger.info("serving %s on %s:%d", args.model_path, args.host, args.port)
    # handler_cancellation: a client that disconnects (e.g. timed out and moved to another
    # server) cancels its /generate handler, which aborts the request here.
    web.run_app(server.app(), host=args.host, port=args.port, print=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
