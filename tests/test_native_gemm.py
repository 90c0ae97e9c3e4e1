"""The native bf16 -> fp32 GEMM of the LM head (arealite/native/gemm_bf16.c): equal to the
float64 product of the same bf16 numbers to fp32 accuracy for every edge of its blocking (row
counts around the 14-row micro-kernel, columns around the 32-column panels, K across the 768
block), strided rows; and the bf16 chunked LM head built on it equal to the widened fp32 head."""

import pytest
import torch

from arealite import native
from arealite.train_engine.lm_head import chunked_logprobs_entropy


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _has_kernel() -> bool:
    return native.linear_bf16_f32(_bf16(2, 4, seed=0), _bf16(3, 4, seed=1)) is not None


needs_kernel = pytest.mark.skipif(not _has_kernel(), reason="no compiler, libgomp or AVX-512 BF16 here")


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 1, 2), (13, 31, 8), (14, 32, 64), (15, 33, 576), (29, 1000, 576),
                                   (40, 65, 770), (3, 7, 1538), (300, 96, 96)])
def test_equals_float64_product_of_the_same_bf16_numbers(m, n, k):
    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=n + 1)
    out = native.linear_bf16_f32(x, w)
    ref = x.double() @ w.double().t()
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # exact products, fp32 sums of k terms: error ≤ k · 2^-24 · Σ|x_i w_i| per entry
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert ((out.double() - ref).abs() <= bound).all()


@needs_kernel
def test_strided_rows_and_odd_or_unsupported_inputs():
    big_x, big_w = _bf16(20, 100, seed=2), _bf16(50, 100, seed=3)
    x, w = big_x[::2, 10:74], big_w[5:45, 20:84]  # row strides 200 and 100, K = 64
    torch.testing.assert_close(native.linear_bf16_f32(x, w), x.float() @ w.float().t(), rtol=1e-5, atol=1e-5)
    assert native.linear_bf16_f32(_bf16(3, 5, seed=0), _bf16(4, 5, seed=1)) is None  # odd K
    assert native.linear_bf16_f32(_bf16(3, 4, seed=0).float(), _bf16(4, 4, seed=1).float()) is None
    assert native.linear_bf16_f32(_bf16(4, 3, seed=0).t(), _bf16(4, 4, seed=1)) is None  # K not contiguous
    assert native.linear_bf16_f32(_bf16(0, 4, seed=0), _bf16(4, 4, seed=1)).shape == (0, 4)


@pytest.mark.parametrize("chunk", [1000, 7])  # one chunk (probabilities kept) and the recompute path
def test_bf16_head_gives_the_widened_fp32_logprobs_and_bf16_close_gradients(chunk):
    """Whichever path runs here (kernel or widening), a bf16 head's logprobs and entropy equal the
    fp32 head over the widened bf16 numbers; ∂hidden and ∂weight are within bf16 rounding of the
    float64 gradients."""
    n, h, v = 60, 64, 300
    hidden = (_bf16(n, h, seed=4) * 2).requires_grad_()
    weight = _bf16(v, h, seed=5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(6))
    lp, ent = chunked_logprobs_entropy(hidden, weight, labels, 0.7, chunk)
    hd, wd = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = ((hd @ wd.t()) / 0.7).log_softmax(-1)
    lp_ref, ent_ref = logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp, lp_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref.float(), rtol=1e-5, atol=1e-5)
    g_out = torch.randn(n, generator=torch.Generator().manual_seed(7))
    gh, gw = torch.autograd.grad((lp * g_out).sum(), [hidden, weight])
    rh, rw = torch.autograd.grad((lp_ref * g_out.double()).sum(), [hd, wd])
    assert gh.dtype == gw.dtype == torch.bfloat16
    for got, ref in ((gh, rh), (gw, rw)):
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2
