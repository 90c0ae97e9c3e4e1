"""Request/response adapters of the inference client, one per server protocol: SGLang's
(SGLang itself and our server, :mod:`arealite.server`) and vLLM's OpenAI API plus our
worker extension (:mod:`arealite.server.vllm_ext`) for weight updates. Each maps a generation
request, its reply, and the weight-update calls of :mod:`arealite.api.weight_update` onto the
server's endpoints; :class:`~arealite.inference.remote.RemoteInferenceEngine` picks one by
``rollout.backend``.
"""

from __future__ import annotations

from arealite.api.weight_update import (DESTROY_GROUP_ENDPOINT, INIT_GROUP_ENDPOINT, MODEL_INFO_ENDPOINT,
                                        UPDATE_DISTRIBUTED_ENDPOINT, UPDATE_FROM_DISK_ENDPOINT, VLLM_METHODS,
                                        VLLM_RPC_ENDPOINT, DiskUpdate, InitGroup, UpdateBucket, destroy_group_body)


class ServerError(RuntimeError):
    """A server answered with an HTTP error (not retried when it is a 4xx: the request is bad), or
    did not answer.

    Attributes:
        status: the HTTP status of the reply (e.g. 404), or None when no reply came (connection
            refused, timeout, every retry failed) or the reply said ``success: false``.
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerTimeoutError(ServerError, TimeoutError):
    """No server answered a request within the configured bound."""


# ----------------------------------------------------------------------------- backend adapters


class SGLangAdapter:
    """SGLang's ``/generate`` protocol (also spoken by :mod:`arealite.server`).

    Reference: SGLang's native API, <https://docs.sglang.ai/basic_usage/native_api.html>.
    """

    name = "sglang"
    generate_endpoint = "/generate"
    server_env: dict[str, str] = {}  # environment the server needs for the control endpoints (none)

    @staticmethod
    def build_request(input_ids: list[int], sampling_params: dict) -> dict:
        """``{"input_ids", "sampling_params", "return_logprob": true, "stream": false}``; no rid
        (the server keys in-flight state by rid, and samples of one prompt share ours)."""
        return {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                "return_logprob": True, "stream": False}

    @staticmethod
    def parse_response(result: dict) -> tuple[list[int], list[float], str, int | None]:
        """``(tokens, logprobs, finish type, weight version or None)`` of one reply.

        Tokens and logprobs come from ``meta_info.output_token_logprobs`` triples
        ``[logprob, id, text]``; a missing list (SGLang's "Abort before prefill" reply) means
        zero tokens. ``weight_version`` is used when it is an integer (SGLang's default is the
        string "default")."""
        meta = result["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        version = meta.get("weight_version")
        try:
            version = int(version) if version is not None else None
        except (TypeError, ValueError):
            version = None
        return ([int(t[1]) for t in triples], [float(t[0]) for t in triples],
                meta["finish_reason"]["type"], version)

    @staticmethod
    def build_score_request(input_ids: list[int], start: int, temperature: float) -> dict:
        """Prompt logprobs, no generation: ``max_new_tokens: 0``, ``return_logprob: true``,
        ``logprob_start_len: start`` (SGLang's native fields)."""
        return {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                "return_logprob": True, "logprob_start_len": start, "stream": False}

    @staticmethod
    def parse_score_response(result: dict, n: int) -> list[float]:
        """The ``n`` logprobs of ``meta_info.input_token_logprobs`` (triples ``[logprob, id, text]``).

        Raises: ServerError: the reply has no such list, the wrong length, or a null logprob."""
        triples = (result.get("meta_info") or {}).get("input_token_logprobs")
        if not isinstance(triples, list) or len(triples) != n or any(t[0] is None for t in triples):
            raise ServerError(f"expected {n} input_token_logprobs in the reply, got "
                              f"{None if triples is None else len(triples)} (does the server support logprob_start_len?)")
        return [float(t[0]) for t in triples]

    pause = ("/pause_generation", {})
    resume = ("/continue_generation", {})

    @staticmethod
    def disk_update(path: str, version: int) -> tuple[str, dict]:
        return UPDATE_FROM_DISK_ENDPOINT, DiskUpdate(path, version, abort_all_requests=True).to_json()

    # Distributed weight updates (SGLang's ``/init_weights_update_group`` family): ``(endpoint, body)`` pairs
    # for :func:`post_control`, used by :mod:`arealite.weights.sync`.
    @staticmethod
    def init_group_request(master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str) -> tuple[str, dict]:
        return INIT_GROUP_ENDPOINT, InitGroup(master_address, master_port, rank_offset, world_size, group_name,
                                              backend).to_json()

    @staticmethod
    def update_distributed_request(payload: dict) -> tuple[str, dict]:
        """``payload``: ``{names, dtypes, shapes, group_name, flush_cache, weight_version}``."""
        return UPDATE_DISTRIBUTED_ENDPOINT, dict(payload)

    @staticmethod
    def destroy_group_request(group_name: str) -> tuple[str, dict]:
        return DESTROY_GROUP_ENDPOINT, destroy_group_body(group_name)

    weight_version_request = ("GET", MODEL_INFO_ENDPOINT, None)  # (method, endpoint, body)

    @staticmethod
    def control_reply(reply: dict) -> dict:
        """SGLang already answers ``{"success", "message"}``."""
        return reply

    @staticmethod
    def parse_weight_version(reply: dict):
        """``weight_version`` of a ``/get_model_info`` reply (None when absent)."""
        return reply.get("weight_version")


class VLLMAdapter:
    """vLLM's OpenAI ``/v1/completions`` with token-id prompts (vLLM's OpenAI-compatible server, <https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html>).

    Logprobs: vLLM reports pre-temperature logprobs unless it runs with
    ``--logprobs-mode processed_logprobs``, which the launcher passes
    (:func:`arealite.launcher.local.server_command`); servers given by address must be started
    with it too, or trainer and server logprobs disagree whenever ``temperature != 1``.
    Pause/resume use vLLM's native ``/pause?mode=abort`` and ``/resume`` (vLLM PR #28037).

    Weight updates (disk and distributed) go through vLLM's ``POST /collective_rpc``
    ``{"method", "kwargs"}`` (mounted when the server runs with ``VLLM_SERVER_DEV_MODE=1``) into
    our worker extension :class:`arealite.server.vllm_ext.WeightUpdateExtension` (loaded with
    ``--worker-extension-cls``); the reply ``{"results": [one dict per worker]}`` is turned into
    SGLang's ``{"success", "message"}`` by :meth:`control_reply`. The launcher sets both.
    """

    worker_extension = "arealite.server.vllm_ext.WeightUpdateExtension"  # --worker-extension-cls
    # /collective_rpc; /v1/load_lora_adapter (a LoRA actor's updates)
    server_env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    lora_name = "arealite-lora"  # the served LoRA adapter's name: requests name it as their "model"
    lora_ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank accepts

    name = "vllm"
    generate_endpoint = "/v1/completions"

    @staticmethod
    def build_request(input_ids: list[int], sampling_params: dict) -> dict:
        """Flat OpenAI body: ``prompt`` = token ids, ``max_tokens``, ``logprobs: 0`` (the sampled
        token only) and ``return_tokens_as_token_ids`` (tokens come back as "token_id:N")."""
        sp = sampling_params
        body = {
            "prompt": list(input_ids),
            "max_tokens": sp["max_new_tokens"],
            "temperature": sp.get("temperature", 1.0),
            "top_p": sp.get("top_p", 1.0),
            "top_k": sp.get("top_k", -1),
            "stop_token_ids": list(sp.get("stop_token_ids", [])),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "ignore_eos": bool(sp.get("ignore_eos", False)),
            "stream": False,
        }
        if sp.get("stop"):
            body["stop"] = list(sp["stop"])
        return body

    @staticmethod
    def parse_response(result: dict) -> tuple[list[int], list[float], str, int | None]:
        """``choices[0]``: ``logprobs.tokens`` ("token_id:N"), ``logprobs.token_logprobs`` and
        ``finish_reason`` ("stop" | "length" | "abort"); vLLM reports no weight version."""
        choice = result["choices"][0]
        lp = choice.get("logprobs") or {}
        tokens = [int(str(t).rsplit(":", 1)[1]) for t in lp.get("tokens") or []]
        logprobs = [float(x) for x in lp.get("token_logprobs") or []]
        if len(tokens) != len(logprobs):
            raise ServerError(f"vLLM reply has {len(tokens)} tokens but {len(logprobs)} logprobs")
        return tokens, logprobs, choice.get("finish_reason") or "abort", None

    @staticmethod
    def build_score_request(input_ids: list[int], start: int, temperature: float) -> dict:
        """Not supported: vLLM's ``prompt_logprobs`` are not yet wired (and tested) here.

        Raises: NotImplementedError naming the alternative."""
        raise NotImplementedError("prompt logprobs (a distillation teacher) through vLLM are not supported yet; "
                                  "serve the teacher with teacher.engine.backend local (or sglang)")

    parse_score_response = None

    pause = ("/pause?mode=abort", {})
    resume = ("/resume", {})

    @staticmethod
    def max_lora_rank(rank: int) -> int:
        """The smallest ``--max-lora-rank`` vLLM accepts that holds adapters of ``rank``.

        Raises: ValueError: ``rank`` is above vLLM's largest (512)."""
        for r in VLLMAdapter.lora_ranks:
            if r >= rank:
                return r
        raise ValueError(f"actor.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLMAdapter.lora_ranks[-1]}")

    @staticmethod
    def lora_load_request(path: str) -> tuple[str, dict]:
        """Load (or replace: ``load_inplace``) the adapter :attr:`lora_name` from the PEFT folder
        ``path`` on the server's machine (vLLM's ``/v1/load_lora_adapter``, mounted with
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; the reply is plain text)."""
        return "/v1/load_lora_adapter", {"lora_name": VLLMAdapter.lora_name, "lora_path": path, "load_inplace": True}

    lora_path_request = ("POST", VLLM_RPC_ENDPOINT, {"method": VLLM_METHODS["lora_path"], "kwargs": {}})

    @staticmethod
    def set_version_request(version: int) -> tuple[str, dict]:
        """Every worker reports ``version`` from now on (after a LoRA load it did not see)."""
        return VLLMAdapter.rpc(VLLM_METHODS["set_weight_version"], weight_version=int(version))

    @staticmethod
    def rpc(method: str, **kwargs) -> tuple[str, dict]:
        """``("/collective_rpc", {"method": method, "kwargs": kwargs})``; kwargs must be JSON."""
        return VLLM_RPC_ENDPOINT, {"method": method, "kwargs": kwargs}

    @staticmethod
    def disk_update(path: str, version: int) -> tuple[str, dict]:
        """Every worker loads the ``*.safetensors`` of the HF folder ``path`` (a path on the
        server's machine) and reports ``version``."""
        return VLLMAdapter.rpc(VLLM_METHODS["update_from_disk"], model_path=path, weight_version=version)

    @staticmethod
    def init_group_request(master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str) -> tuple[str, dict]:
        """Worker of TP rank r joins at ``rank_offset + r`` (same fields as SGLang's)."""
        return VLLMAdapter.rpc(VLLM_METHODS["init_group"], **InitGroup(
            master_address, master_port, rank_offset, world_size, group_name, backend).to_json())

    @staticmethod
    def update_distributed_request(payload: dict) -> tuple[str, dict]:
        """SGLang's bucket payload -> the extension's kwargs. ``flush_cache`` is dropped: vLLM's
        ``/pause`` (sent before every update) already cleared the prefix cache."""
        bucket = UpdateBucket.from_json(payload)
        return VLLMAdapter.rpc(VLLM_METHODS["update_distributed"], names=list(bucket.names),
                               dtypes=list(bucket.dtypes), shapes=[list(s) for s in bucket.shapes],
                               group_name=bucket.group_name, weight_version=bucket.weight_version)

    @staticmethod
    def destroy_group_request(group_name: str) -> tuple[str, dict]:
        return VLLMAdapter.rpc(VLLM_METHODS["destroy_group"], group_name=group_name)

    weight_version_request = ("POST", VLLM_RPC_ENDPOINT, {"method": VLLM_METHODS["weight_version"], "kwargs": {}})

    @staticmethod
    def control_reply(reply: dict) -> dict:
        """``{"results": [{"success", "message", "rank", "weight_version"}, ...]}`` (one per
        worker) -> ``{"success": every worker succeeded, "message": "rank r: ..." joined,
        "weight_version": the workers' common version, or None when they differ}``.

        Raises:
            ServerError: the reply is not of that shape (the extension is not loaded).
        """
        results = reply.get("results") if isinstance(reply, dict) else None
        if not (isinstance(results, list) and results and all(isinstance(r, dict) for r in results)):
            raise ServerError(f"unexpected /collective_rpc reply {reply!r}: start vLLM with --worker-extension-cls "
                              f"{VLLMAdapter.worker_extension} (arealite importable by its workers)")
        versions = {r.get("weight_version") for r in results}
        return {"success": all(r.get("success") is True for r in results),
                "message": "; ".join(f"rank {r.get('rank')}: {r.get('message')}" for r in results),
                "weight_version": versions.pop() if len(versions) == 1 else None}

    @staticmethod
    def parse_weight_version(reply: dict):
        """The workers' common weight version (None before the first update).

        Raises:
            ServerError: the workers report different versions (a partial update).
        """
        versions = {r.get("weight_version") for r in reply.get("results") or [] if isinstance(r, dict)}
        if len(versions) > 1:
            raise ServerError(f"the server's workers report different weight versions {sorted(map(str, versions))}; "
                              "push the weights again")
        return VLLMAdapter.control_reply(reply)["weight_version"]


ADAPTERS = {"local": SGLangAdapter, "sglang": SGLangAdapter, "vllm": VLLMAdapter}
