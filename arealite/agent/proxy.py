"""A training proxy: an OpenAI-compatible HTTP server in front of the inference engine, so that
agents written for the OpenAI Chat Completions API (the ``openai`` package, the OpenAI Agents
SDK, LangChain's ``ChatOpenAI``, or any language's HTTP client) are trained unchanged, in this
process or another one.

Sessions. A workflow (:class:`arealite.agent.proxy_workflow.ProxyAgentWorkflow`) opens one
session per episode (:meth:`TrainingProxy.open_session`) and gives the agent the session's
``base_url`` (``http://127.0.0.1:PORT/s/<session_id>/v1``) and ``api_key`` (the session id).
Every call of a session goes through one :class:`~arealite.agent.openai_client.ArealOpenAI`,
which records it token-in/token-out (prompt prefix matching, masks, logprobs, versions) exactly
as in-process agents are recorded; the workflow exports the session's episode when the agent
is done. A request to ``/v1/chat/completions`` without the ``/s/<id>`` prefix is routed by its
``Authorization: Bearer <session_id>`` header instead.

Endpoints (JSON; errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}``):

- ``POST /s/<id>/v1/chat/completions``: ``messages`` (roles system/developer/user/assistant/tool;
  content a string or a list of ``{"type": "text"}`` parts), ``tools`` (function tools; parsed
  from Hermes-style ``<tool_call>{...}</tool_call>`` text like ``ArealOpenAI``, ``arguments``
  always a JSON string of an object, see :func:`~arealite.agent.openai_client.parse_tool_calls`;
  if the chat template ignores ``tools``, a description of them is appended to the system
  message, see :func:`tools_system_text`), ``tool_choice`` ``auto``/``none`` only,
  ``max_tokens`` / ``max_completion_tokens``, ``stream`` (true: server-sent
  ``chat.completion.chunk`` events, then ``data: [DONE]``; the reply is generated whole, then
  sent). Sampling fields follow :mod:`arealite.agent.sampling`: one that would make the recorded
  logprobs wrong for RL (``temperature`` other than the trainer's, ``top_p < 1``, ``top_k``,
  ``min_p``, penalties, ``logit_bias``, ``n``/``best_of`` > 1, ``stop``, constrained
  ``response_format``) is a 400 ``{"error": {"message", "type": "invalid_request_error",
  "param": <field>, "code": "unsupported_value"}}`` saying how to fix it; the others (``seed``,
  ``logprobs``, ``user``, ...) are ignored and named in the ``X-Arealite-Ignored-Params`` header.
- ``GET /v1/models`` and ``GET /s/<id>/v1/models``.
- ``POST /s/<id>/reward`` (alias ``/s/<id>/rl/set_reward``, AReaL's name): ``{"reward": float}``,
  the episode reward set by the agent itself.

A malformed body is answered 400 naming the field; an unknown or closed session 404 (a late
request of a timed-out session can never land in another episode).

The reply's ``content`` is the full generated text (tool-call markup included) so that a client
that sends its history back unchanged extends the same trajectory (prefix matching compares the
assistant text with what was sampled). A chat template that rewrites earlier turns (Qwen3's
drops past reasoning) is not an error: the call starts a new trajectory segment
(:mod:`arealite.agent.openai_client`).

Weight updates: a call that arrives, or is generating, while the trainer updates the weights is
held by the inference engine (paused servers keep it; an interrupted generation resumes under the
new weights) and completes; each sampled token records the version that produced it. The proxy
itself never times a call out.

Orphans (AReaL#1498): a client that gives up on a call (its timeout) and retries the same
messages leaves the first call behind. The server cancels a call whose client disconnected
(``handler_cancellation``), so it records nothing; one that finished in the same instant is
discarded (:meth:`ArealOpenAI.discard`). Either way it is counted in ``stats["orphans"]`` and the
retry extends the trajectory as if it had been the only call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from arealite.agent.openai_client import ArealOpenAI, ChatCompletion
from arealite.agent.sampling import IGNORED_HEADER, SamplingError, check_sampling
from arealite.api.config import GenerationConfig, ProxyConfig
from arealite.api.engine import InferenceEngine

logger = logging.getLogger("arealite.proxy")

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(ValueError):
    """A request field is malformed or unsupported; ``param`` names it (e.g.
    ``messages[2].content``), ``code`` is the OpenAI error code (None, or ``unsupported_value``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


@dataclass
class Session:
    """One episode's calls. ``client`` records them; ``reward`` is set by ``POST /s/<id>/reward``."""

    id: str
    client: ArealOpenAI
    base_url: str
    created: float = field(default_factory=time.monotonic)
    reward: float | None = None
    requests: int = 0
    closed: bool = False

    @property
    def api_key(self) -> str:
        return self.id


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The description of ``tools`` (OpenAI function tools) appended to the system message when
    the chat template ignores ``tools``: Hermes-style, the format ``ArealOpenAI`` parses."""
    specs = "\n".join(json.dumps(t.get("function", t), sort_keys=True) for t in tools)
    return ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query. "
            f"Function signatures:\n<tools>\n{specs}\n</tools>\n\nTo call a function, reply with a JSON "
            "object within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': str}}) are supported",
                                 f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where} must be a string, null or a list of text parts, got {type(content).__name__}", where)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Request ``messages`` as plain dicts: content as one string, ``developer`` as ``system``,
    ``tool_calls`` / ``tool_call_id`` / ``name`` kept. Deterministic, so that the same history
    sent twice compares equal (prefix matching).

    Raises:
        BadRequest: naming the bad field.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of chat messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with 'role' and 'content'", where)
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role={role!r}: must be one of {', '.join(ROLES)}", f"{where}.role")
        d: dict[str, Any] = {"role": "system" if role == "developer" else role,
                             "content": _text_content(m.get("content"), f"{where}.content")}
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise BadRequest(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            d["tool_calls"] = m["tool_calls"]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                d[key] = m[key]
        out.append(d)
    return out


def _number(body: dict, key: str, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{key}'={v!r}: must be {kind} in [{lo}, {hi}]", key)
    return v


# fields the proxy itself uses; every other field goes through arealite.agent.sampling
_USED = ("messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "stream", "stream_options",
         "model")


def parse_request(body: Any, gconfig: GenerationConfig | None = None) -> dict[str, Any]:
    """Validate a Chat Completions body; returns the keyword arguments of ``ArealOpenAI.create``
    plus ``stream``, ``include_usage`` and ``ignored`` (the fields ignored under
    :mod:`arealite.agent.sampling`, sorted).

    Args:
        body: the decoded JSON body.
        gconfig: the session's sampling parameters (the trainer's ``temperature``).

    Raises:
        BadRequest: naming the bad field (a non-function tool, a bad number, a sampling field
            the RL record cannot honour: code ``unsupported_value``, ...).
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        ignored = check_sampling({k: v for k, v in body.items() if k not in _USED}, gconfig or GenerationConfig())
    except SamplingError as e:
        raise BadRequest(str(e), e.param, "unsupported_value") from None
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list of function tools", "tools")
        for i, t in enumerate(tools):
            if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                    and isinstance(t["function"].get("name"), str)):
                raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}",
                                 f"tools[{i}]")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(f"'tool_choice'={choice!r}: only 'auto' and 'none' are supported (the proxy cannot "
                         "force a call)", "tool_choice", "unsupported_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream'={stream!r}: must be true or false", "stream")
    max_tokens = _number(body, "max_tokens", 1, 1 << 20, integer=True)
    max_completion = _number(body, "max_completion_tokens", 1, 1 << 20, integer=True)
    opts = body.get("stream_options") or {}
    return {
        "messages": normalize_messages(body.get("messages")),
        "tools": (tools or None) if choice != "none" else None,
        "max_tokens": max_tokens, "max_completion_tokens": max_completion,
        "stream": stream, "include_usage": bool(isinstance(opts, dict) and opts.get("include_usage")),
        "ignored": ignored,
    }


def completion_json(c: ChatCompletion) -> dict[str, Any]:
    """A :class:`ChatCompletion` as the OpenAI JSON object."""
    ch = c.choices[0]
    message = {"role": "assistant", "content": ch.message.content}
    if ch.message.tool_calls:
        message["tool_calls"] = ch.message.tool_calls
    return {"id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
            "choices": [{"index": 0, "message": message, "finish_reason": ch.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": c.usage.prompt_tokens, "completion_tokens": c.usage.completion_tokens,
                      "total_tokens": c.usage.total_tokens}}


def completion_chunks(c: ChatCompletion, include_usage: bool) -> list[dict[str, Any]]:
    """The streamed form of ``c`` (``chat.completion.chunk`` objects): the role, the content, one
    delta per tool call (``index``, ``id``, ``function.name``, the whole ``arguments``), the
    ``finish_reason``, and with ``include_usage`` a last chunk with ``usage`` and no choices."""
    ch = c.choices[0]
    head = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model}

    def chunk(delta, finish=None):
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    out = [chunk({"role": "assistant", "content": ""})]
    if ch.message.content:
        out.append(chunk({"content": ch.message.content}))
    for i, call in enumerate(ch.message.tool_calls or []):
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"],
                                                       "arguments": call["function"]["arguments"]}}]}))
    out.append(chunk({}, ch.finish_reason))
    if include_usage:
        out.append({**head, "choices": [], "usage": completion_json(c)["usage"]})
    return out


class TrainingProxy:
    """The HTTP server (aiohttp) on the current event loop; see the module docstring.

    Args:
        tokenizer: the policy's tokenizer (chat template).
        gconfig: sampling defaults of every session's client (``temperature`` is the trainer's).
        config: ``host`` (loopback by default), ``port`` (0 = a free one), request size limit.

    Start it with ``await proxy.start()`` on the loop that runs the episodes (the engine's HTTP
    session belongs to that loop); stop it with ``await proxy.aclose()``.

    ``stats``: counters ``sessions_opened``, ``sessions_closed``, ``sessions_timed_out`` (the
    workflow reports them through :meth:`close_session`), ``requests``, ``bad_requests``,
    ``unknown_session``, ``engine_errors``, ``orphans`` (calls whose client gave up: not
    recorded) and ``ignored_params`` (requests with fields ignored under
    :mod:`arealite.agent.sampling`).
    """

    def __init__(self, tokenizer, gconfig: GenerationConfig, config: ProxyConfig | None = None):
        self.tokenizer, self.gconfig, self.config = tokenizer, gconfig, config or ProxyConfig()
        self.sessions: dict[str, Session] = {}
        self.stats = dict.fromkeys(("sessions_opened", "sessions_closed", "sessions_timed_out", "requests",
                                    "bad_requests", "unknown_session", "engine_errors", "orphans",
                                    "ignored_params"), 0)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self._template_renders_tools: bool | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> "TrainingProxy":
        """Bind ``config.host:config.port`` (0 = a free port, see :attr:`url`)."""
        app = web.Application(client_max_size=self.config.max_request_bytes)
        app.add_routes([
            web.get("/health", self._health),
            web.get("/v1/models", self._models), web.get("/s/{sid}/v1/models", self._models),
            web.post("/v1/chat/completions", self._chat), web.post("/s/{sid}/v1/chat/completions", self._chat),
            web.post("/s/{sid}/reward", self._reward), web.post("/s/{sid}/rl/set_reward", self._reward),
        ])
        # a client that disconnects (gave up on a call) cancels its handler: the orphan records nothing
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as e:
            sock.close()
            await self._runner.cleanup()
            raise OSError(f"proxy.host={self.config.host!r} proxy.port={self.config.port}: cannot bind ({e}); "
                          "use port 0 for a free one") from e
        await web.SockSite(self._runner, sock).start()
        self.port = sock.getsockname()[1]
        logger.info("training proxy listening on %s", self.url)
        return self

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (the server root)."""
        if self.port is None:
            raise RuntimeError("TrainingProxy.start() was not awaited")
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.port = None, None

    # -- sessions ----------------------------------------------------------------------------
    def open_session(self, engine: InferenceEngine, gconfig: GenerationConfig | None = None) -> Session:
        """A new session whose calls go to ``engine`` (the workflow's, so that tokens carry the
        engine's weight versions and the episode goes through the executor's staleness rule)."""
        sid = uuid.uuid4().hex
        session = Session(sid, ArealOpenAI(engine, self.tokenizer, gconfig or self.gconfig, model=self.config.model),
                          f"{self.url}/s/{sid}/v1")
        self.sessions[sid] = session
        self.stats["sessions_opened"] += 1
        return session

    def close_session(self, sid: str, timed_out: bool = False) -> Session:
        """Remove the session (later requests to it get 404) and return it."""
        session = self.sessions.pop(sid)
        session.closed = True
        self.stats["sessions_timed_out" if timed_out else "sessions_closed"] += 1
        return session

    def _session(self, request: web.Request) -> Session | None:
        sid = request.match_info.get("sid")
        if sid is None:
            auth = request.headers.get("Authorization", "")
            sid = auth[7:].strip() if auth.startswith("Bearer ") else None
        return self.sessions.get(sid) if sid else None

    def _unknown(self, request: web.Request) -> web.Response:
        self.stats["unknown_session"] += 1
        sid = request.match_info.get("sid", "(from the Authorization header)")
        return _error(404, f"unknown or closed session {sid!r} (finished, timed out, or never opened); use the "
                           "base_url the workflow gave this episode", None, "not_found_error")

    # -- handlers ----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions)})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": 0, "owned_by": "arealite"}]})

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None

    async def _reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        if session is None:
            return self._unknown(request)
        try:
            body = await self._json(request)
            reward = body.get("reward") if isinstance(body, dict) else None
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise BadRequest(f"'reward'={reward!r}: must be a finite number", "reward")
        except BadRequest as e:
            self.stats["bad_requests"] += 1
            return _error(400, str(e), e.param)
        session.reward = float(reward)
        return web.json_response({"session_id": session.id, "reward": session.reward})

    def _renders_tools(self) -> bool:
        if self._template_renders_tools is None:
            probe = [{"role": "user", "content": "x"}]
            tool = [{"type": "function", "function": {"name": "probe_tool_name", "parameters": {}}}]
            try:
                text = self.tokenizer.apply_chat_template(probe, tools=tool, tokenize=False)
                self._template_renders_tools = "probe_tool_name" in text
            except Exception:  # a template that rejects the argument
                self._template_renders_tools = False
        return self._template_renders_tools

    def _with_tool_text(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[dict[str, Any]]:
        if not tools or self._renders_tools() or not self.config.describe_tools:
            return messages
        if messages[0]["role"] == "system":
            return [{**messages[0], "content": messages[0]["content"] + tools_system_text(tools)}] + messages[1:]
        return [{"role": "system", "content": tools_system_text(tools).lstrip()}] + messages

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.stats["requests"] += 1
        session = self._session(request)
        if session is None:
            return self._unknown(request)
        try:
            args = parse_request(await self._json(request), session.client.gconfig)
        except BadRequest as e:
            self.stats["bad_requests"] += 1
            logger.info("proxy: 400 for session %s: %s", session.id, e)
            return _error(400, str(e), e.param, code=e.code)
        stream, include_usage, ignored = args.pop("stream"), args.pop("include_usage"), args.pop("ignored")
        headers = {IGNORED_HEADER: ",".join(ignored)} if ignored else {}
        if ignored:
            self.stats["ignored_params"] += 1
            logger.debug("proxy: session %s ignores %s", session.id, ignored)
        args["messages"] = self._with_tool_text(args["messages"], args["tools"])
        session.requests += 1
        try:
            completion = await session.client.create(**args)
        except ValueError as e:  # the messages cannot be rendered (e.g. a template's own check)
            self.stats["bad_requests"] += 1
            return _error(400, str(e), None)
        except asyncio.CancelledError:  # the client disconnected (gave up): nothing was recorded
            self.stats["orphans"] += 1
            logger.info("proxy: session %s: the client gave up on a call; it is not recorded", session.id)
            raise
        except Exception as e:
            self.stats["engine_errors"] += 1
            logger.exception("proxy: generation failed for session %s", session.id)
            return _error(500, f"generation failed: {e!r}", None, "server_error")
        if session.closed:  # the session timed out while this call was generating: not recorded
            return self._unknown(request)
        if request.transport is None or request.transport.is_closing():  # gone as it finished
            self.stats["orphans"] += 1
            session.client.discard(completion.id)
            logger.info("proxy: session %s: the client left before its reply; the call is discarded", session.id)
            return web.Response(status=499)
        if not stream:
            return web.json_response(completion_json(completion), headers=headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **headers})
        await resp.prepare(request)
        for chunk in completion_chunks(completion, include_usage):
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
