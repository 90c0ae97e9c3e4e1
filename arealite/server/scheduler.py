"""The server's scheduler: the one thread that owns the model and runs continuous batching
(packed prefill, batched decode, prefix sharing, weight loads between steps), driven by the
typed messages of :mod:`arealite.server.messages`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading

import torch

from arealite.api import weight_update
from arealite.server.kv_cache import (ATTN_IMPLEMENTATION, PrefixStore, SlotKVCache, attention_step,
                                             register_attention)
from arealite.server import packed_linear
from arealite.server.messages import (Abort, Envelope, Generate, LoadFromDisk, LoadTensors, Message,
                                             Pause, Request, SetThreads)
from arealite.server.protocol import ABORT_BEFORE_PREFILL, ABORT_BY_PAUSE, SamplingParams, error_body
from arealite.server.sampling import sample_next_tokens
from arealite.server.weights import load_named_tensors, load_weights_from_disk
from arealite.utils.proc import return_free_heap_to_os

logger = logging.getLogger("arealite.server")


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
    the store. On CPU the linear layers run on oneDNN pre-packed weights
    (:mod:`arealite.server.packed_linear`, repacked after every weight load) unless
    ``use_packed_linear`` is False.
    """

    def __init__(self, model, max_batch_size: int = 64, seed: int = 1, weight_version: int = 0,
                 tokenizer=None, max_prefill_tokens: int = 1024,
                 prefix_cache_tokens: int = 8192, use_packed_linear: bool = True):
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch_size and max_prefill_tokens must be >= 1")
        if prefix_cache_tokens != 0 and prefix_cache_tokens < PrefixStore.BLOCK:
            raise ValueError(f"prefix_cache_tokens={prefix_cache_tokens}: use 0 (off) or at least "
                             f"{PrefixStore.BLOCK} (one block)")
        self.model = model
        self.tokenizer = tokenizer  # optional: stop strings and the reply's "text"
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
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
        register_attention()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        # oneDNN pre-packed linear weights on CPU (arealite/server/packed_linear.py); the
        # self-check below then compares the packed decode with a plain forward
        # fp32 logits from a bf16 LM head, as the trainer's (packed_linear.fp32_lm_head)
        self.fp32_head = packed_linear.fp32_lm_head(model)
        self.packed_linears = (packed_linear.pack_linears(model)
                               if use_packed_linear and packed_linear.available(self.device, dtype) else 0)
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
        self.num_threads = torch.get_num_threads()  # the scheduler thread's (SetThreads changes it)
        self.stats = {"prefill_tokens": 0, "shared_prefix_tokens": 0, "cached_prefix_tokens": 0,
                      "decode_steps": 0}
        self._self_check()

    def _self_check(self):
        """Decode 3 tokens through the slot cache and compare with a plain forward, so that a
        model whose attention ignores transformers' ``AttentionInterface`` fails at start-up
        instead of producing wrong logprobs. Ordinary token ids, not the first (special) ones:
        a bf16 SmolLM2 amplifies its rounding on ``[1, 2, 3]`` to 7.5 of 31 in the logits (10.7
        against fp32), on ``[100, 200, 300]`` to under 1."""
        vocab = self.model.get_input_embeddings().weight.shape[0]
        ids = [i % vocab for i in (100, 200, 300)]
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
            self._release_cache()
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

    def submit(self, message: Message) -> asyncio.Future:
        """Hand ``message`` to the scheduler thread; await the returned future for its answer
        (each message class says what that is)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(Envelope(message, future, loop))
        return future

    def submit_nowait(self, message: Message) -> None:
        """A message without an answer (:class:`Abort`)."""
        self._queue.put(Envelope(message, None, None))

    def counters(self) -> dict:
        """Counters since start (``stats``) plus ``num_threads`` (intra-op threads now),
        ``running_requests`` and ``waiting_requests`` (the staged one included); read without
        locking, so a snapshot."""
        return {**self.stats, "num_threads": self.num_threads, "running_requests": len(self._rows),
                "waiting_requests": len(self._waiting) + (self._staged is not None)}

    # -- scheduler thread
    def _loop(self):
        while not self._stop.is_set():
            try:
                self.step(block=True)
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

    def _handle(self, env: Envelope):
        msg = env.message
        match msg:
            case Generate():
                req = Request(msg.rid, msg.input_ids, msg.params, msg.return_logprob,
                              future=env.future, loop=env.loop, logprob_start_len=msg.logprob_start_len)
                if req.params.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0})
                else:
                    self._waiting.append(req)
            case Pause():
                _resolve(env.loop, env.future, self._abort_all())
            case Abort():  # its client is gone: drop it without a reply
                self._waiting = [r for r in self._waiting if r.future is not msg.future]
                if self._staged is not None and self._staged.future is msg.future:
                    self._clear_staged()
                # the KV cache holds inference tensors: moving a row is an in-place update,
                # allowed only in inference mode (messages are handled outside it)
                with torch.inference_mode():
                    for i in range(len(self._rows) - 1, -1, -1):
                        if self._rows[i].future is msg.future:
                            self._remove_row(i)
            case LoadTensors():
                try:
                    n = load_named_tensors(self.model, msg.tensors)
                except Exception as exc:
                    _resolve(env.loop, env.future, (400, error_body(str(exc))))
                    return
                self._new_weights(msg.weight_version)
                _resolve(env.loop, env.future, (200, weight_update.reply(True, f"Succeeded to update {n} parameters.")))
            case LoadFromDisk():
                if msg.abort_all_requests:
                    self._abort_all()
                try:
                    n, unexpected = load_weights_from_disk(self.model, msg.model_path)
                except Exception as exc:
                    _resolve(env.loop, env.future, (400, error_body(str(exc))))
                    return
                self._new_weights(msg.weight_version)
                message = f"Succeeded to update model weights ({n} tensors from {msg.model_path})."
                if unexpected:
                    message += f" Ignored {len(unexpected)} unknown tensors, e.g. {unexpected[:3]}."
                _resolve(env.loop, env.future, (200, weight_update.reply(True, message, num_paused_requests=0)))
            case SetThreads():
                previous = self.num_threads
                torch.set_num_threads(msg.num_threads)
                self.num_threads = torch.get_num_threads()  # read back on this thread: what runs
                _resolve(env.loop, env.future, previous)
            case _:
                raise TypeError(f"unknown scheduler message {msg!r}")

    def _new_weights(self, version: int | None) -> None:
        """The model now holds new weights (reported as ``version`` when given): KV computed
        with the old weights must not be reused from now on."""
        if version is not None:
            self.weight_version = version
        self._weights_epoch += 1
        # Packed weight copies (packed_linear) need no invalidate() here: every loader of
        # arealite.server.weights writes in place with ops that bump the weights' version
        # counters, so exactly the changed weights are repacked lazily at their next use (a
        # bf16 LoRA adapter, served unmerged, changes none: no ~0.5 s repack of the whole model
        # per version). tests/test_perf.py checks each loader.
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
        self._release_cache()
        return n

    def _fail_all(self, exc: Exception):
        reqs = self._rows + self._waiting + ([self._staged] if self._staged else [])
        self._rows, self._waiting = [], []
        self._clear_staged()
        self._release_cache()
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
            with attention_step(cache or self.cache, segments=ctx_segments):
                self.model(input_ids=torch.tensor([ids], device=self.device),
                           position_ids=torch.tensor([positions], device=self.device),
                           use_cache=False, **self._logits_kw)
            self.stats["prefill_tokens"] += len(ids)

    def _forward_decode(self):
        """One forward of every row's ``last`` token at position ``kv_len``; returns the
        next-token logits ``[rows, vocab]``."""
        rows = self._rows
        pos = torch.tensor([r.kv_len for r in rows], device=self.device)
        kv_len = max(r.kv_len for r in rows) + 1
        self.cache.ensure(len(rows), kv_len, len(rows), kv_len - 1)
        mask = (torch.arange(kv_len, device=self.device)[None, :] <= pos[:, None])[:, None, None]
        with attention_step(self.cache, pos=pos, kv_len=kv_len, mask=mask):
            out = self.model(input_ids=torch.tensor([[r.last] for r in rows], device=self.device),
                             position_ids=pos[:, None], use_cache=False, **self._logits_kw)
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
            self._release_cache()
        else:
            self.cache.shrink(len(self._rows), max((r.kv_len for r in self._rows), default=0) + 1)

    def _release_cache(self) -> None:
        """Free the KV buffers (no request is running) and return the freed heap to the OS
        (:func:`arealite.utils.proc.return_free_heap_to_os`: without it the server's resident
        memory climbs for dozens of load rounds on glibc's arena fragmentation)."""
        self.cache.release()
        return_free_heap_to_os()

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

    def _prompt_logprobs(self, req: Request) -> list:
        """``[[logprob, token, None], ...]`` of every prompt position (logprob None at 0) from one
        plain forward of the prompt (no KV cache: outside a server step the attention is sdpa),
        under the request's temperature (1 when it is 0, i.e. greedy)."""
        ids = torch.tensor([req.input_ids], device=self.device)
        temperature = req.params.temperature if req.params.temperature > 0 else 1.0
        with torch.inference_mode():
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # [P-1, V]
            lp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, 1:, None])[:, 0]
        self.stats["prefill_tokens"] += len(req.input_ids)
        return [[None, req.input_ids[0], None]] + [[v, t, None] for v, t in zip(lp.tolist(), req.input_ids[1:])]

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
            if req.logprob_start_len >= 0:
                meta["input_token_logprobs"] = self._prompt_logprobs(req)[req.logprob_start_len:]
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
