"""Simulated customers for the retail domain (:mod:`arealite.env.retail`), τ-bench's user side
(Yao et al. 2024, arXiv 2406.12045): one interface, a deterministic scripted customer for tests and
cheap training, and a customer played by any :class:`~arealite.api.engine.InferenceEngine`."""

from __future__ import annotations

import abc
import re
import uuid
from dataclasses import replace
from typing import Any

from arealite.api.config import GenerationConfig
from arealite.api.io_struct import ModelRequest
from arealite.utils.hf import tokenize_chat

STOP = "###STOP###"  # the simulated user's "I am done" (τ-bench)


class UserSimulator(abc.ABC):
    """The simulated customer of one episode (τ-bench's user): it opens the conversation and
    replies to each agent message; a reply containing :data:`STOP` means it is done."""

    @abc.abstractmethod
    async def areset(self, task: dict[str, Any]) -> str:
        """Start a conversation for ``task`` (a row of :func:`make_retail_tasks`); return the first message."""

    @abc.abstractmethod
    async def areply(self, agent_message: str) -> str:
        """The customer's reply to ``agent_message`` (:data:`STOP` when done)."""


_DONE_RE = re.compile(r"\b(done|completed|successful(ly)?|all set|has been (cancell?ed|canceled|returned|requested)|"
                      r"is (now )?(cancell?ed|canceled)|return (has been |is )?(requested|initiated|submitted))\b", re.I)
_CONFIRM_RE = re.compile(r"confirm|yes or no|proceed\?|shall i|should i|do you want me to|would you like me to", re.I)
_ASK_EMAIL_RE = re.compile(r"e-?mail", re.I)
_ASK_ORDER_RE = re.compile(r"order (id|number)|which order|order's id", re.I)
_ASK_REASON_RE = re.compile(r"reason|\bwhy\b", re.I)


class ScriptedUser(UserSimulator):
    """A deterministic customer that answers from the task by keywords of the agent's message.

    Rules, in order: the agent says the request is done ("done", "has been cancelled",
    "successfully", ...; for a "status" task also any message containing the status) → :data:`STOP`;
    the agent asks to confirm ("confirm", "yes or no", "proceed?", "shall I" ...) → "yes"; the agent
    asks for the email / the order id / the reason → the asked ones, in one reply; anything else →
    the task's first message again (a fixed re-statement). After ``max_user_turns`` replies the next
    one is :data:`STOP`.

    Args:
        max_user_turns: replies before the customer gives up.
    """

    def __init__(self, max_user_turns: int = 6):
        self.max_user_turns = max_user_turns
        self.task: dict[str, Any] = {}
        self.replies = 0

    async def areset(self, task: dict[str, Any]) -> str:
        self.task, self.replies = task, 0
        return task["first_message"]

    async def areply(self, agent_message: str) -> str:
        self.replies += 1
        if self.replies > self.max_user_turns:
            return STOP
        t, text = self.task, agent_message
        if _DONE_RE.search(text) or any(o.lower() in text.lower() for o in t["outputs"]):
            return STOP
        if _CONFIRM_RE.search(text):
            return "yes"
        answers = []
        if _ASK_EMAIL_RE.search(text):
            answers.append(f"My email is {t['email']}.")
        if _ASK_ORDER_RE.search(text):
            answers.append(f"The order id is {t['order_id']}.")
        if t["reason"] and _ASK_REASON_RE.search(text):
            answers.append(f"The reason is: {t['reason']}.")
        return " ".join(answers) if answers else t["first_message"]


USER_SYSTEM_PROMPT = (
    "You are a customer talking to the customer service agent of an online store. Your goal: {instruction}\n"
    "Write only the customer's next message, short, one message at a time. Never invent information "
    "that is not in your goal: if asked for something you do not know, say you do not know. "
    "When your goal is met, reply with only " + STOP + ".")
AGENT_GREETING = "Hi! How can I help you today?"  # τ-bench's opening, from which the user's first message comes


class LLMUser(UserSimulator):
    """A customer played by a language model through any :class:`~arealite.api.engine.InferenceEngine`
    (τ-bench's LLM user).

    Its prompt: :data:`USER_SYSTEM_PROMPT` with the task's ``instruction``, then the conversation with
    the roles flipped (the agent's messages are "user" turns, its own replies "assistant"), rendered
    by the tokenizer's chat template (:func:`~arealite.utils.hf.tokenize_chat`); one
    ``engine.agenerate`` per message, decoded with special tokens skipped. Its tokens never enter
    the policy's trajectory (the environment passes only text).

    Args:
        engine: generates the customer's messages (may be the policy's engine, or a frozen one).
        tokenizer: HF tokenizer with a chat template (the simulator model's).
        gconfig: its sampling parameters (``n_samples`` is ignored).
        first_message_from_task: open with the task's scripted ``first_message`` instead of
            generating a reply to :data:`AGENT_GREETING`.
        system_prompt: a template with ``{instruction}``.
    """

    def __init__(self, engine, tokenizer, gconfig: GenerationConfig, first_message_from_task: bool = False,
                 system_prompt: str = USER_SYSTEM_PROMPT):
        self.engine, self.tokenizer = engine, tokenizer
        self.gconfig = replace(gconfig, n_samples=1)
        self.first_message_from_task, self.system_prompt = first_message_from_task, system_prompt
        self.rid = uuid.uuid4().hex
        self.messages: list[dict[str, str]] = []

    async def _generate(self) -> str:
        ids = tokenize_chat(self.tokenizer, self.messages)
        resp = await self.engine.agenerate(ModelRequest(input_ids=ids, gconfig=self.gconfig, rid=self.rid))
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True).strip()
        self.messages.append({"role": "assistant", "content": text})
        return text

    async def areset(self, task: dict[str, Any]) -> str:
        self.messages = [{"role": "system", "content": self.system_prompt.format(instruction=task["instruction"])}]
        if self.first_message_from_task:
            self.messages += [{"role": "user", "content": AGENT_GREETING},
                              {"role": "assistant", "content": task["first_message"]}]
            return task["first_message"]
        self.messages.append({"role": "user", "content": AGENT_GREETING})
        return await self._generate()

    async def areply(self, agent_message: str) -> str:
        self.messages.append({"role": "user", "content": agent_message})
        return await self._generate()
