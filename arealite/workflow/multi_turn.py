"""Multi-turn episodes against an :class:`~arealite.api.env.Environment`, token-in token-out.

One episode: the environment's first messages → chat template → the model answers → the
environment replies (feedback, tool output) → the model answers again … until the environment
says ``done`` or ``max_turns`` model turns were taken. The trajectory is built by *appending*:

    ids = template(first messages) + sampled_1 + segment(reply_1) + sampled_2 + …

where ``segment`` tokenises only the new messages' chat-template text (closing the assistant turn,
the new messages, the next generation prompt). Earlier text is never re-tokenised, so the ids the
trainer scores are exactly the ids the model was fed and sampled (no re-tokenisation drift).
Only sampled tokens have ``loss_mask = 1``, their server logprobs and versions; template and
environment tokens have ``loss_mask = 0``, logprob 0 and version -1.

Reward: the environment's final reward times ``turn_discount ** (turns - 1)`` (a correct answer
at the first try keeps its full reward, every extra turn costs a factor ``turn_discount``).

Every episode ends for one counted reason, ``info["ended_<reason>"] = 1`` (:data:`END_REASONS`):
``done`` (the environment said so), ``turn_limit``, ``context_limit`` (the next turn would not fit
``max_context_tokens``), ``time_limit`` (``max_episode_seconds`` of wall time: the turn in flight is
cancelled, reward 0), or the environment's own (``tool_timeout``, ``tool_failed`` of
:class:`~arealite.env.tools.ToolEnv`). An episode cut short keeps every token it has; the other
episodes of its group are untouched.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from arealite.api.cli import check_multi_turn
from arealite.api.config import GenerationConfig, MultiTurnConfig
from arealite.api.engine import InferenceEngine
from arealite.api.env import Environment, StepResult
from arealite.api.io_struct import ModelRequest
from arealite.api.workflow import RolloutWorkflow
from arealite.reward.math import math_reward
from arealite.reward.worker import RewardWorker
from arealite.utils.data import pad_and_stack
from arealite.utils.hf import tokenize_chat
from arealite.workflow.reward_owner import OwnsRewardWorker

END_REASONS = ("done", "turn_limit", "context_limit", "time_limit", "tool_timeout", "tool_failed")
_PROBE = [{"role": "user", "content": "\x00probe-user\x00"}, {"role": "assistant", "content": "\x00probe-reply\x00"}]


def chat_segment_ids(tokenizer, messages: list[dict[str, str]], last_token: int | None = None) -> list[int]:
    """Token ids to append after an assistant turn so that ``messages`` follow it, ending with
    the next assistant generation prompt.

    The segment is the chat template's text after an assistant message: the end of the assistant
    turn (e.g. ``<|im_end|>\\n``), then ``messages``, then the generation prompt; it is found by
    rendering a probe conversation with and without ``messages``. If the sampled turn already ends
    with the template's first closing token (the model emitted EOS ``<|im_end|>``), that token is
    not repeated.

    Args:
        tokenizer: HF tokenizer with a chat template.
        messages: new chat messages (``role``/``content``).
        last_token: the last sampled id of the previous turn (None: nothing was sampled).

    Returns: token ids (list of int), to be appended with ``loss_mask = 0``.

    Raises:
        ValueError: the chat template is not append-only (rendering more messages changes the
            text of earlier ones, e.g. templates that drop past reasoning); such templates need
            a workflow that keeps each turn as its own trajectory.
    """
    base = tokenizer.apply_chat_template(_PROBE, tokenize=False)
    full = tokenizer.apply_chat_template(_PROBE + list(messages), tokenize=False, add_generation_prompt=True)
    if not full.startswith(base):
        raise ValueError("the tokenizer's chat template is not append-only (adding a message changes the "
                         "rendering of earlier ones), so multi-turn token ids cannot be appended")
    close = base[base.rindex(_PROBE[1]["content"]) + len(_PROBE[1]["content"]):]  # e.g. "<|im_end|>\n"
    close_ids = tokenizer(close, add_special_tokens=False)["input_ids"] if close else []
    ids = tokenizer(close + full[len(base):], add_special_tokens=False)["input_ids"]
    if close_ids and last_token is not None and ids[:1] == [close_ids[0]] == [last_token]:
        ids = ids[1:]
    return list(ids)


@dataclass
class Episode:
    """Token-aligned record of one episode (lists of equal length T).

    ``requests`` keeps the ids fed to the model at each turn (each is a prefix of ``input_ids``).
    """

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    requests: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    no_eos: bool = False
    info: dict[str, float] = field(default_factory=dict)

    def append(self, ids: list[int], sampled: bool, logprobs=None, versions=None) -> None:
        n = len(ids)
        self.input_ids += ids
        self.loss_mask += [int(sampled)] * n
        self.logprobs += list(logprobs) if sampled else [0.0] * n
        self.versions += list(versions) if sampled else [-1] * n


def episodes_to_batch(episodes: list[Episode], info_keys: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Pad episodes into the token-aligned layout of :mod:`arealite.api.io_struct`.

    Returns: ``input_ids`` [N, T] int64, ``attention_mask`` [N, T] bool, ``loss_mask`` [N, T]
    int32, ``logprobs`` [N, T] float32, ``versions`` [N, T] int64 (padding -1), ``rewards`` [N]
    float32, ``no_eos`` [N] bool, ``turns`` [N] float32 (model turns per episode), and for each of
    ``info_keys`` its episode total [N] float32 (0 where an episode has none).
    """
    seqs = [e.input_ids for e in episodes]
    extra = {k: torch.tensor([float(e.info.get(k, 0.0)) for e in episodes], dtype=torch.float32) for k in info_keys}
    return {**extra,
        "input_ids": pad_and_stack(seqs, 0, torch.int64),
        "attention_mask": pad_and_stack([[1] * len(s) for s in seqs], 0, torch.bool),
        "loss_mask": pad_and_stack([e.loss_mask for e in episodes], 0, torch.int32),
        "logprobs": pad_and_stack([e.logprobs for e in episodes], 0.0, torch.float32),
        "versions": pad_and_stack([e.versions for e in episodes], -1, torch.int64),
        "rewards": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        "no_eos": torch.tensor([e.no_eos for e in episodes]),
        "turns": torch.tensor([float(e.turns) for e in episodes], dtype=torch.float32),
    }


_DUMP_LOCK = threading.Lock()  # episodes of several event loops append to one file


def rollouts_path(dump_dir: str | None) -> str | None:
    """``dump_dir/rollouts.jsonl`` (the folder is created), or None when ``dump_dir`` is unset."""
    if not dump_dir:
        return None
    os.makedirs(dump_dir, exist_ok=True)
    return os.path.join(dump_dir, "rollouts.jsonl")


def dump_episodes(path: str, data: dict[str, Any], episodes: list[Episode], start: float) -> None:
    """Append one JSON line for a group of episodes of row ``data`` to ``path``: ``prompt`` (the
    row's last message, None without ``messages``), ``answer``, and per episode ``turns``,
    ``rewards``, ``texts`` (each model turn's text), ``info``, ``versions`` (the weight versions
    its tokens came from), plus ``start_time`` / ``end_time`` [s since the epoch]."""
    messages = data.get("messages") or [{}]
    record = {
        "prompt": messages[-1].get("content"), "answer": data.get("answer"),
        "turns": [e.turns for e in episodes], "rewards": [e.reward for e in episodes],
        "texts": [e.texts for e in episodes], "info": [e.info for e in episodes],
        "versions": [sorted({v for v in e.versions if v >= 0}) for e in episodes],
        "start_time": start, "end_time": time.time(),
    }
    with _DUMP_LOCK, open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


class MultiTurnWorkflow(RolloutWorkflow):
    """``gconfig.n_samples`` concurrent multi-turn episodes per dataset row (a GRPO group).

    Args:
        env_factory: ``fn(data) -> Environment``, a fresh environment per episode.
        gconfig: sampling parameters of every turn (``max_new_tokens`` is per turn).
        tokenizer: HF tokenizer with an append-only chat template.
        max_turns: model turns per episode (≥ 1).
        turn_discount: reward factor per extra turn, in (0, 1].
        max_context_tokens: the episode stops before a turn whose prompt plus
            ``max_new_tokens`` would exceed this [tokens].
        truncate_fn: optional ``fn(tokenizer, sampled_ids) -> k``; only the first ``k`` sampled
            ids of a turn are kept (a stop string, e.g. the end of a code block).
        dump_dir: if set, each episode's text, reward and turns go to ``dump_dir/rollouts.jsonl``.
        info_keys: episode ``info`` totals returned as per-trajectory tensors and logged as
            ``rollout/<key>`` (e.g. ``("tool_calls", "ended_time_limit")``).
        max_episode_seconds: wall-time limit of one episode [s] (None: none).

    Raises:
        ValueError: a bad ``max_turns`` / ``turn_discount`` / ``max_context_tokens`` /
            ``max_episode_seconds`` (named).
    """

    stat_keys = ("turns",)  # logged as rollout/turns

    def __init__(self, env_factory: Callable[[dict[str, Any]], Environment], gconfig: GenerationConfig, tokenizer,
                 max_turns: int = 2, turn_discount: float = 0.9, max_context_tokens: int = 1024,
                 truncate_fn: Callable[[Any, list[int]], int] | None = None, dump_dir: str | None = None,
                 info_keys: tuple[str, ...] = (), max_episode_seconds: float | None = None):
        # the agent.* rules of validate_config (one copy, in arealite.api.cli)
        check_multi_turn(MultiTurnConfig(max_turns, turn_discount, max_context_tokens), gconfig.max_new_tokens)
        if max_episode_seconds is not None and not max_episode_seconds > 0:
            raise ValueError(f"max_episode_seconds must be > 0 (or None for no limit), got {max_episode_seconds}")
        self.info_keys, self.max_episode_seconds = tuple(info_keys), max_episode_seconds
        self.stat_keys = type(self).stat_keys + self.info_keys
        self.env_factory, self.gconfig, self.tokenizer = env_factory, gconfig, tokenizer
        self.max_turns, self.turn_discount, self.max_context_tokens = max_turns, turn_discount, max_context_tokens
        self.truncate_fn = truncate_fn
        self.dump_path = rollouts_path(dump_dir)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        start = time.time()
        rid = uuid.uuid4().hex  # one server for the whole group (prefix reuse)
        episodes = await asyncio.gather(*[self.run_one(engine, data, rid) for _ in range(self.gconfig.n_samples)])
        if self.dump_path:
            dump_episodes(self.dump_path, data, episodes, start)
        return episodes_to_batch(list(episodes), self.info_keys)

    async def run_one(self, engine: InferenceEngine, data: dict[str, Any], rid: str | None = None) -> Episode:
        """One episode (one trajectory); see the module docstring."""
        env = self.env_factory(data)
        ep = Episode()
        gconfig = replace(self.gconfig, n_samples=1)
        rid = rid or uuid.uuid4().hex  # every turn on the same server (prefix reuse)
        deadline = None if self.max_episode_seconds is None else time.monotonic() + self.max_episode_seconds

        async def bounded(coro):  # the rest of the episode's wall time (asyncio.TimeoutError past it)
            if deadline is None:
                return await coro
            return await asyncio.wait_for(coro, max(deadline - time.monotonic(), 0.0))

        ended = "turn_limit"
        try:
            ep.append(tokenize_chat(self.tokenizer, await env.areset(data)), sampled=False)
            step = StepResult()
            for turn in range(self.max_turns):
                if len(ep.input_ids) + gconfig.max_new_tokens > self.max_context_tokens:
                    ended = "context_limit"
                    break
                ep.requests.append(list(ep.input_ids))
                try:
                    resp = await bounded(engine.agenerate(ModelRequest(input_ids=list(ep.input_ids), gconfig=gconfig,
                                                                       rid=rid)))
                except asyncio.TimeoutError:
                    ep.requests.pop()
                    ended, step = "time_limit", StepResult()
                    break
                out = resp.output_tokens
                keep = len(out) if self.truncate_fn is None else self.truncate_fn(self.tokenizer, out)
                ep.append(out[:keep], True, resp.output_logprobs[:keep], resp.output_versions[:keep])
                ep.no_eos = resp.stop_reason == "length" and keep == len(out)
                ep.turns += 1
                text = self.tokenizer.decode(out[:keep], skip_special_tokens=True)
                ep.texts.append(text)
                try:
                    step = await bounded(env.astep(text))
                except asyncio.TimeoutError:
                    ended, step = "time_limit", StepResult()
                    break
                for k, v in step.info.items():
                    ep.info[k] = ep.info.get(k, 0.0) + float(v)
                if step.done:
                    ended = "done"
                    break
                if turn == self.max_turns - 1:
                    break
                ep.append(chat_segment_ids(self.tokenizer, step.messages, out[keep - 1] if keep else None), False)
            ep.reward = step.reward * self.turn_discount ** max(ep.turns - 1, 0)
            if not any(k.startswith("ended_") for k in ep.info):  # the environment may name its own reason
                ep.info[f"ended_{ended}"] = 1.0
        finally:
            await env.aclose()
        return ep

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> dict[str, float]:
        """One greedy episode per row (through ``engine``, e.g. inside a recipe, from a fresh
        event loop). Returns ``{"reward": mean discounted reward, "solved": fraction with reward
        > 0, "turns": mean model turns}`` plus the mean of each of ``info_keys`` per episode."""
        greedy = copy.copy(self)
        greedy.gconfig = replace(self.gconfig, greedy=True, n_samples=1)
        return await summarize_episodes(greedy.run_one, engine, rows, self.info_keys)



class MathFeedbackEnv(Environment):
    """Math with retries: a correct final answer ends the episode with reward 1; a wrong one
    gets ``feedback`` as a user message and another try (up to the workflow's ``max_turns``).

    Args:
        reward_worker: runs ``math_reward`` in a process with a timeout (shared by episodes).
        feedback: the user message after a wrong answer.

    Dataset rows need ``messages`` and ``answer`` (as in :mod:`arealite.dataset.math_data`).
    """

    FEEDBACK = "Your answer is wrong. Check your work and give the final answer again."

    def __init__(self, reward_worker: RewardWorker, feedback: str = FEEDBACK):
        self.reward_worker, self.feedback = reward_worker, feedback

    async def areset(self, data: dict[str, Any]) -> list[dict[str, str]]:
        for key in ("messages", "answer"):
            if key not in data:
                raise KeyError(f"dataset row has no {key!r} field; rows need 'messages' and 'answer'")
        self.answer = data["answer"]
        return list(data["messages"])

    async def astep(self, completion: str) -> StepResult:
        reward = await self.reward_worker.acompute(math_reward, completion, self.answer)
        if reward > 0:
            return StepResult(reward=reward, done=True)
        return StepResult(messages=[{"role": "user", "content": self.feedback}], reward=0.0)


class MultiTurnMathWorkflow(OwnsRewardWorker, MultiTurnWorkflow):
    """:class:`MultiTurnWorkflow` on :class:`MathFeedbackEnv` (recipes/multi_turn_math.py).

    Owns ``reward_worker`` (:meth:`close` kills it, like :class:`~arealite.workflow.rlvr.RLVRWorkflow`).
    """

    def __init__(self, gconfig: GenerationConfig, tokenizer, max_turns: int = 2, turn_discount: float = 0.9,
                 max_context_tokens: int = 1024, reward_timeout: float = 10.0, dump_dir: str | None = None):
        super().__init__(lambda data: MathFeedbackEnv(self.reward_worker), gconfig, tokenizer, max_turns,
                         turn_discount, max_context_tokens, dump_dir=dump_dir)
        self.reward_worker = RewardWorker(timeout=reward_timeout)
        self.reward_fn = math_reward  # what the worker runs (OwnsRewardWorker.start imports it early)


async def summarize_episodes(run_one: Callable, engine: InferenceEngine, rows: list[dict[str, Any]],
                             info_keys: tuple[str, ...] = ()) -> dict[str, float]:
    """Run ``run_one(engine, row)`` (→ :class:`Episode`) for every row concurrently and
    summarise: ``{"reward": mean reward, "solved": fraction with reward > 0, "turns": mean
    model turns}`` and the per-episode mean of each of ``info_keys`` (e.g. ``tool_calls``). Closes the engine's per-event-loop HTTP session afterwards (call it from a
    fresh event loop, e.g. ``asyncio.run`` in a recipe)."""
    try:
        eps = await asyncio.gather(*[run_one(engine, r) for r in rows])
    finally:
        aclose = getattr(engine, "aclose", None)  # an HTTP session is bound to this event loop
        if aclose is not None:
            await aclose()
    n = max(1, len(eps))
    return {"reward": sum(e.reward for e in eps) / n, "solved": sum(e.reward > 0 for e in eps) / n,
            "turns": sum(e.turns for e in eps) / n, **{k: sum(e.info.get(k, 0.0) for e in eps) / n for k in info_keys}}
