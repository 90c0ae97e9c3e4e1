"""Abstract engines: the trainer side (:class:`TrainEngine`) and the rollout side
(:class:`InferenceEngine`). Contracts only: no HTTP and no torch.distributed calls here.

Batches passed to a train engine are dicts of padded tensors in the token-aligned layout of
:mod:`arealite.api.io_struct`: every value has leading shape [B] or [B, T], and
``attention_mask`` [B, T] (bool or 0/1) marks real tokens (right padding).
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import torch

from arealite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta

Batch = dict[str, torch.Tensor]


class TrainEngine(abc.ABC):
    """A trainable (or frozen) causal LM, data-parallel over the ranks of torch.distributed."""

    @abc.abstractmethod
    def train_batch(
        self,
        batch: Batch,
        loss_fn: Callable[[torch.Tensor, Batch], torch.Tensor],
        loss_weight_fn: Callable[[Batch], float],
        skipped_weight: float = 0.0,
    ) -> dict[str, float]:
        """One optimizer step on ``batch`` (this rank's share of the global batch).

        The batch is split into micro-batches; for each micro-batch ``mb`` the engine computes
        token-aligned ``logprobs`` [b, T] (float32, under the generation temperature) and calls
        ``loss_fn(logprobs, mb)``, which must return the *mean* loss over its own weight
        ``loss_weight_fn(mb)`` (e.g. the number of loss tokens). The engine combines them as
        ``Σ_mb loss_mb · w_mb / Σ_global w`` (global = all micro-batches of all ranks), so the
        result equals the loss of the whole global batch however it is split.

        ``skipped_weight``: the loss weight of rows of this rank's share that the caller left
        out of ``batch`` because their loss is exactly 0 with a 0 gradient (GRPO's rows whose
        advantages are all 0). It joins ``Σ_global w``, so the step equals the step on the
        whole share, with the same optimizer step and schedule, without their forward and
        backward passes.

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

    # Per-rank non-tensor state for recover checkpoints (arealite.utils.recover). The tensors
    # (``model`` parameters, ``optimizer`` state) are saved through DCP from these attributes.
    model: Any  # the torch.nn.Module being trained (possibly FSDP-sharded)
    optimizer: Any  # torch.optim.Optimizer, or None for a frozen engine

    def extra_state(self) -> dict[str, Any]:
        """Per-rank state beyond parameters and optimizer tensors (e.g. the LR schedule),
        picklable; the default has none."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""


class InferenceEngine(abc.ABC):
    """Generation behind one interface: what a new inference backend implements.

    Abstract (a backend must implement them): :meth:`agenerate`, :meth:`pause_generation`,
    :meth:`continue_generation`, :meth:`update_weights`. Everything else has a default here:
    :meth:`weight_update_meta` (where the trainer pushes new weights: an HF folder by default)
    and :meth:`exclude_servers` (a distributed push named failed servers; nothing by default).
    The rollout executor (:class:`arealite.rollout.executor.WorkflowExecutor`) runs workflows
    against any implementation, and the RL loop (:func:`arealite.trainer.rl_loop.run_rl`, its
    ``inference_engine`` argument) trains with any implementation; the weight-update coordinator
    (:func:`arealite.trainer.weight_update.sync_weights`) calls only the methods declared here.

    The weight version lives here, once per trainer rank: :meth:`get_version` is the number of
    weight updates the servers have completed (set by the coordinator on every rank after each
    update). The executor's staleness rule reads it; tokens are tagged with the version the
    server reports per response, or with this one when a backend reports none.
    """

    _version: int = 0

    def initialize(self) -> None:
        """Wait for the servers (the default: nothing to wait for)."""

    def destroy(self) -> None:
        """Release clients and connections."""

    async def aclose(self) -> None:
        """Close resources bound to the running event loop (e.g. an HTTP session); called when an
        event loop that used :meth:`agenerate` ends."""

    def set_version(self, version: int) -> None:
        """Record that the servers now hold weight version ``version`` (completed updates)."""
        self._version = version

    def get_version(self) -> int:
        return self._version

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion. Interrupted segments (weight updates) are resumed
        transparently; each output token carries the version that produced it.

        Raises:
            TimeoutError / RuntimeError: no server answered within the configured bound.
        """

    async def aprompt_logprobs(self, input_ids: list[int], start: int = 1, temperature: float = 1.0,
                               rid: str | None = None) -> list[float]:
        """log π(input_ids[t] | input_ids[:t]) for t = start … P−1 under ``temperature`` (nats,
        length P − start), without generating: a frozen teacher scoring a student's tokens
        (on-policy distillation), a judge's likelihood.

        Raises:
            NotImplementedError: by default (a backend that cannot return prompt logprobs).
            ValueError: ``start`` outside [1, P).
        """
        raise NotImplementedError(f"{type(self).__name__} does not return prompt logprobs")

    def weight_update_meta(self, path: str, version: int) -> WeightUpdateMeta:
        """Where the trainer writes the weights of ``version`` (called on every trainer rank after
        :meth:`pause_generation`). The default: an HF folder at ``path`` (``type="disk"``), which
        :meth:`update_weights` then loads. A distributed backend returns ``type="distributed"``
        with its ``addresses``."""
        return WeightUpdateMeta(type="disk", path=path, version=version)

    def exclude_servers(self, addresses: list[str], reason: str) -> None:
        """Never use ``addresses`` again: they failed a distributed weight push
        (:class:`~arealite.weights.sync.WeightSyncError` ``.failed``) and hold stale or mixed
        weights. The default does nothing (a backend without servers has none to exclude)."""

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Make every server load the weights described by ``meta`` and report its version
        (trainer rank 0 only)."""

    @abc.abstractmethod
    def pause_generation(self) -> None:
        """Ask every server to interrupt in-flight generation (partial outputs are kept) and hold
        new requests until :meth:`continue_generation` (trainer rank 0 only)."""

    @abc.abstractmethod
    def continue_generation(self) -> None:
        """Let servers generate again (trainer rank 0 only)."""
