"""The one weight-update coordinator: pause → push → load → version → resume.

Every training loop calls :func:`sync_weights` after each optimizer step (collective over the
trainer ranks). The trainer engine only saves an HF folder or exposes its parameters; the HTTP
side lives in the inference client (:class:`~arealite.inference.remote.RemoteInferenceEngine`) and
in the distributed push (:func:`arealite.weights.sync.broadcast_weights`).

Order (``rollout.weight_sync``: disk | distributed):

1. every rank: the rollout executor stops starting episodes (``executor.pause``);
2. rank 0: the servers abort in-flight generation (partial outputs return to the client, which
   resubmits them; the paused servers hold them) — ``pause_generation``;
3. every rank: push — disk: ``actor.save(meta.path)``; distributed: broadcast the full tensors
   bucket by bucket to the servers of ``meta.addresses`` (a LoRA actor: only the adapters to
   our server and vLLM, which serve them unmerged, the merged weights to SGLang;
   :mod:`arealite.train_engine.lora`);
4. rank 0: the servers load (disk) or confirm (distributed) ``meta.version``;
5. every rank, after a barrier: the inference engine records the new version (the one owner of
   the version on the trainer side; the executor's staleness rule reads it) — before the servers
   continue, so that a reply without a version of its own (vLLM) is never tagged with the old one;
6. rank 0, after a barrier: the servers continue; every rank: the executor resumes.

A distributed push that fails raises :class:`~arealite.weights.sync.WeightSyncError` on
every rank; the servers it names as dead or hung are excluded for good and the push is retried
once with the others. A second failure (e.g. no server left) raises.
"""

from __future__ import annotations

import torch.distributed as dist

from arealite.api.engine import InferenceEngine, TrainEngine
from arealite.api.io_struct import WeightUpdateMeta
from arealite.train_engine import lora
from arealite.inference.adapters import ADAPTERS
from arealite.weights.sync import WeightSyncError, broadcast_weights
from arealite.rollout.executor import WorkflowExecutor


def push_weights(actor: TrainEngine, meta: WeightUpdateMeta) -> None:
    """Write the actor's current weights where ``meta`` says. Collective over the trainer ranks.

    Raises:
        ValueError: unknown ``meta.type``.
        WeightSyncError: the distributed push failed (on every rank).
    """
    # A LoRA actor sends only its adapters to our server and vLLM (which serve them unmerged:
    # merged into bf16 weights most of an update rounds away) and the merged full weights to
    # SGLang (docs/engine.md, "LoRA"). meta.lora tells the servers' loader (update_weights).
    lora_actor = getattr(actor, "peft", None) is not None
    merged = meta.backend not in ("local", "vllm")
    meta.lora = lora_actor and not merged
    if meta.type == "disk":
        if lora_actor:
            (lora.save_merged if merged else lora.save_adapter)(actor, meta.path)
        else:
            actor.save(meta.path)
    elif meta.type == "distributed":
        source = (lora.sync_specs(actor.model, merged), lora.sync_tensors(actor.model, merged)) if lora_actor else None
        broadcast_weights(actor.model, meta.addresses, meta.version, meta.bucket_bytes, tp_size=meta.tp_size,
                          timeout_s=meta.timeout_s, adapter=ADAPTERS[meta.backend], source=source)
    else:
        raise ValueError(f"weight update type {meta.type!r}: use 'disk' or 'distributed' (rollout.weight_sync)")


def sync_weights(actor: TrainEngine, rollout: InferenceEngine, executor: WorkflowExecutor | None,
                 weight_dir: str, version: int) -> None:
    """Make the servers generate with the actor's current weights as version ``version``.

    Args:
        actor: the trained policy.
        rollout: the inference engine (``weight_update_meta``, ``exclude_servers``, pause/continue,
            ``update_weights``, ``set_version``).
        executor: this rank's rollout executor (paused during the update), or None.
        weight_dir: folder for the disk path (overwritten at every update).
        version: the new weight version (= completed training steps).
    """
    if executor is not None:
        executor.pause()
    if dist.get_rank() == 0:
        rollout.pause_generation()  # servers that do not answer are excluded (not in the meta)
    for attempt in (1, 2):
        meta = rollout.weight_update_meta(weight_dir, version)
        try:
            push_weights(actor, meta)
            break
        except WeightSyncError as e:  # raised on every rank, with the same e.failed
            rollout.exclude_servers(e.failed, f"failed the weight update to version {version}")
            if attempt == 2:
                raise
    if dist.get_rank() == 0:
        rollout.update_weights(meta)
    dist.barrier()
    # Before the servers continue: replies without a version of their own (vLLM) are tagged with
    # this one, so a token of the new weights never carries the old version.
    rollout.set_version(version)
    dist.barrier()
    if dist.get_rank() == 0:
        rollout.continue_generation()
    if executor is not None:
        executor.resume()
