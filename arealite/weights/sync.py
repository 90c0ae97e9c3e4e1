"""Distributed weight sync: the trainer broadcasts parameters to inference servers in buckets.

Protocol (SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed``,
<https://docs.sglang.ai/basic_usage/native_api.html>):

1. Once: every server gets ``POST /init_weights_update_group`` ``{master_address, master_port,
   rank_offset, world_size, group_name, backend}`` and joins a process group of
   ``world_size = n_servers · tp + 1`` ranks at rank ``rank_offset + tp_rank``
   (``rank_offset = 1 + i · tp``); trainer rank 0 joins the same group as rank 0, at the same
   time (every join blocks until all ranks are there). The group is *separate* from the
   trainer's default group: its own ``TCPStore`` (hosted by trainer rank 0) and a
   ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) built on it, so the servers never
   see the FSDP ranks.
2. Every update, for each bucket of parameters (at most ``bucket_bytes``, at least one tensor):
   every FSDP rank all-gathers the full tensors (``DTensor.full_tensor``, a collective); rank 0
   posts ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name,
   flush_cache, weight_version}`` to every server and, concurrently, broadcasts the tensors in
   the declared order from rank 0. A server allocates ``(dtype, shape)`` per name, receives,
   then loads the bucket into its model.

Names are HF parameter names from ``model.named_parameters()`` (tied weights appear once, e.g.
``model.embed_tokens.weight`` and no ``lm_head.weight`` with ``tie_word_embeddings``), dtypes
are ``str(dtype)`` without ``torch.``, shapes are the full (unsharded) shapes.

Failures (a server dies or hangs during an update): :func:`broadcast_weights` raises
:class:`WeightSyncError` on every trainer rank, naming the servers that failed (``err.failed``).
Bound: a server whose process is gone closes its TCP connections, so gloo's broadcast (or the
HTTP call) fails at once (0.2 s from the start of the push in tests/test_weight_sync_failure.py);
a server that hangs costs at most ``timeout_s`` (``rollout.weight_sync_timeout``) per bucket (or
group setup) plus a 5 s ``/health`` probe that identifies it (SIGSTOP, ``timeout_s=5``: 10.05 s).
The broken group is then released and forgotten on the trainer, and the surviving
servers are asked to ``/destroy_weights_update_group``; the next call re-creates the group with
the addresses it is given (the live ones: ``RemoteInferenceEngine.exclude_servers(err.failed)``
then ``weight_update_meta``). Survivors hold partly updated weights until that push.
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from arealite.api.weight_update import DEFAULT_GROUP_NAME, UpdateBucket
from arealite.inference.adapters import SGLangAdapter, ServerError
from arealite.inference.remote import post_control, post_json
from arealite.utils.proc import free_port
from arealite.weights.group import WeightUpdateGroup, broadcast_tensor, new_weight_update_group

logger = logging.getLogger("arealite.weight_sync")
HEALTH_PROBE_TIMEOUT = 5.0  # [s] a server that does not answer GET /health within this failed


class WeightSyncError(ServerError):
    """A distributed weight update failed; raised on every trainer rank.

    Attributes:
        failed: addresses of the servers that died or hung (no answer to ``GET /health`` within
            ``HEALTH_PROBE_TIMEOUT`` after the failure); empty when every server is healthy (e.g.
            one refused the request: its reason is in the message).
    """

    def __init__(self, message: str, failed=()):
        super().__init__(message)
        self.failed = list(failed)


# ----------------------------------------------------------------------------- trainer side


def _master_address(addresses: list[str]) -> str:
    hosts = {a.rsplit(":", 1)[0] for a in addresses}
    if hosts <= {"127.0.0.1", "localhost"}:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


_GROUPS: dict[tuple, WeightUpdateGroup] = {}  # (addresses, group_name) -> group; trainer rank 0


def _run_concurrently(fn, *args):
    """Run ``fn(*args)`` in a thread; returns a join function that re-raises its exception."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in join
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()

    def failed():  # the call's exception if it already finished with one, else None
        return box.get("error") if not t.is_alive() else None

    def join(timeout: float | None = None):
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    join.failed = failed
    join.done = lambda: not t.is_alive()
    return join


def _join_all(joins):
    """Results of concurrent calls in order; raises the first failure as soon as it happens
    (the others may be blocked in a collective that the failed server will never join)."""
    while True:
        for j in joins:
            error = j.failed()
            if error is not None:
                raise error
        if all(j.done() for j in joins):
            return [j() for j in joins]
        time.sleep(0.002)


def init_group(addresses: list[str], backend: str, tp_size: int = 1,
               group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 600.0, adapter=SGLangAdapter):
    """Trainer rank 0: create the weight-update group with every server (cached per
    ``(addresses, group_name)``; :func:`forget_group` drops it).

    Posts ``/init_weights_update_group`` to all servers from threads while joining as rank 0
    (also from a thread), and returns or raises as soon as any of them fails: a dead server
    does not make the trainer wait for the rendezvous timeout.

    Raises:
        ServerError: a server refused or did not answer (its message is included).
        RuntimeError / DistStoreError: the rendezvous failed or timed out (``timeout_s`` [s]).
    """
    key = (tuple(addresses), group_name)
    if key in _GROUPS:
        return _GROUPS[key]
    master, port = _master_address(addresses), free_port("")
    world = len(addresses) * tp_size + 1

    def post_all():  # concurrently: each call returns only once every rank has joined
        _join_all([_run_concurrently(post_control, adapter, a, adapter.init_group_request(
            master, port, 1 + i * tp_size, world, group_name, backend), timeout_s, 1)
            for i, a in enumerate(addresses)])  # retries=1: not idempotent; raises on a refusal

    # A failed rendezvous thread stays blocked until timeout_s; it is a daemon and harmless.
    pg, _ = _join_all([_run_concurrently(new_weight_update_group, master, port, 0, world, group_name,
                                         backend, timeout_s),
                       _run_concurrently(post_all)])
    _GROUPS[key] = pg
    logger.info("weight-update group %r: trainer + %d server ranks (%s)", group_name, world - 1, backend)
    return pg


def forget_group(addresses: list[str], group_name: str = DEFAULT_GROUP_NAME, notify=(), adapter=SGLangAdapter) -> None:
    """Trainer rank 0: abort and drop the cached group of ``addresses`` (if any), then ask each
    server in ``notify`` to ``/destroy_weights_update_group`` (best effort, a warning on failure),
    so that a later :func:`init_group` with the same ``group_name`` is accepted.

    The process group is released (gloo: ``abort()`` does not close the connections, freeing
    the last reference does; NCCL: ``abort()`` first, untested: needs one GPU per rank), so a
    server still waiting in a broadcast of the old group fails at once instead of after its own
    timeout. Its destructor may wait for an in-flight collective, so the last reference is
    dropped in a daemon thread. Call it outside ``except`` blocks: a live traceback keeps the
    group's objects alive.
    """
    group = _GROUPS.pop((tuple(addresses), group_name), None)
    if group is not None:
        doomed, backend = [group.pg, group.store], group.backend
        group.pg = group.store = None  # callers may still hold the WeightUpdateGroup

        def release():
            if backend == "nccl":  # NCCL: abort the communicator (kills a kernel stuck on a dead peer)
                try:
                    doomed[0].abort()
                except Exception as e:  # noqa: BLE001 - best effort; the group is dropped anyway
                    logger.warning("aborting weight-update group %r failed: %r", group_name, e)
            doomed.clear()
            gc.collect()

        threading.Thread(target=release, daemon=True).start()
    for a in notify:
        try:
            post_control(adapter, a, adapter.destroy_group_request(group_name), HEALTH_PROBE_TIMEOUT, 1)
        except ServerError as e:
            logger.warning("%s did not leave weight-update group %r: %s", a, group_name, e)


def unhealthy_servers(addresses: list[str], timeout: float = HEALTH_PROBE_TIMEOUT) -> list[str]:
    """The servers among ``addresses`` that do not answer ``GET /health`` within ``timeout`` [s]
    (probed concurrently, one attempt each)."""

    def probe(a):
        try:
            post_json(a, "/health", timeout=timeout, retries=1, method="GET")
            return False
        except ServerError:
            return True

    joins = [_run_concurrently(probe, a) for a in addresses]
    out = []
    for a, j in zip(addresses, joins):
        try:
            bad = j(timeout=timeout + 5)
        except Exception:  # noqa: BLE001 - a probe that itself hangs counts as unhealthy
            bad = True
        if bad:
            out.append(a)
    return out


def iter_buckets(named_tensors, bucket_bytes: int):
    """Group an iterable of ``(name, tensor)`` into lists of at most ``bucket_bytes`` bytes.

    A bucket always holds at least one tensor (a tensor larger than the budget is alone), so
    ``bucket_bytes=0`` gives one tensor per bucket. The order is kept.
    """
    bucket, size = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def _full_tensors(model: torch.nn.Module):
    """``(name, full tensor)`` per parameter; all-gathers DTensors (collective on every rank)."""
    for name, p in model.named_parameters():
        data = p.data
        if hasattr(data, "full_tensor"):
            data = data.full_tensor()
        yield name, data.detach()


class _PushFailed(Exception):
    """Internal: a bucket push failed; ``refused`` = servers whose HTTP call failed or said no
    (a healthy one among them may only have lost a peer of the broken group)."""

    def __init__(self, cause: BaseException, refused: list[str]):
        super().__init__(repr(cause))
        self.cause, self.refused = cause, refused


def _send_bucket(pg: WeightUpdateGroup, addresses: list[str], payload: dict, tensors, backend: str,
                 timeout_s: float, adapter=SGLangAdapter) -> None:
    """Rank 0: post the bucket to every server (threads) and broadcast its tensors in order.

    Fails as soon as one server's call fails, a broadcast fails (gloo: a peer closed its
    connection), or ``timeout_s`` [s] has passed since the bucket started.

    Raises:
        _PushFailed: with the cause and the servers already known to have failed.
    """
    deadline = time.monotonic() + timeout_s
    joins = [_run_concurrently(post_control, adapter, a, adapter.update_distributed_request(payload), timeout_s, 1)
             for a in addresses]

    def abort_if():  # polled while broadcasting and while waiting for the replies
        for j in joins:
            if j.failed() is not None:
                return j.failed()
        if time.monotonic() > deadline:
            return TimeoutError(f"bucket not done within timeout_s={timeout_s} s (rollout.weight_sync_timeout)")
        return None

    try:
        for t in tensors:
            t = t.contiguous()
            if backend == "gloo" and t.device.type != "cpu":
                t = t.cpu()
            broadcast_tensor(pg, t, abort_if=abort_if)
        while not all(j.done() for j in joins):  # post_control raises on "success": false
            error = abort_if()
            if error is not None:
                raise error
            time.sleep(0.002)
        for j in joins:
            j()  # re-raises a call's failure
    except Exception as e:
        raise _PushFailed(e, [a for a, j in zip(addresses, joins) if j.failed() is not None]) from e


@dataclass
class _Push:
    """The context of one :func:`broadcast_weights` call on rank 0 and its steps (group set-up,
    bucket sends, the failure message)."""

    addresses: list[str]
    version: int
    backend: str
    tp_size: int
    group_name: str
    timeout_s: float
    adapter: Any
    start: float  # time.perf_counter() at the call

    def failure(self, where: str, e: BaseException) -> tuple[str, list[str]]:
        """The (logged) message of a push that failed ``where`` with ``e``, and the servers it
        blames: only dead or hung ones (no answer to ``GET /health``); a healthy server whose
        receive failed may just have lost a peer of the broken group, and it can join the next."""
        cause = e.cause if isinstance(e, _PushFailed) else e
        bad = unhealthy_servers(self.addresses)
        refused = [a for a in (e.refused if isinstance(e, _PushFailed) else []) if a not in bad]
        survivors = [a for a in self.addresses if a not in bad]
        message = (f"distributed weight update to version {self.version} failed {where} after "
                   f"{time.perf_counter() - self.start:.2f} s: "
                   + (f"server(s) {', '.join(bad)} died or hung (no answer to GET /health)" if bad
                      else "no dead or hung server found")
                   + (f"; {', '.join(refused)} answered but failed the update" if refused else "")
                   + f" (cause: {cause!r}). The weight-update group was dropped"
                   + (f"; servers {survivors} may hold partly updated weights" if survivors else "")
                   + (": exclude the failed servers (RemoteInferenceEngine.exclude_servers(err.failed)) and push "
                      "again" if bad else ": fix the cause and push again")
                   + f"; a hung server costs at most rollout.weight_sync_timeout={self.timeout_s} s per bucket")
        logger.error(message)
        return message, bad

    def open_group(self) -> tuple[WeightUpdateGroup | None, str | None, list[str]]:
        """The weight-update group with every server: ``(group, None, [])``, or ``(None, error
        message, blamed servers)`` when there is no server or the set-up failed."""
        if not self.addresses:
            return None, (f"distributed weight update to version {self.version}: no server to push to (every "
                          "server failed a control call, see the log); restart the servers or fix "
                          "rollout.addresses"), []
        try:
            return init_group(self.addresses, self.backend, self.tp_size, self.group_name, self.timeout_s,
                              self.adapter), None, []
        except Exception as e:  # noqa: BLE001 - reported on every rank by broadcast_weights
            return None, *self.failure("while creating the weight-update group", e)

    def send_buckets(self, pg: WeightUpdateGroup, buckets, n_buckets: int, stats: dict) -> tuple[str | None, list[str]]:
        """Send ``buckets`` (of ``n_buckets``; the last one carries the version) until one
        fails, counting them in ``stats``. Returns ``(None, [])``, or the failure message and
        the blamed servers; the unsent buckets are left in the iterator."""
        for k, bucket in enumerate(buckets):
            payload = UpdateBucket.of_tensors(bucket, self.group_name,
                                              self.version if k == n_buckets - 1 else None).to_json()
            try:
                _send_bucket(pg, self.addresses, payload, [t for _, t in bucket], self.backend, self.timeout_s,
                             self.adapter)
            except _PushFailed as e:
                return self.failure(f"at bucket {k + 1} ({stats['n_tensors']} tensors sent before it)", e)
            stats["n_buckets"] += 1
            stats["n_tensors"] += len(bucket)
            stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
        return None, []


def _bucket_count(specs, bucket_bytes: int) -> int:
    """How many buckets :func:`iter_buckets` makes of ``specs`` (``(name, shape, dtype)``), from
    the shapes alone, before any gather. Only the last bucket carries the version, so a server
    left half-updated by a failure keeps reporting its old version."""
    return sum(1 for _ in iter_buckets(
        ((n, torch.empty(shape, dtype=dtype, device="meta")) for n, shape, dtype in specs), bucket_bytes))


def _outcome_of_rank0(error: str | None, failed: list[str]) -> tuple[str | None, list[str]]:
    """Rank 0's ``(error, failed)`` on every rank (a broadcast, also a barrier); as is without a
    process group."""
    if not dist.is_initialized():
        return error, failed
    box = [(error, failed)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_weights(model: torch.nn.Module, addresses: list[str], version: int,
                      bucket_bytes: int, backend: str | None = None, tp_size: int = 1,
                      group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 600.0,
                      adapter=SGLangAdapter, source=None) -> dict:
    """Push ``model``'s parameters to every server; collective over the default group.

    Every rank gathers the full tensors; rank 0 sends them bucket by bucket: one
    ``/update_weights_from_distributed`` request per server and bucket (posted from a thread)
    plus one broadcast per tensor. The last bucket carries ``weight_version=version``, so a
    server reports the new version only once it holds every new tensor.

    Args:
        model: the (FSDP-sharded or plain) model.
        addresses: servers, in the order used for ``rank_offset`` (rank 0's list is used).
        bucket_bytes: bucket budget [bytes] (``rollout.weight_sync_bucket_mb`` · 2**20).
        backend: "gloo"/"nccl"; None = NCCL when the parameters are on a GPU, else gloo.
        timeout_s: bound for a hung server [s], per bucket and for the group setup
            (``rollout.weight_sync_timeout``); a dead server is detected at once.
        source: what to send instead of ``model.named_parameters()``: ``(specs, tensors)`` with
            ``specs`` a list of ``(name, shape, dtype)`` and ``tensors`` an iterable of
            ``(name, full tensor)`` in the same order (collective on every rank), e.g. a LoRA
            actor's adapters (:func:`arealite.train_engine.lora.sync_tensors`).

    Returns: ``{"n_buckets", "n_tensors", "bytes", "seconds"}`` (rank 0; zeros elsewhere).

    Raises:
        WeightSyncError: on every rank, after the remaining all-gathers (so no rank hangs), when
            ``addresses`` is empty or a server died, hung or failed the update; ``err.failed``
            names the dead or hung servers. The group is forgotten (see the module docstring);
            the other servers may hold a mix of old and new tensors until the next push.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    start = time.perf_counter()
    device = next(model.parameters()).device
    push = _Push(addresses, version, backend or ("nccl" if device.type == "cuda" else "gloo"), tp_size, group_name,
                 timeout_s, adapter, start)
    stats = {"n_buckets": 0, "n_tensors": 0, "bytes": 0, "seconds": 0.0}
    pg, error, failed = push.open_group() if rank == 0 else (None, None, [])
    specs, tensors = source or ([(n, p.shape, p.dtype) for n, p in model.named_parameters()], _full_tensors(model))
    n_buckets = _bucket_count(specs, bucket_bytes)
    with torch.no_grad():
        buckets = iter_buckets(tensors, bucket_bytes)
        if rank == 0 and error is None:
            error, failed = push.send_buckets(pg, buckets, n_buckets, stats)
        for _ in buckets:  # the remaining all-gathers (all of them on ranks ≠ 0), so that every rank reaches the end
            pass
    if rank == 0 and error is not None and addresses:  # outside the except blocks (see forget_group)
        forget_group(addresses, group_name, notify=[a for a in addresses if a not in failed], adapter=adapter)
    error, failed = _outcome_of_rank0(error, failed)
    if error is not None:
        raise WeightSyncError(error, failed)
    stats["seconds"] = time.perf_counter() - start
    return stats
