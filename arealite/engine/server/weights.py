"""Weight loading for the server: a folder of safetensors, a bucket of named tensors, and the
weight-update groups through which the trainer broadcasts buckets
(:mod:`arealite.engine.weight_group`; request bodies: :mod:`arealite.api.weight_update`).

The loads run in the scheduler thread between decode steps; joining a group and receiving a
bucket block, so the HTTP layer runs them in a worker thread.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from arealite.api.weight_update import InitGroup, UpdateBucket
from arealite.engine.weight_group import WeightUpdateGroup, broadcast_tensor, new_weight_update_group

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
    return len(loaded), unexpected


def load_named_tensors(model: torch.nn.Module, tensors: dict) -> int:
    """Copy a subset of parameters ``{name: tensor}`` into ``model`` in place (one bucket of a
    distributed update). Names must be known and shapes equal; all are checked before anything
    is copied. Tied parameters update together (shared storage). Values are cast to the
    model's dtype. Returns the number of tensors; raises ``ValueError`` naming the first bad one.
    """
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
