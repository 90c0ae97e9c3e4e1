"""Online preference pairs: sample several answers per prompt from the current policy, rank them
with a verifiable reward, and keep one (correct, incorrect) pair for DPO.

One episode = :class:`RLVRWorkflow`'s episode (``gconfig.n_samples`` completions, rewards in a
worker process, per-token versions) reduced to 2 rows: row 0 the first sample with the highest
reward (chosen), row 1 the first with the lowest (rejected). When all rewards are equal there is
no preference and the episode returns ``None``; the executor then counts it as rejected and keeps
sampling, so every training batch holds ``consumer_batch_size`` pairs. The rows keep
``versions``, so the executor's staleness rules (admission bound and the drop of samples older
than ``v − η``) apply to pairs exactly as to GRPO groups.
"""

from __future__ import annotations

from typing import Any

import torch

from arealite.api.cli import check_algorithm
from arealite.api.config import DPOAlgoConfig
from arealite.api.engine import InferenceEngine
from arealite.utils.data import trim_padding
from arealite.workflow.rlvr import RLVRWorkflow


def pick_pair(rewards: torch.Tensor) -> tuple[int, int] | None:
    """(chosen, rejected) row indices: the first argmax and first argmin of ``rewards`` [N];
    None when max == min (no preference)."""
    hi, lo = int(torch.argmax(rewards)), int(torch.argmin(rewards))
    return None if rewards[hi] <= rewards[lo] else (hi, lo)


class PreferenceWorkflow(RLVRWorkflow):
    """:class:`RLVRWorkflow` whose episode is one (chosen, rejected) pair (same constructor;
    ``gconfig.n_samples`` ≥ 2 answers are sampled per prompt).

    Raises:
        ValueError: ``gconfig.n_samples`` < 2 (at construction).
    """

    stat_keys = ("chosen_reward",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_algorithm(DPOAlgoConfig(), group_size=self.gconfig.n_samples)  # n_samples >= 2, as validate_config

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        traj = await super().arun_episode(engine, data)
        if traj is None:  # a sample without a score (a learned reward failed)
            return None
        pair = pick_pair(traj["rewards"])
        if pair is None:
            return None
        idx = torch.tensor(pair)
        out = trim_padding({k: v[idx] for k, v in traj.items()})
        out["chosen_reward"] = out["rewards"][:1].expand(2).clone()  # [2]: logged as rollout/chosen_reward
        return out
