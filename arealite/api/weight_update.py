"""The weight-update protocol: what a trainer sends an inference server to change its weights,
and what the server answers.

One definition shared by the trainer side (:mod:`arealite.weights.sync` and the HTTP
adapters of :mod:`arealite.inference.remote`), our server (:mod:`arealite.server`) and the
vLLM worker extension (:mod:`arealite.server.vllm_ext`). Pure data: endpoint names, request
bodies as small frozen dataclasses that build (``to_json``) and validate (``from_json``) the
JSON, dtype names, and the one reply shape. The torch.distributed side (joining the group,
broadcasting) is :mod:`arealite.weights.group`.

Wire format: SGLang's HTTP protocol (SGLang's native API, <https://docs.sglang.ai/basic_usage/native_api.html>:
``/update_weights_from_disk`` and the distributed-update endpoints), unchanged:

* ``POST /init_weights_update_group`` :class:`InitGroup` ``{master_address, master_port,
  rank_offset, world_size, group_name, backend}``: the server's rank ``r`` (its TP rank, 0
  without TP) joins a standalone process group of ``world_size`` ranks at ``rank_offset + r``;
  the trainer is rank 0.
* ``POST /update_weights_from_distributed`` :class:`UpdateBucket` ``{names, dtypes, shapes,
  group_name, flush_cache, weight_version?}``: one bucket; rank 0 then broadcasts one tensor per
  name, in list order. Only the last bucket of a push carries ``weight_version``.
* ``POST /destroy_weights_update_group`` ``{group_name}``.
* ``POST /update_weights_from_disk`` :class:`DiskUpdate` ``{model_path, weight_version?,
  abort_all_requests?}``.
* ``GET /get_model_info`` -> ``{..., "weight_version"}``.
* Every reply is :func:`reply` ``{"success": bool, "message": str, "weight_version"?}``
  (HTTP 200 on success, 400 on a refusal).

vLLM has no such endpoints: the same bodies go as keyword arguments through ``POST
/collective_rpc`` ``{"method", "kwargs"}`` to the worker extension's methods named in
:data:`VLLM_METHODS`.

Imports torch (dtypes) and nothing else of arealite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_GROUP_NAME = "weight_update_group"

INIT_GROUP_ENDPOINT = "/init_weights_update_group"
UPDATE_DISTRIBUTED_ENDPOINT = "/update_weights_from_distributed"
DESTROY_GROUP_ENDPOINT = "/destroy_weights_update_group"
UPDATE_FROM_DISK_ENDPOINT = "/update_weights_from_disk"
MODEL_INFO_ENDPOINT = "/get_model_info"  # GET; the reply's "weight_version"

VLLM_RPC_ENDPOINT = "/collective_rpc"
# Request kind -> method of arealite.server.vllm_ext.WeightUpdateExtension (vLLM refuses method
# names its worker already has, hence the prefix).
VLLM_METHODS = {
    "init_group": "arealite_init_group",
    "update_distributed": "arealite_update_from_distributed",
    "destroy_group": "arealite_destroy_group",
    "update_from_disk": "arealite_update_from_disk",
    "weight_version": "arealite_weight_version",
    "lora_path": "arealite_lora_path",
    "set_weight_version": "arealite_set_weight_version",
}

BACKENDS = ("gloo", "nccl")  # gloo: CPU tensors; nccl: CUDA tensors


class ProtocolError(ValueError):
    """A malformed request body; ``field`` names the offending field ("body" for the whole)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name
        self.message = message


# ----------------------------------------------------------------------------- values


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``; ValueError if unknown."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use e.g. 'float32' or 'bfloat16'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the wire name; inverse of :func:`parse_dtype`)."""
    return str(dtype).removeprefix("torch.")


def parse_version(v):
    """A ``weight_version`` field: an integer, or a string of one (SGLang's type is str);
    None stays None.

    Raises:
        ValueError: anything else (the message names ``weight_version``).
    """
    if v is None or _is_int(v):
        return v
    if isinstance(v, str) and v.lstrip("-").isdigit():
        return int(v)
    raise ValueError(f"weight_version must be an integer (or a string of one), got {v!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("body", "request body must be a JSON object")
    return body


def _version(body: dict):
    try:
        return parse_version(body.get("weight_version"))
    except ValueError as e:
        raise ProtocolError("weight_version", str(e)) from None


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class InitGroup:
    """Body of ``/init_weights_update_group``: join the trainer's weight-update group."""

    master_address: str  # host of the group's TCPStore (trainer rank 0)
    master_port: int  # its port (AReaL sends a numeric string; both are accepted)
    rank_offset: int  # the server's first rank in the group (1 + server index · tp)
    world_size: int  # trainer + every server rank
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"  # "gloo" | "nccl"

    def to_json(self) -> dict:
        return {"master_address": self.master_address, "master_port": int(self.master_port),
                "rank_offset": self.rank_offset, "world_size": self.world_size,
                "group_name": self.group_name, "backend": self.backend}

    @classmethod
    def from_json(cls, body, default_backend: str = "nccl") -> InitGroup:
        """Validate a body; ``backend`` defaults to ``default_backend`` when absent.

        Raises:
            ProtocolError: a field is missing or of the wrong type, ``1 <= rank_offset <
                world_size`` does not hold (rank 0 is the trainer), or the backend is unknown.
        """
        body = _object(body)
        try:
            address = body["master_address"]
            port = int(body["master_port"])
            rank, world = body["rank_offset"], body["world_size"]
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError("body", "need master_address, master_port, rank_offset, world_size: "
                                f"{e!r}") from None
        if not isinstance(address, str):
            raise ProtocolError("master_address", f"master_address must be a string, got {address!r}")
        if not (_is_int(rank) and _is_int(world) and 1 <= rank < world):
            raise ProtocolError("rank_offset", "rank_offset and world_size must be integers with "
                                "1 <= rank_offset < world_size (rank 0 is the trainer)")
        backend = body.get("backend", default_backend)
        if backend not in BACKENDS:
            raise ProtocolError("backend", f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        name = body.get("group_name", DEFAULT_GROUP_NAME)
        if not isinstance(name, str):
            raise ProtocolError("group_name", f"group_name must be a string, got {name!r}")
        return cls(address, port, rank, world, name, backend)


@dataclass(frozen=True)
class UpdateBucket:
    """Body of ``/update_weights_from_distributed``: one bucket of a push. The trainer then
    broadcasts one tensor per name, in list order, from rank 0 of the group."""

    names: tuple  # HF parameter names (tied weights once)
    dtypes: tuple  # wire dtype names (dtype_name), one per name
    shapes: tuple  # full (unsharded) shapes, one tuple of ints per name
    group_name: str = DEFAULT_GROUP_NAME
    weight_version: int | None = None  # set on the last bucket of a push only
    flush_cache: bool = True  # SGLang's flag; our server empties its prefix store at any load

    @classmethod
    def of_tensors(cls, named_tensors, group_name: str = DEFAULT_GROUP_NAME,
                   weight_version: int | None = None) -> UpdateBucket:
        """The bucket describing ``[(name, tensor), ...]``."""
        return cls(tuple(n for n, _ in named_tensors), tuple(dtype_name(t.dtype) for _, t in named_tensors),
                   tuple(tuple(t.shape) for _, t in named_tensors), group_name, weight_version)

    def torch_dtypes(self) -> list[torch.dtype]:
        return [parse_dtype(d) for d in self.dtypes]

    def to_json(self) -> dict:
        """The wire body; ``weight_version`` only when set (a server keeps its version until the
        last bucket)."""
        out = {"names": list(self.names), "dtypes": list(self.dtypes),
               "shapes": [list(s) for s in self.shapes], "group_name": self.group_name,
               "flush_cache": self.flush_cache}
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        return out

    @classmethod
    def from_json(cls, body) -> UpdateBucket:
        """Validate a body (before any tensor is received).

        Raises:
            ProtocolError: the lists differ in length or hold the wrong types, a dtype is
                unknown, or ``weight_version`` is not an integer.
        """
        body = _object(body)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        ok = (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
              and len(names) == len(dtypes) == len(shapes)
              and all(isinstance(s, list) and all(_is_int(d) for d in s) for s in shapes))
        if not ok:
            raise ProtocolError("names", "names, dtypes and shapes must be lists of equal length "
                                "(shapes: lists of integers)")
        version = _version(body)
        for d in dtypes:
            try:
                parse_dtype(d)
            except ValueError as e:
                raise ProtocolError("dtypes", str(e)) from None
        return cls(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes),
                   body.get("group_name", DEFAULT_GROUP_NAME), version, bool(body.get("flush_cache", True)))


@dataclass(frozen=True)
class DiskUpdate:
    """Body of ``/update_weights_from_disk``: load an HF folder saved by ``save_pretrained``."""

    model_path: str  # a folder on the server's machine
    weight_version: int | None = None  # reported after a successful load
    abort_all_requests: bool = False  # abort in-flight requests first (their partial output returns)

    def to_json(self) -> dict:
        return {"model_path": self.model_path, "weight_version": self.weight_version,
                "abort_all_requests": self.abort_all_requests}

    @classmethod
    def from_json(cls, body) -> DiskUpdate:
        """Raises: ProtocolError: no string ``model_path``, or a bad ``weight_version``."""
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise ProtocolError("model_path", "body must be {\"model_path\": str}")
        return cls(body["model_path"], _version(body), bool(body.get("abort_all_requests")))


def destroy_group_body(group_name: str = DEFAULT_GROUP_NAME) -> dict:
    """Body of ``/destroy_weights_update_group``."""
    return {"group_name": group_name}


def parse_destroy_group(body) -> str:
    """The ``group_name`` of a ``/destroy_weights_update_group`` body (default when absent or
    when the body is not an object)."""
    return body.get("group_name", DEFAULT_GROUP_NAME) if isinstance(body, dict) else DEFAULT_GROUP_NAME


# ----------------------------------------------------------------------------- replies


def reply(success: bool, message: str, **extra) -> dict:
    """The reply of every weight-update call: ``{"success", "message", **extra}``; ``extra`` holds
    e.g. ``weight_version`` (vLLM workers) or SGLang's ``num_paused_requests``."""
    return {"success": bool(success), "message": str(message), **extra}
