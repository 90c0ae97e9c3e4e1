"""Weight updates inside ``vllm serve``: a worker extension reached through ``/collective_rpc``.

Plain vLLM cannot take new weights over HTTP. vLLM can, however, mix a user class into its
worker (``--worker-extension-cls module.Class``: the class is appended to the worker's bases, so
its methods see ``self.model_runner`` and ``self.rank``; vLLM refuses method names the worker
already has, hence the ``arealite_`` prefix), and with ``VLLM_SERVER_DEV_MODE=1`` its API server
mounts ``POST /collective_rpc`` ``{"method": str, "args": list, "kwargs": dict, "timeout":
float?}``, which runs ``getattr(worker, method)(*args, **kwargs)`` on every worker (all TP ranks)
and answers ``{"results": [one value per worker]}`` (dicts/lists/None as-is, anything else
``str()``-ed; an exception in a worker gives HTTP 500). Sources: vLLM
``vllm/entrypoints/serve/dev/rpc/api_router.py`` and ``tests/entrypoints/openai/
test_collective_rpc.py`` (endpoint added by vLLM PR #23075, Aug 2025); AReaL's extension with
the same role: ``../shared/reference/inference-protocols.md`` §2.3.

:class:`WeightUpdateExtension` speaks the trainer's protocol of
:mod:`arealite.engine.weight_sync` (SGLang's, ``inference-protocols.md`` §1.4 / §6.3):

* ``arealite_init_group``: join the trainer's weight-update group (trainer = rank 0) at rank
  ``rank_offset + self.rank`` (``self.rank`` = the worker's rank inside this server, i.e. its
  TP rank; pipeline parallelism is not supported), through
  :func:`arealite.engine.weight_sync.new_weight_update_group`.
* ``arealite_update_from_distributed``: receive one bucket ``{names, dtypes, shapes}`` (one
  broadcast from rank 0 per name, in list order, into a fresh full-size tensor), then
  ``self.model_runner.model.load_weights(weights=[(hf_name, tensor), ...])``, vLLM's own loader
  entry point, which maps HF names onto its fused/sharded parameters.
* ``arealite_update_from_disk``: the same ``load_weights`` fed from the ``*.safetensors`` files
  of an HF folder (what ``save_pretrained`` writes).
* ``arealite_weight_version``: the version set by the last successful update (vLLM's replies
  carry none).

Every method returns ``{"success": bool, "message": str, "rank": int, "weight_version": int |
None}`` and catches its own errors, so one failing worker is reported by name instead of as an
HTTP 500. The module imports without vLLM. Tested only with a fake worker (tests/
test_vllm_ext.py), never inside a real vLLM.
"""

from __future__ import annotations

import glob
import logging
import os

import torch

from arealite.engine.weight_sync import DEFAULT_GROUP_NAME, broadcast_tensor, new_weight_update_group, parse_dtype

logger = logging.getLogger("arealite.vllm_ext")


def iter_safetensors(folder: str):
    """``(name, tensor)`` for every tensor of every ``*.safetensors`` file in ``folder`` (CPU,
    stored dtype), file by file so that only one tensor at a time is materialised.

    Raises:
        FileNotFoundError: ``folder`` holds no ``*.safetensors`` file.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder!r}; save the weights with "
                                "save_pretrained (safetensors is its default)")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class WeightUpdateExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls
    arealite.engine.vllm_ext.WeightUpdateExtension``; called via ``POST /collective_rpc``.

    Uses from the worker: ``self.rank`` (int, rank among this server's workers = TP rank) and
    ``self.model_runner`` (``.model.load_weights(weights)`` taking ``(HF name, tensor)`` pairs;
    ``.device``: the worker's GPU). Keeps its state in ``_arealite_*`` attributes (no
    ``__init__``: vLLM does not call one on extensions).
    """

    # -- helpers ---------------------------------------------------------------------------------
    def _arealite_reply(self, success: bool, message: str) -> dict:
        return {"success": success, "message": message, "rank": int(getattr(self, "rank", 0)),
                "weight_version": getattr(self, "_arealite_version", None)}

    def _arealite_groups(self) -> dict:
        if not hasattr(self, "_arealite_group_map"):
            self._arealite_group_map = {}  # group_name -> WeightUpdateGroup
        return self._arealite_group_map

    def _arealite_device(self, backend: str) -> torch.device:
        if backend == "gloo":
            return torch.device("cpu")
        device = getattr(self.model_runner, "device", None)
        return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())

    # -- RPC methods ---------------------------------------------------------------------------
    def arealite_init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl",
                            timeout_s: float = 600.0) -> dict:
        """Join the trainer's weight-update group at rank ``rank_offset + self.rank``.

        Blocks until all ``world_size`` ranks have joined (the trainer joins concurrently as
        rank 0). Same fields as SGLang's ``/init_weights_update_group``; ``master_port`` may be a
        numeric string (AReaL sends one).

        Returns: the reply dict; ``success`` false when the rank falls outside
        ``[1, world_size)``, the group name is taken, or the rendezvous fails.
        """
        try:
            worker_rank = int(getattr(self, "rank", 0))
            rank = int(rank_offset) + worker_rank
            if not 1 <= rank < int(world_size):
                return self._arealite_reply(False, f"rank_offset {rank_offset} + worker rank {worker_rank} = {rank} "
                                                   f"is outside [1, world_size={world_size}) (rank 0 is the trainer)")
            groups = self._arealite_groups()
            if groups.pop(group_name, None) is not None:  # a restarted trainer: the old group is dead
                logger.warning("replacing weight-update group %r (a new trainer joined)", group_name)
            groups[group_name] = new_weight_update_group(master_address, int(master_port), rank, int(world_size),
                                                         group_name, backend, timeout_s)
            return self._arealite_reply(True, f"joined {group_name!r} as rank {rank}/{world_size} ({backend})")
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            logger.exception("joining weight-update group failed")
            return self._arealite_reply(False, f"joining group {group_name!r} at {master_address}:{master_port} "
                                               f"failed: {e!r}")

    def arealite_update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                         group_name: str = DEFAULT_GROUP_NAME,
                                         weight_version: int | None = None) -> dict:
        """Receive one bucket from rank 0 and load it with ``model_runner.model.load_weights``.

        Args:
            names: HF parameter names, in broadcast order.
            dtypes: ``str(dtype)`` without ``torch.`` per name, e.g. "bfloat16".
            shapes: full (unsharded) shape per name.
            weight_version: reported by :meth:`arealite_weight_version` after loading.

        Every tensor is received before anything is loaded (so the group's collectives stay
        aligned even when loading fails); bad metadata fails before receiving anything, which
        the trainer sees at once (:func:`arealite.engine.remote.post_control` raises and
        ``broadcast_weights`` stops waiting). A load error leaves the weights partly updated
        (the message says so: push again or reload from disk).
        """
        group = self._arealite_groups().get(group_name)
        if group is None:
            return self._arealite_reply(False, f"no weight-update group {group_name!r}; call arealite_init_group")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            return self._arealite_reply(False, "names, dtypes and shapes must be lists of equal length")
        try:
            torch_dtypes = [parse_dtype(d) for d in dtypes]
            shapes = [[int(d) for d in s] for s in shapes]
        except (ValueError, TypeError, AttributeError) as e:
            return self._arealite_reply(False, f"bad dtypes/shapes: {e}")
        device = self._arealite_device(group.backend)
        try:
            received = []
            for name, dtype, shape in zip(names, torch_dtypes, shapes):
                t = torch.empty(shape, dtype=dtype, device=device)
                broadcast_tensor(group, t, src=0)
                received.append((name, t))
        except Exception as e:  # noqa: BLE001
            logger.exception("receiving weights failed")
            return self._arealite_reply(False, f"receiving {len(names)} tensors failed: {e!r}")
        return self._arealite_load(received, f"{len(names)} tensors", weight_version)

    def arealite_update_from_disk(self, model_path: str, weight_version: int | None = None) -> dict:
        """Load every tensor of the HF folder ``model_path`` (``*.safetensors``) into the model.

        The folder is checked before anything is loaded; a load error midway leaves the weights
        partly updated (the message says so).
        """
        if not os.path.isdir(model_path):
            return self._arealite_reply(False, f"model_path {model_path!r} is not a folder on this server")
        if not glob.glob(os.path.join(model_path, "*.safetensors")):
            return self._arealite_reply(False, f"no *.safetensors file in {model_path!r}")
        return self._arealite_load(iter_safetensors(model_path), repr(model_path), weight_version)

    def _arealite_load(self, weights, what: str, weight_version: int | None) -> dict:
        """``model_runner.model.load_weights(weights)`` (``(HF name, tensor)`` pairs); on success
        the version becomes ``weight_version`` (if given)."""
        try:
            with torch.no_grad():
                self.model_runner.model.load_weights(weights=weights)
        except Exception as e:  # noqa: BLE001
            logger.exception("loading %s failed", what)
            return self._arealite_reply(False, f"loading {what} failed ({e!r}); the weights may be partly "
                                               "updated: push or load again")
        if weight_version is not None:
            self._arealite_version = int(weight_version)
        return self._arealite_reply(True, f"loaded {what}")

    def arealite_destroy_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        """Forget the group (its process group is released with the last reference)."""
        if self._arealite_groups().pop(group_name, None) is None:
            return self._arealite_reply(False, f"no weight-update group {group_name!r}")
        return self._arealite_reply(True, f"left {group_name!r}")

    def arealite_weight_version(self) -> dict:
        """The version of the last successful update (None before the first one)."""
        return self._arealite_reply(True, "weight version")
