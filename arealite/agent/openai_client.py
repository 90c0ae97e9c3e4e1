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
one trajectory whose ids are exactly the sampled ones. Otherwise (edited history, new tools, or a
chat template that is not append-only, e.g. Qwen3's, which drops the reasoning of earlier
assistant turns) the messages are tokenised afresh; the call still extends the record whose
prompt + sampled ids are a prefix of the fresh ids, and starts a new **segment** (a chain of its
own, never an error) when none is. :meth:`ArealOpenAI.export_episode` trains on the segment of
the last call; :meth:`ArealOpenAI.export_episodes` gives every segment as its own sample.

A call that is cancelled (the caller's timeout, a client that gave up) records nothing, so a
retry of the same messages extends the trajectory as if it were the only call.

Only the subset of the API that agents use for chat is implemented (``messages``, ``tools``,
``tool_choice`` auto/none, ``max_tokens`` / ``max_completion_tokens``); sampling fields follow
:mod:`arealite.agent.sampling` (refused unless neutral: ``temperature`` must be the trainer's,
``top_p`` 1, ``n`` 1, ...; others ignored and reported). The returned objects mirror
``openai.types.chat.ChatCompletion`` attribute names (``choices[0].message.content``,
``.tool_calls``, ``.finish_reason``, ``usage``) without depending on the ``openai`` package.

Tool calls are parsed from Hermes/Qwen-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
text (:func:`parse_tool_calls`). ``function.arguments`` is always a JSON string that decodes, once,
to an object, as in OpenAI's API: arguments written as an object are serialised; arguments written
as a string holding a JSON object are decoded once (never double-encoded); absent, null or blank
arguments are ``"{}"``. A block whose arguments are anything else (a list, a number, a string that
is not a JSON object), whose JSON is malformed or whose ``name`` is not a non-empty string is not a
tool call: its text stays in ``content`` only, and a reply without a valid call finishes with
``"stop"``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

import torch

from arealite.api.config import GenerationConfig
from arealite.api.engine import InferenceEngine
from arealite.api.io_struct import ModelRequest
from arealite.api.workflow import RolloutWorkflow
from arealite.agent.sampling import SamplingError, check_sampling
from arealite.env.tools import parse_tool_calls  # one parser for environments and the proxy
from arealite.workflow.multi_turn import (Episode, chat_segment_ids, dump_episodes, episodes_to_batch, rollouts_path,
                                         summarize_episodes)

logger = logging.getLogger("arealite.agent")



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
                try:
                    seg = chat_segment_ids(self.tokenizer, messages[k + 1:],
                                           rec.output_ids[-1] if rec.output_ids else None)
                except ValueError:  # the template is not append-only: render afresh, below
                    break
                return rec.prompt_ids + rec.output_ids + seg, rec.id
        kwargs = {"tools": tools} if tools else {}
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        ids = list(out)
        return ids, self._token_parent(ids)

    def _token_parent(self, ids: list[int]) -> str | None:
        """The latest record whose prompt + sampled ids are a proper prefix of ``ids`` (the fresh
        prompt extends its trajectory token for token), or None: a new segment."""
        for rec in reversed(self.records):
            p, n = len(rec.prompt_ids), len(rec.prompt_ids) + len(rec.output_ids)
            if n < len(ids) and ids[:p] == rec.prompt_ids and ids[p:n] == rec.output_ids:
                return rec.id
        return None

    async def create(self, messages: list[Any], tools: list[dict] | None = None, max_tokens: int | None = None,
                     max_completion_tokens: int | None = None, tool_choice: Any = None,
                     model: str | None = None, **params: Any) -> ChatCompletion:
        """Generate one assistant reply to ``messages`` (see the module docstring).

        ``tool_choice`` "none" generates without tools ("auto" or None: with them); sampling fields in ``params`` follow
        :func:`arealite.agent.sampling.check_sampling` (others are ignored, logged at debug).

        Raises:
            SamplingError: a ``ValueError`` naming a refused field (``temperature`` different
                from ``gconfig.temperature``, ``top_p < 1``, ``n != 1``, a penalty, ...): recorded
                logprobs under it would not be the ones the trainer recomputes; or a forced
                ``tool_choice``.
        """
        ignored = check_sampling(params, self.gconfig)
        if ignored:
            logger.debug("ArealOpenAI.create ignores %s", ignored)
        if tool_choice not in (None, "auto", "none"):
            raise SamplingError("tool_choice", f"'tool_choice'={tool_choice!r}: only 'auto' and 'none' are "
                                "supported (a forced call is not sampled freely); parse the reply instead")
        if tool_choice == "none":
            tools = None
        msgs = [_as_dict(m) for m in messages]
        prompt_ids, parent = self._prompt_ids(msgs, tools)
        budget = max_completion_tokens or max_tokens or self.gconfig.max_new_tokens
        gconfig = replace(self.gconfig, n_samples=1, max_new_tokens=budget)
        # cancelled here (a caller's timeout): nothing is recorded, a retry is the only call
        resp = await self.engine.agenerate(ModelRequest(input_ids=prompt_ids, gconfig=gconfig, rid=self.rid))
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        rec = CompletionRecord(id=f"chatcmpl-{uuid.uuid4().hex}", messages=msgs, tools=tools, prompt_ids=prompt_ids,
                               output_ids=list(resp.output_tokens), output_logprobs=list(resp.output_logprobs),
                               output_versions=list(resp.output_versions), text=text, stop_reason=resp.stop_reason,
                               parent=parent)
        self.records.append(rec)
        tool_calls = parse_tool_calls(text) if tools else None
        finish = "tool_calls" if tool_calls else ("length" if resp.stop_reason == "length" else "stop")
        return ChatCompletion(
            id=rec.id, created=int(time.time()), model=self.model,
            choices=[Choice(0, ChatCompletionMessage("assistant", text, tool_calls), finish)],
            usage=CompletionUsage(len(prompt_ids), resp.output_len, len(prompt_ids) + resp.output_len))

    def discard(self, record_id: str) -> bool:
        """Forget the call ``record_id`` (an orphan: its caller never received the reply) unless a
        later call extends it. Returns whether it was removed."""
        if any(r.parent == record_id for r in self.records):
            return False
        before = len(self.records)
        self.records = [r for r in self.records if r.id != record_id]
        return len(self.records) < before

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
        user/tool message ids have 0, 0.0 and -1. Calls outside that chain (a history the agent
        rewrote, the earlier segments of a template that rewrites past turns) are not included; a
        warning says how many (:meth:`export_episodes` gives them all).

        Raises:
            RuntimeError: the client made no call.
        """
        if not self.records:
            raise RuntimeError("ArealOpenAI.export_episode: the agent made no chat.completions.create call")
        chains = self.chains()
        if len(chains) > 1:
            logger.warning("export_episode: %d of %d calls are in other chains and are not trained on",
                           len(self.records) - len(chains[-1]), len(self.records))
        return _chain_episode(chains[-1], reward)

    def export_episodes(self, reward: float) -> list[Episode]:
        """Every chain (trajectory segment) as its own :class:`Episode`, each with ``reward``, in
        the order of :meth:`chains`: one sample per segment, for workflows that train each segment
        (one row per session, e.g. a GRPO group, uses :meth:`export_episode`).

        Raises:
            RuntimeError: the client made no call.
        """
        if not self.records:
            raise RuntimeError("ArealOpenAI.export_episodes: the agent made no chat.completions.create call")
        return [_chain_episode(chain, reward) for chain in self.chains()]


def _chain_episode(chain: list[CompletionRecord], reward: float) -> Episode:
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
