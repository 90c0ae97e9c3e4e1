"""The :class:`Environment` contract: what a multi-turn agent talks to.

An environment turns the model's text into the next chat messages and a reward; it never sees
token ids. :class:`arealite.workflow.multi_turn.MultiTurnWorkflow` owns the tokens (token-in,
token-out: sampled ids and the tokenised new messages are appended, nothing is re-tokenised), so a
user plugs in a new task by writing only an environment, without touching the executor.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What :meth:`Environment.astep` returns.

    Attributes:
        messages: chat messages to show the model next (``[{"role": ..., "content": ...}]``;
            e.g. feedback or a tool's output); ignored when ``done``.
        reward: reward of the episode so far; the value returned with ``done=True`` (or at the
            turn limit) is the episode reward.
        done: the episode is over (solved, gave up, ...).
        info: free-form, e.g. ``{"tool_calls": 1}``; numbers are summed over the episode.
    """

    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """One episode's environment (a fresh instance per episode; methods are async so that
    rewards, tools and sandboxes never block the rollout event loop)."""

    @abc.abstractmethod
    async def areset(self, data: dict[str, Any]) -> list[dict[str, str]]:
        """Start an episode for dataset row ``data``; return the initial chat messages."""

    @abc.abstractmethod
    async def astep(self, completion: str) -> StepResult:
        """React to the model's latest turn (decoded text, special tokens skipped)."""

    async def aclose(self) -> None:
        """Release resources (called once per episode, also after errors)."""


# The task sections of the environments arealite ships (recipes/search_agent.py, recipes/service_agent.py).

@dataclass
class SearchTaskConfig:
    """The search agent's world (arealite/env/search.py): a seeded fictional encyclopedia, BM25 over it."""

    seed: int = 0  # the encyclopedia's facts (train and held-out questions are about different people)
    n_people: int = 300
    n_cities: int = 40
    kinds: tuple[str, ...] = ("city", "year", "profession", "country")  # question kinds ("country": two hops)
    k: int = 3  # passages per search
    call_format: str = "tags"  # "tags" (<search>q</search>, Search-R1) or "hermes" (<tool_call> JSON)
    format_reward: float = 0.0  # reward of a wrong answer in <answer> tags


@dataclass
class RetailTaskConfig:
    """The customer-service domain (arealite/env/retail.py): a store database, tools, a policy, a user."""

    db_seed: int = 0  # the store's database (users, orders, products); held-out tasks use db_seed + 1
    n_users: int = 20
    difficulty: str = "easy"  # "easy": the first message says it all; "hard": ask, confirm before writes
    intents: tuple[str, ...] = ("cancel", "return", "status")
    demos: bool = True  # worked episodes as earlier chat turns (a 135M model calls tools only after them)
    call_format: str = "tags"  # "tags" (<tool>args</tool>) or "hermes" (<tool_call> JSON)
    strict_policy: bool = False  # reward 0 after a policy violation (default: violations are counted)
    max_user_turns: int = 4  # the scripted user's replies before it stops
