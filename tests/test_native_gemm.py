"""The native LM-head kernels (arealite/native/gemm_bf16.c, logits.c): the bf16 -> fp32 GEMM
equal to the float64 product of the same bf16 numbers to fp32 accuracy for every edge of its
blocking (row counts around the 14-row micro-kernel, columns around the 32-column panels, K
across the 768 block), strided rows, pre-packed weights; the fused softmax statistics and bf16
logit gradient equal to float64 references; and the bf16 chunked LM head built on them equal to
the widened fp32 head (logprobs) and within bf16 rounding of float64 (gradients)."""

import pytest
import torch

from arealite import native
from arealite.train_engine.lm_head import chunked_logprobs_entropy


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


_AVAILABLE = {"native": native._native_bf16_dot, "onednn": native._onednn_bf16_math}


@pytest.fixture(autouse=True)
def _choose_backend_again():
    """Each test chooses the GEMM backend afresh (``AREALITE_BF16_GEMM`` as it sets it)."""
    native._gemm_plan.cache_clear()
    yield
    native._gemm_plan.cache_clear()


@pytest.fixture(params=["native", "onednn"])
def backend(request, monkeypatch):
    """Each GEMM backend in turn (``AREALITE_BF16_GEMM``), skipped where it cannot run."""
    if not _AVAILABLE[request.param]():
        pytest.skip(f"the {request.param} bf16 GEMM cannot run here (no compiler/libgomp, AVX-512 BF16 or oneDNN bf16)")
    monkeypatch.setenv("AREALITE_BF16_GEMM", request.param)
    return request.param


@pytest.mark.parametrize("m,n,k", [(1, 1, 2), (13, 31, 8), (14, 32, 64), (15, 33, 576), (29, 1000, 576),
                                   (40, 65, 770), (3, 7, 1538), (300, 96, 96)])
def test_equals_float64_product_of_the_same_bf16_numbers(backend, m, n, k):
    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=n + 1)
    out = native.linear_bf16_f32(x, w)
    ref = x.double() @ w.double().t()
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # exact products, fp32 sums of k terms: error ≤ k · 2^-24 · Σ|x_i w_i| per entry
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert ((out.double() - ref).abs() <= bound).all()


def test_strided_rows_and_odd_or_unsupported_inputs(backend):
    big_x, big_w = _bf16(20, 100, seed=2), _bf16(50, 100, seed=3)
    x, w = big_x[::2, 10:74], big_w[5:45, 20:84]  # row strides 200 and 100, K = 64
    torch.testing.assert_close(native.linear_bf16_f32(x, w), x.float() @ w.float().t(), rtol=1e-5, atol=1e-5)
    assert native.linear_bf16_f32(_bf16(3, 5, seed=0), _bf16(4, 5, seed=1)) is None  # odd K
    assert native.linear_bf16_f32(_bf16(3, 4, seed=0).float(), _bf16(4, 4, seed=1).float()) is None
    assert native.linear_bf16_f32(_bf16(4, 3, seed=0).t(), _bf16(4, 4, seed=1)) is None  # K not contiguous
    assert native.linear_bf16_f32(_bf16(0, 4, seed=0), _bf16(4, 4, seed=1)).shape == (0, 4)


def test_prepacked_weight_gives_the_same_product(backend):
    x, w = _bf16(29, 576, seed=8), _bf16(1000, 576, seed=9)
    packed = native.pack_bf16(w)
    assert torch.equal(native.linear_bf16_f32(x, w, packed), native.linear_bf16_f32(x, w))
    form = packed.form(backend)  # built at first use
    if backend == "native":
        assert form.numel() == 32 * 32 * 576 // 2  # 1000 columns -> 32 panels of 32
    else:
        assert form.dtype == torch.float32 and torch.equal(form, w.float())
    with pytest.raises(ValueError, match="repack"):
        native.linear_bf16_f32(x, w[:500], packed)
    w.add_(1)  # changed in place after packing: the built form and one not built yet are refused
    for other in (backend, "onednn" if backend == "native" else "native"):
        with pytest.raises(ValueError, match="changed in place.*repack"):
            packed.form(other)
    with pytest.raises(ValueError, match="changed in place.*repack"):
        native.linear_bf16_f32(x, w, packed)


def test_backend_is_chosen_by_measurement_per_row_count_and_can_be_forced(monkeypatch, caplog):
    found = [b for b, ok in _AVAILABLE.items() if ok()]
    monkeypatch.setenv("AREALITE_BF16_GEMM", "auto")
    with caplog.at_level("INFO", logger="arealite.native"):
        choice = native.bf16_gemm_backend()
    assert choice in found if found else choice is None
    if len(found) == 2:  # both timed at every probed row count, named in the log line
        assert all(f"{m} rows: native " in caplog.text and " ms" in caplog.text for m in native._PROBE_ROWS)
        assert all(native.bf16_gemm_backend(m) in found for m in (1, 8, 9, 128, 10_000))
    for forced in found:
        monkeypatch.setenv("AREALITE_BF16_GEMM", forced)
        native._gemm_plan.cache_clear()
        assert all(native.bf16_gemm_backend(m) == forced for m in (None, 1, 100, 10_000))
    monkeypatch.setenv("AREALITE_BF16_GEMM", "fast")
    native._gemm_plan.cache_clear()
    with pytest.raises(ValueError, match="AREALITE_BF16_GEMM must be auto, native or onednn"):
        native.bf16_gemm_backend()


def test_each_row_count_runs_on_its_planned_backend(monkeypatch):
    """A plan of 'native up to 8 rows, oneDNN beyond' sends 1-8 rows to the native kernel and
    more to oneDNN, each with its own form of one packed weight."""
    if not all(ok() for ok in _AVAILABLE.values()):
        pytest.skip("needs both GEMM backends")
    monkeypatch.setattr(native, "_gemm_plan", lambda: ((8, "native"), (128, "onednn")))
    assert [native.bf16_gemm_backend(m) for m in (1, 8, 9, 128, 129, None)] == ["native"] * 2 + ["onednn"] * 4
    calls = []
    real = native._linear
    monkeypatch.setattr(native, "_linear", lambda x, w, p, b: calls.append((x.shape[0], b)) or real(x, w, p, b))
    w = _bf16(100, 64, seed=1)
    packed = native.pack_bf16(w)
    for m in (1, 8, 9, 40):
        x = _bf16(m, 64, seed=m)
        out = native.linear_bf16_f32(x, w, packed)
        torch.testing.assert_close(out, x.float() @ w.float().t(), rtol=1e-5, atol=1e-5)
    assert calls == [(1, "native"), (8, "native"), (9, "onednn"), (40, "onednn")]
    assert set(packed._forms) == {"native", "onednn"}


needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler / libgomp here")


@needs_library
@pytest.mark.parametrize("v,std,scale", [(1, 1.0, 1.0), (50, 2.0, 1 / 0.7), (49152, 4.0, 1.0), (3000, 40.0, 2.0)])
def test_softmax_stats_equal_float64(v, std, scale):
    g = torch.Generator().manual_seed(v)
    logits = torch.randn(37, v, generator=g) * std
    labels = torch.randint(0, v, (37,), generator=g)
    lp, ent, lse = native.softmax_stats(logits, labels, scale)
    z = logits.double() * scale
    ref_lse = z.logsumexp(-1)
    logp = z - ref_lse[:, None]
    ref_lp, ref_ent = logp.gather(1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    tol = 1e-6 * (1 + z.abs().max().item())  # a few fp32 ulps of the largest |z|
    for got, ref in ((lp, ref_lp), (ent, ref_ent), (lse, ref_lse)):
        assert got.dtype == torch.float32 and (got.double() - ref).abs().max() <= tol


@needs_library
@pytest.mark.parametrize("margin", [0.0, 8.0, 16.0, 25.0, 40.0])
def test_softmax_stats_entropy_from_one_exp_per_logit(margin):
    """Rows whose label leads the other logits by ``margin`` (entropy 10.3 down to ~1e-11 on a
    49k vocabulary). The entropy comes from the same exps as the sum, ``log S - sum(e d) / S``:
    two non-negative terms, so it is never negative and nothing cancels; at high entropy it is
    within 1e-6 relative of float64, at low entropy within the resolution of the fp32 sum S ~ 1
    (the same as the two-exp form before 2026-12-06: 4.2e-5 absolute at margin 16)."""
    g = torch.Generator().manual_seed(int(margin))
    logits = torch.randn(64, 49152, generator=g)
    labels = torch.randint(0, 49152, (64,), generator=g)
    logits[torch.arange(64), labels] += margin
    _, ent, _ = native.softmax_stats(logits, labels, 1.0)
    logp = logits.double().log_softmax(-1)
    ref = -(logp.exp() * logp).sum(-1)
    assert (ent >= 0).all() and (ent.double() - ref).abs().max() <= 1e-4
    if margin == 0.0:
        assert ((ent.double() - ref).abs() / ref).max() <= 1e-6


@needs_library
def test_loading_the_library_keeps_denormals():
    """Linked without -ffast-math: gcc's crtfastmath.o would turn on flush-to-zero in the thread
    that loads the library (here, pytest's: the library is loaded by now), and torch's results in
    that thread would change."""
    assert native.library() is not None
    assert (torch.tensor([1e-30]) * 1e-9).item() > 0  # 1e-39, a float32 denormal


@needs_library
@pytest.mark.parametrize("std", [3.0, 60.0])  # 60: rows spanning ~400, exp arguments far below -87
def test_logprob_grad_bf16_equals_float64_rounded_once(std):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 777, generator=g) * std
    labels = torch.randint(0, 777, (9,), generator=g)
    g_lp = torch.randn(9, generator=g)
    _, _, lse = native.softmax_stats(logits, labels, 0.5)
    got = native.logprob_grad_bf16(logits, lse, g_lp, labels, 0.5)
    z = logits.double() * 0.5
    ref = -torch.softmax(z, -1)
    ref[torch.arange(9), labels] += 1
    ref *= 0.5 * g_lp.double()[:, None]
    assert got.dtype == torch.bfloat16
    # one rounding to bf16 (relative 2^-8 at most) of a value accurate to fp32
    assert ((got.double() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-7).all()
    with pytest.raises(ValueError, match="labels must lie in"):
        native.softmax_stats(logits, labels + 777, 1.0)
    buf = torch.zeros(11, 777, dtype=torch.bfloat16)  # rows 1..9 of a larger buffer
    assert native.logprob_grad_bf16(logits, lse, g_lp, labels, 0.5, out=buf[1:10]).data_ptr() == buf[1].data_ptr()
    assert torch.equal(buf[1:10], got) and not buf[0].any() and not buf[10].any()
    with pytest.raises(ValueError, match="out must be a \\[9, 777\\] bfloat16"):
        native.logprob_grad_bf16(logits, lse, g_lp, labels, 0.5, out=buf[:9].float())


@pytest.mark.parametrize("gemm", ["native", "onednn"])
@pytest.mark.parametrize("chunk,head_grad", [(1000, True), (7, True), (1000, False), (30, False), (7, False)])
def test_bf16_head_gives_the_widened_fp32_logprobs_and_bf16_close_gradients(chunk, head_grad, gemm, monkeypatch):
    """Whichever path runs here (either GEMM backend, kernels or torch ops; a backend that
    cannot run here leaves the widened fp32 GEMM), a bf16 head's logprobs and entropy equal
    the fp32 head over the widened bf16 numbers; ∂hidden (and ∂weight when the head trains; a
    frozen head, as under LoRA, takes the fused bf16 gradient) are within bf16 rounding of the
    float64 gradients; one chunk (probabilities kept), several (recomputed) and, for a frozen
    head, 60 rows in chunks of 30 (the bf16 logit gradient kept from forward)."""
    monkeypatch.setenv("AREALITE_BF16_GEMM", gemm)
    n, h, v = 60, 64, 300
    hidden = (_bf16(n, h, seed=4) * 2).requires_grad_()
    weight = _bf16(v, h, seed=5).requires_grad_(head_grad)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(6))
    lp, ent = chunked_logprobs_entropy(hidden, weight, labels, 0.7, chunk)
    hd, wd = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = ((hd @ wd.t()) / 0.7).log_softmax(-1)
    lp_ref, ent_ref = logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp, lp_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref.float(), rtol=1e-5, atol=1e-5)
    g_out = torch.randn(n, generator=torch.Generator().manual_seed(7))
    params = [hidden, weight] if head_grad else [hidden]
    got = torch.autograd.grad((lp * g_out).sum(), params)
    refs = torch.autograd.grad((lp_ref * g_out.double()).sum(), [hd, wd][:len(params)])
    assert all(g.dtype == torch.bfloat16 for g in got)
    for got, ref in zip(got, refs):
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


@needs_library
def test_frozen_bf16_head_keeps_its_logit_gradient_up_to_two_chunks_and_recomputes_beyond(monkeypatch):
    """A frozen bf16 head with N <= 2 * chunk rows computes its logits once (forward only) and
    gives the same ∂hidden as the recomputing path, each within bf16 rounding of float64; a
    second backward (retain_graph) recomputes and agrees."""
    from arealite.train_engine import lm_head
    calls = []
    real = lm_head._chunk_logits
    monkeypatch.setattr(lm_head, "_chunk_logits", lambda h, *a, **k: calls.append(h.shape[0]) or real(h, *a, **k))
    n, h, v = 60, 64, 300
    weight = _bf16(v, h, seed=5)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(6))
    g_out = torch.randn(n, generator=torch.Generator().manual_seed(7))
    hd = (_bf16(n, h, seed=4) * 2).double().requires_grad_()
    ref, = torch.autograd.grad((((hd @ weight.double().t()) / 0.7).log_softmax(-1)
                                .gather(-1, labels[:, None])[:, 0] * g_out.double()).sum(), hd)
    grads = {}
    for chunk in (30, 29):
        calls.clear()
        hidden = (_bf16(n, h, seed=4) * 2).requires_grad_()
        lp, _ = chunked_logprobs_entropy(hidden, weight, labels, 0.7, chunk)
        first, = torch.autograd.grad((lp * g_out).sum(), hidden, retain_graph=True)
        forward_and_first = list(calls)
        second, = torch.autograd.grad((lp * g_out).sum(), hidden)
        grads[chunk] = first
        assert first.dtype == torch.bfloat16
        assert ((first.double() - ref).norm() / ref.norm()).item() < 1e-2
        assert ((second.double() - ref).norm() / ref.norm()).item() < 1e-2
        if chunk == 30:  # kept: logits built in forward only, then recomputed by the second backward
            assert forward_and_first == [30, 30] and calls == [30, 30, 30, 30]
        else:  # 60 > 2 * 29 rows: recomputed in backward
            assert forward_and_first == [29, 29, 2, 29, 29, 2]
    assert ((grads[30].double() - grads[29].double()).norm() / ref.norm()).item() < 1e-2
