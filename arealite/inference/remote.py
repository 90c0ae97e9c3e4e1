"""Client for servers speaking SGLang's HTTP protocol (SGLang itself or our
:mod:`arealite.server`) or vLLM's: an :class:`~arealite.api.engine.InferenceEngine`.

Protocol subset: SGLang's native API, <https://docs.sglang.ai/basic_usage/native_api.html>
(``/generate``, ``/health``, ``/abort_request``, weight updates) and vLLM's OpenAI-compatible
server, <https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html>.

* ``agenerate`` posts ``/generate`` with ``input_ids``, ``sampling_params`` and
  ``return_logprob=true``, and reads ``meta_info.output_token_logprobs`` (``[logprob, id, _]``
  triples) and ``meta_info.finish_reason``.
* **Interruptible generation**: a reply with ``finish_reason.type == "abort"`` (the trainer
  paused the servers for a weight update) keeps its partial tokens; the client resubmits
  prompt + partial output with the remaining token budget at once, and the paused server holds
  it until ``continue_generation`` (after the new weights are loaded).
  Each token is tagged with the ``weight_version`` the server reported for its segment, so one
  trajectory can span several versions.
* Server choice: a request id (``rid``) sticks to the server first chosen for it (all samples
  of a prompt and all turns of an episode share the prefix), new rids go to the server with the
  fewest outstanding requests.
* Failures: a server that refuses connections or does not answer within
  ``rollout.request_timeout`` is marked dead for ``DEAD_SERVER_COOLDOWN`` seconds and the
  request (with its partial output) moves to a live server. After ``rollout.request_retries``
  failed attempts ``agenerate`` raises :class:`ServerTimeoutError` (a ``TimeoutError``) or
  :class:`ServerError`, so a stalled server costs at most
  ``request_retries × request_timeout`` plus the backoff sleeps (1 s, 2 s, … between attempts
  on the same server; none when another server is live). A refused connection to a server
  that the launcher restarts (``restart_hook`` claims it; every rank has one when
  ``rollout.max_server_restarts > 0``) costs no attempt: the request waits, up to
  ``rollout.setup_timeout``, until that server is readmitted or another one is live.
* Backends: SGLang's protocol (``backend`` "local" and "sglang") or vLLM's OpenAI
  ``/v1/completions`` (``backend`` "vllm"), through the small adapters below.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from arealite.api.cli import check_section
from arealite.api.config import InferenceEngineConfig
from arealite.api.engine import InferenceEngine
from arealite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
from arealite.utils import trace

logger = logging.getLogger("arealite.remote")

_RID_CACHE_SIZE = 1024


DEAD_SERVER_COOLDOWN = 30.0  # [s] a failed server gets no new requests for this long


from arealite.inference.adapters import ADAPTERS, ServerError, ServerTimeoutError


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
            try:
                return json.loads(body) if body else {}
            except ValueError:  # a plain-text success (vLLM's /v1/load_lora_adapter)
                return {"text": body.decode(errors="replace")}
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            if 400 <= e.code < 500:
                raise ServerError(f"{url} answered {e.code}: {body}", status=e.code) from None
            last = ServerError(f"{url} answered {e.code}: {body}", status=e.code)
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            last = e
        if attempt + 1 < retries:
            time.sleep(2**attempt)
    raise ServerError(f"{url}: no answer after {retries} attempts: {last!r}") from last


def post_control(adapter, address: str, request: tuple[str, dict], timeout: float, retries: int = 1) -> dict:
    """POST a control request built by ``adapter`` (an ``(endpoint, body)`` pair such as
    ``adapter.init_group_request(...)``) and return the reply in SGLang's shape ``{"success":
    True, "message", ...}`` (``adapter.control_reply``).

    Raises:
        ServerError: no answer, an HTTP error, or the server (or one of its vLLM workers)
            reports ``success: false`` (its message is included).
    """
    endpoint, body = request
    try:
        reply = adapter.control_reply(post_json(address, endpoint, body, timeout, retries))
    except ServerError as e:
        if e.status == 404 and adapter.server_env:
            raise ServerError(f"{e}; start the server with {adapter.server_env} (launcher does it)", status=404) from None
        raise
    if not reply.get("success", False):
        raise ServerError(f"{address}{endpoint} failed: {reply.get('message', reply)}")
    return reply


def wait_healthy(addresses: list[str], timeout: float, poll: float = 1.0,
                 procs: list | None = None, logs: list[str] | None = None) -> None:
    """Poll ``GET /health`` on every server until all answer 200.

    Args:
        procs: the launched server processes (``subprocess.Popen``), one per address: a process
            that exits before it is healthy (a bad flag, an import error, out of memory) fails the
            wait at once instead of after ``timeout``.
        logs: their log files, one per address: the error quotes each one's last lines.

    Raises:
        RuntimeError: a launched server process exited before it was healthy (names its status,
            log and last log lines).
        TimeoutError: a server is not healthy after ``timeout`` seconds (names it).
    """
    deadline = time.monotonic() + timeout
    for i, addr in enumerate(addresses):
        while True:
            try:
                post_json(addr, "/health", timeout=5, retries=1, method="GET")
                break
            except ServerError:
                proc = procs[i] if procs else None
                if proc is not None and proc.poll() is not None:
                    log = logs[i] if logs else ""
                    tail = ""
                    if log and os.path.exists(log):
                        with open(log, errors="replace") as f:
                            tail = "".join(f.readlines()[-5:]).strip()
                    raise RuntimeError(f"inference server {addr} exited with status {proc.returncode} before it "
                                       f"was healthy; its log {log or '(none)'} ends with:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"inference server {addr} not healthy after {timeout} s; check its log "
                        "(or rollout.addresses) and rollout.setup_timeout"
                    ) from None
                time.sleep(poll)


class RemoteInferenceEngine(InferenceEngine):
    """HTTP client of one trainer rank to the inference servers at ``addresses``.

    Args:
        config: ``rollout`` config (backend, timeouts, retries, weight sync).
        addresses: ``host:port`` of every server (same order on every rank).
        lora_rank: the actor's ``lora.rank`` (0 = full fine-tuning). With vLLM and a LoRA actor
            the servers (started with ``--enable-lora``) serve the adapter unmerged under
            ``VLLMAdapter.lora_name``: every request names it (:attr:`serves_lora`), so the
            adapter must be loaded before the first request (the RL loop pushes the initial one
            at version 0), and each update replaces it in place.
    """

    def __init__(self, config: InferenceEngineConfig, addresses: list[str], lora_rank: int = 0):
        if not addresses:
            raise ValueError("rollout.addresses is empty: launch servers first or pass host:port addresses")
        if config.backend not in ADAPTERS:
            raise ValueError(f"rollout.backend={config.backend!r}: use one of {sorted(ADAPTERS)}")
        check_section(config, "rollout.")  # validate_config's rollout.* rules (one copy), e.g. weight_sync_timeout > 0
        self.config, self.addresses = config, list(addresses)
        self.adapter = ADAPTERS[config.backend]
        self.serves_lora = lora_rank > 0 and config.backend == "vllm"
        self._outstanding = {a: 0 for a in self.addresses}
        self._dead_until = {a: 0.0 for a in self.addresses}  # monotonic time; 0 = alive
        self._excluded: set[str] = set()  # missed a control call (e.g. a weight update): never used again
        self.restarting: set[str] = set()  # being restarted by the launcher (readmit() when caught up)
        self.restart_hook = None  # set by the launcher: fn(addr) -> True if it restarts that server
        self.on_destroy: list = []  # callables run by destroy() (e.g. stop the launcher's watcher)
        self.sync_lock = threading.Lock()  # held from pause_generation to continue_generation
        self._paused_at: int | None = None  # the version at which this rank knows the servers paused
        self._sync_held = False
        self.last_disk_update: tuple[str, int] | None = None  # (folder, version) of the last disk load
        self._rid_to_addr: OrderedDict[str, str] = OrderedDict()
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def initialize(self) -> None:
        """Wait until every server answers ``GET /health`` (``rollout.setup_timeout``)."""
        wait_healthy(self.addresses, self.config.setup_timeout)

    def destroy(self) -> None:
        """Run the :attr:`on_destroy` callbacks (the launcher stops watching the servers)."""
        for fn in self.on_destroy:
            fn()
        self.on_destroy = []

    def requests_in_flight(self) -> int:
        """Generation calls of this client now waiting on a server (all event loops; a plain read
        of per-server counters, safe from any thread). Core sharing (:mod:`arealite.trainer.cores`)
        gives the trainer the servers' cores while this is 0."""
        return sum(self._outstanding.values())

    # -- server choice -----------------------------------------------------------------------
    def live_addresses(self) -> list[str]:
        """Servers not marked dead (a dead mark expires after ``DEAD_SERVER_COOLDOWN`` s), not
        excluded (a server that missed a pause or weight update would serve stale weights) and not
        restarting (back up but not yet caught up to the current weights: :meth:`readmit`)."""
        now = time.monotonic()
        return [a for a in self.addresses
                if self._dead_until[a] <= now and a not in self._excluded and a not in self.restarting]

    @property
    def excluded(self) -> frozenset[str]:
        """The servers excluded for good (:meth:`exclude_servers`, a failed control call), until a
        restart :meth:`readmit` s one."""
        return frozenset(self._excluded)

    def mark_dead(self, addr: str) -> None:
        """Send no new requests to ``addr`` for ``DEAD_SERVER_COOLDOWN`` seconds."""
        self._dead_until[addr] = time.monotonic() + DEAD_SERVER_COOLDOWN
        for rid in [r for r, a in self._rid_to_addr.items() if a == addr]:
            del self._rid_to_addr[rid]

    def exclude_servers(self, addrs, reason: str) -> None:
        """Mark ``addrs`` dead and exclude them for good (no generation, control calls or weight
        updates any more), e.g. the ``err.failed`` of a :class:`~arealite.weights.sync.WeightSyncError`:
        a server that missed a weight update holds stale or mixed weights."""
        for a in addrs:
            if a not in self._dead_until:
                raise ValueError(f"{a!r} is not one of this engine's servers {self.addresses}")
            self.mark_dead(a)
            if a not in self._excluded:
                logger.error("server %s is excluded from now on: %s", a, reason)
            self._excluded.add(a)

    def readmit(self, addr: str) -> None:
        """``addr`` was restarted and holds the current weights and version: use it again."""
        self._dead_until[addr] = 0.0
        self._excluded.discard(addr)
        self.restarting.discard(addr)
        logger.warning("server %s is back (restarted, at weight version %d)", addr, self.get_version())

    async def _wait_for_restart(self, backoff: float) -> None:
        """Sleep ``backoff`` s; while a server is being restarted (and none is live), wait for it
        instead, up to ``rollout.setup_timeout``, so that a restart does not fail the requests."""
        deadline = time.monotonic() + self.config.setup_timeout
        await asyncio.sleep(backoff)
        while self.restarting and not self.live_addresses() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    def _choose_server(self, rid: str) -> str:
        live = self.live_addresses()
        if rid in self._rid_to_addr and self._rid_to_addr[rid] in live:
            self._rid_to_addr.move_to_end(rid)
            return self._rid_to_addr[rid]
        # Least outstanding requests among live servers; if all are dead, the one whose mark
        # expires first (it may have come back).
        usable = ([a for a in self.addresses if a not in self._excluded and a not in self.restarting]
                  or [a for a in self.addresses if a not in self._excluded])
        if not usable:
            raise ServerError(f"every server is excluded ({sorted(self._excluded)}): they missed a weight "
                              "update or were not back in time after a restart; see the log")
        pool = live or [min(usable, key=lambda a: self._dead_until[a])]
        addr = min(pool, key=lambda a: self._outstanding[a])
        self._rid_to_addr[rid] = addr
        self._rid_to_addr.move_to_end(rid)
        if len(self._rid_to_addr) > _RID_CACHE_SIZE:
            self._rid_to_addr.popitem(last=False)
        return addr

    # -- HTTP ----------------------------------------------------------------------------------
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

    async def _apost_once(self, addr: str, endpoint: str, payload: dict) -> dict:
        async with self._session().post(f"http://{addr}{endpoint}", json=payload) as resp:
            if 400 <= resp.status < 500:
                raise ServerError(f"{addr}{endpoint} answered {resp.status}: {await resp.text()}", status=resp.status)
            resp.raise_for_status()
            return await resp.json()

    def _give_up(self, where: str, last: Exception | None) -> ServerError:
        cls = ServerTimeoutError if isinstance(last, asyncio.TimeoutError) else ServerError
        return cls(f"{where}: no answer after {self.config.request_retries} attempts "
                   f"(rollout.request_timeout={self.config.request_timeout} s, "
                   f"rollout.request_retries={self.config.request_retries}): {last!r}")

    async def _generate_segment(self, rid: str, payload: dict) -> dict:
        """One generation call with failover: on a connection error or timeout the server is
        marked dead and the next attempt goes to another live server (or, if none, to the same
        one after a backoff)."""
        last: Exception | None = None
        attempts = max(1, self.config.request_retries)
        attempt = 0
        restart_deadline = time.monotonic() + self.config.setup_timeout
        while attempt < attempts:
            if self.restarting and not self.live_addresses():
                await self._wait_for_restart(0.0)  # never to a restarted server before its catch-up
            addr = self._choose_server(rid)
            self._outstanding[addr] += 1
            try:
                return await self._apost_once(addr, self.adapter.generate_endpoint, payload)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = e
                self.mark_dead(addr)
                # A server the launcher restarts (nothing listens there now) costs no attempt:
                # the request waits for it (or another live server), up to rollout.setup_timeout.
                if (isinstance(e, aiohttp.ClientConnectionError) and self.restart_hook is not None
                        and time.monotonic() < restart_deadline
                        and await asyncio.to_thread(self.restart_hook, addr)):
                    logger.warning("%s%s failed (%r): the server is restarting; the request waits for it",
                                   addr, self.adapter.generate_endpoint, e)
                    continue
                attempt += 1
                logger.warning("%s%s attempt %d/%d failed: %r", addr, self.adapter.generate_endpoint,
                               attempt, attempts, e)
            finally:
                self._outstanding[addr] -= 1
            if attempt < attempts and not self.live_addresses():
                await self._wait_for_restart(2 ** (attempt - 1))
        raise self._give_up(f"{self.adapter.generate_endpoint} (rid {rid})", last)

    # -- generation ----------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """Record the servers' new weight version; the pause this rank saw (if any) is over for
        tagging purposes: a segment sent from now on is served by ``version``."""
        super().set_version(version)
        self._paused_at = None

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion; see the module docstring for interruption and failover.

        Versions (AReaL #1569's bug class): every token carries the version of the weights that
        produced it. A server that reports its version per reply (ours; SGLang after its first
        versioned update) is believed. For one that reports none (vLLM; SGLang's "default"), a
        segment sent while the servers run is tagged with this rank's version *at send* — never
        at the time its reply is read, which may be after the next update landed although the old
        weights produced it. A segment sent while the servers are paused (rank 0 between
        :meth:`pause_generation` and :meth:`set_version`; any rank after it got an abort reply,
        until :meth:`set_version`) is held by the server and served by the new weights: it is
        tagged with the version when its reply arrives. Residual window: on ranks other than 0,
        a *new* request first sent after rank 0 paused the servers and before this rank saw an
        abort is tagged as sent while running (the old version) although the new weights serve it.

        Returns: a :class:`ModelResponse` whose ``stop_reason`` is "stop" or "length".

        Raises:
            ServerTimeoutError: no server answered within ``request_retries`` attempts of
                ``request_timeout`` seconds each (plus backoff).
            ServerError: the server rejected the request (4xx) or failed repeatedly.
        """
        gconfig = req.gconfig
        budget = gconfig.max_new_tokens
        resp = ModelResponse(input_tokens=list(req.input_ids))
        while True:
            params = gconfig.sampling_params()
            params["max_new_tokens"] = budget - resp.output_len
            payload = self.adapter.build_request(resp.input_tokens + resp.output_tokens, params)
            if self.serves_lora:
                payload["model"] = self.adapter.lora_name
            seg_start, sent_version, sent_paused = time.time(), self.get_version(), self._paused_at is not None
            result = await self._generate_segment(req.rid, payload)
            tokens, logprobs, finish, version = self.adapter.parse_response(result)
            if version is None:  # the backend reports none: see "Versions" above
                version = self.get_version() if sent_paused else sent_version
                if finish == "abort" and self.get_version() == sent_version:
                    self._paused_at = sent_version  # the servers are paused for the update to sent_version + 1
            trace.lane_complete(f"server {self._rid_to_addr.get(req.rid, '?')}", "interrupted" if finish == "abort"
                                else "generate", seg_start, time.time(), {"tokens": len(tokens), "version": version})
            resp.output_tokens += tokens
            resp.output_logprobs += logprobs
            resp.output_versions += [version] * len(tokens)
            resp.stop_reason = finish
            if resp.stop_reason != "abort" or resp.output_len >= budget:
                break
        if resp.stop_reason == "abort":  # aborted exactly at the end of the budget
            resp.stop_reason = "length"
        return resp

    async def aprompt_logprobs(self, input_ids: list[int], start: int = 1, temperature: float = 1.0,
                               rid: str | None = None) -> list[float]:
        """See :meth:`InferenceEngine.aprompt_logprobs`: one ``max_new_tokens: 0`` request with
        ``logprob_start_len`` (SGLang and our server), with the failover of generation.

        Raises:
            ValueError: ``start`` outside [1, len(input_ids)).
            NotImplementedError: the backend has no prompt-logprob request (vLLM, for now).
            ServerError / ServerTimeoutError: as :meth:`agenerate`, or a reply without the logprobs.
        """
        if not 1 <= start < len(input_ids):
            raise ValueError(f"aprompt_logprobs: start={start} must be in [1, {len(input_ids)})")
        payload = self.adapter.build_score_request(list(input_ids), start, temperature)
        result = await self._generate_segment(rid or uuid.uuid4().hex, payload)
        return self.adapter.parse_score_response(result, len(input_ids) - start)

    # -- weight updates (called by trainer rank 0) --------------------------------------------------
    def _all_servers(self, endpoint: str, payload: dict | None = None, method: str = "POST") -> list[dict]:
        """The same request to every server not excluded yet, concurrently.

        A server that does not answer (after retries) is excluded for good, with an error in
        the log, so that it never serves stale weights; the call fails only if every server
        fails. A 4xx answer (a bad request) raises at once.

        Raises:
            ServerError: every server failed, or one answered 4xx.
        """
        addrs = [a for a in self.addresses if a not in self._excluded and a not in self.restarting]
        if not addrs and self.restarting:
            return []  # the servers being restarted get the current weights when they are back
        if not addrs:
            raise ServerError(f"{endpoint}: every server was excluded after failing a control call; see the log")
        with ThreadPoolExecutor(len(addrs)) as pool:
            futures = [pool.submit(post_json, a, endpoint, payload, self.config.request_timeout,
                                   self.config.request_retries, method) for a in addrs]
            replies, errors = [], []
            for a, f in zip(addrs, futures):
                try:
                    replies.append(f.result())
                except ServerError as e:
                    if e.status is not None and 400 <= e.status < 500:  # a bad request: not the server's fault
                        raise
                    errors.append((a, e))
        # A server whose process the launcher restarts is caught up when it is back, not excluded.
        errors = [(a, e) for a, e in errors if not (self.restart_hook and self.restart_hook(a))]
        if errors and len(errors) == len(addrs):
            raise errors[0][1]
        for a, e in errors:
            logger.error("server %s failed %s and is excluded from now on: %s", a, endpoint, e)
            self._excluded.add(a)
        return replies

    def pause_generation(self) -> None:
        """Servers abort in-flight requests (partial outputs return) and hold new ones. Holds
        :attr:`sync_lock` until :meth:`continue_generation` (a restart's catch-up waits)."""
        if not self._sync_held:  # a restart's catch-up (it holds the lock) finishes first
            self._sync_held = self.sync_lock.acquire(timeout=self.config.setup_timeout)
        self._paused_at = self.get_version()  # segments sent from now on are held (see agenerate)
        self._all_servers(*self.adapter.pause)

    def continue_generation(self) -> None:
        self._all_servers(*self.adapter.resume)
        if self._sync_held:
            self._sync_held = False
            self.sync_lock.release()

    def set_server_threads(self, num_threads: int) -> bool:
        """Every live server runs the model with ``num_threads`` torch intra-op threads from its
        next scheduler iteration on (our server's ``POST /set_num_threads``; returns once
        applied, at most one iteration later). Core sharing (:mod:`arealite.trainer.cores`)
        lends the trainer's cores this way while the trainer waits for generation.

        Returns:
            True when every live server applied it; False for backends without the endpoint
            (``rollout.backend`` "sglang"/"vllm": nothing is sent) or when a server did not
            answer (logged; a thread count never fails the run).

        Raises:
            ValueError: ``num_threads < 1``.
        """
        if num_threads < 1:
            raise ValueError(f"set_server_threads: num_threads={num_threads} must be >= 1")
        if self.config.backend != "local":
            return False
        ok = True
        for a in self.live_addresses():
            try:
                post_json(a, "/set_num_threads", {"num_threads": int(num_threads)}, timeout=30, retries=1)
            except ServerError as e:
                logger.warning("server %s did not change its thread count to %d: %s", a, num_threads, e)
                ok = False
        return ok

    def weight_update_meta(self, path: str, version: int) -> WeightUpdateMeta:
        """The :class:`WeightUpdateMeta` for this config (``rollout.weight_sync``): the trainer
        passes it to ``push_weights`` (all ranks, :mod:`arealite.trainer.weight_update`) and rank 0
        to :meth:`update_weights`.

        ``addresses``: the servers not excluded (:meth:`exclude_servers`, or a failed pause or
        update), in the original order; build the meta after :meth:`pause_generation` so that a
        server that did not answer the pause is left out. A server only marked dead for a while
        (a slow ``/generate``) is kept: skipping it would leave it with stale weights. Empty when
        every server is excluded (the push then raises ``WeightSyncError``)."""
        return WeightUpdateMeta(type=self.config.weight_sync, path=path, version=version,
                                addresses=[a for a in self.addresses if a not in self._excluded],
                                tp_size=self.config.tp_size,
                                bucket_bytes=int(self.config.weight_sync_bucket_mb * 2**20),
                                timeout_s=self.config.weight_sync_timeout, backend=self.config.backend)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """"disk": every server loads the HF folder ``meta.path`` and reports ``meta.version``.
        "distributed": the trainer's ``push_weights`` already broadcast the tensors; check that
        every server of ``meta.addresses`` reports ``meta.version``. vLLM with a LoRA actor
        (``meta.lora``): the adapter folder is loaded under its name (:meth:`_load_lora`).

        Raises:
            ValueError: unknown ``meta.type`` (or the backend cannot load weights from disk).
            ServerError: a server failed to load the weights or reports another version.
        """
        if meta.lora and self.config.backend == "vllm":
            self._load_lora(meta)
        elif meta.type == "disk":
            endpoint, payload = self.adapter.disk_update(meta.path, meta.version)
            for reply in self._all_servers(endpoint, payload):
                if not self.adapter.control_reply(reply).get("success", False):
                    raise ServerError(f"{endpoint} failed: {reply}")
            self.last_disk_update = (meta.path, meta.version)  # a restarted server loads it
        elif meta.type == "distributed":
            for a in meta.addresses or self.live_addresses() or self.addresses:
                method, endpoint, body = self.adapter.weight_version_request
                v = self.adapter.parse_weight_version(post_json(a, endpoint, body, timeout=30,
                                                                retries=self.config.request_retries, method=method))
                if v is not None and str(v) != str(meta.version):
                    raise ServerError(f"{a} reports weight_version {v!r} after a distributed "
                                      f"update to version {meta.version}")
                if a in self.restarting:  # a restarted server that took part in the push
                    self.readmit(a)
        else:
            raise ValueError(f"weight update type {meta.type!r}: use 'disk' or 'distributed' (rollout.weight_sync)")

    def _load_lora(self, meta: WeightUpdateMeta) -> None:
        """vLLM, a LoRA actor: every server loads the adapter folder in place under
        ``VLLMAdapter.lora_name`` — disk: ``meta.path``; distributed: the folder its worker wrote
        from the push (``arealite_lora_path``), after checking its version.

        Raises:
            ValueError: this engine was built without ``lora_rank`` (its requests would not name
                the adapter).
            ServerError: a server failed to load it (e.g. vLLM without ``--enable-lora``) or
                reports another version.
        """
        if not self.serves_lora:
            raise ValueError("a LoRA actor's adapters reach vLLM unmerged, but this RemoteInferenceEngine was built "
                             "without lora_rank: pass lora_rank=actor.lora.rank (make_inference_engine does)")
        if meta.type == "disk":
            endpoint, payload = self.adapter.lora_load_request(meta.path)
            self._all_servers(endpoint, payload)  # 4xx (no --enable-lora, a bad folder) raises
            for reply in self._all_servers(*self.adapter.set_version_request(meta.version)):
                if not self.adapter.control_reply(reply).get("success", False):
                    raise ServerError(f"setting weight version {meta.version} failed: {reply}")
            self.last_disk_update = (meta.path, meta.version)
            return
        for a in meta.addresses or self.live_addresses() or self.addresses:
            method, endpoint, body = self.adapter.lora_path_request
            reply = post_json(a, endpoint, body, timeout=30, retries=self.config.request_retries, method=method)
            v = self.adapter.parse_weight_version(reply)
            paths = [r.get("lora_path") for r in reply.get("results") or [] if isinstance(r, dict) and r.get("lora_path")]
            if str(v) != str(meta.version) or not paths:
                raise ServerError(f"{a} reports weight_version {v!r} and LoRA folder {paths} after a distributed "
                                  f"LoRA push of version {meta.version}")
            post_json(a, *self.adapter.lora_load_request(paths[0]), timeout=self.config.request_timeout,
                      retries=self.config.request_retries)
            if a in self.restarting:
                self.readmit(a)
