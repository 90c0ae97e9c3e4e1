"""On-policy distillation: the student samples, a frozen teacher scores every sampled token, and
the per-token reverse KL is the (negated) reward — trained with GRPO's decoupled clipped
surrogate, so the loop's asynchrony and staleness rules apply unchanged.

Per generated token t of a student sample y ~ π_behav (the student weights that sampled it)::

    A_t = log π_teacher(y_t | x, y_<t) − log π_behav(y_t | x, y_<t)      # −(per-token reverse KL)
    ℓ_t = GRPO's ℓ_t with A_t in place of the group-normalised A_i      # grpo.py, decoupled PPO

E_{y~π}[Σ_t (log π − log π_teacher)] is the sequence-level reverse KL(π ‖ π_teacher); its policy
gradient with a per-token, undiscounted reward is the on-policy distillation of Agarwal et al.
2024 (GKD, arXiv 2306.13649, λ = 1 with reverse KL) and Gu et al. 2024 (MiniLLM, arXiv
2306.08543), in the per-token, discount-0 form of Thinking Machines' "On-Policy Distillation"
(Lu et al. 2025). Both logprobs use the sampling temperature (the server's and the teacher's
``log_softmax(logits / T)``), and ``teacher_logprobs`` [B, T] float32 is token-aligned like
``logprobs`` (0 off the generated tokens), filled by :class:`arealite.workflow.distill.DistillWorkflow`.
The reward a verifier gives (``rewards``) is only logged. Not implemented: the generalised JSD of
GKD (needs both full distributions per token, not just the sampled token's logprob).
"""

from __future__ import annotations

import torch

from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO
from arealite.api.engine import Batch


def reverse_kl_advantages(teacher_logprobs: torch.Tensor, logprobs: torch.Tensor,
                          loss_mask: torch.Tensor) -> torch.Tensor:
    """A_t = log π_teacher − log π_behav on generated tokens, 0 elsewhere: [B, T] float32 from
    token-aligned ``teacher_logprobs``, ``logprobs`` [B, T] float32 and ``loss_mask`` [B, T] 0/1."""
    keep = loss_mask > 0
    diff = teacher_logprobs.float() - logprobs.float()
    return torch.where(keep, diff, torch.zeros_like(diff))


class OnPolicyDistillation(GRPO):
    """GRPO's update with the teacher's per-token signal as the advantage (module doc).

    Batch: GRPO's layout plus ``teacher_logprobs`` [B, T]. ``algo.*`` as GRPO (clip, correction,
    ``loss_agg_mode``, KL to a reference); the group statistics of the reward are not used.

    Raises (from :meth:`prepare`): KeyError: the batch has no ``teacher_logprobs`` (the workflow
    is not :class:`~arealite.workflow.distill.DistillWorkflow`).
    """

    def compute_advantages(self, batch: Batch, rewards: torch.Tensor) -> torch.Tensor:
        if "teacher_logprobs" not in batch:
            raise KeyError("on-policy distillation needs batch['teacher_logprobs']; roll out with "
                           "arealite.workflow.distill.DistillWorkflow")
        return reverse_kl_advantages(batch["teacher_logprobs"], batch["logprobs"], batch["loss_mask"])

    def update(self, batch: Batch) -> dict[str, float]:
        """GRPO's update, plus ``actor/reverse_kl``: the mean over generated tokens of
        log π_behav − log π_teacher (the per-token reverse-KL estimate of the sampled batch)."""
        stats = super().update(batch)
        mask = batch["loss_mask"]
        stats["actor/reverse_kl"] = float(F.masked_mean(batch["logprobs"].float() - batch["teacher_logprobs"].float(), mask))
        return stats
