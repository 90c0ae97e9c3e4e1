"""short_attention (four batched GEMMs, P kept) against float64 SDPA: grouped-query heads, bool
masks, causal rows, a query that attends nothing; and the engine's attention dispatch."""

import pytest
import torch
import torch.nn.functional as F

from arealite.train_engine import segment_attention, short_attention
from arealite.train_engine.short_attention import fits


def _reference(q, k, v, keep, causal, scale):
    """float64 SDPA with K and V repeated per query head (repeat_kv's order)."""
    g = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=keep, is_causal=causal, scale=scale)
    return out, (q, k, v)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("kind", ["mask", "causal", "suffix"])
def test_equals_sdpa_forward_and_backward(dtype, tol, heads, kv_heads, kind):
    torch.manual_seed(0)
    r, lq, lk, d = 3, 7, 7 if kind != "suffix" else 11, 8
    q = torch.randn(r, heads, lq, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(r, kv_heads, lk, d, dtype=dtype, requires_grad=True) for _ in range(2))
    keep = None
    if kind == "mask":  # a different random mask per row; every query keeps its own key
        keep = (torch.rand(r, 1, lq, lk) < 0.6) | torch.eye(lq, lk, dtype=torch.bool)
    elif kind == "suffix":  # 4 prompt keys then causal over the row's own 7 (bottom-right aligned)
        keep = torch.ones(lq, lk, dtype=torch.bool).tril_(lk - lq)[None, None]
    causal = kind == "causal"
    out = short_attention.short_attention(q, k, v, keep, 0.3, is_causal=causal)
    ref, leaves = _reference(q, k, v, keep, causal, 0.3)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=tol)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    for mine, want in zip((q, k, v), leaves):
        torch.testing.assert_close(mine.grad.double(), want.grad, rtol=0, atol=tol * 10)


def test_bf16_error_is_no_larger_than_the_flash_kernels():
    """bf16 at command 1's shape (9 / 3 heads of 64, 232 tokens): each output and gradient within
    1.5x the error of torch's SDPA on the same bf16 inputs, both against float64."""
    torch.manual_seed(1)
    q = torch.randn(2, 9, 232, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 3, 232, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 9, 232, 64, dtype=torch.bfloat16)
    ref, leaves = _reference(q, k, v, None, True, 0.125)
    ref.backward(grad.double())
    errors = {}
    for name in ("ours", "sdpa"):
        for t in (q, k, v):
            t.grad = None
        if name == "ours":
            out = short_attention.short_attention(q, k, v, None, 0.125, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                 is_causal=True, scale=0.125)
        out.backward(grad)
        errors[name] = [float((a.detach().double() - b.detach()).abs().max())
                        for a, b in ((out, ref), *((t.grad, u.grad) for t, u in zip((q, k, v), leaves)))]
    assert all(e < 0.1 for e in errors["ours"]), errors
    assert all(o <= 1.5 * s for o, s in zip(errors["ours"], errors["sdpa"])), errors


def test_a_query_that_attends_nothing_gets_zeros_and_no_gradient():
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    keep = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    keep[0, 0, 1] = False  # query 1 sees no key
    out = short_attention.short_attention(q, k, v, keep, 0.5)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 4)) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.equal(q.grad[:, :, 1], torch.zeros(1, 2, 4))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_bad_shapes_name_the_problem():
    q, k = torch.randn(1, 5, 3, 4), torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="5 query heads are not a multiple of 2"):
        short_attention.short_attention(q, k, k, None, 0.5)
    with pytest.raises(ValueError, match=r"mask must be \[R or 1, 1, Lq, Lk\]"):
        short_attention.short_attention(torch.randn(1, 4, 3, 4), k, k, torch.ones(1, 4, 3, 3, dtype=torch.bool), 0.5)


def test_fits_only_short_cpu_rows_without_dropout():
    q = torch.randn(1, 9, 256, 64, dtype=torch.bfloat16)
    assert fits(q, q[:, :3], 0.0)
    assert not fits(q, q[:, :3], 0.1)  # dropout
    assert not fits(torch.randn(1, 9, 257, 64), torch.randn(1, 3, 257, 64), 0.0)  # keys > MAX_KEYS
    assert not fits(torch.randn(16, 9, 256, 8), torch.randn(16, 3, 256, 8), 0.0)  # > MAX_SCORES scores
    assert not fits(q.half(), q[:, :3].half(), 0.0)


def test_engine_dispatch_runs_short_attention_and_equals_transformers_sdpa(monkeypatch):
    """segment_attention's dense path: transformers' SDPA result (its [R, Lq, H, d] layout), by
    short_attention where it fits and by SDPA where it does not (a float mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(2)
    module = type("Attn", (), {"num_key_value_groups": 3, "is_causal": True, "training": True})()
    q = torch.randn(2, 6, 10, 8)
    k, v = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    keep = torch.ones(10, 10, dtype=torch.bool).tril_()[None, None].repeat(2, 1, 1, 1)
    keep[1, 0, 5:, :5] = False  # row 1: two packed sequences
    calls = []
    real = short_attention.short_attention
    monkeypatch.setattr(short_attention, "short_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for mask in (keep, None):
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
        got, _ = segment_attention.segment_attention(module, q, k, v, mask, scaling=0.25)
        assert got.shape == (2, 10, 6, 8) and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert len(calls) == 2
    additive = torch.zeros(2, 1, 10, 10).masked_fill_(~keep, float("-inf"))
    got, _ = segment_attention.segment_attention(module, q, k, v, additive, scaling=0.25)
    assert len(calls) == 2  # a float mask goes to SDPA
    torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, keep, scaling=0.25)[0], rtol=0, atol=1e-6)


def test_values_of_another_head_size_go_to_sdpa():
    """Multi-head latent attention (DeepSeek-V2/V3) has value heads narrower than the keys':
    short_attention refuses them and the dispatch keeps SDPA."""
    module = type("Attn", (), {"num_key_value_groups": 1, "is_causal": True, "training": True})()
    q, k, v = torch.randn(2, 4, 10, 24), torch.randn(2, 4, 10, 24), torch.randn(2, 4, 10, 16)
    assert fits(q, k, 0.0) and not fits(q, k, 0.0, v)
    with pytest.raises(ValueError, match="must share R and the head size"):
        short_attention.short_attention(q, k, v, None, 0.2, is_causal=True)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    got, _ = segment_attention.segment_attention(module, q, k, v, None, scaling=0.2)
    assert got.shape == (2, 10, 4, 16)
    torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, None, scaling=0.2)[0])


def test_backward_twice_with_the_graph_kept():
    """fp32: the saved probabilities are not modified by backward (retain_graph works)."""
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out = short_attention.short_attention(q, k, v, None, 0.5, is_causal=True)
    out.sum().backward(retain_graph=True)
    first = q.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(q.grad, 2 * first)
