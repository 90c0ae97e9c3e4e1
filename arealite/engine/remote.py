"""Client for servers speaking SGLang's HTTP protocol (SGLang itself or our
:mod:`arealite.engine.server`), plus the rollout executor around it.

Protocol subset: ``../shared/reference/inference-protocols.md`` §1 and §3.

* ``agenerate`` posts ``/generate`` with ``input_ids``, ``sampling_params`` and
  ``return_logprob=true``, and reads ``meta_info.output_token_logprobs`` (``[logprob, id, _]``
  triples) and ``meta_info.finish_reason``.
* **Interruptible generation**: a reply with ``finish_reason.type == "abort"`` (the trainer
  paused the servers for a weight update) keeps its partial tokens; the client waits while the
  rollout is paused, then resubmits prompt + partial output with the remaining token budget.
  Each token is tagged with the ``weight_version`` the server reported for its segment, so one
  trajectory can span several versions.
* Server choice: a request id (``rid``) sticks to the server first chosen for it (all samples
  of a prompt and all turns of an episode share the prefix), new rids go to the server with the
  fewest outstanding requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from typing import Any

import aiohttp

from arealite.api.config import InferenceEngineConfig
from arealite.api.engine import InferenceEngine
from arealite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
from arealite.rollout.executor import WorkflowExecutor

logger = logging.getLogger("arealite.remote")

_RID_CACHE_SIZE = 1024


class ServerError(RuntimeError):
    """A server answered with an HTTP error (not retried when it is a 4xx: the request is bad)."""


def post_json(address: str, endpoint: str, payload: dict | None = None, timeout: float = 60.0,
              retries: int = 3, method: str = "POST") -> dict:
    """Blocking JSON request with retries (1 s, 2 s, 4 s … backoff); used for control calls.

    Raises:
        ServerError: a 4xx reply (its body is in the message), or every attempt failed.
    """
    url = f"http://{address}{endpoint}"
    data = None if method == "GET" else json.dumps(payload or {}).encode()
    last: Exception | None = None
    for attempt in range(max(1, retries)):
        try:
            req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
                return json.loads(body) if body else {}
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            if 400 <= e.code < 500:
                raise ServerError(f"{url} answered {e.code}: {body}") from None
            last = ServerError(f"{url} answered {e.code}: {body}")
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            last = e
        if attempt + 1 < retries:
            time.sleep(2**attempt)
    raise ServerError(f"{url}: no answer after {retries} attempts: {last!r}") from last


def wait_healthy(addresses: list[str], timeout: float, poll: float = 1.0) -> None:
    """Poll ``GET /health`` on every server until all answer 200.

    Raises:
        TimeoutError: a server is not healthy after ``timeout`` seconds (names it).
    """
    deadline = time.monotonic() + timeout
    for addr in addresses:
        while True:
            try:
                post_json(addr, "/health", timeout=5, retries=1, method="GET")
                break
            except ServerError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"inference server {addr} not healthy after {timeout} s; check its log "
                        "(or rollout.addresses) and rollout.setup_timeout"
                    ) from None
                time.sleep(poll)


class RemoteInferenceEngine(InferenceEngine):
    """Rollout engine of one trainer rank: HTTP client to ``addresses`` + a :class:`WorkflowExecutor`.

    Args:
        config: ``rollout`` config (timeouts, retries, staleness).
        addresses: ``host:port`` of every server (same order on every rank).
        world_size: trainer ranks (the executor's per-rank batch is divided by it).
    """

    def __init__(self, config: InferenceEngineConfig, addresses: list[str], world_size: int = 1):
        if not addresses:
            raise ValueError("rollout.addresses is empty: launch servers first or pass host:port addresses")
        self.config, self.addresses = config, list(addresses)
        self.executor = WorkflowExecutor(config, self, world_size)
        self._outstanding = {a: 0 for a in self.addresses}
        self._rid_to_addr: OrderedDict[str, str] = OrderedDict()
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def initialize(self) -> None:
        wait_healthy(self.addresses, self.config.setup_timeout)
        self.executor.initialize()

    def destroy(self) -> None:
        self.executor.destroy()

    # -- generation --------------------------------------------------------------------------
    def _choose_server(self, rid: str) -> str:
        if rid in self._rid_to_addr:
            self._rid_to_addr.move_to_end(rid)
            return self._rid_to_addr[rid]
        addr = min(self.addresses, key=lambda a: self._outstanding[a])
        self._rid_to_addr[rid] = addr
        if len(self._rid_to_addr) > _RID_CACHE_SIZE:
            self._rid_to_addr.popitem(last=False)
        return addr

    def _session(self) -> aiohttp.ClientSession:
        # One session per event loop (the executor's loop, or a caller's own asyncio.run).
        loop = asyncio.get_running_loop()
        sess = self._sessions.get(id(loop))
        if sess is None or sess.closed:
            timeout = aiohttp.ClientTimeout(total=self.config.request_timeout)
            sess = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
            self._sessions[id(loop)] = sess
        return sess

    async def aclose(self) -> None:
        """Close the HTTP session of the running event loop (called when the executor stops)."""
        sess = self._sessions.pop(id(asyncio.get_running_loop()), None)
        if sess is not None:
            await sess.close()

    async def _apost(self, addr: str, endpoint: str, payload: dict) -> dict:
        """POST with retries on connection errors and timeouts; 4xx raises at once."""
        last: Exception | None = None
        for attempt in range(max(1, self.config.request_retries)):
            try:
                async with self._session().post(f"http://{addr}{endpoint}", json=payload) as resp:
                    if 400 <= resp.status < 500:
                        raise ServerError(f"{addr}{endpoint} answered {resp.status}: {await resp.text()}")
                    resp.raise_for_status()
                    return await resp.json()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = e
                logger.warning("%s%s attempt %d failed: %r", addr, endpoint, attempt + 1, e)
            if attempt + 1 < self.config.request_retries:
                await asyncio.sleep(2**attempt)
        raise ServerError(
            f"{addr}{endpoint}: no answer after {self.config.request_retries} attempts "
            f"(rollout.request_timeout={self.config.request_timeout} s): {last!r}"
        ) from last

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion; see the module docstring for interruption handling.

        Returns: a :class:`ModelResponse` whose ``stop_reason`` is "stop" or "length".

        Raises:
            ServerError: the server rejected the request (4xx) or never answered.
        """
        start = time.perf_counter()
        gconfig = req.gconfig
        budget = gconfig.max_new_tokens
        resp = ModelResponse(input_tokens=list(req.input_ids))
        addr = self._choose_server(req.rid)
        self._outstanding[addr] += 1
        try:
            while True:
                while self.executor.is_paused():  # a weight update is in progress
                    await asyncio.sleep(0.05)
                params = gconfig.sampling_params()
                params["max_new_tokens"] = budget - resp.output_len
                payload = {
                    "input_ids": resp.input_tokens + resp.output_tokens,
                    "sampling_params": params,
                    "return_logprob": True,
                }
                result = await self._apost(addr, "/generate", payload)
                meta = result["meta_info"]
                triples = meta.get("output_token_logprobs") or []  # missing = zero tokens
                version = int(meta.get("weight_version", self.get_version()))
                resp.output_tokens += [int(t[1]) for t in triples]
                resp.output_logprobs += [float(t[0]) for t in triples]
                resp.output_versions += [version] * len(triples)
                resp.stop_reason = meta["finish_reason"]["type"]
                if resp.stop_reason != "abort" or resp.output_len >= budget:
                    break
        finally:
            self._outstanding[addr] -= 1
        if resp.stop_reason == "abort":  # aborted exactly at the end of the budget
            resp.stop_reason = "length"
        resp.latency = time.perf_counter() - start
        return resp

    # -- weight updates (called by trainer rank 0) --------------------------------------------------
    def _all_servers(self, endpoint: str, payload: dict | None = None) -> list[dict]:
        return [
            post_json(a, endpoint, payload, timeout=self.config.request_timeout, retries=self.config.request_retries)
            for a in self.addresses
        ]

    def pause_generation(self) -> None:
        self._all_servers("/pause_generation")

    def continue_generation(self) -> None:
        self._all_servers("/continue_generation")

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Every server loads the HF folder ``meta.path`` and reports ``meta.version``.

        Raises:
            ValueError: ``meta.type`` is not "disk".
            ServerError: a server failed to load the weights.
        """
        if meta.type != "disk":
            raise ValueError(f"weight update type {meta.type!r} is not supported yet; use 'disk'")
        for reply in self._all_servers("/update_weights_from_disk", {"model_path": meta.path, "weight_version": meta.version}):
            if not reply.get("success", False):
                raise ServerError(f"update_weights_from_disk failed: {reply}")

    # -- executor delegation -------------------------------------------------------------------------
    def submit(self, data, workflow) -> None:
        self.executor.submit(data, workflow)

    def wait(self, count: int, timeout: float | None = None):
        return self.executor.wait(count, timeout)

    def rollout_batch(self, data, workflow):
        return self.executor.rollout_batch(data, workflow)

    def prepare_batch(self, dataloader, workflow):
        return self.executor.prepare_batch(dataloader, workflow)

    def pause(self) -> None:
        self.executor.pause()

    def resume(self) -> None:
        self.executor.resume()

    def set_version(self, version: int) -> None:
        self.executor.set_version(version)

    def get_version(self) -> int:
        return self.executor.get_version()
