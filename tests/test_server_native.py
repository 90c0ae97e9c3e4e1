"""The server's native decode-attention kernel (arealite/native/, decode_attention.c):
equality with a float64 reference that reads each row's own length, positions past a row's
length never read, torch's thread pool shared, and the SDPA fallback where it cannot be built."""

import logging
import os

import pytest
import torch

from arealite import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler / libgomp here")


def _reference(q, k_buf, v_buf, lens, scale):
    """float64 attention of row r over its positions [0, lens[r]), GQA by repeating KV heads."""
    b, hkv, g, d = q.shape
    out = torch.empty(b, hkv, g, d, dtype=torch.float64)
    for r in range(b):
        n = int(lens[r])
        k, v = k_buf[r, :, :n].double(), v_buf[r, :, :n].double()  # [hkv, n, d]
        s = torch.einsum("hgd,hnd->hgn", q[r].double(), k) * scale
        out[r] = torch.einsum("hgn,hnd->hgd", torch.softmax(s, -1), v)
    return out


def _case(b, hkv, g, d, rows, capacity, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, g, d, generator=gen).to(dtype)
    k_buf = torch.randn(rows, hkv, capacity, d, generator=gen).to(dtype)
    v_buf = torch.randn(rows, hkv, capacity, d, generator=gen).to(dtype)
    lens = torch.randint(1, capacity + 1, (b,), generator=gen)
    lens[0], lens[-1] = 1, capacity  # one position only, and the full buffer
    return q, k_buf, v_buf, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hkv,g,d,capacity", [
    (5, 3, 3, 64, 37), (3, 1, 1, 128, 37), (4, 4, 2, 8, 37), (2, 2, 16, 256, 37),
    # the AVX-512 BF16 path: blocks of 16 positions with a tail, 4 + 1 heads per value pass (d 64),
    # 2 + 2 + 2 (d 128), and 16 heads
    (4, 2, 5, 64, 83), (3, 2, 6, 128, 70), (2, 1, 16, 64, 32)])
def test_decode_attention_matches_a_float64_reference(dtype, b, hkv, g, d, capacity):
    q, k_buf, v_buf, lens = _case(b, hkv, g, d, rows=b + 2, capacity=capacity, dtype=dtype)
    scale = d ** -0.5
    out = native.decode_attention(q, k_buf, v_buf, lens, scale)
    assert out.dtype == dtype and out.shape == (b, hkv, g, d)
    ref = _reference(q, k_buf, v_buf, lens, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    else:  # fp32 inside, one rounding to bf16 at the end: within one bf16 ulp of the exact value
        err = (out.double() - ref).abs()
        assert (err <= ref.abs() * 2 ** -8 + 1e-6).all(), err.max()
    # a row attending one position returns that position's value (softmax of one score = 1)
    torch.testing.assert_close(out[0].double(), v_buf[0, :, :1].double().expand(hkv, g, d),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_spanning_hundreds_match_the_reference(dtype):
    """Scores 30x the usual scale (rows spanning ~1000, exp arguments far below -87, where
    the kernel floors them): still the float64 softmax, each weight within fp32 of it."""
    q, k_buf, v_buf, lens = _case(4, 2, 3, 64, rows=5, capacity=50, dtype=dtype, seed=1)
    scale = 30 * 64 ** -0.5
    out = native.decode_attention(q, k_buf, v_buf, lens, scale)
    ref = _reference(q, k_buf, v_buf, lens, scale)
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * (2 ** -8 if dtype == torch.bfloat16 else 1e-5) + 1e-5).all(), err.max()


def test_positions_past_each_rows_length_are_never_read():
    q, k_buf, v_buf, lens = _case(6, 2, 3, 64, rows=6, capacity=50, dtype=torch.float32, seed=1)
    clean = native.decode_attention(q, k_buf, v_buf, lens, 0.125)
    for r in range(6):  # NaN wherever a row must not look (and in rows beyond b)
        k_buf[r, :, int(lens[r]):] = float("nan")
        v_buf[r, :, int(lens[r]):] = float("nan")
    assert torch.equal(native.decode_attention(q, k_buf, v_buf, lens, 0.125), clean)


def test_strided_views_and_non_contiguous_queries():
    """The server passes the whole cache buffers and a query reshaped from a transposed tensor."""
    q, k_buf, v_buf, lens = _case(3, 2, 2, 64, rows=3, capacity=20, dtype=torch.float32, seed=2)
    big_k = torch.zeros(5, 2, 64, 64)  # more rows and capacity than the step uses
    big_v = torch.zeros(5, 2, 64, 64)
    big_k[:3, :, :20], big_v[:3, :, :20] = k_buf, v_buf
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not q_t.is_contiguous()
    out = native.decode_attention(q_t, big_k, big_v, lens, 0.125)
    assert torch.equal(out, native.decode_attention(q, k_buf, v_buf, lens, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_keys_and_values_are_written_at_each_rows_last_position_first(dtype):
    """With this step's keys/values (strided views, as the server's transposed projections are)
    the kernel writes them at position lens[r] - 1 of row r, touches nothing else, and attends
    over them: the same buffers and output as writing them first and attending without."""
    b, hkv, g, d = 4, 3, 3, 64
    q, k_buf, v_buf, lens = _case(b, hkv, g, d, rows=b + 1, capacity=40, dtype=dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    k_new = torch.randn(b, 1, hkv, d, generator=gen).to(dtype).transpose(1, 2)[:, :, 0]  # strides (hkv*d, d, 1)
    v_new = torch.randn(b, 5 * hkv * d, generator=gen).to(dtype)[:, 2 * hkv * d:3 * hkv * d].view(b, hkv, d)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    for r in range(b):
        k_ref[r, :, int(lens[r]) - 1], v_ref[r, :, int(lens[r]) - 1] = k_new[r], v_new[r]
    ref = native.decode_attention(q, k_ref, v_ref, lens, d ** -0.5)
    out = native.decode_attention(q, k_buf, v_buf, lens, d ** -0.5, k_new, v_new)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    assert torch.equal(out, ref)
    assert not torch.equal(k_ref, _case(b, hkv, g, d, rows=b + 1, capacity=40, dtype=dtype, seed=3)[1])
    # both or neither, of q's dtype and [b, hkv, d]: else None (the caller writes and runs SDPA)
    assert native.decode_attention(q, k_buf, v_buf, lens, 1.0, k_new, None) is None
    assert native.decode_attention(q, k_buf, v_buf, lens, 1.0, k_new.double(), v_new.double()) is None
    assert native.decode_attention(q, k_buf, v_buf, lens, 1.0, k_new[:2], v_new[:2]) is None
    # a length past the buffers' capacity, or buffers of fewer rows / other heads: None, and
    # nothing written (the indexed write it replaced raised instead of writing out of bounds)
    before = k_buf.clone()
    assert native.decode_attention(q, k_buf, v_buf, lens.clone().fill_(41), 1.0, k_new, v_new) is None
    assert native.decode_attention(q, k_buf, v_buf, lens * 0, 1.0, k_new, v_new) is None
    assert native.decode_attention(q, k_buf[:b - 1], v_buf[:b - 1], lens, 1.0, k_new, v_new) is None
    assert native.decode_attention(q, k_buf[:, :2], v_buf[:, :2], lens, 1.0, k_new, v_new) is None
    assert torch.equal(k_buf, before)


def test_unsupported_inputs_return_none_for_the_sdpa_fallback():
    q, k_buf, v_buf, lens = _case(2, 1, 1, 8, rows=2, capacity=4, dtype=torch.float32)
    assert native.decode_attention(q.double(), k_buf.double(), v_buf.double(), lens, 1.0) is None
    assert native.decode_attention(q, k_buf.to(torch.bfloat16), v_buf, lens, 1.0) is None
    assert native.decode_attention(q, k_buf.transpose(2, 3), v_buf, lens, 1.0) is None


def test_kernel_runs_on_torchs_own_openmp_runtime():
    """One libgomp in the process (torch's): a second OpenMP pool would make both sleep between
    parallel regions (the 1.4x decode throttle of arealite.utils.proc.run_in_short_lived_thread)."""
    runtimes = native._mapped_openmp_runtimes()
    assert len(runtimes) == 1 and os.path.basename(next(iter(runtimes))) == "libgomp.so.1", runtimes
    assert os.path.dirname(next(iter(runtimes))) == os.path.join(os.path.dirname(torch.__file__), "lib")


def test_without_a_compiler_the_server_falls_back_to_sdpa(monkeypatch, tmp_path, caplog):
    from arealite.server import kv_cache

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("AREALITE_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="arealite.native"):
            assert native.library() is None
        assert any("no C compiler" in r.getMessage() and "no-such-cc" in r.getMessage() for r in caplog.records)
        # the scheduler's decode attention through SDPA equals the kernel's result
        q, k_buf, v_buf, lens = _case(3, 2, 2, 16, rows=3, capacity=9, dtype=torch.float32, seed=3)
        assert native.decode_attention(q, k_buf, v_buf, lens, 0.25) is None
        monkeypatch.delenv("CC")
        monkeypatch.setenv("AREALITE_NATIVE_KERNELS", "0")
        native.library.cache_clear()
        assert native.library() is None
    finally:
        native.library.cache_clear()
    cache = kv_cache.SlotKVCache(1, 2, 16, torch.float32, "cpu", max_rows=4)
    cache.ensure(3, 9, 0, 0)
    cache.k[0][:3, :, :9], cache.v[0][:3, :, :9] = k_buf, v_buf  # capacity rounds up to 128
    module = torch.nn.Module()
    module.layer_idx = 0
    pos = lens - 1
    query = q.reshape(3, 4, 1, 16)
    key, value = k_buf[torch.arange(3), :, pos][:, :, None], v_buf[torch.arange(3), :, pos][:, :, None]
    outs = []
    for env in ("0", "1"):  # SDPA, then the kernel
        monkeypatch.setenv("AREALITE_NATIVE_KERNELS", env)
        native.library.cache_clear()
        mask = (torch.arange(9)[None, :] <= pos[:, None])[:, None, None]
        with kv_cache.attention_step(cache, pos=pos, kv_len=int(lens.max()), mask=mask):
            outs.append(kv_cache.slot_attention(module, query, key, value, None, scaling=0.25)[0])
    native.library.cache_clear()
    assert outs[0].shape == (3, 1, 4, 16)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
