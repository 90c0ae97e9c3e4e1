"""LoRA on the FSDP2 engines with PEFT (``actor.lora`` / ``critic.lora``, rank > 0).

* Model: ``peft.get_peft_model`` injects PEFT's ``LoraLayer`` modules into the HF model before
  ``fully_shard``; the engine then shards and runs the *inner* HF model (``peft_model.base_model
  .model``, so names, ``base_model`` and the chunked LM head are unchanged) and keeps the
  ``PeftModel`` wrapper as ``engine.peft`` (adapter switching, saving). Only ``lora_A``/``lora_B``
  (and, for the critic, the ``score`` head, a PEFT ``modules_to_save`` copy) require grad; the
  optimizer holds only those. Packing, gradient checkpointing and the chunked LM head compose
  unchanged: a LoRA linear is a drop-in module inside each decoder layer.
* LoRA (Hu et al. 2021, arXiv 2106.09685, Eq. 3): ``h = W0 x + s · B A x`` with ``A`` [r, in],
  ``B`` [out, r], ``s = alpha / r`` (PEFT ``LoraLayer.scaling``); the merged weight is
  ``W = W0 + s · B A`` (PEFT ``LoraLayer.get_delta_weight``).
* Reference model: :class:`LoRAReference` runs the actor with its adapters disabled
  (``PeftModel.disable_adapter``) — the base weights, no second copy.
* Weight sync (:func:`sync_specs` / :func:`sync_tensors`): to our server only the adapters, as
  ``{module}.lora_A.weight`` (A) and ``{module}.lora_B.weight`` (s · B, the scale folded in);
  our server serves them unmerged in bf16 and merges them into its kept copy of ``W0`` in fp32
  (:mod:`arealite.server.weights`); vLLM serves them through its own LoRA path
  (:mod:`arealite.server.vllm_ext`). To SGLang the merged full weights under the HF names.
* Saving (:func:`save`): ``path/adapter/`` is a PEFT adapter folder
  (``PeftModel.from_pretrained(base, path/adapter)``), and with ``lora.merged_final`` ``path/``
  also holds the merged full model (``AutoModelForCausalLM.from_pretrained(path)``).

All functions that gather tensors are collectives over the trainer ranks (same order everywhere).
"""

from __future__ import annotations

import os
import types
from typing import Iterator

import torch
import torch.distributed as dist

from arealite.api.config import LoRAConfig

ADAPTER = "default"  # PEFT's adapter name
ADAPTER_SUBDIR = "adapter"  # save(path): the PEFT adapter folder is path/adapter


def _config_error(field: str, message: str) -> Exception:
    from arealite.api.cli import ConfigError

    return ConfigError(field, message)


def check_target_modules(model_path: str, cfg: LoRAConfig, field: str = "actor.lora",
                         critic: bool = False) -> None:
    """Check that every ``cfg.target_modules`` entry names linear layers of the model at
    ``model_path``, from its config.json only (a meta-device model: no weights are read).

    A name matches a module whose dotted name equals it or ends with ``"." + name`` (PEFT's
    rule); the LM head is not a valid target (its weight is tied or served as-is).

    Raises:
        ConfigError: ``{field}.target_modules`` names no linear layer (the message lists the
            available names).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    hf_config = AutoConfig.from_pretrained(model_path, **({"num_labels": 1} if critic else {}))
    cls = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(hf_config)
    head = model.get_output_embeddings() if not critic else getattr(model, "score", None)
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    if cfg.target_modules == ["all-linear"]:
        return
    available = sorted({n.rsplit(".", 1)[-1] for n in linear})
    for i, name in enumerate(cfg.target_modules):
        if not any(n == name or n.endswith("." + name) for n in linear):
            raise _config_error(f"{field}.target_modules[{i}]", f"{name!r} is no linear layer of {model_path} "
                                f"({type(model).__name__}); available: {available} or [all-linear]")


def peft_config(cfg: LoRAConfig, modules_to_save: tuple[str, ...] = ()):
    """The PEFT ``LoraConfig`` of ``cfg`` (``init_lora_weights`` "true"/"false" → bool)."""
    from peft import LoraConfig

    init = {"true": True, "false": False}.get(str(cfg.init_lora_weights).lower(), cfg.init_lora_weights)
    targets = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                      init_lora_weights=init, bias="none", modules_to_save=list(modules_to_save) or None)


def wrap_model(model: torch.nn.Module, cfg: LoRAConfig, modules_to_save: tuple[str, ...] = ()):
    """Inject LoRA adapters into the HF ``model`` (in place) with ``peft.get_peft_model``.

    Returns ``(peft_model, hf_model)``: the ``PeftModel`` wrapper and the same HF model object,
    now holding ``LoraLayer`` modules; every parameter but the adapters (and ``modules_to_save``)
    has ``requires_grad=False``. The engine shards and runs ``hf_model``.
    """
    from peft import get_peft_model

    from peft.tuners.lora.layer import Linear

    peft_model = get_peft_model(model, peft_config(cfg, modules_to_save))
    for _, layer in lora_layers(peft_model.base_model.model):
        if type(layer) is Linear:  # bound to the layer: a deepcopy binds the copy's
            layer.forward = types.MethodType(_fused_forward, layer)
    return peft_model, peft_model.base_model.model


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A PEFT LoRA ``Linear``'s forward with its vanilla LoRA ``W0 x + (B (A x)) · s`` computed
    as ``W0 x`` then one in-place ``addmm_`` of ``s · (A x) Bᵀ`` into it: the GEMM adds its
    product (summed in fp32) to the base output, where PEFT makes three passes over the
    ``[tokens, out]`` output (B's product, the scaling, the sum) and rounds twice in bf16.
    Anything else (adapters disabled or merged, dropout, a LoRA variant, extra arguments, mixed
    dtypes) runs PEFT's own forward."""
    if (args or kwargs or self.disable_adapters or self.merged or self.active_adapters != [ADAPTER]
            or ADAPTER in self.lora_variant or not isinstance(self.lora_dropout[ADAPTER], torch.nn.Identity)):
        return type(self).forward(self, x, *args, **kwargs)
    a, b = self.lora_A[ADAPTER].weight, self.lora_B[ADAPTER].weight
    if not x.dtype == a.dtype == b.dtype == self.base_layer.weight.dtype:  # PEFT casts between them
        return type(self).forward(self, x)
    # On [tokens, in] rows: the base output is then a tensor of its own, not a view, and the
    # in-place addmm_ becomes its autograd node. (In place on a view of a 3-D output, autograd
    # cloned and copied back the whole [tokens, out] gradient in backward: 2 copies per layer.)
    x2 = x.reshape(-1, x.shape[-1])  # [T, in]
    result = self.base_layer(x2)  # [T, out]
    result.addmm_(torch.nn.functional.linear(x2, a), b.t(), alpha=self.scaling[ADAPTER])
    return result.view(*x.shape[:-1], result.shape[-1])


@torch.no_grad()
def broadcast_trainable(model: torch.nn.Module, device: torch.device) -> None:
    """Copy rank 0's trainable parameters (the randomly initialised adapters) to every rank,
    before ``fully_shard`` (each rank keeps its shard of the same tensor). Collective;
    no-op with one rank. ``device``: where the backend communicates (CUDA for NCCL)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for p in model.parameters():
        if p.requires_grad:
            t = p.data.to(device)
            dist.broadcast(t, src=0)
            p.data.copy_(t)


class LoRAReference:
    """The reference policy of a LoRA actor: the actor's model with its adapters disabled
    (``PeftModel.disable_adapter``), i.e. the base weights; no second copy of them.

    ``forward(batch)`` → token-aligned logprobs [B, T] float32 (CPU) under the actor's
    temperature, like a frozen :class:`~arealite.train_engine.fsdp.FSDPEngine` (collective).
    """

    def __init__(self, actor):
        if getattr(actor, "peft", None) is None:
            raise ValueError("LoRAReference needs an actor built with actor.lora.rank > 0")
        self.actor = actor
        self.optimizer = None  # frozen: never saved in recover checkpoints

    @torch.no_grad()
    def forward(self, batch):
        with self.actor.peft.disable_adapter():
            return self.actor.forward(batch)


def _full(p: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter (all-gathers a DTensor: collective)."""
    data = p.data
    return (data.full_tensor() if hasattr(data, "full_tensor") else data).detach()


def _meta_or_full(p: torch.Tensor, meta: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`_full` of ``p`` (or an empty meta tensor of its shape), cast to ``dtype`` if given."""
    dtype = dtype or p.dtype
    return torch.empty(p.shape, dtype=dtype, device="meta") if meta else _full(p).to(dtype)


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, LoraLayer)`` of every adapted module of ``model``, in module order."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A]


def sync_specs(model: torch.nn.Module, merged: bool) -> list[tuple[str, tuple, torch.dtype]]:
    """``(name, full shape, dtype)`` of what :func:`sync_tensors` yields, in the same order
    (from shapes only: no collective)."""
    return [(n, tuple(t.shape), t.dtype) for n, t in _iter_sync(model, merged, meta=True)]


def sync_tensors(model: torch.nn.Module, merged: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a weight update sends (collective: all-gathers on every rank).

    ``merged=False`` (our server, vLLM): per adapted module ``{module}.lora_A.weight`` = A [r, in]
    and ``{module}.lora_B.weight`` = s · B [out, r] (the scale folded in, so the server needs no
    config). ``merged=True`` (SGLang): every parameter under its HF name, with
    ``{module}.weight`` = W0 + s · B A (computed in float32), every tensor in the adapters' dtype
    (fp32). With bf16 compute W0 is the bf16-rounded base the trainer computes with
    (``FSDPEngine._freeze_frozen``; exact for a bf16 checkpoint).
    """
    return _iter_sync(model, merged, meta=False)


def _iter_sync(model: torch.nn.Module, merged: bool, meta: bool):
    layers = dict(lora_layers(model))
    if not merged:
        for name, m in layers.items():
            a, b = _meta_or_full(m.lora_A[ADAPTER].weight, meta), _meta_or_full(m.lora_B[ADAPTER].weight, meta)
            yield f"{name}.lora_A.weight", a
            yield f"{name}.lora_B.weight", b if meta else (b.float() * m.scaling[ADAPTER]).to(b.dtype)
        return
    # merged: every tensor in the adapters' dtype (fp32: PEFT keeps adapters in fp32); the engine
    # may keep the frozen base weights in the compute dtype (FSDPEngine._freeze_frozen), and
    # W0 + s·B A rounded to bf16 would lose most of the update
    dtype = next(iter(layers.values())).lora_A[ADAPTER].weight.dtype if layers else None

    def full(p):
        return _meta_or_full(p, meta, dtype)

    seen: set[int] = set()
    inside: tuple[str, ...] = ()  # prefixes of LoRA layers (their children are handled with them)
    for mname, mod in model.named_modules():
        if inside and mname.startswith(inside):
            continue
        if type(mod).__name__ == "ModulesToSaveWrapper":  # the critic's trained score head
            inside += (mname + ".",)
            seen.update(id(p) for p in mod.parameters())
            for pname, p in mod.modules_to_save[ADAPTER].named_parameters():
                yield f"{mname}.{pname}", full(p)
            continue
        if mname in layers:
            inside += (mname + ".",)
            base = mod.get_base_layer()
            w0, a, b = full(base.weight), full(mod.lora_A[ADAPTER].weight), full(mod.lora_B[ADAPTER].weight)
            seen.update(id(p) for p in mod.parameters())
            w = w0 if meta else (w0.float() + mod.scaling[ADAPTER] * (b.float() @ a.float())).to(dtype)
            yield f"{mname}.weight", w
            if getattr(base, "bias", None) is not None:
                yield f"{mname}.bias", full(base.bias)
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) not in seen:  # tied weights once (the first name, as model.named_parameters)
                seen.add(id(p))
                yield (f"{mname}.{pname}" if mname else pname), full(p)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU tensors of every trainable parameter under the ``PeftModel`` state-dict names
    (``base_model.model.`` + the HF model's name). Collective."""
    return {"base_model.model." + n: _full(p).cpu() for n, p in model.named_parameters() if p.requires_grad}


def save_adapter(engine, path: str) -> None:
    """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) of
    ``engine`` at ``path``; ``base_model_name_or_path`` is the engine's model folder. Collective."""
    state = trainable_state(engine.model)
    if engine.rank == 0:
        os.makedirs(path, exist_ok=True)
        engine.peft.peft_config[ADAPTER].base_model_name_or_path = engine.model_path
        engine.peft.save_pretrained(path, state_dict=state)
    dist.barrier()


def save_merged(engine, path: str) -> None:
    """Write the merged full model (``W0 + s·B A``, HF names) and the tokenizer as an HF folder
    that ``AutoModelForCausalLM.from_pretrained`` loads. Collective."""
    state = {n: t.cpu() for n, t in sync_tensors(engine.model, merged=True)}
    if engine.rank == 0:
        from transformers.utils import logging as hf_logging

        os.makedirs(path, exist_ok=True)
        hf_logging.disable_progress_bar()
        engine.model.save_pretrained(path, state_dict=state)
        engine.tokenizer.save_pretrained(path)
    dist.barrier()


def save(engine, path: str, merged: bool) -> None:
    """A LoRA engine's checkpoint: the PEFT adapter folder ``path/adapter`` and, when
    ``merged``, the merged full model in ``path`` (AutoModelForCausalLM / the servers load it).
    Collective."""
    save_adapter(engine, os.path.join(path, ADAPTER_SUBDIR))
    if merged:
        save_merged(engine, path)
    elif engine.rank == 0:
        engine.tokenizer.save_pretrained(path)
    dist.barrier()
