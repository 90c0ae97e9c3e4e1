"""FSDP2 train engines (``torch.distributed.fsdp.fully_shard``): gloo on CPU, NCCL on GPU.

* :class:`FSDPEngine` — the policy (actor) or, with ``trainable=False``, a frozen reference
  model: any HF causal LM folder. :class:`FSDPCriticEngine` — a value model on the same
  backbone class (``AutoModelForTokenClassification``, ``num_labels=1``). Both share every code
  path; a subclass overrides only :meth:`FSDPEngine._load_model` and :meth:`FSDPEngine._head`.
* Sharding: each decoder layer (``model._no_split_modules``) and the root are sharded with
  ``fully_shard``; optionally bf16 compute with fp32 master weights and gradient reduction
  (``MixedPrecisionPolicy``) and CPU offload (``CPUOffloadPolicy``). Weights that never train
  (LoRA's base, a frozen engine's) are stored once in the compute dtype instead of being cast at
  every forward (the same values) and, on one rank without offload, left out of FSDP
  (``ignored_params``: no all-gather copies; 1.1 s of a 5.6 s 1.5B LoRA step, docs/performance.md).
* Micro-batches: rows are split into the same number of micro-batches on every rank (FSDP
  forward/backward are collectives), enough that each holds at most ``mb_spec.max_tokens_per_mb``
  real tokens if balanced, balanced by token count (longest-first greedy).
* Packing (``mb_spec.packing``, default on): a micro-batch's sequences are concatenated into
  rows with ``position_ids`` restarting at 0 per sequence and no attention mask; transformers
  then builds varlen ``cu_seqlens`` (flash-attention: ONE row) or a block-diagonal causal mask
  (sdpa/eager, ``masking_utils.find_packed_sequence_indices``: rows of at most the longest
  sequence, first-fit decreasing, as a dense mask costs (row length)² attention per row).
  ``packing=False`` runs the padded [b, T] rows instead. Either way ``loss_fn`` sees the padded
  [b, T] layout.
* Loss scaling: ``Σ_mb loss_mb · w_mb / Σ_{all ranks, all mb} w_mb`` — identical to the loss of the
  global batch however it is split (FSDP2 averages gradients over ranks: local loss × world size).
* LM head: logprobs and entropy come from the final hidden states in chunks of
  ``mb_spec.logits_chunk_size`` tokens (:mod:`arealite.train_engine.lm_head`); fp32 logits of all
  tokens are never materialised. It runs inside the root module's FSDP forward
  (``register_fsdp_forward_method``), so tied embeddings keep working.
* Logprobs: token-aligned, float32, under the generation temperature — the same convention as
  the server (``log_softmax(logits / T)``), see :func:`arealite.algorithms.functional.gather_logprobs`.
  When the batch has a ``loss_mask``, only tokens with ``loss_mask = 1`` get a logprob (others 0).
* Optimizer: AdamW (fused: one pass per tensor), no weight decay on biases and norms, gradient clipping
  with the norm reported, constant/linear/cosine schedules with linear warmup. A non-finite loss
  or gradient norm skips the update (parameters and optimizer state untouched);
  ``optimizer.max_consecutive_skips`` skips in a row raise.
* LoRA (``lora.rank > 0``): PEFT adapters are injected before sharding and only they train
  (:mod:`arealite.train_engine.lora`: reference = adapters disabled, adapter/merged saving, sync).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from arealite.api.cli import check_section
from arealite.api.config import OptimizerConfig, TrainEngineConfig
from arealite.api.engine import Batch, TrainEngine
from arealite.train_engine import fused_layers, lora, segment_attention
from arealite.train_engine.lm_head import chunked_logprobs_entropy
from arealite.train_engine.packing import (pack_sequences, packed_layout, prompt_units, shared_prompt_layout,
                                     split_microbatches, unit_length)
from arealite.utils import perf, trace
from arealite.utils.data import trim_padding
from arealite.utils.proc import free_port

logger = logging.getLogger("arealite.fsdp")


def init_distributed() -> None:
    """Initialise the default process group (idempotent).

    Under ``torchrun`` the env vars are set; under plain ``python`` a 1-rank group on a free
    local port is created, so recipes run both ways. Backend: NCCL with CUDA, gloo otherwise.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        port = free_port("")  # the wildcard address, as TCPStore binds: free on every interface
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def lr_multiplier(oc: OptimizerConfig, step: int, total_steps: int) -> float:
    """LR factor at optimizer step ``step`` (0-based) of ``total_steps``.

    Warmup: ``(step + 1) / (warmup_steps + 1)`` for ``step < warmup_steps``; then with
    ``p = (step − warmup) / max(1, total_steps − warmup)`` clipped to [0, 1] and
    ``m = min_lr_ratio``: constant 1; linear ``1 − (1 − m)·p``; cosine
    ``m + (1 − m)·(1 + cos(π p))/2`` (SGDR, Loshchilov & Hutter 2017, arXiv 1608.03983, Eq. 5).
    """
    if step < oc.warmup_steps:
        return (step + 1) / (oc.warmup_steps + 1)
    p = min(1.0, (step - oc.warmup_steps) / max(1, total_steps - oc.warmup_steps))
    m = oc.min_lr_ratio
    if oc.lr_scheduler == "linear":
        return 1.0 - (1.0 - m) * p
    if oc.lr_scheduler == "cosine":
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))
    return 1.0


def _check_config(config: TrainEngineConfig) -> None:
    """Reject bad engine settings before any model is loaded (fields named in the error): the
    section's rules of :func:`arealite.api.cli.validate_config` (one copy)."""
    check_section(config)


def compute_precision(config: TrainEngineConfig) -> str:
    """``mixed_precision`` resolved for this machine (:func:`arealite.utils.perf.resolve_precision`:
    ``auto`` -> ``bf16`` on a GPU or a CPU with fast bf16, else ``none``)."""
    return perf.resolve_precision(config.mixed_precision, "cuda" if torch.cuda.is_available() else "cpu",
                                  "actor.mixed_precision")


class FSDPEngine(TrainEngine):
    """A causal LM sharded with FSDP2 over all ranks of the default process group.

    Args:
        config: ``actor`` (or ``ref``) config.
        temperature: generation temperature; logits are divided by it (0/1 = no scaling).
        trainable: False builds no optimizer (a frozen reference model).

    Raises:
        ValueError: a bad config field (named in the message), before any model is loaded.
    """

    # Only tokens with loss_mask = 1 get an output (the actor needs no prompt logprobs); the
    # critic returns values at every real position.
    _outputs_on_loss_tokens_only = True
    _lora_modules_to_save: tuple[str, ...] = ()  # LoRA: modules trained in full (critic: the value head)

    def __init__(self, config: TrainEngineConfig, temperature: float = 1.0, trainable: bool = True):
        _check_config(config)
        self.config, self.temperature, self.trainable = config, temperature, trainable
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None
        self.tokenizer = None
        self.peft = None  # the PeftModel wrapper when config.lora.rank > 0 (arealite.train_engine.lora)
        self._consecutive_skips = 0
        self.n_skipped_steps = 0  # total optimizer steps skipped for a non-finite loss/grad norm

    # -- setup -----------------------------------------------------------------------------------
    def _load_model(self, model_path: str, dtype: torch.dtype) -> torch.nn.Module:
        """Hook: the unsharded HF model (on CPU). The actor loads ``AutoModelForCausalLM``."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                    attn_implementation=self._attn_implementation())

    def initialize(self, model_path: str, total_steps: int = 1) -> None:
        """Load ``model_path``, shard it, build AdamW and the LR schedule over ``total_steps``."""
        from arealite.utils.hf import load_tokenizer

        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.config.num_threads > 0:
            torch.set_num_threads(self.config.num_threads)
        if self.device.type == "cpu":  # each step reuses the pages the last one freed
            perf.keep_freed_memory()
        use_lora = self.config.lora.rank > 0 and self.trainable  # a frozen engine needs no adapters
        if use_lora:  # target modules checked on a meta model, before the weights load
            lora.check_target_modules(model_path, self.config.lora, critic=bool(self._lora_modules_to_save))
        model = fused_layers.install(self._load_model(model_path, getattr(torch, self.config.dtype)))
        self._flop_shape = perf.flop_shape(model)
        if use_lora:  # PEFT adapters before sharding; only they (and a value head) train
            self.peft, model = lora.wrap_model(model, self.config.lora, self._lora_modules_to_save)
        if self.config.gradient_checkpointing:  # transformers ≥ 5.x renamed the method
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        if not self.config.cpu_offload:
            model.to(self.device)
        if self.peft is not None:  # random adapter init: every rank must shard the same tensors
            lora.broadcast_trainable(model, self.device)
        # one rank: nothing to free by resharding, so backward skips an all-gather (copy + cast)
        kw = {} if self.world_size > 1 or self.config.cpu_offload else {"reshard_after_forward": False}
        self.precision = compute_precision(self.config)
        if self.precision == "bf16":  # fp32 master weights, optimizer state and gradient reduction
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ignored = self._freeze_frozen(model)
        if ignored:  # (a keyword of torch >= 2.7)
            kw["ignored_params"] = ignored
        if self.config.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if any(c.__name__ in layer_classes for c in type(module).__mro__):  # (a Fused<cls> too)
                fully_shard(module, **kw)
        fully_shard(model, **kw)
        # Backbone + head as one FSDP forward of the root: root parameters (embeddings, final
        # norm, LM/value head) are unsharded while it runs.
        model.arealite_forward = self._root_forward
        register_fsdp_forward_method(model, "arealite_forward")
        self.model = model
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.total_steps = total_steps
        if not self.trainable:
            model.eval()
            model.requires_grad_(False)
            return
        oc = self.config.optimizer
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:  # LoRA: the frozen base weights get no optimizer state
                continue
            (no_decay if p.dim() < 2 or "norm" in name.lower() else decay).append(p)
        self.optimizer = torch.optim.AdamW(  # fused: one pass per tensor (CPU: 4.4x foreach at 135M)
            [{"params": decay, "weight_decay": oc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps, fused=True,
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_multiplier(oc, step, total_steps))

    def _freeze_frozen(self, model: torch.nn.Module) -> set:
        """Never-trained weights in the compute dtype (module docstring, Sharding); returns the
        set FSDP ignores."""
        frozen = [p for p in model.parameters() if not (p.requires_grad and self.trainable)]
        for p in frozen if self.precision == "bf16" else ():
            p.data = p.data.to(torch.bfloat16)
        return set() if self.world_size > 1 or self.config.cpu_offload else set(frozen)

    def _attn_implementation(self) -> str:  # sdpa -> its variant that can attend by segments
        impl = segment_attention.resolve_attn_implementation(self.config, compute_precision(self.config))
        return segment_attention.register() if impl == "sdpa" else impl

    # -- micro-batching --------------------------------------------------------------------------
    def _prefix_sharing(self) -> bool:
        """Prompts shared within a micro-batch: packed sdpa/eager rows (a 4D mask; flash
        varlen attention takes none) and ``mb_spec.prefix_sharing``."""
        return (self.config.mb_spec.packing and self.config.mb_spec.prefix_sharing
                and self.model.config._attn_implementation in ("sdpa", "eager", segment_attention.NAME))

    def _units(self, batch: Batch, lengths: list[int]) -> list[tuple[int, list[int]]]:
        """:func:`prompt_units` of ``batch``: a row's prompt is its tokens before its first
        ``loss_mask = 1`` token; no ``loss_mask`` or no sharing = one unit per row."""
        if not self._prefix_sharing() or "loss_mask" not in batch:
            return [(0, [i]) for i in range(len(lengths))]
        first = (batch["loss_mask"] > 0).float().argmax(1).tolist()  # [B] first loss token
        has = (batch["loss_mask"] > 0).any(1).tolist()
        ids = batch["input_ids"]
        keys = [tuple(ids[i, :first[i]].tolist()) if has[i] else () for i in range(len(lengths))]
        return prompt_units(keys, lengths, self.config.mb_spec.max_tokens_per_mb)

    def _microbatches(self, batch: Batch) -> list[tuple[Batch, bool, list[int]]]:
        """Split ``batch`` into micro-batches; the same count on every rank.

        Returns (micro-batch on ``self.device`` trimmed of padding, is_dummy, its rows of
        ``batch``) triples; a dummy (one real row, loss weight forced to 0) fills a slot when a
        rank has too few rows. Rows with the same prompt (:meth:`_units`) stay together, and the
        token budget counts a shared prompt once.
        """
        lengths = batch["attention_mask"].sum(1).tolist()
        units = self._units(batch, lengths)
        costs = [unit_length(u, lengths) for u in units]
        budget = self.config.mb_spec.max_tokens_per_mb
        # Smallest count such that each group fits the budget if perfectly balanced.
        n_local = max(1, math.ceil(sum(costs) / budget))
        n = torch.tensor(n_local, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        out = []
        for group in split_microbatches(costs, int(n)):
            rows = sorted(i for u in group for i in units[u][1])
            dummy = not rows
            idx = torch.tensor(rows or [0])
            mb = {k: v[idx].to(self.device) for k, v in batch.items()}
            out.append((trim_padding(mb), dummy, rows))
        return out

    # -- forward ---------------------------------------------------------------------------------
    def _head(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hook, run inside the root FSDP forward: per-position outputs from final hidden states.

        Args: hidden [n, H] at the selected positions; labels [n] int64, the next token of each.
        Returns: (logprobs [n] float32, entropy [n] float32 detached).
        """
        head = self.model.get_output_embeddings()
        return chunked_logprobs_entropy(hidden, head.weight, labels, self.temperature,
                                        self.config.mb_spec.logits_chunk_size, bias=head.bias)

    def _root_forward(self, input_ids, position_ids, attention_mask, index, labels, segments=None):
        """Backbone → :meth:`_head` at the positions ``index`` (registered as an FSDP forward).

        ``input_ids``/``position_ids`` [R, C] (packed rows, ``attention_mask`` None: transformers
        derives a block-diagonal mask or varlen ``cu_seqlens`` from the restarting position ids)
        or [b, T] (padded rows with their ``attention_mask``); ``index`` [n] indexes the flattened
        [R·C] positions whose hidden states feed the head; labels [n] their next tokens;
        ``segments``: a prefix-shared layout's ``segment_attention.Segments`` (replace the mask).
        """
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       use_cache=False, **({} if segments is None else {"arealite_segments": segments})).last_hidden_state
        return self._head(hidden.reshape(-1, hidden.shape[-1])[index], labels)  # hidden [n, H]

    def _forward_mb(self, mb: Batch) -> torch.Tensor:
        """Token-aligned outputs [b, T] float32 of one micro-batch (logprobs for the actor,
        values for the critic): ``out[:, t]`` comes from the hidden state at position t-1; 0 at
        index 0 and on padding. Sets ``mb["entropy"]`` [b, T] (detached) when the head gives one."""
        valid = mb["attention_mask"].bool()  # [b, T]
        b, T = valid.shape
        ids = mb["input_ids"][valid]  # [N] real tokens, row after row
        N = ids.shape[0]
        has_next = torch.ones(N, dtype=torch.bool, device=ids.device)
        has_next[valid.sum(1).cumsum(0)[valid.any(1)] - 1] = False  # last token of each row
        need = has_next.clone()
        if self._outputs_on_loss_tokens_only and "loss_mask" in mb:
            need[:-1] &= mb["loss_mask"][valid][1:] > 0
        src = need.nonzero().squeeze(-1)  # [n] positions whose next token gets an output
        labels = ids[src + 1]
        lengths = valid.sum(1).tolist()
        units = self._units(mb, lengths)
        self._mb_flops = self._forward_flops(units, lengths, int(src.numel()))
        if any(p for p, _ in units):
            # rows with the same prompt: the prompt once, each suffix attending to it (4D mask);
            # packed rows of at most the longest unit, as the dense mask costs (row length)²
            sizes = [unit_length(u, lengths) for u in units]
            bins = pack_sequences(sizes, max(sizes))
            ids_p, pos_p, where, allowed, spans = shared_prompt_layout(ids, lengths, units, bins)
            segments = segment_attention.for_layout(spans, ids_p, self.model.config._attn_implementation)
            if self.model.config._attn_implementation == "eager":  # additive float mask
                dtype = self.model.get_input_embeddings().weight.dtype
                allowed = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(
                    ~allowed, torch.finfo(dtype).min)
            out, extra = self.model.arealite_forward(ids_p, pos_p, allowed, where[src], labels, segments)
        elif self.config.mb_spec.packing:
            # flash-attention: one row (varlen); sdpa/eager: rows of at most the longest sequence,
            # as their block-diagonal mask costs (row length)² per row
            one_row = "flash" in self.model.config._attn_implementation
            bins = pack_sequences(lengths, sum(lengths) if one_row else max(lengths))
            ids_p, pos_p, where = packed_layout(ids, lengths, bins)
            out, extra = self.model.arealite_forward(ids_p, pos_p, None, where[src], labels)
        else:
            flat = valid.flatten().nonzero().squeeze(-1)  # [N] positions of real tokens in [b·T]
            out, extra = self.model.arealite_forward(mb["input_ids"], (valid.long().cumsum(1) - 1).clamp(min=0),
                                                     valid.long(), flat[src], labels)

        def to_padded(x):  # [n] at flat positions src + 1 → [b, T]
            flat = x.new_zeros(N).index_copy(0, src + 1, x)
            return x.new_zeros(b, T).masked_scatter(valid, flat)

        if extra is not None:
            mb["entropy"] = to_padded(extra.detach())
        return to_padded(out.float())

    def _forward_flops(self, units, lengths: list[int], head_positions: int) -> float:
        """Model FLOPs of one micro-batch forward (:func:`arealite.utils.perf.forward_flops`): a
        shared prompt counted once, each row's suffix attending to it."""
        tokens = sum(unit_length(u, lengths) for u in units)
        pairs = sum(perf.causal_pairs(p) + sum(perf.causal_pairs(lengths[i] - p, p) for i in rows)
                    for p, rows in units)
        return perf.forward_flops(tokens=tokens, attn_pairs=pairs, head_positions=head_positions,
                                  **self._flop_shape)

    # -- training --------------------------------------------------------------------------------
    def train_batch(
        self,
        batch: Batch,
        loss_fn: Callable[[torch.Tensor, Batch], torch.Tensor],
        loss_weight_fn: Callable[[Batch], float],
        skipped_weight: float = 0.0,
    ) -> dict[str, float]:
        """See :meth:`TrainEngine.train_batch`. ``loss_fn(out, mb)`` gets the token-aligned logprobs
        (critic: values) [b, T] float32 and the micro-batch, which also holds ``mb["entropy"]``
        [b, T] (actor, detached); a micro-batch whose ``loss_weight_fn`` is 0 contributes exactly
        0 and is not passed to ``loss_fn``. A non-finite loss or gradient norm skips the update
        (parameters, optimizer state and LR schedule untouched) and reports ``skipped = 1``.

        Raises:
            ValueError: the global loss weight is 0 (no loss tokens in the whole batch).
            RuntimeError: ``optimizer.max_consecutive_skips`` non-finite steps in a row.
        """
        if self.optimizer is None:
            raise RuntimeError("train_batch on a frozen engine (built with trainable=False)")
        self.model.train()
        mbs = self._microbatches(batch)
        weights = [0.0 if dummy else float(loss_weight_fn(mb)) for mb, dummy, _ in mbs]
        total = torch.tensor(sum(weights) + skipped_weight, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        if float(total) <= 0:
            raise ValueError("train_batch: the global loss weight is 0 (no tokens with loss_mask=1)")
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        n_tokens = 0
        for (mb, dummy, _), w in zip(mbs, weights):
            with trace.span("forward"):  # the timeline's trainer track (arealite/utils/trace.py)
                out = self._forward_mb(mb)
            n_tokens += 0 if dummy else int(mb["attention_mask"].sum())
            if not dummy:  # forward + activation grads (+ weight grads unless LoRA)
                perf.FLOPS.add(self._mb_flops * (2 if self.peft is not None else 3))
            if w == 0:  # dummy, or no loss tokens: loss_fn is not called (its mean would be 0/0);
                with trace.span("backward"):
                    (out.sum() * 0.0).backward()  # FSDP still needs the backward collectives
                continue
            loss = loss_fn(out, mb)
            scale = w / float(total)
            with trace.span("backward"):
                (loss * (scale * self.world_size)).backward()
            loss_sum += loss.detach().double() * scale
        opt_start = time.time()
        dist.all_reduce(loss_sum)
        clip = self.config.optimizer.gradient_clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        loss_value = float(loss_sum)
        skipped = not (math.isfinite(grad_norm) and math.isfinite(loss_value))
        if skipped:
            self._consecutive_skips += 1
            self.n_skipped_steps += 1
            logger.warning("non-finite loss %s / grad norm %s: skipping this optimizer step (%d in a row)",
                           loss_value, grad_norm, self._consecutive_skips)
            self.optimizer.zero_grad(set_to_none=True)
            limit = self.config.optimizer.max_consecutive_skips
            if 0 < limit <= self._consecutive_skips:
                raise RuntimeError(
                    f"{self._consecutive_skips} optimizer steps in a row had a non-finite loss or gradient "
                    f"norm (optimizer.max_consecutive_skips={limit}); lower optimizer.lr, check the data "
                    "and rewards, or raise optimizer.max_consecutive_skips (0 = never stop)")
        lr = self.lr_scheduler.get_last_lr()[0]
        if not skipped:  # a skipped step does not advance the schedule (as in Megatron-LM)
            self._consecutive_skips = 0
            self.optimizer.step()
            self.lr_scheduler.step()
        trace.complete("optimizer", opt_start, time.time())
        return {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "skipped": float(skipped),
                "skipped_total": float(self.n_skipped_steps), "n_microbatches": float(len(mbs)),
                "n_tokens": float(n_tokens)}

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Token-aligned logprobs [B, T] float32 (CPU) of ``batch["input_ids"]`` (no grad);
        0 at index 0, on padding and (when the batch has a ``loss_mask``) where it is 0."""
        self.model.eval()
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for mb, dummy, rows in self._microbatches(batch):
            with trace.span("forward (no grad)"):
                lp = self._forward_mb(mb).float().cpu()
            if not dummy:
                perf.FLOPS.add(self._mb_flops)
                out[torch.tensor(rows), : lp.shape[1]] = lp
        return out

    # -- saving -------------------------------------------------------------------
    def save(self, path: str) -> None:
        """HF folder: config, safetensors, generation config, tokenizer. Collective. LoRA: the
        PEFT adapter folder ``path/adapter`` plus, with ``lora.merged_final``, the merged model
        in ``path`` (:func:`arealite.train_engine.lora.save`)."""
        if self.peft is not None:
            return lora.save(self, path, merged=self.config.lora.merged_final)
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            from transformers.utils import logging as hf_logging

            os.makedirs(path, exist_ok=True)
            hf_logging.disable_progress_bar()  # no "Writing model shards" bar at every weight sync
            self.model.save_pretrained(path, state_dict=state)
            self.tokenizer.save_pretrained(path)
        dist.barrier()

    def extra_state(self) -> dict:
        """LR schedule and the non-finite-step skip counters (recover checkpoints)."""
        return {"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                "n_skipped_steps": self.n_skipped_steps, "consecutive_skips": self._consecutive_skips}

    def load_extra_state(self, state: dict) -> None:
        if state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.n_skipped_steps, self._consecutive_skips = state["n_skipped_steps"], state["consecutive_skips"]

    def destroy(self) -> None:
        """End the process group (collective: every rank calls it at the end of a run). A barrier
        first, so no rank tears gloo down while a peer's last collective is still in flight (a
        rank exiting with gloo work pending can abort in its C++ teardown)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def load_scalar_head_model(auto_cls, model_path: str, dtype: torch.dtype, attn_implementation: str, role: str,
                           zero_head: bool, **config_fields) -> torch.nn.Module:
    """``auto_cls`` (``AutoModelForTokenClassification`` / ``...ForSequenceClassification``) with
    one label from ``model_path``, its config updated with ``config_fields``; with ``zero_head``
    the ``score`` head (new for a causal-LM folder) is set to 0 (every rank starts from the same
    weights; every initial output is 0).

    Raises:
        ValueError: transformers has no such class for the architecture, or it has no 1-output
            ``score`` head (names ``role``).
    """
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_config = AutoConfig.from_pretrained(model_path, num_labels=1)
    for key, value in config_fields.items():
        setattr(hf_config, key, value)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report would list the new score head as MISSING
    try:
        model = auto_cls.from_pretrained(model_path, config=hf_config, dtype=dtype, attn_implementation=attn_implementation)
    except ValueError as e:
        raise ValueError(f"{role}: transformers has no {auto_cls.__name__} for model_type {hf_config.model_type!r} "
                         f"({model_path}); use a Llama/Qwen2-family model for the {role}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    score = getattr(model, "score", None)
    if not isinstance(score, torch.nn.Linear) or score.out_features != 1:
        raise ValueError(f"{role}: {type(model).__name__} has no 1-output `score` head; "
                         f"use a Llama/Qwen2-family model for the {role}")
    if zero_head:
        with torch.no_grad():
            score.weight.zero_()
            if score.bias is not None:
                score.bias.zero_()
    return model


class FSDPCriticEngine(FSDPEngine):
    """A value model (PPO critic) on the backbone of a causal LM folder, sharing
    :class:`FSDPEngine`'s sharding, micro-batching, packing, loss scaling and optimizer.

    The folder is loaded as ``AutoModelForTokenClassification(num_labels=1)``: the backbone
    weights come from the checkpoint; the new ``score`` head [1, H] (+ bias) is initialised to
    zero, so every initial value is 0. Values are token-aligned like logprobs:
    ``values[:, t] = score(h_{t-1})`` is V of the state *before* token t is generated (the input
    ``input_ids[:, :t]``); index 0 and padding are 0. No dropout is applied to the head.

    ``forward(batch)`` → values [B, T] float32 (no grad); ``train_batch(batch, loss_fn,
    loss_weight_fn)`` calls ``loss_fn(values [b, T] float32 with grad, mb)``; ``save(path)``
    writes an HF folder that ``AutoModelForTokenClassification.from_pretrained`` loads.
    """

    _outputs_on_loss_tokens_only = False
    _lora_modules_to_save = ("score",)

    def __init__(self, config: TrainEngineConfig):
        super().__init__(config, temperature=1.0, trainable=True)

    def _load_model(self, model_path: str, dtype: torch.dtype) -> torch.nn.Module:
        """``AutoModelForTokenClassification`` with one label and a zero ``score`` head.

        Raises:
            ValueError: transformers has no token-classification class for the architecture.
        """
        from transformers import AutoModelForTokenClassification

        return load_scalar_head_model(AutoModelForTokenClassification, model_path, dtype, self._attn_implementation(),
                                      "critic", zero_head=True, classifier_dropout=0.0)

    def _head(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Values [n] float32 = score(hidden) (labels unused)."""
        return self.model.score(hidden).sum(-1, dtype=torch.float32), None  # [n]; sum, not a view

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Token-aligned values [B, T] float32 (CPU), no grad: ``values[:, t] = V(input_ids[:, :t])``;
        0 at index 0 and on padding."""
        return super().forward(batch)


class FSDPRewardEngine(FSDPEngine):
    """A reward model (a scalar head at the last token of a sequence) on the backbone of a causal
    LM folder, or a folder this engine saved, sharing :class:`FSDPEngine`'s sharding,
    micro-batching, packing, loss scaling and optimizer.

    The folder is loaded as ``AutoModelForSequenceClassification(num_labels=1)`` (for a causal-LM
    folder the new ``score`` head [1, H] is zero-initialised, so every rank starts from the same
    weights and every initial reward is 0; a saved reward model keeps its head).
    ``config.pad_token_id`` is :func:`arealite.utils.hf.reward_pad_id` (not EOS), so transformers'
    own forward of the saved folder reads the same last token (a final EOS included). Outputs are token-aligned like the actor's:
    ``out[:, t] = score(h_{t-1})``; only ``loss_mask = 1`` positions get an output. A sequence's
    reward is the output at the extra token after it (:func:`arealite.algorithms.reward_model.reward_batch`).

    ``save(path)`` writes an HF folder that ``AutoModelForSequenceClassification.from_pretrained``
    loads (and ``python -m arealite.server.reward_model`` serves).
    """

    _lora_modules_to_save = ("score",)

    def __init__(self, config: TrainEngineConfig, trainable: bool = True):
        super().__init__(config, temperature=1.0, trainable=trainable)

    def _load_model(self, model_path: str, dtype: torch.dtype) -> torch.nn.Module:
        """``AutoModelForSequenceClassification`` with one label (zero head for a new one).

        Raises:
            ValueError: transformers has no sequence-classification class for the architecture,
                or it has no 1-output ``score`` head.
        """
        from transformers import AutoConfig, AutoModelForSequenceClassification

        from arealite.utils.hf import load_tokenizer, reward_pad_id

        saved = AutoConfig.from_pretrained(model_path).architectures or []
        fresh = not any(a.endswith("ForSequenceClassification") for a in saved)
        return load_scalar_head_model(AutoModelForSequenceClassification, model_path, dtype, self._attn_implementation(),
                                      "reward model", zero_head=fresh,
                                      pad_token_id=reward_pad_id(load_tokenizer(model_path)))

    def _head(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Rewards [n] float32 = score(hidden) (labels unused)."""
        return self.model.score(hidden).sum(-1, dtype=torch.float32), None
