"""The torch.distributed side of weight updates: a standalone process group between the trainer
(rank 0) and the inference-server ranks, and the broadcast of one tensor over it.

Shared by the trainer (:mod:`arealite.weights.sync`), our server
(:mod:`arealite.server`) and the vLLM worker extension (:mod:`arealite.server.vllm_ext`).
The group is *separate* from the trainer's default group: its own ``TCPStore`` (hosted by rank 0)
and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) built on it, so the servers never
see the FSDP ranks. Imports only torch and :mod:`arealite.api.weight_update`: it runs inside
vLLM's worker, whose environment has none of arealite's other dependencies.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from arealite.api.weight_update import BACKENDS


@dataclass
class WeightUpdateGroup:
    """A standalone process group and the store it was built on (kept alive with it)."""

    pg: object
    store: object
    backend: str
    rank: int
    world_size: int


def new_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                            group_name: str, backend: str, timeout_s: float = 600.0) -> WeightUpdateGroup:
    """Join a standalone process group (not the default group) through a TCP rendezvous.

    Rank 0 hosts the ``TCPStore`` at ``master_address:master_port``; the other ranks connect to
    it. Blocks until all ``world_size`` ranks have joined.

    Args:
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors of the current device).
        timeout_s: rendezvous and collective timeout [s].

    Returns: a :class:`WeightUpdateGroup`; use :func:`broadcast_tensor` on it.

    Raises:
        ValueError: unknown backend or rank outside ``[0, world_size)``.
        RuntimeError / DistStoreError: a rank did not join within ``timeout_s``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    group = WeightUpdateGroup(pg, store, backend, rank, world_size)
    # A first collective so that every rank has really connected before anyone returns.
    broadcast_tensor(group, torch.zeros(1, device="cuda" if backend == "nccl" else "cpu"))
    return group


def broadcast_tensor(group: WeightUpdateGroup, tensor: torch.Tensor, src: int = 0, abort_if=None) -> None:
    """Blocking broadcast of ``tensor`` (in place on receivers) from ``src`` over ``group``.

    ``abort_if``: optional callable polled while waiting; when it returns an exception, that
    exception is raised instead of waiting for the group timeout (e.g. a server rejected the
    request and will never join this broadcast).
    """
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    work = group.pg.broadcast([tensor], opts)
    if abort_if is None:
        work.wait()
        return
    while not work.is_completed():
        error = abort_if()
        if error is not None:
            raise error
        time.sleep(0.0005)
    work.wait()  # raises if the collective failed
