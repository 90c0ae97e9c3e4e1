"""An OpenAI-style chat client backed by an arealite :class:`InferenceEngine`, for training
agents written against the familiar API unchanged.

    client = ArealOpenAI(engine, tokenizer, gconfig)
    completion = await client.chat.completions.create(messages=messages, max_tokens=64)
    text = completion.choices[0].message.content
    ...
    batch = episodes_to_batch([client.export_episode(reward)])   # token-aligned, trainable

Every call is recorded (:class:`CompletionRecord`: prompt ids, sampled ids, logprobs, versions).
Token-in, token-out: when a call's ``messages`` extend an earlier call's messages by that call's
own reply (as returned, unchanged) plus new messages, its prompt ids are the earlier prompt +
sampled ids + the tokenised new messages only (:func:`chat_segment_ids`), so a conversation is
one trajectory whose ids are exactly the sampled ones. Otherwise (edited history, new tools) the
messages are tokenised afresh and the call starts a new chain.

Only the subset of the API that agents use for chat is implemented (``messages``, ``tools``,
``temperature``, ``max_tokens`` / ``max_completion_tokens``, ``top_p``, ``n=1``); the returned
objects mirror ``openai.types.chat.ChatCompletion`` attribute names (``choices[0].message.content``,
``.tool_calls``, ``.finish_reason``, ``usage``) without depending on the ``openai`` package.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

import torch

from arealite.api.config import GenerationConfig
from arealite.api.engine import InferenceEngine
from arealite.api.io_struct import ModelRequest
from arealite.api.workflow import RolloutWorkflow
from arealite.workflow.multi_turn import (Episode, chat_segment_ids, dump_episodes, episodes_to_batch, rollouts_path,
                                         summarize_episodes)

logger = logging.getLogger("arealite.agent")

# Hermes/Qwen-style tool calls in the generated text: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class ChatCompletionMessage:
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class Choice:
    index: int
    message: ChatCompletionMessage
    finish_reason: str  # "stop" | "length" | "tool_calls"


@dataclass
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class ChatCompletion:
    id: str
    choices: list[Choice]
    created: int
    model: str
    usage: CompletionUsage
    object: str = "chat.completion"


@dataclass
class CompletionRecord:
    """One recorded call. ``prompt_ids`` + ``output_ids`` are the ids of the call's sequence;
    ``parent`` is the record whose sequence is a prefix of ``prompt_ids`` (None: fresh prompt)."""

    id: str
    messages: list[dict[str, Any]]
    tools: Any
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    text: str
    stop_reason: str
    parent: str | None = None


def _as_dict(message: Any) -> dict[str, Any]:
    """A chat message (dict or a returned :class:`ChatCompletionMessage`) as a plain dict."""
    if isinstance(message, dict):
        d = dict(message)
    else:
        d = {"role": message.role, "content": message.content}
        if getattr(message, "tool_calls", None):
            d["tool_calls"] = message.tool_calls
    if d.get("content") is None:
        d["content"] = ""
    return d


def _parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    calls = []
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "name" in obj:
            calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                          "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}})
    return calls or None


class ArealOpenAI:
    """``client.chat.completions.create(...)`` (async) over ``engine.agenerate``, recording every call.

    Args:
        engine: the rollout engine (inside a workflow: the one passed to ``arun_episode``).
        tokenizer: HF tokenizer with the policy's chat template.
        gconfig: default sampling parameters (``n_samples`` is ignored: one completion per call).
        model: the ``model`` field of returned completions (informational).

    One client = one episode: create a fresh client per episode.
    """

    def __init__(self, engine: InferenceEngine, tokenizer, gconfig: GenerationConfig | None = None,
                 model: str = "arealite"):
        self.engine, self.tokenizer = engine, tokenizer
        self.gconfig = gconfig or GenerationConfig()
        self.model = model
        self.records: list[CompletionRecord] = []
        self.rid = uuid.uuid4().hex  # all calls of the episode go to one server (prefix reuse)
        self.chat = _Chat(self)

    # -- prompt construction -------------------------------------------------------------------
    def _prompt_ids(self, messages: list[dict[str, Any]], tools: Any) -> tuple[list[int], str | None]:
        for rec in reversed(self.records):
            k = len(rec.messages)
            if (rec.tools == tools and len(messages) > k + 1 and messages[:k] == rec.messages
                    and messages[k]["role"] == "assistant" and messages[k]["content"] == rec.text):
                seg = chat_segment_ids(self.tokenizer, messages[k + 1:], rec.output_ids[-1] if rec.output_ids else None)
                return rec.prompt_ids + rec.output_ids + seg, rec.id
        kwargs = {"tools": tools} if tools else {}
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out), None

    async def create(self, messages: list[Any], tools: list[dict] | None = None, temperature: float | None = None,
                     max_tokens: int | None = None, max_completion_tokens: int | None = None,
                     top_p: float | None = None, n: int = 1, **unused: Any) -> ChatCompletion:
        """Generate one assistant reply to ``messages`` (see the module docstring).

        Raises:
            ValueError: ``n != 1``, or a ``temperature`` different from ``gconfig.temperature``
                (the trainer divides logits by ``gconfig.temperature``, so recorded logprobs
                under another temperature would not be the behaviour policy's).
        """
        if n != 1:
            raise ValueError(f"n={n}: ArealOpenAI returns one choice per call; call create() n times")
        if temperature is not None and abs(temperature - self.gconfig.temperature) > 1e-9:
            raise ValueError(f"temperature={temperature} differs from gconfig.temperature={self.gconfig.temperature}, "
                             "which the trainer uses; omit temperature or set gconfig.temperature")
        if unused:
            logger.debug("ArealOpenAI.create ignores %s", sorted(unused))
        msgs = [_as_dict(m) for m in messages]
        prompt_ids, parent = self._prompt_ids(msgs, tools)
        budget = max_completion_tokens or max_tokens or self.gconfig.max_new_tokens
        gconfig = replace(self.gconfig, n_samples=1, max_new_tokens=budget,
                          top_p=self.gconfig.top_p if top_p is None else top_p)
        resp = await self.engine.agenerate(ModelRequest(input_ids=prompt_ids, gconfig=gconfig, rid=self.rid))
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        rec = CompletionRecord(id=f"chatcmpl-{uuid.uuid4().hex}", messages=msgs, tools=tools, prompt_ids=prompt_ids,
                               output_ids=list(resp.output_tokens), output_logprobs=list(resp.output_logprobs),
                               output_versions=list(resp.output_versions), text=text, stop_reason=resp.stop_reason,
                               parent=parent)
        self.records.append(rec)
        tool_calls = _parse_tool_calls(text) if tools else None
        finish = "tool_calls" if tool_calls else ("length" if resp.stop_reason == "length" else "stop")
        return ChatCompletion(
            id=rec.id, created=int(time.time()), model=self.model,
            choices=[Choice(0, ChatCompletionMessage("assistant", text, tool_calls), finish)],
            usage=CompletionUsage(len(prompt_ids), resp.output_len, len(prompt_ids) + resp.output_len))

    # -- export ----------------------------------------------------------------------------------
    def chains(self) -> list[list[CompletionRecord]]:
        """Recorded calls grouped into trajectories: one chain (root → leaf) per call that no
        later call extended, in the order of their last calls."""
        by_id = {r.id: r for r in self.records}
        parents = {r.parent for r in self.records}
        out = []
        for leaf in (r for r in self.records if r.id not in parents):
            chain = [leaf]
            while chain[-1].parent is not None:
                chain.append(by_id[chain[-1].parent])
            out.append(chain[::-1])
        return out

    def export_episode(self, reward: float) -> Episode:
        """The trajectory of the chain containing the **last** call, with ``reward``.

        Sampled ids have ``loss_mask = 1``, their logprobs and versions; prompt, template and
        user/tool message ids have 0, 0.0 and -1. Calls outside that chain (e.g. a history the
        agent rewrote) are not included; a warning says how many.

        Raises:
            RuntimeError: the client made no call.
        """
        if not self.records:
            raise RuntimeError("ArealOpenAI.export_episode: the agent made no chat.completions.create call")
        chains = self.chains()
        chain = chains[-1]
        if len(chains) > 1:
            logger.warning("export_episode: %d of %d calls are in other chains and are not trained on",
                           len(self.records) - len(chain), len(self.records))
        leaf = chain[-1]
        ep = Episode(reward=float(reward), turns=len(chain), no_eos=leaf.stop_reason == "length")
        pos = 0
        for rec in chain:
            ep.append(rec.prompt_ids[pos:], sampled=False)  # all new ids before this call's output
            ep.append(rec.output_ids, True, rec.output_logprobs, rec.output_versions)
            ep.requests.append(list(rec.prompt_ids))
            ep.texts.append(rec.text)
            pos = len(rec.prompt_ids) + len(rec.output_ids)
        assert ep.input_ids == leaf.prompt_ids + leaf.output_ids  # chains are prefix-consistent
        return ep


class _Completions:
    def __init__(self, client: ArealOpenAI):
        self.create = client.create


class _Chat:
    def __init__(self, client: ArealOpenAI):
        self.completions = _Completions(client)


AgentFn = Callable[[ArealOpenAI, dict[str, Any]], Awaitable[float]]


class OpenAIAgentWorkflow(RolloutWorkflow):
    """Train an agent written against the OpenAI-style client: ``gconfig.n_samples`` episodes per
    row, each ``reward = await agent_fn(client, data)`` with a fresh :class:`ArealOpenAI`; each
    episode becomes one trajectory (:meth:`ArealOpenAI.export_episode`), a GRPO group per row.

    Args:
        agent_fn: ``async fn(client, data) -> float`` (the episode reward).
        tokenizer: HF tokenizer with the policy's chat template.
        gconfig: sampling defaults for the client.
        dump_dir: if set, each group goes to ``dump_dir/rollouts.jsonl``
            (:func:`~arealite.workflow.multi_turn.dump_episodes`).
    """

    stat_keys = ("turns",)  # logged as rollout/turns

    def __init__(self, agent_fn: AgentFn, tokenizer, gconfig: GenerationConfig, dump_dir: str | None = None):
        self.agent_fn, self.tokenizer, self.gconfig = agent_fn, tokenizer, gconfig
        self.dump_path = rollouts_path(dump_dir)

    async def run_one(self, engine: InferenceEngine, data: dict[str, Any]) -> Episode:
        client = ArealOpenAI(engine, self.tokenizer, self.gconfig)
        reward = await self.agent_fn(client, data)
        return client.export_episode(reward)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        start = time.time()
        episodes = await asyncio.gather(*[self.run_one(engine, data) for _ in range(self.gconfig.n_samples)])
        if self.dump_path:
            dump_episodes(self.dump_path, data, list(episodes), start)
        return episodes_to_batch(list(episodes))

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> dict[str, float]:
        """One greedy episode per row (from a fresh event loop, e.g. in a recipe). Returns
        ``{"reward": mean reward, "solved": fraction with reward > 0, "turns": mean calls}``."""
        greedy = OpenAIAgentWorkflow(self.agent_fn, self.tokenizer, replace(self.gconfig, greedy=True, n_samples=1))
        return await summarize_episodes(greedy.run_one, engine, rows)
