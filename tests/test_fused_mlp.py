"""SwiGLU as native passes (arealite/native/swiglu.c, arealite/train_engine/fused_mlp.py): torch's
roundings (within two bf16 ulps, mostly bit-equal) forward and backward, extreme gates, the torch
fallback elsewhere, and the MLPs of a real transformers model swapped with the same outputs and
gradients."""

import pytest
import torch
import torch.nn.functional as F

from arealite import native
from arealite.train_engine import fused_mlp

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
    h = native.swiglu_bf16(gate, up)
    g_ref, u_ref = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ref = F.silu(g_ref) * u_ref
    ref.backward(grad)
    d_gate, d_up = native.swiglu_backward_bf16(grad, gate, up)
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
    out = fused_mlp.swiglu(g1, u1)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_SwiGLUBackward"
    out.backward(grad)
    (F.silu(g2) * u2).backward(grad)
    assert _ulps(g1.grad, g2.grad).max() <= 2 and _ulps(u1.grad, u2.grad).max() <= 2
    # fp32, float64 and non-contiguous bf16 run torch's ops: the same numbers exactly
    for a, b in ((gate.float(), up.float()), (gate.double(), up.double()), (gate.mT, up.mT)):
        assert not native.swiglu_fits(a, b)
        assert torch.equal(fused_mlp.swiglu(a, b), F.silu(a) * b)
    assert native.swiglu_bf16(gate, up[..., :32].contiguous()) is None  # shapes differ


def _tiny_llama(act="silu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act=act)
    return LlamaForCausalLM(cfg).bfloat16()


@needs_library
def test_install_swaps_silu_mlps_with_the_same_outputs_and_gradients():
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    results = []
    for fused in (False, True):
        model = _tiny_llama()
        if fused:
            assert fused_mlp.install(model) is model
            assert all("forward" in layer.mlp.__dict__ for layer in model.model.layers)
        logits = model(ids).logits.float()
        logits.logsumexp(-1).sum().backward()
        results.append((logits, model.model.layers[0].mlp.gate_proj.weight.grad.float()))
    (l0, g0), (l1, g1) = results
    assert (l1 - l0).abs().max() <= 0.05 * l0.abs().max()  # bf16 model: ulp-level differences propagate
    assert (g1 - g0).norm() <= 0.02 * g0.norm()
    gelu = _tiny_llama("gelu")
    fused_mlp.install(gelu)
    assert not any("forward" in layer.mlp.__dict__ for layer in gelu.model.layers)  # not a SwiGLU: left alone
