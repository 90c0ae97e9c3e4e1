"""Attention of short rows on the CPU as four batched GEMMs with the probabilities kept, instead
of torch's CPU flash kernel.

For the rows an RL trainer packs (a prompt and its group's completions: a few hundred tokens),
the flash kernel's backward is 5-6x its forward (it recomputes the probabilities block by block
and runs its small GEMMs one (sequence, head) at a time). Here, per call (Vaswani et al. 2017,
eq. 1; the backward as in FlashAttention, Dao et al. 2022, appendix B.2, with P kept):

* forward: ``S = scale · Q Kᵀ`` (fp32), −∞ where not attended, ``E = exp(S − rowmax S)``,
  ``l = rowsum E`` (fp32), ``O = (E V) / l``;
* backward: ``P = E / l``, ``dV = Pᵀ dO``, ``dP = dO Vᵀ`` (fp32), ``D = rowsum(dO ∘ O)``,
  ``dS = P ∘ (dP − D)``, ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q``.

Grouped-query attention needs no copies of K and V: the G query heads of a KV head are one
``[G·Lq, d]`` operand (``repeat_kv``'s head order), so ``dK`` and ``dV`` come out summed over them.
bf16 inputs: the products that make S and dP are exact in fp32 and summed in fp32 (oneDNN's bf16
path, :func:`arealite.native.bf16_math`); E (unnormalised, so each row's largest weight is exactly
1) and dS are rounded to bf16 for their GEMMs, as in the flash kernel. The cost is memory: E of
every layer is kept for backward (``R·H·Lq·Lk`` values), so :func:`fits` admits calls of at most
:data:`MAX_SCORES` scores and :data:`MAX_KEYS` keys.

Speed (forward + backward of one layer, bf16, 2 threads, the 2-core Xeon with AMX, 2026-12-05,
``python benchmarks/attention_bench.py``): 1.2x the flash kernel on README command 1's rows (232
tokens, dense prefix-shared mask), 2.2-3.4x on causal rows of 64-128 tokens and on suffix segments
of 64 queries over 128 keys, 1.1x at 256 keys and 0.89x at 512 (so :data:`MAX_KEYS`); the errors
against float64 are the flash kernel's or smaller (dQ up to 1.8x on 64-token rows).
"""

from __future__ import annotations

import torch

from arealite import native

MAX_SCORES = 1 << 23  # R·H·Lq·Lk: 32 MiB of fp32 scores per call, 16 MiB of bf16 E kept per layer
MAX_KEYS = 256  # longer rows: the flash kernel wins (0.89x at 512 keys; its memory is O(L), not O(L²))


def fits(query: torch.Tensor, key: torch.Tensor, dropout: float, value: torch.Tensor | None = None) -> bool:
    """Whether :func:`short_attention` should run this call: a CPU tensor in bf16 or fp32, no
    dropout, at most :data:`MAX_KEYS` keys and :data:`MAX_SCORES` scores, and (given ``value``)
    values of the keys' shape (not multi-head latent attention's narrower value heads)."""
    r, h, lq, _ = query.shape
    lk = key.shape[2]
    same = value is None or (value.shape == key.shape and query.shape[0] == key.shape[0]
                             and query.shape[-1] == key.shape[-1])
    return (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float32) and dropout == 0.0
            and lk <= MAX_KEYS and r * h * lq * lk <= MAX_SCORES and same)


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32 or wider: bf16 operands' products are exact in fp32 and summed in fp32
    (oneDNN's bf16 path where it is the fast one, :func:`arealite.native.bf16_math`)."""
    if a.dtype not in (torch.bfloat16, torch.float16):
        return torch.matmul(a, b)
    with native.bf16_math(a):
        return torch.matmul(a.float(), b.float())


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, scale):
        r, hk, lk, d = k.shape
        g, lq = q.shape[1] // hk, q.shape[2]
        qg = q.reshape(r, hk, g * lq, d)
        s = _mm32(qg, k.transpose(-1, -2)).view(r, hk, g, lq, lk).mul_(scale)
        if keep is not None:
            s.masked_fill_(~keep, float("-inf"))
        top = s.amax(-1, keepdim=True).nan_to_num_(0.0, neginf=0.0)  # a query that attends nothing: 0
        e = s.sub_(top).exp_().view(r, hk, g * lq, lk)  # in (0, 1], exactly 1 at each row's top key
        total = e.sum(-1, keepdim=True).clamp_min_(1e-30)  # [R, H_kv, G·Lq, 1]
        # E V with E rounded to q's dtype (oneDNN's bf16 path rounds it; fp32 otherwise), as the
        # flash kernel: unnormalised, so each row's top weight (1) is exact in bf16
        with native.bf16_math(q):
            o = torch.matmul(e, v.to(e.dtype)).div_(total).to(q.dtype)  # [R, H_kv, G·Lq, d]
        e = e.to(q.dtype)
        ctx.save_for_backward(qg, k, v, e, total, o)
        ctx.scale = scale
        return o.view(r, hk * g, lq, d)

    @staticmethod
    def backward(ctx, do):
        qg, k, v, e, total, o = ctx.saved_tensors
        r, h, lq, d = do.shape
        do = do.reshape(qg.shape)  # [R, H_kv, G·Lq, d]
        dp = _mm32(do, v.transpose(-1, -2))  # [R, H_kv, G·Lq, Lk], fp32 or wider
        p = e.to(dp.dtype, copy=True).div_(total)  # e is saved: never in place
        dv = torch.matmul(p.to(qg.dtype).transpose(-1, -2), do)  # summed over the G query heads
        rowsum = (do * o).sum(-1, keepdim=True, dtype=dp.dtype)
        ds = dp.sub_(rowsum).mul_(p).mul_(ctx.scale).to(qg.dtype)
        del dp, p
        dq = torch.matmul(ds, k).view(r, h, lq, d)
        dk = torch.matmul(ds.transpose(-1, -2), qg)
        return dq, dk, dv, None, None


def short_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None,
                    scale: float, is_causal: bool = False) -> torch.Tensor:
    """Softmax attention (module docstring) of short rows.

    Args:
        query: [R, H, Lq, d] bf16 or fp32 (CPU).
        key, value: [R, H_kv, Lk, d], ``H`` a multiple of ``H_kv`` (grouped-query attention).
        keep: bool mask, True = attend, broadcastable to [R, 1, Lq, Lk] (transformers' SDPA
            mask), or None.
        scale: the score scale (``d ** -0.5`` usually).
        is_causal: attend key j from query i iff j <= i (top-left aligned, as SDPA; with
            ``keep``: both).

    Returns:
        [R, H, Lq, d] in ``query``'s dtype. A query that attends no key gets zeros (SDPA would
        give NaN).

    Raises:
        ValueError: ``H`` is not a multiple of ``H_kv``, the three differ in R or head size, or
            ``keep`` has a per-head dimension.
    """
    r, h, lq, _ = query.shape
    hk, lk = key.shape[1], key.shape[2]
    if h % hk:
        raise ValueError(f"short_attention: {h} query heads are not a multiple of {hk} key/value heads")
    if value.shape != key.shape or query.shape[0] != key.shape[0] or query.shape[-1] != key.shape[-1]:
        raise ValueError(f"short_attention: query {list(query.shape)}, key {list(key.shape)} and value "
                         f"{list(value.shape)} must share R and the head size (use SDPA otherwise)")
    if keep is not None:
        if keep.dim() != 4 or keep.shape[1] != 1:
            raise ValueError(f"short_attention: the mask must be [R or 1, 1, Lq, Lk], got {list(keep.shape)}")
        keep = keep.unsqueeze(2)  # over [R, H_kv, G, Lq, Lk]
    if is_causal:  # top-left aligned, as SDPA's is_causal
        causal = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril_()
        keep = causal if keep is None else keep & causal
    return _ShortAttention.apply(query, key, value, keep, scale)
