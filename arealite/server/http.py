"""The server's HTTP layer: the aiohttp app and one handler per SGLang endpoint. Handlers parse
and validate in the event-loop thread, hand model work to the :class:`Scheduler` thread as typed
messages, and answer errors in the one shape of :func:`~arealite.server.protocol.error_body`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

from aiohttp import web

from arealite.api.weight_update import (DEFAULT_GROUP_NAME, DiskUpdate, InitGroup, ProtocolError, UpdateBucket,
                                        parse_destroy_group, reply)
from arealite.server.messages import Abort, Generate, LoadFromDisk, LoadTensors, Pause, SetThreads
from arealite.server.protocol import error_body, is_int, parse_generate_request, parse_logprob_start_len
from arealite.server.scheduler import Scheduler
from arealite.server.weights import WeightGroups


def _error(message: str, field_name: str = "", status: int = 400) -> web.Response:
    """Every error reply: :func:`~arealite.server.protocol.error_body` with ``status``."""
    return web.json_response(error_body(message, field_name), status=status)


async def _json(request: web.Request):
    """The parsed JSON body, or None when it is not valid JSON."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


class Server:
    """aiohttp handlers; all model work is delegated to the ``Scheduler`` thread."""

    def __init__(self, scheduler: Scheduler, model_path: str):
        self.scheduler = scheduler
        self.model_path = model_path
        cfg = scheduler.model.config.get_text_config()
        self.vocab_size = cfg.vocab_size
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self._resumed: asyncio.Event | None = None  # set = not paused
        self.groups = WeightGroups(scheduler.device)  # weight-update groups joined, by name

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_model_info", self.get_model_info)
        app.router.add_get("/get_server_info", self.get_server_info)
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_post("/set_num_threads", self.set_num_threads)
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

        With ``"logprob_start_len": k`` (SGLang's field, k ≥ 0, and ``return_logprob``) the reply
        also has ``meta_info.input_token_logprobs``: ``[logprob, token_id, null]`` for prompt
        positions k, k+1, …, P−1 — log π(input_ids[t] | input_ids[:t]) under the request's
        temperature (1 when 0), ``null`` at position 0 — from one plain forward of the prompt (a
        frozen teacher scoring a student's tokens: ``max_new_tokens: 0``).

        ``finish_reason`` is ``{"type": "stop", "matched": id}`` (matched id included in the
        output), ``{"type": "length", "length": max_new_tokens}`` or ``{"type": "abort",
        "message": ...}`` after ``/pause_generation``.  Requests arriving while paused are held
        until ``/continue_generation``.  Malformed requests get 400 before any model work.
        """
        body = await _json(request)
        if body is None:
            return _error("request body must be valid JSON", "body")
        try:
            ids, params, return_logprob, rid = parse_generate_request(
                body, self.vocab_size, self.max_positions, self.scheduler.tokenizer is not None)
            logprob_start = parse_logprob_start_len(body, len(ids))
        except ProtocolError as e:
            return _error(e.message, e.field)
        while not self._resumed.is_set():
            await self._resumed.wait()
        future = self.scheduler.submit(Generate(rid, ids, params, return_logprob, logprob_start))
        try:
            result = await future
        except asyncio.CancelledError:  # the client went away (handler_cancellation): free the row
            self.scheduler.submit_nowait(Abort(future))
            raise
        if isinstance(result, Exception):
            return _error(f"generation failed: {result}", status=500)
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
        ``num_threads``, ``waiting_requests`` and ``max_prefill_tokens``. Read without locking
        (a snapshot)."""
        return web.json_response({**self.scheduler.counters(),
                                  "max_prefill_tokens": self.scheduler.max_prefill_tokens})

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``POST /pause_generation`` (body ignored), SGLang's abort mode: running requests are
        aborted at the next decode-step boundary with their partial output, waiting ones
        with zero tokens; new ``/generate`` calls are held.  Replies once nothing is in flight:
        ``{"status": "ok", "message": ..., "num_aborted_requests": N}``."""
        self._resumed.clear()
        n = await self.scheduler.submit(Pause())
        return web.json_response({"status": "ok", "message": "Generation paused successfully.",
                                  "num_aborted_requests": n})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``POST /continue_generation``: release held ``/generate`` requests."""
        self._resumed.set()
        return web.json_response({"status": "ok",
                                  "message": "Generation continued successfully."})

    async def set_num_threads(self, request: web.Request) -> web.Response:
        """``POST /set_num_threads`` ``{"num_threads": int >= 1}`` (ours; not in SGLang): the
        model's torch intra-op threads from the next scheduler iteration on. Core sharing
        (:mod:`arealite.trainer.cores`) lends the trainer's cores to the server this way
        while the trainer waits for generation. Replies once applied: ``{"status": "ok",
        "num_threads": n, "previous": p}`` (``n`` read back on the scheduler thread); 400 for a
        missing or non-positive count."""
        body = await _json(request)
        n = body.get("num_threads") if isinstance(body, dict) else None
        if not is_int(n) or n < 1:
            return _error(f"num_threads must be an integer >= 1, got {n!r}", "num_threads")
        previous = await self.scheduler.submit(SetThreads(int(n)))
        return web.json_response({"status": "ok", "num_threads": self.scheduler.num_threads, "previous": previous})

    # -- weight updates (bodies: arealite.api.weight_update; trainer side: engine.weight_sync)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk`` ``{"model_path": str, "weight_version": int?,
        "abort_all_requests": bool?}``.

        Loads safetensors from the folder into the live model between decode steps. With
        ``abort_all_requests: true`` (SGLang's flag, sent by arealite's client) running and
        waiting requests are first aborted with their partial output, so every token is tagged
        with the version that produced it; otherwise running requests continue with the new
        weights (attending over KV of the old ones) and their reply reports the new version.
        200 ``{"success": true, "message", "num_paused_requests": 0}``; 400 error reply with
        the old weights kept.
        """
        try:
            req = DiskUpdate.from_json(await _json(request))
        except ProtocolError as e:
            return _error(e.message, e.field)
        status, result = await self.scheduler.submit(
            LoadFromDisk(req.model_path, req.weight_version, req.abort_all_requests))
        return web.json_response(result, status=status)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group`` ``{"master_address": str, "master_port": int
        (or a numeric string, as AReaL sends), "rank_offset": int, "world_size": int,
        "group_name": str = "weight_update_group", "backend": "gloo" | "nccl"}``.

        Joins the trainer's weight-update group at rank ``rank_offset`` (no tensor
        parallelism here) and replies once every rank has joined: ``{"success": true,
        "message"}``; 400 error reply on bad fields or a failed join. A group of the same name
        is replaced (a restarted trainer).
        """
        default_backend = "nccl" if self.scheduler.device.type == "cuda" else "gloo"
        try:
            req = InitGroup.from_json(await _json(request), default_backend)
            self.groups.check(req)
        except ProtocolError as e:
            return _error(e.message, e.field)
        except ValueError as e:
            return _error(str(e), "backend")
        try:
            message = await asyncio.get_running_loop().run_in_executor(None, self.groups.join, req)
        except (ValueError, RuntimeError) as e:
            return _error(str(e))
        return web.json_response(reply(True, message))

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
        body = await _json(request)
        if isinstance(body, dict) and not self.groups.has(name := body.get("group_name", DEFAULT_GROUP_NAME)):
            return _error(f"no weight-update group {name!r}; call /init_weights_update_group", "group_name")
        try:
            bucket = UpdateBucket.from_json(body)
        except ProtocolError as e:
            return _error(e.message, e.field)
        try:
            tensors = await asyncio.get_running_loop().run_in_executor(None, self.groups.receive, bucket)
        except RuntimeError as e:
            return _error(str(e))
        status, result = await self.scheduler.submit(LoadTensors(tensors, bucket.weight_version))
        return web.json_response(result, status=status)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        """``POST /destroy_weights_update_group`` ``{"group_name": str}``: leave the group."""
        if not self.groups.leave(parse_destroy_group(await _json(request))):
            return _error("no such group", "group_name")
        return web.json_response(reply(True, "Group destroyed."))

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """``POST /get_weights_by_name`` ``{"name": str, "truncate_size": int = 100,
        "digest": bool = false}`` -> SGLang's reply, the parameter's first ``truncate_size``
        rows as nested lists; with ``digest`` instead ``{"name", "shape", "dtype", "sha256"}``
        (sha256 of the float32 bytes, C order) to compare whole tensors cheaply."""
        body = await _json(request)
        body = body if isinstance(body, dict) else {}
        state = self.scheduler.model.state_dict()
        name = body.get("name")
        if name not in state:
            return _error(f"unknown parameter {name!r}; e.g. {list(state)[:3]}", "name")
        t = state[name].detach().float().cpu().contiguous()
        if body.get("digest"):
            return web.json_response({"name": name, "shape": list(t.shape),
                                      "dtype": str(state[name].dtype).removeprefix("torch."),
                                      "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()})
        size = body.get("truncate_size", 100)
        if not is_int(size) or size < 0:
            return _error("truncate_size must be an integer >= 0", "truncate_size")
        return web.json_response(t[:size].tolist() if t.dim() else t.item())
