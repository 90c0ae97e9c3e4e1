"""Chunked LM head: token logprobs and entropy from final hidden states without ever holding
the fp32 logits of all tokens at once.

``logits = hidden @ weight.T (+ bias)`` has shape [N, V]; for N = 16k tokens and V = 150k that
is 9.6 GB in float32 — more than the rest of a 0.5B model's training state. Here the logits are
built ``chunk_size`` rows at a time, reduced to a logprob and an entropy per row, and freed; the
backward recomputes each chunk's logits (one extra [c, H] × [H, V] matmul per chunk) and
accumulates the gradients of ``hidden`` and ``weight``; when all rows fit in one chunk, the
probabilities are kept from the forward instead (no recompute). A bf16 model whose head gets no
gradient (LoRA, a frozen head) with at most ``2 · chunk_size`` rows keeps instead each row's logit
gradient per unit of its logprob's gradient, ``(onehot − p) / T`` in bf16 ([N, V], at most one fp32
chunk's bytes), written while the forward's logits exist: its backward is one bf16 GEMM. The
largest float buffers of the head are two [chunk_size, V] fp32 ones' worth, in forward and in
backward.

Formulas (z = logits / T, p = softmax(z), T = temperature, 0 and 1 meaning no scaling — the
server's sampling convention, see :func:`arealite.algorithms.functional.gather_logprobs`):

* ``logprob_i = z_{i,y_i} − logsumexp_j z_{i,j}``
* ``entropy_i = −Σ_j p_{i,j} log p_{i,j}``
* ``∂ logprob_i / ∂ logits_{i,j} = (1[j = y_i] − p_{i,j}) / T`` (softmax cross-entropy gradient)

The entropy is returned detached (for logging): no gradient flows through it.
"""

from __future__ import annotations

import torch

from arealite import native

_HALF = (torch.bfloat16, torch.float16)  # multiplied in fp32 in the head


def _scale(temperature: float) -> float:
    return 1.0 if temperature in (0.0, 1.0) else float(temperature)


def _packed(weight: torch.Tensor) -> native.PackedBF16 | None:
    """:func:`arealite.native.pack_bf16` of a bf16 CPU head weight (once per forward or backward,
    for all its chunks), else None."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    return native.pack_bf16(weight.detach())


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: float,
                  packed: native.PackedBF16 | None = None) -> torch.Tensor:
    """[c, V] float32 logits / T of one chunk. The logits are fp32 whatever the model dtype
    (bf16 logits are off by ~0.04 at |logit| 10, a train-inference mismatch of its own; MiniMax-M1,
    arXiv:2506.13585, section 3.3, likewise keeps the LM head in fp32). bf16 operands on a CPU
    with AVX-512 BF16 or AMX go through :func:`arealite.native.linear_bf16_f32` (exact products,
    fp32 sums: the same logits as widening, at 2-3x the speed; ``packed`` is :func:`_packed` of
    ``weight``); otherwise they are widened to fp32."""
    logits = native.linear_bf16_f32(h, weight, packed) if h.dtype == torch.bfloat16 else None
    if logits is not None:
        if bias is not None:
            logits.add_(bias.float())
    else:
        if h.dtype in _HALF:
            h, weight = h.float(), weight.float()
            bias = bias.float() if bias is not None else None
        logits = torch.nn.functional.linear(h, weight, bias).float()  # [c, V]
    if t != 1.0:
        logits.div_(t)
    return logits


def _torch_stats(z: torch.Tensor, labels: torch.Tensor, t: float):
    """(logprob [c], entropy [c], lse [c], p [c, V]) of raw logits z [c, V] with torch ops; z's
    buffer is reused (it holds log p afterwards)."""
    if t != 1.0:
        z.div_(t)
    lse = z.logsumexp(-1)  # [c]
    logprob = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    logp = z.sub_(lse[:, None])  # log p, in z's buffer [c, V]
    p = torch.exp(logp)  # [c, V]
    # −Σ p log p (not lse − Σ p z, which cancels catastrophically at low entropy)
    entropy = -torch.bmm(p[:, None, :], logp[:, :, None]).view(-1)
    return logprob, entropy, lse, p


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """Two implementations of the same formulas (module docstring): on the CPU with the native
    library, each chunk's softmax statistics are :func:`arealite.native.softmax_stats` and, for a
    bf16 model whose head weight and bias get no gradient (LoRA, a frozen head), the logit
    gradient is :func:`arealite.native.logprob_grad_bf16`; elsewhere torch ops."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size):
        t = _scale(temperature)
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # float64 inputs keep torch's ops: the reference path of the tests
        native_ok = hidden.device.type == "cpu" and hidden.dtype != torch.float64 and native.library() is not None
        ctx.fused_grad = native_ok and hidden.dtype == torch.bfloat16 and need_h and not need_w and not need_b
        # A bf16 model whose head gets no gradient: each row's logit gradient per unit of its
        # logprob's gradient, s·(onehot − p), is written in bf16 while the chunk's logits exist
        # and kept for backward (no recomputed logits), when all rows' [N, V] bf16 fit in one
        # fp32 chunk's bytes (N ≤ 2·chunk_size: the head's peak stays 2·chunk_size·V·4 bytes).
        direction = (torch.empty(n, weight.shape[0], dtype=torch.bfloat16)
                     if ctx.fused_grad and n <= 2 * chunk_size else None)
        # Otherwise, one chunk only: keep its probabilities for backward instead of recomputing
        # them (still one [c, V] buffer; saves the recompute matmul).
        keep = direction is None and n <= chunk_size and (need_h or need_w or need_b)
        ctx.kept = None
        packed = _packed(weight)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            z = _chunk_logits(hidden[s:e], weight, bias, 1.0, packed)  # [c, V] raw logits
            stats = native.softmax_stats(z, labels[s:e], 1.0 / t) if native_ok else None
            if stats is not None:
                logprobs[s:e], entropy[s:e], lse_all[s:e] = stats
                if direction is not None:
                    native.logprob_grad_bf16(z, lse_all[s:e], torch.ones(e - s), labels[s:e], 1.0 / t,
                                             out=direction[s:e])
                elif keep:  # probabilities
                    ctx.kept = z.mul_(1.0 / t).sub_(lse_all[s:e, None]).exp_()
            else:  # (the kernels cannot run: nothing was written into direction)
                direction = None
                logprobs[s:e], entropy[s:e], lse_all[s:e], p = _torch_stats(z, labels[s:e], t)
                if keep:
                    ctx.kept = p
                del p
            del z
        ctx.direction = direction
        ctx.save_for_backward(hidden, weight, bias, labels, lse_all)
        ctx.temperature, ctx.chunk_size = t, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, lse_all = ctx.saved_tensors
        t, chunk_size = ctx.temperature, ctx.chunk_size
        n = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_lp = grad_logprobs.float()  # [N]
        if ctx.direction is not None:  # bf16 s·(onehot − p) [N, V] from forward: one bf16 GEMM
            grad_h = (ctx.direction @ weight).mul_(g_lp[:, None])  # [N, H], rows scaled by g in fp32
            ctx.direction = None  # freed now (a second backward recomputes the logits)
            return grad_h, None, None, None, None, None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        # ∂/∂hidden: a bf16 model gets g rounded to bf16 and a bf16 GEMM with fp32 sums (as under
        # autocast); its result is rounded to bf16 anyway, and g's rounding adds ~1.4x that
        # rounding's error (relative 2.3e-3 vs 1.7e-3 on a 49k vocabulary) at 1/4 of the fp32 cost.
        # fp16 (narrow exponent) widens to fp32.
        w_mm = weight.float() if weight.dtype == torch.float16 else weight
        packed = _packed(weight) if ctx.kept is None else None  # for the recomputed logits
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            if ctx.fused_grad:  # bf16 model, only ∂hidden, too many rows to keep: g straight into bf16
                z = _chunk_logits(hidden[s:e], weight, bias, 1.0, packed)
                g = native.logprob_grad_bf16(z, lse_all[s:e], g_lp[s:e], labels[s:e], 1.0 / t)  # [c, V]
                del z
                grad_h[s:e] = g @ weight  # [c, H] bf16, fp32 sums
                del g
                continue
            if ctx.kept is not None:  # single chunk, probabilities kept from forward
                g = ctx.kept.mul_(-g_lp[:, None])  # −g·p [N, V], in place: used once
            else:
                z = _chunk_logits(hidden[s:e], weight, bias, t, packed)  # [c, V]
                # g_logits = g_lp · (onehot(y) − p) / T, built in place in z's buffer
                g = z.sub_(lse_all[s:e, None]).exp_().mul_(-g_lp[s:e, None])  # −g·p
                del z
            g.scatter_add_(-1, labels[s:e, None], g_lp[s:e, None])
            if t != 1.0:
                g.div_(t)
            if need_h:
                grad_h[s:e] = (g.to(w_mm.dtype) @ w_mm).to(hidden.dtype)  # [c, H]
            if need_w:  # a bf16 model: g rounded to bf16 as for ∂hidden, where oneDNN does that fastest
                with native.bf16_math(hidden):
                    grad_w.addmm_(g.t(), hidden[s:e].float())
            if need_b:
                grad_b += g.sum(0)
            del g
        ctx.kept = None
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``labels`` and entropy under ``softmax((hidden @ weight.T + bias) / T)``.

    Args:
        hidden: [N, H] final hidden states (after the final norm), any float dtype.
        weight: [V, H] LM-head (output embedding) weight, same dtype as ``hidden``; a bf16
            head gives fp32 logits (bf16 products summed in fp32, :func:`_chunk_logits`), its
            gradients are returned in bf16 (∂hidden from a bf16 GEMM of the rounded logit
            gradient, ∂weight summed in fp32).
        labels: [N] int64 token ids predicted by each row (the *next* token).
        temperature: sampling temperature; 0 or 1 = no scaling.
        chunk_size: rows of logits materialised at once [tokens]; peak extra memory is about
            ``2 · chunk_size · V · 4`` bytes.
        bias: optional [V] LM-head bias.

    Returns:
        (logprobs [N] float32 with gradient w.r.t. ``hidden``/``weight``/``bias``,
        entropy [N] float32, detached).

    Raises:
        ValueError: ``chunk_size < 1`` or mismatched shapes.
    """
    if chunk_size < 1:
        raise ValueError(f"mb_spec.logits_chunk_size must be ≥ 1, got {chunk_size}")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"chunked_logprobs_entropy: shapes hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}, labels {tuple(labels.shape)} do not fit [N,H], [V,H], [N]")
    return _ChunkedLogprobEntropy.apply(hidden, weight, bias, labels.long(), temperature, int(chunk_size))
