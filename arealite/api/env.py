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
