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
- ``GET /health``, ``GET /get_model_info``.
- ``POST /pause_generation`` / ``POST /continue_generation`` (abort-on-pause semantics).
- ``POST /update_weights_from_disk`` (safetensors, applied between decode steps).
- ``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``,
  ``POST /destroy_weights_update_group``: weights broadcast by the trainer (gloo on CPU, NCCL on
  GPU), see :mod:`arealite.engine.weight_sync`.

Not implemented: text prompts, streaming, ``n > 1``, penalties, min_p, LoRA, input logprobs,
tensor parallelism, sliding-window KV caches (the cache padding/merging below assumes
full-attention ``DynamicLayer`` caches).

Design: the model lives in ONE scheduler thread.  HTTP handlers (aiohttp, event-loop thread)
put messages on a thread-safe queue and await an asyncio future that the scheduler resolves
with ``loop.call_soon_threadsafe``.  The scheduler does continuous batching: between decode
steps it drains its queue, prefills newly arrived requests as a left-padded group and merges
them into the running batch (the shorter KV cache is left-padded along the sequence dim,
then both are concatenated along the batch dim).  Finished rows are dropped from the cache,
and columns that are padding for every remaining row are trimmed away.  Padding is always
masked out and position ids are ``cumsum(attention_mask) - 1``, so each row computes the
same thing as if it ran alone (up to float rounding).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import queue
import threading
import time
import uuid
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
            raise RequestError(where, "n_samples must be 1 per request; send n requests")
    p = SamplingParams()
    t = sp.get("temperature", p.temperature)
    if not _is_number(t) or t < 0:
        raise RequestError("sampling_params.temperature",
                           "temperature must be a number >= 0 (0 means greedy)")
    top_p = sp.get("top_p", p.top_p)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise RequestError("sampling_params.top_p", "top_p must be a number in (0, 1]")
    top_k = sp.get("top_k", p.top_k)
    if not _is_int(top_k):
        raise RequestError("sampling_params.top_k", "top_k must be an integer (-1 disables it)")
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
        choice = torch.multinomial(logprobs_all[plain].exp(), 1, generator=generator)
        tokens[plain] = choice.squeeze(1)
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
        choice = torch.multinomial(sorted_p, 1, generator=generator)
        tokens[rows] = sorted_idx.gather(1, choice).squeeze(1)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


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


class _Batch:
    """Running rows: KV cache ``[B, heads, L, dim]`` per layer, ``mask`` ``[B, L]`` (1 = real
    token), ``positions`` ``[B]`` (position id of the next fed token) and ``last`` ``[B]``
    (sampled tokens not yet fed to the model)."""

    def __init__(self, reqs, cache, mask, positions, last):
        self.reqs, self.cache, self.mask, self.positions, self.last = (
            reqs, cache, mask, positions, last)

    def _layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None]

    def select(self, keep: list):
        """Keep only rows ``keep``; drop KV columns that are padding for every kept row."""
        idx = torch.tensor(keep, dtype=torch.long)
        self.reqs = [self.reqs[i] for i in keep]
        self.cache.batch_select_indices(idx)
        self.mask, self.positions, self.last = self.mask[idx], self.positions[idx], self.last[idx]
        first = int(self.mask.any(dim=0).int().argmax())
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self._layers():
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]

    def merge(self, other: "_Batch"):
        """Append ``other``'s rows, left-padding the shorter cache along the sequence dim."""
        length = max(self.mask.shape[1], other.mask.shape[1])

        def pad(x, dim):  # left-pad dim ``dim`` (counted from the end) to ``length`` with zeros
            n = length - x.shape[dim]
            return x if n == 0 else torch.nn.functional.pad(x, (0, 0) * (-dim - 1) + (n, 0))

        for mine, theirs in zip(self._layers(), other._layers()):
            mine.keys = torch.cat([pad(mine.keys, -2), pad(theirs.keys, -2)])
            mine.values = torch.cat([pad(mine.values, -2), pad(theirs.values, -2)])
        self.mask = torch.cat([pad(self.mask, -1), pad(other.mask, -1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.last = torch.cat([self.last, other.last])
        self.reqs = self.reqs + other.reqs


class Scheduler:
    """Owns the model; runs prefill/decode in one thread with continuous batching."""

    def __init__(self, model, max_batch_size: int = 64, seed: int = 1, weight_version: int = 0,
                 decode_step_delay: float = 0.0, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer  # optional: stop strings and the reply's "text"
        self.max_batch_size = max_batch_size
        self.decode_step_delay = decode_step_delay
        self.weight_version = weight_version
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.device = model.device
        cfg = model.config.get_text_config()
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._extra_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._queue: queue.Queue = queue.Queue()
        self._waiting: list[Request] = []
        self._running: _Batch | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

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

    # -- scheduler thread
    def _loop(self):
        while not self._stop.is_set():
            try:
                self._drain(block=self._running is None and not self._waiting)
                with torch.inference_mode():
                    self._admit()
                    if self._running is not None:
                        self._decode_step()
                if self.decode_step_delay and self._running is not None:
                    time.sleep(self.decode_step_delay)
            except Exception as exc:  # keep serving; fail what was in flight
                logger.exception("scheduler step failed")
                self._fail_all(exc)

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
        elif msg.kind == "load_tensors":
            tensors, version = msg.payload
            try:
                n = load_named_tensors(self.model, tensors)
            except Exception as exc:
                _resolve(msg.loop, msg.future, (400, {"success": False, "message": str(exc)}))
                return
            if version is not None:
                self.weight_version = version
            _resolve(msg.loop, msg.future, (200, {
                "success": True, "message": f"Succeeded to update {n} parameters."}))
        elif msg.kind == "update_weights":
            path, version = msg.payload
            try:
                n, unexpected = load_weights_from_disk(self.model, path)
            except Exception as exc:
                _resolve(msg.loop, msg.future, (400, {"success": False, "message": str(exc)}))
                return
            if version is not None:
                self.weight_version = version
            message = f"Succeeded to update model weights ({n} tensors from {path})."
            if unexpected:
                message += f" Ignored {len(unexpected)} unknown tensors, e.g. {unexpected[:3]}."
            _resolve(msg.loop, msg.future, (200, {
                "success": True, "message": message, "num_paused_requests": 0}))
        else:
            raise ValueError(f"unknown message kind {msg.kind!r}")

    def _abort_all(self) -> int:
        n = 0
        if self._running is not None:
            for req in self._running.reqs:
                self._finish(req, {"type": "abort", "message": ABORT_BY_PAUSE})
                n += 1
            self._running = None
        for req in self._waiting:
            self._finish(req, {"type": "abort", "message": ABORT_BEFORE_PREFILL})
            n += 1
        self._waiting = []
        return n

    def _fail_all(self, exc: Exception):
        reqs = (self._running.reqs if self._running else []) + self._waiting
        self._running, self._waiting = None, []
        for req in reqs:
            _resolve(req.loop, req.future, exc)

    def _forward(self, input_ids, mask, positions, cache):
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **{self._cache_kw: cache}, **self._extra_kw)
        return out.logits[:, -1]

    def _admit(self):
        """Prefill waiting requests (as many as fit) and merge them into the running batch."""
        free = self.max_batch_size - (len(self._running.reqs) if self._running else 0)
        if not self._waiting or free <= 0:
            return
        reqs, self._waiting = self._waiting[:free], self._waiting[free:]
        lengths = [len(r.input_ids) for r in reqs]
        width = max(lengths)
        ids = torch.zeros(len(reqs), width, dtype=torch.long)
        mask = torch.zeros(len(reqs), width, dtype=torch.long)
        for i, req in enumerate(reqs):  # left padding
            ids[i, width - lengths[i]:] = torch.tensor(req.input_ids)
            mask[i, width - lengths[i]:] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids.to(self.device), mask.to(self.device),
                               positions.to(self.device), cache)
        batch = _Batch(reqs, cache, mask.to(self.device),
                       torch.tensor(lengths, device=self.device), None)
        batch.last = self._sample_and_append(batch.reqs, logits)
        self._drop_finished(batch)
        logger.debug("prefilled %d requests (width %d); %d running before merge", len(reqs),
                     width, len(self._running.reqs) if self._running else 0)
        if batch.reqs:
            if self._running is None:
                self._running = batch
            else:
                self._running.merge(batch)

    def _decode_step(self):
        b = self._running
        b.mask = torch.cat([b.mask, torch.ones_like(b.mask[:, :1])], dim=1)
        logits = self._forward(b.last[:, None], b.mask, b.positions[:, None], b.cache)
        b.positions = b.positions + 1
        b.last = self._sample_and_append(b.reqs, logits)
        self._drop_finished(b)
        if not b.reqs:
            self._running = None

    def _drop_finished(self, batch: _Batch):
        keep = [i for i, r in enumerate(batch.reqs) if not r.finished]
        if len(keep) < len(batch.reqs):
            batch.select(keep)

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
            text = self.tokenizer.decode(req.output_ids)
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
        result = await self.scheduler.submit("generate", (rid, ids, params, return_logprob))
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

        Loads safetensors from the folder into the live model between decode steps (running
        requests continue with the new weights).  200 ``{"success": true, "message",
        "num_paused_requests": 0}``; 400 ``{"success": false, "message"}`` with old weights kept.
        """
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return web.json_response(
                {"success": False, "message": "body must be {\"model_path\": str}"}, status=400)
        version = body.get("weight_version")
        if version is not None and not _is_int(version):
            return web.json_response(
                {"success": False, "message": "weight_version must be an integer"}, status=400)
        status, result = await self.scheduler.submit("update_weights",
                                                     (body["model_path"], version))
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
        """
        from arealite.engine.weight_sync import DEFAULT_GROUP_NAME, new_weight_update_group

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
        if name in self.groups:
            return self._fail(f"group {name!r} exists; destroy it first")
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
        ``flush_cache`` is accepted and ignored (this server keeps no prefix cache).
        """
        from arealite.engine.weight_sync import broadcast_tensor, parse_dtype

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
        if version is not None and not _is_int(version):
            return self._fail("weight_version must be an integer")
        try:
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
    p.add_argument("--max-batch-size", type=int, default=64)
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
                          args.decode_step_delay, tokenizer)
    server = Server(scheduler, args.model_path)
    logger.info("serving %s on %s:%d", args.model_path, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
