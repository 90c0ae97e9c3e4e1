"""Tools in OpenAI function-calling form, and :class:`ToolEnv`: an :class:`~arealite.api.env.Environment`
whose model turns either call tools or do something else (answer, talk to a user).

Protocol (Hermes / Qwen2.5 style, the one :mod:`arealite.agent.openai_client` parses for the proxy,
so an environment and an openai-package agent see the same text): the system prompt lists the tools'
JSON schemas inside ``<tools>...</tools>``; a model turn that contains

    <tool_call>{"name": "search", "arguments": {"query": "Velora Kint"}}</tool_call>

is cut right after the first ``</tool_call>`` (:func:`truncate_after_tool_call`), the call runs, and its
output comes back as one message ``<tool_response>\\n...\\n</tool_response>`` (role ``tool_role``). A turn
without a valid call goes to :meth:`ToolEnv.aon_text` (the subclass: a final answer, a message to the
user).

A second call syntax, ``call_format="tags"``, is Search-R1's (Jin et al. 2025, arXiv 2503.09516),
generalised: ``<search>Velora Kint</search>``, i.e. ``<tool name>arguments</tool name>`` with several
arguments in the schema's order separated by `` | ``; outputs come back in ``<information>...</information>``.
SmolLM2-135M-Instruct writes it after two demonstrations (22 of 24 sampled first turns), and the
JSON form not at all (0 of 24, same demonstrations): the tags are for small models, the JSON form for
the rest and for agents behind the proxy.

Failures, and what each costs:

- a *domain* error (:class:`ToolError`, e.g. "order not found"), an unknown tool, or arguments that do
  not fit the tool's signature: the error text is the tool's output, counted in ``info["tool_errors"]``;
  the episode goes on (the model can correct itself — τ-bench's convention);
- a call that runs past ``tool_timeout`` seconds, or a tool that raises anything else (the index or the
  database itself failed): the episode ends at once with reward 0 and ``info["ended_tool_timeout"]`` /
  ``info["ended_tool_failed"]`` = 1. The tokens sampled so far stay in the trajectory and every other
  episode is untouched.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from arealite.api.env import Environment, StepResult

logger = logging.getLogger("arealite.env")

# Hermes/Qwen-style tool calls in the generated text: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
TOOL_CALL_END = "</tool_call>"


class ToolError(Exception):
    """A tool's domain error (bad id, refused by policy...): the message is the tool's output and the
    episode goes on."""


@dataclass
class Tool:
    """One tool: an OpenAI function schema plus the Python function that runs it.

    Args:
        name: function name the model calls.
        description: one line for the model.
        parameters: JSON schema of the arguments (``{"type": "object", "properties": ..., "required": [...]}``).
        fn: called with the arguments as keywords; returns the output text (a non-str is JSON-encoded);
            ``async def`` or plain (a plain function runs on the event loop: keep it fast, or make it async).
        writes: the tool changes the environment's state (a policy may require confirmation first).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any | Awaitable[Any]]
    writes: bool = False

    def schema(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}`` (OpenAI ``tools=``)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def acall(self, arguments: dict[str, Any]) -> str:
        """Run the tool on ``arguments`` (a dict).

        Raises:
            ToolError: the arguments do not fit the signature (named), or the tool's own domain error.
            Anything else the tool raises (a failure of the tool itself).
        """
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as e:
            raise ToolError(f"bad arguments for {self.name}: {e}; parameters: {json.dumps(self.parameters)}") from None
        out = self.fn(**arguments)
        if inspect.isawaitable(out):
            out = await out
        return out if isinstance(out, str) else json.dumps(out)


def _arguments(value: Any) -> str | None:
    """``arguments`` as OpenAI returns them (a JSON string of an object), or None when ``value`` is not
    an object's arguments. A JSON string is decoded exactly once."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "{}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value) if isinstance(value, dict) else None


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` of a generated ``text`` (Hermes-style ``<tool_call>`` blocks), or None
    when it has no valid one. Each call is ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` with ``isinstance(json.loads(arguments), dict)``; blocks that are not JSON, lack a
    name, or whose arguments are not an object are skipped."""
    calls = []
    for m in TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"].strip()):
            continue
        arguments = _arguments(obj.get("arguments"))
        if arguments is not None:
            calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                          "function": {"name": obj["name"], "arguments": arguments}})
    return calls or None


def tools_prompt(tools: list[Tool]) -> str:
    """The system-prompt text that lists ``tools`` (Hermes / Qwen2.5's wording and tags)."""
    schemas = "\n".join(json.dumps(t.schema()) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{schemas}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


CALL_FORMATS = ("hermes", "tags")


def stop_at(stops: tuple[str, ...]) -> Callable[[Any, list[int]], int]:
    """A ``truncate_fn`` for :class:`~arealite.workflow.multi_turn.MultiTurnWorkflow`: ``fn(tokenizer,
    ids)`` is the number of leading ``ids`` whose decoded text first contains one of ``stops``
    (``len(ids)`` when none does). Stop strings of tool turns: a model that goes on after its call
    would otherwise write the tool's output itself.

    Raises:
        ValueError: empty ``stops``.
    """
    if not stops:
        raise ValueError("stop_at needs at least one stop string")

    def hit(tokenizer, ids):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stops)

    def truncate(tokenizer, ids: list[int]) -> int:
        if not hit(tokenizer, ids):
            return len(ids)
        lo, hi = 1, len(ids)  # "the prefix contains a stop string" is monotone in the length
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(tokenizer, ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    return truncate


truncate_after_tool_call = stop_at((TOOL_CALL_END,))
truncate_after_tool_call.__doc__ = "``stop_at(('</tool_call>',))``: the stop string of a Hermes tool-call turn."


def _params(tool: Tool) -> list[str]:
    """The tool's parameter names in schema order (the order of "tags" arguments)."""
    return list(tool.parameters.get("properties", {}))


@dataclass
class ToolCallRecord:
    """One executed call: ``name``, decoded ``arguments``, ``output`` text, ``ok`` (no error)."""

    name: str
    arguments: dict[str, Any]
    output: str
    ok: bool


class ToolEnv(Environment):
    """An environment whose model turns call :attr:`tools` or end in :meth:`aon_text` (module docstring).

    Args:
        tools: the tools of this episode (their functions may close over per-episode state).
        tool_timeout: seconds one call may run before the episode ends (``ended_tool_timeout``).
        tool_role: chat role of the tool-output message ("user" for templates without a tool role,
            e.g. SmolLM2's; "tool" for those with one).
        max_calls_per_turn: calls of one turn that run (later ones are ignored, counted as errors).
        call_format: "hermes" (``<tool_call>`` JSON) or "tags" (``<name>args</name>``), module docstring.

    ``info`` per step: ``tool_calls`` (calls run), ``tool_errors`` (domain errors, unknown tools, bad
    arguments), and ``ended_tool_timeout`` / ``ended_tool_failed`` when a call ended the episode.
    :attr:`calls` keeps every executed call of the episode, in order.
    """

    def __init__(self, tools: list[Tool], tool_timeout: float = 10.0, tool_role: str = "user",
                 max_calls_per_turn: int = 4, call_format: str = "hermes"):
        if tool_timeout <= 0:
            raise ValueError(f"tool_timeout must be > 0 seconds, got {tool_timeout}")
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
        self.call_format = call_format
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self.tools, self.tool_timeout, self.tool_role = list(tools), tool_timeout, tool_role
        self.max_calls_per_turn = max_calls_per_turn
        self.tool_map = {t.name: t for t in tools}
        self.calls: list[ToolCallRecord] = []

    @abc.abstractmethod
    async def aon_text(self, completion: str) -> StepResult:
        """A model turn without a tool call (a final answer, a message to the user...)."""

    def describe_tools(self) -> str:
        """System-prompt text listing the tools in this environment's call format."""
        if self.call_format == "hermes":
            return tools_prompt(self.tools)
        lines = [f"<{t.name}>{' | '.join(_params(t))}</{t.name}>: {t.description}" for t in self.tools]
        return ("Call a tool by writing its tag with the arguments inside; the result comes back in "
                "<information></information>. Tools:\n" + "\n".join(lines))

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text of one call in this environment's format (for demonstrations)."""
        if self.call_format == "hermes":
            return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
        return f"<{name}>{' | '.join(str(arguments[p]) for p in _params(self.tool_map[name]))}</{name}>"

    def render_outputs(self, outputs: list[str]) -> str:
        """The tool-output message's text for one turn's outputs."""
        if self.call_format == "hermes":
            return "<tool_response>\n" + "\n</tool_response>\n<tool_response>\n".join(outputs) + "\n</tool_response>"
        return "<information>" + "\n".join(outputs) + "</information>"

    def stops(self) -> tuple[str, ...]:
        """Stop strings of a tool turn in this format (:func:`stop_at`)."""
        return (TOOL_CALL_END,) if self.call_format == "hermes" else tuple(f"</{t.name}>" for t in self.tools)

    def parse_calls(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        """The calls of a model turn, in order: ``[(name, arguments)]`` (empty: no call)."""
        if self.call_format == "hermes":
            return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parse_tool_calls(text) or []]
        found = []
        for t in self.tools:
            for m in re.finditer(f"<{re.escape(t.name)}>(.*?)</{re.escape(t.name)}>", text, re.DOTALL):
                params = _params(t)
                values = [m.group(1).strip()] if len(params) == 1 else [v.strip() for v in m.group(1).split("|")]
                found.append((m.start(), t.name, dict(zip(params, values)) if len(values) == len(params) else
                              {"__bad__": f"{t.name} takes {len(params)} arguments ({' | '.join(params)}), "
                                          f"got {len(values)}"}))
        return [(name, args) for _, name, args in sorted(found, key=lambda f: f[0])]

    async def astep(self, completion: str) -> StepResult:
        calls = self.parse_calls(completion)
        if not calls:
            return await self.aon_text(completion)
        outputs, errors = [], 0
        for i, (name, arguments) in enumerate(calls):
            if i >= self.max_calls_per_turn:
                outputs.append(f"Error: at most {self.max_calls_per_turn} calls per turn; {name} was not run")
                errors += 1
                continue
            tool = self.tool_map.get(name)
            try:
                if tool is None:
                    raise ToolError(f"unknown tool {name!r}; the tools are {sorted(self.tool_map)}")
                if "__bad__" in arguments:
                    raise ToolError(arguments["__bad__"])
                output = await asyncio.wait_for(tool.acall(arguments), self.tool_timeout)
                ok = True
            except ToolError as e:
                output, ok = f"Error: {e}", False
            except asyncio.TimeoutError:
                logger.warning("tool %s ran past tool_timeout=%.1fs: the episode ends", name, self.tool_timeout)
                return self._ended("tool_timeout", len(outputs), errors)
            except Exception as e:  # noqa: BLE001 - the tool itself failed; the episode ends, the run goes on
                logger.warning("tool %s failed (%s: %s): the episode ends", name, type(e).__name__, e)
                return self._ended("tool_failed", len(outputs), errors)
            errors += int(not ok)
            self.calls.append(ToolCallRecord(name, arguments, output, ok))
            outputs.append(output)
        ran = min(len(calls), self.max_calls_per_turn)
        return StepResult(messages=[{"role": self.tool_role, "content": self.render_outputs(outputs)}],
                          info={"tool_calls": ran, "tool_errors": errors})

    def _ended(self, reason: str, ran: int, errors: int) -> StepResult:
        """The episode ends because of a tool: ``ran`` earlier calls of this turn plus the failed one."""
        return StepResult(reward=0.0, done=True, info={"tool_calls": ran + 1, "tool_errors": errors, f"ended_{reason}": 1})
