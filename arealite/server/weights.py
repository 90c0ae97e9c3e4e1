"""Weight loading for the server: a folder of safetensors, a bucket of named tensors, and the
weight-update groups through which the trainer broadcasts buckets
(:mod:`arealite.weights.group`; request bodies: :mod:`arealite.api.weight_update`).

The loads run in the scheduler thread between decode steps; joining a group and receiving a
bucket block, so the HTTP layer runs them in a worker thread.

LoRA actors (:mod:`arealite.train_engine.lora`) send only their adapters: a PEFT adapter folder on
disk (``adapter_config.json``), or buckets of ``{module}.lora_A.weight`` (A [r, in]) and
``{module}.lora_B.weight`` (s · B [out, r], the scale s = alpha / r folded in by the trainer).
:func:`merge_lora` applies them:

* fp32 weights: ``W = W0 + s · B A`` (merged in fp32), where ``W0`` is a copy of the weight kept
  from before the first LoRA load: every version merges afresh onto the same base (no drift).
* bf16/fp16 weights: **unmerged**. ``W`` stays ``W0`` and the module's output gets
  ``(x Aᵀ)(s B)ᵀ`` added in the weight's dtype (a forward hook), as the trainer's PEFT layers
  compute it. Rounding ``W0 + s · B A`` to bf16 loses the part of the update below half a bf16
  ulp of ``W0`` (2⁻⁹ relative), and LoRA updates are mostly that small: on the main job's
  adapters (SmolLM2-135M, rank 16) the merged bf16 model was 19-40× further from the fp32
  policy (mismatch KL k3) than the unmerged one (2026-12-05, docs/performance.md).

A full-weight load replaces the base (the kept copies of those weights, and the adapters of
those modules, drop).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from arealite.api.weight_update import InitGroup, UpdateBucket
from arealite.weights.group import WeightUpdateGroup, broadcast_tensor, new_weight_update_group

logger = logging.getLogger("arealite.server")


def load_weights_from_disk(model: torch.nn.Module, path: str) -> tuple[int, list[str]]:
    """Copy safetensors weights from folder ``path`` into ``model`` in place.

    Accepts a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
    Every tensor is validated (known key, same shape) and every expected parameter must be
    present -- except ones tied to a present parameter, e.g. ``lm_head.weight`` with
    ``tie_word_embeddings`` -- before anything is copied, so on error the old weights stay.
    Tensors the model does not know are ignored (``strict=False``).
    Returns ``(num_loaded, unexpected_keys)``; raises ``ValueError`` with a readable message.
    """
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise ValueError(f"model_path {path!r} is not a directory")
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return load_adapter_from_disk(model, path), []
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r}")
    loaded = {}
    for name in files:
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise ValueError(f"missing weight shard {file_path!r}")
        loaded.update(load_file(file_path))

    expected = model.state_dict()
    unexpected = [k for k in loaded if k not in expected]  # ignored, like strict=False
    loaded = {k: v for k, v in loaded.items() if k in expected}
    for key, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(f"shape mismatch for {key!r}: file has {tuple(tensor.shape)}, "
                             f"model expects {tuple(expected[key].shape)}")
    # Parameters sharing storage (tied weights) count as present if any alias is loaded.
    by_storage: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(key)
    missing = [keys[0] for keys in by_storage.values() if not any(k in loaded for k in keys)]
    if missing:
        raise ValueError(f"{len(missing)} expected tensors missing from {path!r}, "
                         f"e.g. {missing[:3]}")
    with torch.no_grad():
        model.load_state_dict({k: v.to(expected[k].dtype) for k, v in loaded.items()},
                              strict=False)
    _drop_lora_base(model, loaded)
    return len(loaded), unexpected


LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def _drop_lora_base(model: torch.nn.Module, names) -> None:
    """Full weights ``names`` were loaded: they are the new base of later LoRA merges, and the
    unmerged adapters of their modules no longer apply."""
    base = getattr(model, "_arealite_lora_w0", None)
    for n in names if base else ():
        base.pop(n, None)
    unmerged = getattr(model, "_arealite_lora_unmerged", None)
    for n in names if unmerged else ():
        module = unmerged.pop(n, None)
        if module is not None:
            module._arealite_lora = None


def _lora_hook(module: torch.nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a module with an unmerged adapter: ``output + (x Aᵀ)(s B)ᵀ``."""
    lora = module._arealite_lora
    if lora is None:
        return output
    a, b = lora
    return output + torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b)


def _attach_lora(model: torch.nn.Module, name: str, module: torch.nn.Linear, a: torch.Tensor,
                 b: torch.Tensor) -> None:
    """Serve ``module`` (``model``'s ``name``) with the adapter A [r, in], s·B [out, r] unmerged,
    in the weight's dtype; ``model`` lists it under ``{name}.weight`` for :func:`_drop_lora_base`."""
    w = module.weight
    module._arealite_lora = (a.to(device=w.device, dtype=w.dtype), b.to(device=w.device, dtype=w.dtype))
    if not hasattr(module, "_arealite_lora_hook"):
        module._arealite_lora_hook = module.register_forward_hook(_lora_hook)
    model.__dict__.setdefault("_arealite_lora_unmerged", {})[name + ".weight"] = module


def load_adapter_from_disk(model: torch.nn.Module, path: str) -> int:
    """Merge the PEFT LoRA adapter folder ``path`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes) into ``model``
    with :func:`merge_lora`; s = ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
    ``use_rslora``). Returns the number of merged modules.

    Raises:
        ValueError: not a LoRA adapter, a setting the merge does not implement
            (``fan_in_fan_out``, per-module rank/alpha patterns, ``modules_to_save``, DoRA),
            or a tensor that does not fit the model (nothing is changed then).
    """
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LoRA adapters are merged")
    for key in ("fan_in_fan_out", "use_dora", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{path}: adapter_config {key}={cfg[key]!r} is not supported by the server's merge")
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"no adapter_model.safetensors in {path!r}")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / (r ** 0.5 if cfg.get("use_rslora") else r)
    tensors = {}
    for key, t in load_file(file).items():
        name = key.removeprefix("base_model.model.")
        if not name.endswith((LORA_A, LORA_B)):
            raise ValueError(f"{path}: tensor {key!r} is not a LoRA A/B matrix (modules_to_save is not supported)")
        tensors[name] = t * scale if name.endswith(LORA_B) else t
    n = merge_lora(model, tensors)
    if getattr(model, "_arealite_lora_pending", None):
        pending = sorted(model._arealite_lora_pending)
        model._arealite_lora_pending.clear()
        raise ValueError(f"{path}: LoRA matrices without their pair, e.g. {pending[:3]}")
    return n


def merge_lora(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Apply the adapter of every module whose ``{module}.lora_A.weight`` (A [r, in]) and
    ``{module}.lora_B.weight`` (B [out, r], already scaled) are both known, from ``tensors`` or
    from earlier calls (a pair may straddle two buckets; the first half waits on the model):
    fp32 weights get ``W = W0 + B A`` (``W0``: the module's weight before its first merge, kept
    on the model); other dtypes keep ``W`` and add ``(x Aᵀ) Bᵀ`` to the module's output in that
    dtype (unmerged; the module docstring says why). Every tensor is validated (linear module
    of the model, shapes fit ``W`` [out, in] and each other) before anything changes. Returns
    the number of modules given their adapter now.

    Raises:
        ValueError: naming the first tensor that does not fit.
    """
    modules = dict(model.named_modules())
    pending = model.__dict__.setdefault("_arealite_lora_pending", {})
    base = model.__dict__.setdefault("_arealite_lora_w0", {})
    new = {**pending, **tensors}
    for key, t in tensors.items():
        mname = key.removesuffix(LORA_A).removesuffix(LORA_B)
        mod = modules.get(mname)
        if not isinstance(mod, torch.nn.Linear):
            raise ValueError(f"LoRA tensor {key!r}: {mname!r} is no linear layer of the served model "
                             "(the trainer's architecture differs from the server's?)")
        out_f, in_f = mod.weight.shape
        if t.dim() != 2 or (key.endswith(LORA_A) and t.shape[1] != in_f) or (key.endswith(LORA_B) and t.shape[0] != out_f):
            raise ValueError(f"LoRA tensor {key!r}: shape {tuple(t.shape)} does not fit {mname}.weight {(out_f, in_f)}")
        other = new.get(mname + (LORA_B if key.endswith(LORA_A) else LORA_A))
        if other is not None and (t.shape[0] if key.endswith(LORA_A) else t.shape[1]) != (
                other.shape[1] if key.endswith(LORA_A) else other.shape[0]):
            raise ValueError(f"LoRA tensor {key!r}: rank differs from its pair's")
    merged = 0
    with torch.no_grad():
        for key in list(new):
            if not key.endswith(LORA_A) or (mname := key.removesuffix(LORA_A)) + LORA_B not in new:
                continue
            w = modules[mname].weight
            a, b = new.pop(key), new.pop(mname + LORA_B)
            if w.dtype == torch.float32:
                w0 = base.setdefault(mname + ".weight", w.detach().clone())
                w.copy_(w0 + b.to(w.device).float() @ a.to(w.device).float())
            else:
                _attach_lora(model, mname, modules[mname], a, b)
            merged += 1
    pending.clear()
    pending.update(new)  # halves still waiting for their pair
    return merged


def load_named_tensors(model: torch.nn.Module, tensors: dict) -> int:
    """Copy a subset of parameters ``{name: tensor}`` into ``model`` in place (one bucket of a
    distributed update). Names must be known and shapes equal; all are checked before anything
    is copied. Tied parameters update together (shared storage). Values are cast to the
    model's dtype. Returns the number of tensors; raises ``ValueError`` naming the first bad one.
    """
    if any(k.endswith((LORA_A, LORA_B)) for k in tensors):  # a LoRA actor's adapters
        if not all(k.endswith((LORA_A, LORA_B)) for k in tensors):
            raise ValueError("a bucket mixes LoRA matrices and full weights; send them in separate buckets")
        merge_lora(model, tensors)
        return len(tensors)
    expected = model.state_dict()
    for key, tensor in tensors.items():
        if key not in expected:
            raise ValueError(f"unknown parameter {key!r} (the trainer's model architecture "
                             f"differs from the server's?); e.g. known: {list(expected)[:3]}")
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(f"shape mismatch for {key!r}: sent {tuple(tensor.shape)}, "
                             f"model expects {tuple(expected[key].shape)}")
    with torch.no_grad():
        for key, tensor in tensors.items():
            expected[key].copy_(tensor.to(device=expected[key].device, dtype=expected[key].dtype))
    _drop_lora_base(model, tensors)
    return len(tensors)


class WeightGroups:
    """The weight-update groups this server has joined, by group name (one rank each: no
    tensor parallelism here, so the server's rank is the request's ``rank_offset``).

    Args:
        device: the model's device; NCCL groups receive there, gloo groups on the CPU.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._groups: dict[str, WeightUpdateGroup] = {}

    def check(self, req: InitGroup) -> None:
        """Raises: ValueError: ``nccl`` asked of a CPU server."""
        if req.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs a GPU server; use 'gloo' on CPU")

    def join(self, req: InitGroup) -> str:
        """Join the trainer's group at rank ``req.rank_offset``; blocks until every rank has
        joined. A group of the same name is replaced (a restarted trainer re-creates its group
        under the same name: the old one is dead; a receive still blocked in it fails once the
        old trainer's connections close or at that group's timeout). Returns the reply message.

        Raises:
            ValueError: see :meth:`check`.
            RuntimeError: the rendezvous failed (the message names the group and address).
        """
        self.check(req)
        if self._groups.pop(req.group_name, None) is not None:
            logger.warning("replacing weight-update group %r (a new trainer joined)", req.group_name)
        try:
            group = new_weight_update_group(req.master_address, req.master_port, req.rank_offset,
                                            req.world_size, req.group_name, req.backend)
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            logger.exception("joining weight-update group failed")
            raise RuntimeError(f"joining group {req.group_name!r} at {req.master_address}:{req.master_port} "
                               f"failed: {e}") from e
        self._groups[req.group_name] = group
        return f"Joined {req.group_name!r} as rank {req.rank_offset}/{req.world_size}."

    def has(self, name: str) -> bool:
        return name in self._groups

    def receive(self, bucket: UpdateBucket) -> dict[str, torch.Tensor]:
        """Receive one broadcast from rank 0 per name of ``bucket``, in order, into fresh tensors
        of the declared dtype and shape (on the model's device for NCCL, else the CPU); blocks.

        Raises:
            KeyError: no group ``bucket.group_name``.
            RuntimeError: a broadcast failed (the weights may be partly updated: push again).
        """
        group = self._groups[bucket.group_name]
        device = self.device if group.backend == "nccl" else torch.device("cpu")
        out = {}
        try:
            for name, dtype, shape in zip(bucket.names, bucket.torch_dtypes(), bucket.shapes):
                t = torch.empty(shape, dtype=dtype, device=device)
                broadcast_tensor(group, t)
                out[name] = t
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            logger.exception("receiving weights failed")
            raise RuntimeError(f"receiving {len(bucket.names)} tensors failed (weights may be partly "
                               f"updated; push again): {e}") from e
        return out

    def leave(self, name: str) -> bool:
        """Forget group ``name`` (released with its last reference); False if there is none."""
        return self._groups.pop(name, None) is not None
