"""FSDP2 train engine (``torch.distributed.fsdp.fully_shard``): gloo on CPU, NCCL on GPU.

* Model: any HF causal LM folder; each decoder layer (``model._no_split_modules``) and the root
  are sharded with ``fully_shard``.
* Micro-batches: rows are split into the same number of micro-batches on every rank (FSDP
  forward/backward are collectives) so that each holds at most ``mb_spec.max_tokens_per_mb``
  padded tokens where possible, balanced by token count (longest-first greedy).
* Loss scaling: ``Σ_mb loss_mb · w_mb / Σ_{all ranks, all mb} w_mb`` — identical to the loss of
  the global batch however it is split (FSDP2 averages gradients over ranks, so the local
  loss is multiplied by the world size before backward).
* Logprobs: token-aligned, float32, under the generation temperature — the same convention as
  the server (``log_softmax(logits / T)``), see :func:`arealite.algorithms.functional.gather_logprobs`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from arealite.algorithms.functional import gather_logprobs
from arealite.api.config import TrainEngineConfig
from arealite.api.engine import Batch, TrainEngine
from arealite.api.io_struct import WeightUpdateMeta
from arealite.utils.data import trim_padding

logger = logging.getLogger("arealite.fsdp")


def init_distributed() -> None:
    """Initialise the default process group (idempotent).

    Under ``torchrun`` the env vars are set; under plain ``python`` a 1-rank group on a free
    local port is created, so recipes run both ways. Backend: NCCL with CUDA, gloo otherwise.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def split_microbatches(lengths: list[int], n_mbs: int) -> list[list[int]]:
    """Partition row indices into ``n_mbs`` groups with balanced token counts.

    Longest-first greedy: each row goes to the group with the fewest tokens so far. Groups keep
    ascending row order. Some groups are empty when there are fewer rows than ``n_mbs``.
    """
    groups: list[list[int]] = [[] for _ in range(n_mbs)]
    load = [0] * n_mbs
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = min(range(n_mbs), key=lambda g: load[g])
        groups[g].append(i)
        load[g] += lengths[i]
    return [sorted(g) for g in groups]


class FSDPEngine(TrainEngine):
    """A causal LM sharded with FSDP2 over all ranks of the default process group.

    Args:
        config: ``actor`` (or ``ref``) config.
        temperature: generation temperature; logits are divided by it (0/1 = no scaling).
        trainable: False builds no optimizer (a frozen reference model).
    """

    def __init__(self, config: TrainEngineConfig, temperature: float = 1.0, trainable: bool = True):
        self.config, self.temperature, self.trainable = config, temperature, trainable
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None
        self.tokenizer = None
        self._version = 0

    # -- setup -----------------------------------------------------------------------------------
    def initialize(self, model_path: str, total_steps: int = 1) -> None:
        """Load ``model_path``, shard it, build AdamW and the LR schedule over ``total_steps``."""
        from transformers import AutoModelForCausalLM

        from arealite.utils.hf import load_tokenizer

        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.config.num_threads > 0:
            torch.set_num_threads(self.config.num_threads)
        dtype = getattr(torch, self.config.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.to(self.device)
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module)
        fully_shard(model)
        self.model = model
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        if not self.trainable:
            model.eval()
            model.requires_grad_(False)
            return
        oc = self.config.optimizer
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            (no_decay if p.dim() < 2 or "norm" in name.lower() else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": oc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps,
        )

        def lr_lambda(step: int) -> float:
            if step < oc.warmup_steps:
                return (step + 1) / (oc.warmup_steps + 1)
            if oc.lr_scheduler == "cosine":
                progress = (step - oc.warmup_steps) / max(1, total_steps - oc.warmup_steps)
                return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
            return 1.0

        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    # -- micro-batching --------------------------------------------------------------------------
    def _microbatches(self, batch: Batch) -> list[tuple[Batch, bool]]:
        """Split ``batch`` into micro-batches; the same count on every rank.

        Returns (micro-batch on ``self.device`` trimmed of padding, is_dummy) pairs; a dummy
        (one real row, loss weight forced to 0) fills a slot when a rank has too few rows.
        """
        lengths = batch["attention_mask"].sum(1).tolist()
        budget = self.config.mb_spec.max_tokens_per_mb
        # Smallest count such that each group fits the budget if perfectly balanced.
        n_local = max(1, math.ceil(sum(lengths) / budget))
        n = torch.tensor(n_local, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        out = []
        for rows in split_microbatches(lengths, int(n)):
            dummy = not rows
            idx = torch.tensor(rows or [0])
            mb = {k: v[idx].to(self.device) for k, v in batch.items()}
            out.append((trim_padding(mb), dummy))
        return out

    def _logprobs(self, mb: Batch) -> torch.Tensor:
        """Token-aligned logprobs [b, T] of one micro-batch. With a ``loss_mask``, the LM head
        only runs from the position before the earliest loss token on (prompt positions
        need no logits), which saves a large share of the compute for long prompts."""
        mask = mb["attention_mask"].long()
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        T = mask.shape[1]
        keep = T
        if "loss_mask" in mb and mb["loss_mask"].any():
            first = int(mb["loss_mask"].bool().float().argmax(1)[mb["loss_mask"].any(1)].min())
            keep = T - max(first - 1, 0)
        logits = self.model(input_ids=mb["input_ids"], attention_mask=mask, position_ids=position_ids,
                            use_cache=False, logits_to_keep=keep).logits
        return gather_logprobs(logits, mb["input_ids"], self.temperature) * mask

    # -- training --------------------------------------------------------------------------------
    def train_batch(
        self,
        batch: Batch,
        loss_fn: Callable[[torch.Tensor, Batch], torch.Tensor],
        loss_weight_fn: Callable[[Batch], float],
    ) -> dict[str, float]:
        """See :meth:`TrainEngine.train_batch`. A non-finite gradient norm skips the update
        (parameters untouched) and reports ``skipped = 1``.

        Raises:
            ValueError: the global loss weight is 0 (no loss tokens in the whole batch).
        """
        assert self.optimizer is not None, "train_batch on a frozen engine (trainable=False)"
        self.model.train()
        mbs = self._microbatches(batch)
        weights = [0.0 if dummy else float(loss_weight_fn(mb)) for mb, dummy in mbs]
        total = torch.tensor(sum(weights), dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        if float(total) <= 0:
            raise ValueError("train_batch: the global loss weight is 0 (no tokens with loss_mask=1)")
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for (mb, dummy), w in zip(mbs, weights):
            loss = loss_fn(self._logprobs(mb), mb)
            scale = w / float(total)
            # dummy micro-batches still run forward/backward (collectives) but contribute 0.
            (loss * (scale * self.world_size if not dummy else 0.0)).backward()
            loss_sum += loss.detach().double() * scale
        dist.all_reduce(loss_sum)
        clip = self.config.optimizer.gradient_clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("non-finite grad norm %s: skipping this optimizer step", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        return {"loss": float(loss_sum), "grad_norm": grad_norm, "lr": lr, "skipped": float(skipped),
                "n_microbatches": float(len(mbs))}

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Token-aligned logprobs [B, T] float32 (CPU) of ``batch["input_ids"]`` (no grad)."""
        self.model.eval()
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        lengths = batch["attention_mask"].sum(1).tolist()
        mbs = self._microbatches(batch)
        groups = split_microbatches(lengths, len(mbs))
        for (mb, dummy), rows in zip(mbs, groups):
            lp = self._logprobs(mb).float().cpu()
            if not dummy:
                out[torch.tensor(rows), : lp.shape[1]] = lp
        return out

    # -- saving and weight upload -------------------------------------------------------------------
    def save(self, path: str) -> None:
        """HF folder: config, safetensors, generation config, tokenizer. Collective."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            from transformers.utils import logging as hf_logging

            os.makedirs(path, exist_ok=True)
            hf_logging.disable_progress_bar()  # no "Writing model shards" bar at every weight sync
            self.model.save_pretrained(path, state_dict=state)
            self.tokenizer.save_pretrained(path)
        dist.barrier()

    def upload_weights(self, meta: WeightUpdateMeta) -> None:
        """"disk": save an HF folder at ``meta.path`` for the servers to load. "distributed":
        gather full tensors bucket by bucket and broadcast them from rank 0 to
        ``meta.addresses`` (:func:`arealite.engine.weight_sync.broadcast_weights`). Collective."""
        if meta.type == "distributed":
            from arealite.engine.weight_sync import broadcast_weights

            broadcast_weights(self.model, meta.addresses, meta.version, meta.bucket_bytes, tp_size=meta.tp_size)
            return
        if meta.type != "disk":
            raise ValueError(f"weight update type {meta.type!r}: use 'disk' or 'distributed' (rollout.weight_sync)")
        self.save(meta.path)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
