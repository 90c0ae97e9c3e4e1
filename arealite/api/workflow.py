"""The unit a user writes for a new task or agent: :class:`RolloutWorkflow`."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from arealite.api.engine import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """Turns one dataset row into trajectories by calling ``engine.agenerate`` (any number of
    times, concurrently or in turns) and scoring the result.

    Subclass it and implement :meth:`arun_episode`; the executor runs many episodes
    concurrently on its asyncio loop, so never block the loop (use ``await``).

    Everything the RL loop (:mod:`arealite.trainer.rl_loop`) calls is declared here, with a
    default where one makes sense:

    * ``stat_keys``: names of extra per-trajectory float tensors [N] in the returned dict whose
      batch mean the loop logs as ``rollout/<key>`` (e.g. ``turns``);
    * :meth:`aevaluate`: the held-out evaluation (start, end, in-loop);
    * :meth:`counters` / :meth:`reward_counters`: cumulative counts the loop sums over ranks and
      logs each step as ``workflow/<name>`` / as they are (``reward/<name>``);
    * :meth:`start` / :meth:`close`: called once before the models load and once at the end.
    """

    stat_keys: tuple[str, ...] = ()

    def start(self) -> None:
        """Called once by the loop before the models load, e.g. to start a reward process so that
        its start-up overlaps model loading. The default does nothing."""

    def close(self) -> None:
        """Release what the workflow owns (reward processes, sandboxes); called once at the end of
        a run. The default does nothing."""

    async def aclose(self) -> None:
        """Close what is bound to the running event loop (e.g. a reward source's HTTP sessions);
        the rollout executor calls it when its loop ends. The default does nothing."""

    def reward_counters(self) -> dict[str, float]:
        """Cumulative counters of the reward computation, named ``reward/<name>`` (``calls``,
        ``timeout``, ``crash``, ``memory``, ``non_finite``, ...), the same keys on every rank;
        ``{}`` by default."""
        return {}

    async def aevaluate(self, engine: "InferenceEngine", rows: list[dict[str, Any]]) -> dict[str, float]:
        """Greedy held-out evaluation of ``rows``: ``{metric: value}`` (e.g. ``accuracy``).

        Raises:
            NotImplementedError: by default; a workflow evaluated by the loop overrides it (or the
                run sets ``evaluator.at_start/at_end false`` and ``evaluator.freq_steps 0``).
        """
        raise NotImplementedError(f"{type(self).__name__}.aevaluate is not implemented: implement it, or pass "
                                  "--evaluator.at_start False --evaluator.at_end False --evaluator.freq_steps 0")

    def counters(self) -> dict[str, float]:
        """Cumulative counts since the workflow was built (``{}`` by default); the same keys on
        every rank (the loop sums them with a collective)."""
        return {}

    @abc.abstractmethod
    async def arun_episode(
        self, engine: "InferenceEngine", data: dict[str, Any]
    ) -> dict[str, torch.Tensor] | None:
        """Run one episode.

        Returns: a dict of padded tensors with leading dim N (trajectories of this episode, e.g.
        the GRPO group): ``input_ids`` [N, T] int64, ``attention_mask`` [N, T] bool,
        ``loss_mask`` [N, T] int32, ``logprobs`` [N, T] float32, ``versions`` [N, T] int64,
        ``rewards`` [N] float32 (token-aligned layout, see :mod:`arealite.api.io_struct`);
        or ``None`` to reject the episode. An exception is logged and counted by the executor,
        which goes on with other episodes.
        """
