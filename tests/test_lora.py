"""LoRA (PEFT) on the FSDP2 actor, end to end on a tiny random Llama and one of our servers.

The torchrun runs are tests/dist/lora_grpo.py (3 GRPO steps, the reference = adapters disabled,
a weight push to the server after every step, recover checkpoints after every step):
1 rank with the disk push (a PEFT adapter folder), 2 ranks with the distributed push (only the
lora_A / lora_B tensors), and a 2-rank run SIGKILLed after step 2 then resumed.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from arealite.api.cli import ConfigError, load_config
from arealite.api.config import GRPOConfig, LoRAConfig
from arealite.server.weights import load_named_tensors, merge_lora
from conftest import REPO_ROOT, save_tiny_model

SCRIPT = os.path.join(REPO_ROOT, "tests", "dist", "lora_grpo.py")
PROMPT = [1, 17, 300, 4000, 25, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("lora_model")), initializer_range=0.2)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from arealite.api.config import InferenceEngineConfig
    from arealite.inference.remote import RemoteInferenceEngine
    from arealite.launcher.local import launch_servers

    cfg = InferenceEngineConfig(n_servers=1, setup_timeout=120, request_timeout=60)
    addrs = launch_servers(cfg, model_dir, str(tmp_path_factory.mktemp("lora_logs")))
    eng = RemoteInferenceEngine(cfg, addrs)
    yield addrs[0]
    eng.destroy()


def _torchrun(model_dir, run_dir, addr, sync, nproc, total=3, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           SCRIPT, model_dir, str(run_dir), addr, sync, str(total)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{k: str(v) for k, v in env.items()})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _steps(run_dir):
    return [json.loads(line) for line in open(run_dir / "steps.jsonl")]


@pytest.fixture(scope="module")
def runs(model_dir, server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_runs")
    one, two = root / "one_rank_disk", root / "two_ranks_distributed"
    for run_dir, sync, nproc in ((one, "disk", 1), (two, "distributed", 2)):
        proc = _torchrun(model_dir, run_dir, server, sync, nproc)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return one, two


def test_lora_grpo_one_vs_two_ranks_only_adapters_change_and_the_server_follows(runs):
    one, two = runs
    s1, s2 = _steps(one), _steps(two)
    assert [s["step"] for s in s1] == [s["step"] for s in s2] == [0, 1, 2]
    for a, b in zip(s1, s2):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5) and a["grad_norm"] > 0
        for s in (a, b):  # disk (adapter folder) and distributed (lora_A/B only) pushes
            assert s["server_diff"] <= 1e-4, s
    assert s1[1]["kl_ref"] > 0  # the adapters moved the policy away from the base (reference) model
    r1, r2 = torch.load(one / "final.pt"), torch.load(two / "final.pt")
    for r in (r1, r2):
        assert r["frozen_differ"] == [] and r["frozen_missing"] == [] and r["n_frozen"] > 0  # base bitwise equal
        assert len(r["adapters"]) == 2 * 2 * 7  # 2 layers x 7 target modules x (A, B), nothing else trains
        assert all("lora_A" in k or "lora_B" in k for k in r["adapters"])
    # 3 AdamW steps at lr 2e-2: each step moves an element by up to ~lr whatever its gradient's
    # size, so the fp32 rounding of 1 vs 2 ranks' gradient sums reaches the adapters scaled to lr
    # (seen: 1.2e-6 on one element of 512 on an AMX Xeon); allow 1e-3 of one step's update
    for k, v in r1["adapters"].items():
        torch.testing.assert_close(v, r2["adapters"][k], rtol=1e-4, atol=1e-3 * 2e-2)
        assert v.abs().max() > 0
    assert r1["greedy"] == r2["greedy"]


def test_saved_adapter_loads_with_peft_and_generates_the_trainers_tokens(runs, model_dir, server):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from arealite.inference.remote import post_json

    one, _ = runs
    want = torch.load(one / "final.pt")["greedy"]
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = PeftModel.from_pretrained(base, str(one / "final" / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(one / "final")).eval()  # lora.merged_final
    ids = torch.tensor([PROMPT])
    for model in (peft_model, merged):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out[0, len(PROMPT):].tolist() == want


def test_resume_after_sigkill_gives_bitwise_equal_adapters(runs, model_dir, server, tmp_path):
    _, two = runs
    run_dir = tmp_path / "killed"
    proc = _torchrun(model_dir, run_dir, server, "distributed", 2, KILL_AT=2)
    assert proc.returncode != 0 and "start step 0" in proc.stdout
    ckpt = run_dir / "recover" / "step2"
    names = os.listdir(ckpt)
    # adapters + their AdamW moments only (the embedding alone is 97% of the base weights)
    base_bytes = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    assert sum(os.path.getsize(ckpt / n) for n in names if n.endswith(".distcp")) < base_bytes / 20
    proc = _torchrun(model_dir, run_dir, server, "distributed", 2)
    assert proc.returncode == 0 and "start step 2" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert [s["step"] for s in _steps(run_dir)] == [0, 1, 2]
    ref, got = torch.load(two / "final.pt"), torch.load(run_dir / "final.pt")
    assert ref["adapters"].keys() == got["adapters"].keys()
    for k in ref["adapters"]:
        assert torch.equal(ref["adapters"][k], got["adapters"][k]), k
    assert _steps(run_dir)[2]["server_diff"] <= 1e-4  # the resumed run pushed its adapters first


def test_server_merge_keeps_the_base_and_checks_before_changing_anything():
    lin = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
    w0 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    lin[0].weight.data.copy_(w0)
    a, b = torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([[2.0], [-1.0]])  # r = 1
    assert merge_lora(lin, {"0.lora_A.weight": a}) == 0  # waits for its pair (another bucket)
    assert merge_lora(lin, {"0.lora_B.weight": b}) == 1
    torch.testing.assert_close(lin[0].weight, w0 + torch.tensor([[2.0, 0.0, 2.0], [-1.0, 0.0, -1.0]]))
    merge_lora(lin, {"0.lora_A.weight": a, "0.lora_B.weight": 3 * b})  # next version: onto W0, no drift
    torch.testing.assert_close(lin[0].weight, w0 + 3 * torch.tensor([[2.0, 0.0, 2.0], [-1.0, 0.0, -1.0]]))
    before = lin[0].weight.clone()
    with pytest.raises(ValueError, match="does not fit"):
        merge_lora(lin, {"0.lora_A.weight": a, "0.lora_B.weight": torch.ones(3, 1)})
    with pytest.raises(ValueError, match="no linear layer"):
        merge_lora(lin, {"1.lora_A.weight": a})
    assert torch.equal(lin[0].weight, before)


def test_bf16_server_keeps_a_small_lora_update_that_a_bf16_merge_would_round_away():
    """W = 1 everywhere and an update B A = ±1e-3 (under half a bf16 ulp of 1, 2^-9): bf16(W + B A)
    is W again, so a merged bf16 server would serve the base policy. The bf16 server keeps W and
    adds (x Aᵀ) Bᵀ. With x = (+1, -1, +1, ...) the base output is exactly 0 and the update's
    is 64 · 1e-3 = 0.064: unmerged it is kept (up to bf16 output rounding), merged it is 0."""
    from arealite.server import packed_linear

    lin = torch.nn.Sequential(torch.nn.Linear(64, 8, bias=False)).to(torch.bfloat16)
    lin[0].weight.data.fill_(1.0)
    sign = torch.tensor([(-1.0) ** j for j in range(64)])
    a, b = 0.5 * sign.repeat(2, 1), torch.full((8, 2), 1e-3)  # B A = ±1e-3, r = 2
    assert torch.equal((lin[0].weight.float() + b @ a).to(torch.bfloat16), lin[0].weight)  # lost in a merge
    x = sign.repeat(3, 1).to(torch.bfloat16)
    assert merge_lora(lin, {"0.lora_A.weight": a, "0.lora_B.weight": b}) == 1
    assert torch.equal(lin[0].weight, torch.ones(8, 64, dtype=torch.bfloat16))  # W untouched
    exact = x.double() @ (torch.ones(8, 64).double() + b.double() @ a.double()).T
    torch.testing.assert_close(exact, torch.full((3, 8), 0.064, dtype=torch.float64), rtol=1e-6, atol=0)  # b is 1e-3 in fp32
    with torch.no_grad():
        out = lin(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=0)
    if packed_linear.available(x.device, torch.bfloat16):  # the server's packed forward keeps it too
        packed_linear.pack_linears(lin)
        with torch.inference_mode():
            assert torch.equal(lin(x), out)
    merge_lora(lin, {"0.lora_A.weight": a, "0.lora_B.weight": 2 * b})  # the next version replaces it
    with torch.no_grad():
        torch.testing.assert_close(lin(x).float(), torch.full((3, 8), 0.128), rtol=2 ** -8, atol=0)
    load_named_tensors(lin, {"0.weight": torch.full((8, 64), 2.0)})  # a full load drops the adapter
    with torch.no_grad():
        assert torch.equal(lin(x), torch.zeros(3, 8, dtype=torch.bfloat16))


def test_bad_lora_config_names_the_field(model_dir):
    from arealite.train_engine.lora import check_target_modules

    for argv, field in ((["--actor.lora.rank", "-2"], "actor.lora.rank"),
                        (["--actor.lora.rank", "8", "--actor.lora.alpha", "0"], "actor.lora.alpha"),
                        (["--actor.lora.rank", "8", "--actor.lora.dropout", "1.0"], "actor.lora.dropout"),
                        (["--actor.lora.rank", "8", "--actor.lora.init_lora_weights", "pissa"],
                         "actor.lora.init_lora_weights")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(GRPOConfig, argv)
    check_target_modules(model_dir, LoRAConfig(rank=8))  # the defaults exist in a Llama
    check_target_modules(model_dir, LoRAConfig(rank=8, target_modules=["all-linear"]))
    with pytest.raises(ConfigError, match=r"actor\.lora\.target_modules\[1\].*qkv_proj.*available"):
        check_target_modules(model_dir, LoRAConfig(rank=8, target_modules=["q_proj", "qkv_proj"]))


def test_merged_push_for_sglang_has_the_hf_names_and_the_trainers_logprobs(model_dir, tmp_path):
    """What a LoRA actor sends SGLang (merged=True; also the merged final checkpoint): every HF parameter name of the base
    model once, and a plain HF model loaded with it computes the trainer's logprobs."""
    from transformers import AutoModelForCausalLM

    from arealite.api.config import TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine
    from arealite.train_engine.lora import sync_specs, sync_tensors
    from arealite.server.weights import load_named_tensors, load_weights_from_disk

    actor = FSDPEngine(TrainEngineConfig(lora=LoRAConfig(rank=4, alpha=8.0, init_lora_weights="false")), temperature=0.7)
    actor.initialize(model_dir)  # random A and B: the adapters change the outputs
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    merged = dict(sync_tensors(actor.model, merged=True))
    assert list(merged) == [n for n, _ in plain.named_parameters()] == [n for n, _, _ in sync_specs(actor.model, True)]
    ids = torch.tensor([PROMPT + [5, 6, 7, 8]])
    lm = torch.ones_like(ids, dtype=torch.int32)
    mine = actor.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "loss_mask": lm})

    def logprobs(model):
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float() / 0.7
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]

    before = logprobs(plain)
    assert (before - mine[0, 1:]).abs().max() > 1e-2  # the adapters matter
    load_named_tensors(plain, merged)
    torch.testing.assert_close(logprobs(plain), mine[0, 1:], atol=1e-4, rtol=0)
    # the disk form of the same push (save_merged) and the adapter folder both load into a fresh server model
    from arealite.train_engine.lora import save_adapter, save_merged

    save_merged(actor, str(tmp_path / "merged"))
    save_adapter(actor, str(tmp_path / "adapter"))
    for folder in ("merged", "adapter"):
        fresh = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        load_weights_from_disk(fresh, str(tmp_path / folder))
        torch.testing.assert_close(logprobs(fresh), mine[0, 1:], atol=1e-4, rtol=0)


def test_bf16_engine_keeps_frozen_weights_in_bf16_outside_fsdp_and_merges_in_fp32(model_dir):
    """bf16 compute on one rank: the frozen base weights are stored once as bf16 (the values
    FSDP's per-forward cast gave: fp32 rounded to nearest bf16) and left out of FSDP (plain
    tensors, no all-gather copies); the adapters stay fp32 FSDP parameters (DTensors) with
    AdamW state. The merged push (SGLang, merged_final) is fp32 again: W0 + s·B A for W0 = 1 and
    s·B A = 1e-3 is 1.001, which bf16 (ulp 2^-7 at 1) would round back to 1."""
    from transformers import AutoModelForCausalLM

    from arealite.api.config import TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine
    from arealite.train_engine.lora import lora_layers, sync_specs, sync_tensors

    cfg = TrainEngineConfig(mixed_precision="bf16", lora=LoRAConfig(rank=4, alpha=8.0, init_lora_weights="false"))
    actor = FSDPEngine(cfg)
    actor.initialize(model_dir)
    plain = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    frozen = {n: p for n, p in actor.model.named_parameters() if not p.requires_grad}
    trained = {n: p for n, p in actor.model.named_parameters() if p.requires_grad}
    assert len(frozen) == len(plain) and len(trained) == 2 * 2 * 7
    for n, p in frozen.items():
        assert p.dtype == torch.bfloat16 and not hasattr(p, "full_tensor"), n
        hf = n.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(p.data, plain[hf].data.to(torch.bfloat16)), n
    assert all(p.dtype == torch.float32 and hasattr(p, "full_tensor") for p in trained.values())
    name, layer = lora_layers(actor.model)[0]
    base = layer.get_base_layer().weight
    a, b = (p.data.to_local() for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight))  # 1 rank: whole
    base.data.fill_(1.0)
    a.fill_(0.0)
    a[:, 0] = 1.0
    b.fill_(1e-3 / (4 * layer.scaling["default"]))  # s·B A = 1e-3 in column 0
    merged = dict(sync_tensors(actor.model, merged=True))
    assert {t.dtype for t in merged.values()} == {torch.float32}
    assert {d for _, _, d in sync_specs(actor.model, True)} == {torch.float32}
    w = merged[f"{name}.weight"]
    torch.testing.assert_close(w[:, 0], torch.full_like(w[:, 0], 1.001), rtol=1e-6, atol=0)
    assert torch.equal(w[:, 1:], torch.ones_like(w[:, 1:]))
    actor.destroy()
    ref = FSDPEngine(TrainEngineConfig(mixed_precision="bf16"), trainable=False)
    ref.initialize(model_dir)  # a frozen engine: every weight
    assert all(p.dtype == torch.bfloat16 and not hasattr(p, "full_tensor") for p in ref.model.parameters())
    ref.destroy()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_lora_forward_equals_peft_and_falls_back_where_it_must(dtype, tol):
    """wrap_model's forward (W0 x, then s·(A x) Bᵀ added in place by one addmm_) against PEFT's own
    forward on the same layer: outputs and the gradients of x, A and B; with the adapters
    disabled (the reference policy), merged or under dropout PEFT's forward runs."""
    from arealite.train_engine.lora import lora_layers, wrap_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12, bias=True)).to(dtype)
    model.config = None
    cfg = LoRAConfig(rank=4, alpha=8.0, init_lora_weights="false", target_modules=["0"])
    peft_model, hf = wrap_model(model, cfg)
    (_, layer), = lora_layers(hf)
    if dtype == torch.bfloat16:  # PEFT keeps adapters fp32 on a bf16 base: its own forward runs, in bf16
        x = torch.randn(2, 5, 16, dtype=dtype)
        assert layer.lora_A["default"].weight.dtype == torch.float32 and layer(x).dtype == torch.bfloat16
        torch.testing.assert_close(layer(x), type(layer).forward(layer, x), rtol=0, atol=0)
        hf.to(dtype)  # as FSDP's bf16 policy computes: every weight bf16, the fused path
    peft_forward = type(layer).forward.__get__(layer)
    assert layer.forward is not peft_forward
    x = torch.randn(2, 5, 16, dtype=dtype)
    outs = {}
    for name, fwd in (("fused", layer.forward), ("peft", peft_forward)):
        xi = x.clone().requires_grad_()
        out = fwd(xi)
        out.backward(torch.ones_like(out))
        grads = [xi.grad] + [m["default"].weight.grad.clone() for m in (layer.lora_A, layer.lora_B)]
        layer.zero_grad(set_to_none=True)
        outs[name] = [out.detach()] + grads
    for got, want in zip(outs["fused"], outs["peft"]):
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
    base = layer.base_layer(x)
    assert (outs["fused"][0] - base).abs().max() > 10 * tol  # the adapter matters
    with peft_model.disable_adapter():  # the reference: base only
        torch.testing.assert_close(layer(x), base, rtol=0, atol=0)
    layer.lora_dropout["default"] = torch.nn.Dropout(0.5)
    layer.train()
    torch.manual_seed(1)
    with_dropout = layer(x)
    torch.manual_seed(1)
    torch.testing.assert_close(with_dropout, peft_forward(x), rtol=0, atol=0)  # PEFT's path, same mask


def test_fused_lora_forward_is_bound_to_its_layer_and_a_deepcopy_runs_its_own_adapters():
    """The fused forward is a method bound to its layer (not a closure): a deepcopy of the
    model binds the copy's layer, whose own (here changed) adapter then runs."""
    import copy

    from arealite.api.config import LoRAConfig
    from arealite.train_engine.lora import lora_layers, wrap_model

    torch.manual_seed(0)
    hf = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    hf.config = None
    _, model = wrap_model(hf, LoRAConfig(rank=4, alpha=8.0, target_modules=["0", "1"]))
    twin = copy.deepcopy(model)
    (_, layer), (_, twin_layer) = next(iter(lora_layers(model))), next(iter(lora_layers(twin)))
    assert layer.forward.__self__ is layer and twin_layer.forward.__self__ is twin_layer
    with torch.no_grad():
        twin_layer.lora_B["default"].weight.fill_(1.0)
    x = torch.randn(3, 16)
    torch.testing.assert_close(twin_layer(x), type(twin_layer).forward(twin_layer, x))
    assert not torch.allclose(twin_layer(x), layer(x))
