"""Abstract engines: the trainer side (:class:`TrainEngine`) and the rollout side
(:class:`InferenceEngine`). Contracts only: no HTTP and no torch.distributed calls here.

Batches passed to a train engine are dicts of padded tensors in the token-aligned layout of
:mod:`arealite.api.io_struct`: every value has leading shape [B] or [B, T], and
``attention_mask`` [B, T] (bool or 0/1) marks real tokens (right padding).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable

import torch

from arealite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta

if TYPE_CHECKING:
    from arealite.api.workflow import RolloutWorkflow

Batch = dict[str, torch.Tensor]


class TrainEngine(abc.ABC):
    """A trainable (or frozen) causal LM, data-parallel over the ranks of torch.distributed."""

    @abc.abstractmethod
    def train_batch(
        self,
        batch: Batch,
        loss_fn: Callable[[torch.Tensor, Batch], torch.Tensor],
        loss_weight_fn: Callable[[Batch], float],
    ) -> dict[str, float]:
        """One optimizer step on ``batch`` (this rank's share of the global batch).

        The batch is split into micro-batches; for each micro-batch ``mb`` the engine computes
        token-aligned ``logprobs`` [b, T] (float32, under the generation temperature) and calls
        ``loss_fn(logprobs, mb)``, which must return the *mean* loss over its own weight
        ``loss_weight_fn(mb)`` (e.g. the number of loss tokens). The engine combines them as
        ``Σ_mb loss_mb · w_mb / Σ_global w`` (global = all micro-batches of all ranks), so the
        result equals the loss of the whole global batch however it is split.

        Returns: stats with at least ``loss``, ``grad_norm``, ``lr``.
        """

    @abc.abstractmethod
    def forward(self, batch: Batch) -> torch.Tensor:
        """Token-aligned log-probabilities [B, T] float32 of ``batch["input_ids"]`` (no grad);
        index 0 and padding are 0."""

    @abc.abstractmethod
    def save(self, path: str) -> None:
        """Save an HF folder (config, safetensors weights, tokenizer) that
        ``AutoModelForCausalLM.from_pretrained(path)`` loads. Collective over all ranks."""

    @abc.abstractmethod
    def upload_weights(self, meta: WeightUpdateMeta) -> None:
        """Write the current weights where ``meta`` says, for the inference servers to load.
        Collective over all ranks."""

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return getattr(self, "_version", 0)


class InferenceEngine(abc.ABC):
    """Generation behind one interface, plus the asynchronous rollout executor around it."""

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion. Interrupted segments (weight updates) are resumed
        transparently; each output token carries the version that produced it.

        Raises:
            TimeoutError / RuntimeError: no server answered within the configured bound.
        """

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Make every server load the weights described by ``meta`` and report its version."""

    @abc.abstractmethod
    def pause_generation(self) -> None:
        """Ask every server to interrupt in-flight generation (partial outputs are kept)."""

    @abc.abstractmethod
    def continue_generation(self) -> None:
        """Let servers generate again."""

    # The executor API (implemented by delegating to arealite.rollout.executor.WorkflowExecutor).
    @abc.abstractmethod
    def submit(self, data: dict[str, Any], workflow: "RolloutWorkflow") -> None: ...

    @abc.abstractmethod
    def wait(self, count: int, timeout: float | None = None) -> Batch: ...

    @abc.abstractmethod
    def rollout_batch(self, data: list[dict[str, Any]], workflow: "RolloutWorkflow") -> Batch: ...

    @abc.abstractmethod
    def prepare_batch(self, dataloader: Any, workflow: "RolloutWorkflow") -> Batch: ...

    @abc.abstractmethod
    def pause(self) -> None: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    @abc.abstractmethod
    def get_version(self) -> int: ...
