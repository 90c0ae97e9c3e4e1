"""SwiGLU and RMSNorm as native passes (arealite/native/layers.c, layers.py;
arealite/train_engine/fused_layers.py): torch's roundings (within two bf16 ulps, mostly
bit-equal) forward and backward, extreme inputs, the torch fallback elsewhere, and the MLPs and
norms of a real transformers model swapped with the same outputs and gradients."""

import pytest
import torch
import torch.nn.functional as F

from arealite import native
from arealite.native import layers
from arealite.train_engine import fused_layers

needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler / libgomp here")


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got − ref| in units of ref's bf16 ulp (2^(e − 8) for |ref| in [2^(e−1), 2^e)), an
    absolute 1e-30 counting as none (the kernel's silu and sigmoid of a gate below -80 are 0,
    torch's at most 1.5e-33 in magnitude)."""
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32),
                      torch.frexp(ref.float().abs().clamp_min(2.0 ** -126)).exponent - 8)
    diff = (got.float() - ref.float()).abs()
    return torch.where(diff <= 1e-30, 0.0, diff / ulp)


def _case(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 4).bfloat16()
    up, grad = torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()
    flat = gate.view(-1)
    extremes = torch.tensor([-1e4, -100., -87.5, -80., -1e-3, 0., 1e-30, 80., 87.5, 100., 1e4])
    flat[:min(flat.numel(), extremes.numel())] = extremes[:flat.numel()].bfloat16()
    return gate, up, grad


@needs_library
@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 5000), (2, 40, 1536)])  # one element; under, over one block
def test_native_swiglu_has_torchs_roundings_forward_and_backward(shape):
    gate, up, grad = _case(shape)
    h = layers.swiglu_bf16(gate, up)
    g_ref, u_ref = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ref = F.silu(g_ref) * u_ref
    ref.backward(grad)
    d_gate, d_up = layers.swiglu_backward_bf16(grad, gate, up)
    for got, want in ((h, ref.detach()), (d_gate, g_ref.grad), (d_up, u_ref.grad)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.isfinite(got.float()).all()
        assert _ulps(got, want).max() <= 2  # s = bf16(silu(gate)) may round the other way at a tie
        assert (_ulps(got, want) == 0).float().mean() > 0.99  # mostly the very same numbers
    # silu(-1e4) = -0, silu(1e4) = 1e4: h = s * up exactly at both ends
    if gate.numel() > 10:
        assert h.view(-1)[0] == 0 and h.view(-1)[10] == (gate.view(-1)[10].float() * up.view(-1)[10].float()).bfloat16()


@needs_library
def test_swiglu_is_differentiable_through_the_kernels_and_falls_back_to_torch():
    gate, up, grad = _case((4, 9, 64), seed=1)
    g1, u1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    g2, u2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = fused_layers.swiglu(g1, u1)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_SwiGLUBackward"
    out.backward(grad)
    (F.silu(g2) * u2).backward(grad)
    assert _ulps(g1.grad, g2.grad).max() <= 2 and _ulps(u1.grad, u2.grad).max() <= 2
    # fp32, float64 and non-contiguous bf16 run torch's ops: the same numbers exactly
    for a, b in ((gate.float(), up.float()), (gate.double(), up.double()), (gate.mT, up.mT)):
        assert not layers.swiglu_fits(a, b)
        assert torch.equal(fused_layers.swiglu(a, b), F.silu(a) * b)
    assert layers.swiglu_bf16(gate, up[..., :32].contiguous()) is None  # shapes differ


def _count_calls(monkeypatch) -> dict:
    """Calls of the native layer kernels from now on, by name."""
    calls = {}
    for fn, key in (("swiglu_bf16", "swiglu"), ("swiglu_backward_bf16", "swiglu_backward"),
                    ("rmsnorm_bf16", "rms_norm"), ("rmsnorm_backward_bf16", "rms_norm_backward")):
        def spy(*a, _real=getattr(layers, fn), _key=key, **k):
            calls[_key] = calls.get(_key, 0) + 1
            return _real(*a, **k)
        monkeypatch.setattr(layers, fn, spy)
    return calls


def _tiny_llama(act="silu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act=act)
    return LlamaForCausalLM(cfg).bfloat16()


def _hf_rmsnorm(x, weight, eps):
    """transformers' own LlamaRMSNorm.forward on (x, weight, eps)."""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward(SimpleNamespace(weight=weight, variance_epsilon=eps), x)


@needs_library
@pytest.mark.parametrize("shape", [(1, 8), (3, 7, 64), (37, 576), (5, 1536)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_native_rmsnorm_has_torchs_roundings_forward_and_backward(shape, scale):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * scale).bfloat16()
    x.view(-1, shape[-1])[0] = 0  # an all-zero row: y = 0, r = 1/sqrt(eps)
    weight = (1 + torch.randn(shape[-1], generator=g) / 4).bfloat16()
    grad = torch.randn(shape, generator=g).bfloat16()
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _hf_rmsnorm(x_ref, w_ref, 1e-5)
    ref.backward(grad)
    y, rstd = layers.rmsnorm_bf16(x, weight, 1e-5)
    dx, dw = layers.rmsnorm_backward_bf16(grad, x, weight, rstd, True)
    rows = x.float().view(-1, shape[-1])
    torch.testing.assert_close(rstd, torch.rsqrt(rows.pow(2).mean(-1) + 1e-5), rtol=1e-6, atol=0)
    for got, want in ((y, ref.detach()), (dx, x_ref.grad)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert _ulps(got, want).max() <= 2
        assert (_ulps(got, want) == 0).float().mean() > 0.95
    # ∂weight: a sum over rows of bf16 products, in another order than torch's: fp32-close
    assert dw.dtype == torch.bfloat16 and _ulps(dw, w_ref.grad).max() <= 2
    assert layers.rmsnorm_backward_bf16(grad, x, weight, rstd, False)[1] is None
    assert torch.equal(layers.rmsnorm_backward_bf16(grad, x, weight, rstd, False)[0], dx)


@needs_library
def test_rms_norm_is_differentiable_through_the_kernels_and_falls_back_to_torch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 9, 64, generator=g).bfloat16()
    weight = (1 + torch.randn(64, generator=g) / 4).bfloat16()
    grad = torch.randn(4, 9, 64, generator=g).bfloat16()
    x1, w1 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_layers.rms_norm(x1, w1, 1e-6)
    assert type(out.grad_fn).__name__ == "_RMSNormBackward"
    out.backward(grad)
    x2, w2 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    _hf_rmsnorm(x2, w2, 1e-6).backward(grad)
    assert _ulps(x1.grad, x2.grad).max() <= 2 and _ulps(w1.grad, w2.grad).max() <= 2
    x3 = x.clone().requires_grad_()  # a frozen weight (LoRA): no ∂weight computed
    fused_layers.rms_norm(x3, weight, 1e-6).backward(grad)
    assert torch.equal(x3.grad, x1.grad)
    # fp32, float64, a bf16 input with an fp32 weight (fp32 out, as in transformers) and a
    # non-contiguous input run transformers' formula in torch: the same numbers exactly
    for a, w in ((x.float(), weight.float()), (x.double(), weight.double()), (x, weight.float()), (x.mT, weight[:9])):
        assert not layers.rmsnorm_fits(a, w)
        assert torch.equal(fused_layers.rms_norm(a, w, 1e-6), _hf_rmsnorm(a, w, 1e-6))


@needs_library
def test_install_swaps_silu_mlps_and_rmsnorms_with_the_same_outputs_and_gradients(monkeypatch):
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    results = []
    for fused in (False, True):
        model = _tiny_llama()
        if fused:
            assert fused_layers.install(model) is model
            assert all(type(layer.mlp).__name__ == "FusedLlamaMLP" for layer in model.model.layers)
            norms = [m for m in model.modules() if type(m).__name__ == "FusedLlamaRMSNorm"]
            assert len(norms) == 5
            calls = _count_calls(monkeypatch)
        logits = model(ids).logits.float()
        logits.logsumexp(-1).sum().backward()
        layer = model.model.layers[0]
        results.append((logits, layer.mlp.gate_proj.weight.grad.float(), layer.input_layernorm.weight.grad.float()))
    assert calls == {"swiglu": 2, "rms_norm": 5, "swiglu_backward": 2, "rms_norm_backward": 5}
    (l0, g0, n0), (l1, g1, n1) = results
    assert (l1 - l0).abs().max() <= 0.05 * l0.abs().max()  # bf16 model: ulp-level differences propagate
    assert (g1 - g0).norm() <= 0.02 * g0.norm() and (n1 - n0).norm() <= 0.02 * n0.norm()
    gelu = _tiny_llama("gelu")
    fused_layers.install(gelu)
    assert not any(type(layer.mlp).__name__.startswith("Fused") for layer in gelu.model.layers)  # not a SwiGLU


def test_only_modules_with_llamas_formulas_are_swapped():
    """Gemma's RMSNorm (1 + weight, product before the cast) and OLMo2's MLP-free norm order
    compute other numbers: their classes' forwards differ from Llama's, and install leaves them."""
    from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm
    from transformers import Qwen2Config, GemmaConfig

    cfg_q = Qwen2Config(hidden_size=32, intermediate_size=64)
    cfg_g = GemmaConfig(hidden_size=32, intermediate_size=64, hidden_activation="gelu_pytorch_tanh")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg_l = LlamaConfig(hidden_size=32, intermediate_size=64)

    class ScaledMLP(LlamaMLP):  # a SiLU MLP with gate/up/down that computes something else
        def forward(self, x):
            return 2 * super().forward(x)

    class SameMLP(LlamaMLP):  # Llama's forward, inherited
        pass

    mods = torch.nn.ModuleList([Qwen2MLP(cfg_q), Qwen2RMSNorm(32), GemmaMLP(cfg_g), GemmaRMSNorm(32),
                                ScaledMLP(cfg_l), SameMLP(cfg_l)])
    fused_layers.install(mods)
    assert [type(m).__name__.startswith("Fused") for m in mods] == [True, True, False, False, False, True]
    assert fused_layers.install(mods) is mods and type(mods[0]).__name__ == "FusedQwen2MLP"  # idempotent
    x = torch.randn(3, 32)
    torch.testing.assert_close(mods[4](x), 2 * LlamaMLP.forward(mods[4], x))


@needs_library
def test_a_deepcopy_runs_its_own_weights_and_second_derivatives_are_refused():
    import copy

    model = fused_layers.install(_tiny_llama())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    mlp, twin_mlp = model.model.layers[0].mlp, twin.model.layers[0].mlp
    assert type(twin_mlp) is type(mlp) and type(mlp).__name__ == "FusedLlamaMLP"
    x = torch.randn(1, 7, 64).bfloat16()
    assert not torch.equal(twin_mlp(x), mlp(x))
    assert torch.equal(twin_mlp(x), twin_mlp.down_proj(F.silu(twin_mlp.gate_proj(x)) * twin_mlp.up_proj(x))) or \
        _ulps(twin_mlp(x), twin_mlp.down_proj(F.silu(twin_mlp.gate_proj(x)) * twin_mlp.up_proj(x))).max() <= 2
    assert torch.isfinite(twin(ids).logits).all()
    gate, up = (torch.randn(5, 8).bfloat16().requires_grad_() for _ in range(2))
    v = torch.ones(5, 8).bfloat16().requires_grad_()  # a gradient that is itself differentiated
    for fn in (fused_layers.swiglu, lambda a, b: fused_layers.rms_norm(a, b[0], 1e-6)):
        d_gate, = torch.autograd.grad(fn(gate, up), gate, v, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):  # not a silently wrong one
            d_gate.sum().backward()


@needs_library
def test_pickle_and_torch_save_keep_the_fused_classes_and_the_outputs(tmp_path):
    import pickle

    model = fused_layers.install(_tiny_llama())
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(3))
    want = model(ids).logits
    for copy in (pickle.loads(pickle.dumps(model)), _saved_and_loaded(model, tmp_path / "m.pt")):
        assert [type(m).__name__ for m in copy.modules()] == [type(m).__name__ for m in model.modules()]
        assert type(copy.model.layers[0].mlp) is type(model.model.layers[0].mlp)  # the same Fused class
        assert torch.equal(copy(ids).logits, want)


def _saved_and_loaded(model, path):
    torch.save(model, path)
    return torch.load(path, weights_only=False)



def test_the_reference_forwards_are_transformers_llama_ones():
    """The native passes compute transformers' Llama formulas as they read today: if an upgrade
    changes LlamaMLP.forward or LlamaRMSNorm.forward, this fails (and install swaps nothing)."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    assert fused_layers._source(LlamaMLP) == fused_layers.MLP_SOURCE
    assert fused_layers._source(LlamaRMSNorm) == fused_layers.NORM_SOURCE


@needs_library
def test_a_loaded_model_keeps_its_native_layers_through_train_and_eval(tiny_model_dir, monkeypatch):
    """As the engine loads it (from_pretrained, then install): transformers' train()/eval() run
    the kernels package where it is installed, which deletes instance forwards of RMSNorms (a
    probe shows it ran); the Fused classes' forwards stay, and a training step calls the kernels."""
    from transformers import AutoModelForCausalLM

    model = fused_layers.install(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16))
    probe = model.model.norm
    probe.forward = lambda h: 1 / 0  # an instance forward, as the first version of install set
    model.train()
    model.eval()
    model.train()
    try:
        import kernels  # noqa: F401
        assert "forward" not in vars(probe)  # the kernels package removed it: the hazard is real here
    except ImportError:
        probe.__dict__.pop("forward")
    n_layers = len(model.model.layers)
    calls = _count_calls(monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    model(ids).logits.float().logsumexp(-1).sum().backward()
    assert calls == {"swiglu": n_layers, "rms_norm": 2 * n_layers + 1,
                     "swiglu_backward": n_layers, "rms_norm_backward": 2 * n_layers + 1}


def test_without_the_kernels_conditions_the_swapped_modules_run_transformers_own_forward():
    """fp32 (and any device or dtype the passes do not take): a swapped model gives the very
    numbers of the original one; an activation with a hook is not a plain SiLU: not swapped."""
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    plain, swapped = _tiny_llama().float(), fused_layers.install(_tiny_llama().float())
    assert type(swapped.model.layers[0].mlp).__name__ == "FusedLlamaMLP"
    assert torch.equal(plain(ids).logits, swapped(ids).logits)
    hooked = _tiny_llama()
    hooked.model.layers[0].mlp.act_fn.register_forward_hook(lambda *a: None)
    fused_layers.install(hooked)
    assert [type(layer.mlp).__name__ for layer in hooked.model.layers] == ["LlamaMLP", "FusedLlamaMLP"]
