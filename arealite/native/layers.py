"""Native passes of a bf16 model's elementwise layers on the CPU (``layers.c``;
built with the other kernels, :func:`arealite.native.library`): the SwiGLU activation
``silu(gate) * up`` and transformers' Llama RMSNorm, forward and backward, with torch's roundings
(results within two bf16 ulps of torch's ops, most of them equal). Used by
:mod:`arealite.train_engine.fused_layers`. Each function returns None where it cannot run (the
caller then uses torch's ops).
"""

from __future__ import annotations

import torch

from arealite.native import library


def swiglu_fits(*tensors: torch.Tensor) -> bool:
    """Whether :func:`swiglu_bf16` / :func:`swiglu_backward_bf16` run on ``tensors`` here:
    contiguous bfloat16 CPU tensors of one shape, and the library built."""
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous()
               and t.shape == tensors[0].shape for t in tensors) and library() is not None


def swiglu_bf16(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` with torch's roundings (``layers.c``): ``s = bf16(silu(gate))``, then
    ``bf16(s · up)``, each in fp32; equal to ``F.silu(gate) * up`` within two bf16 ulps (s
    within one: another exp), mostly bit-equal, except that silu of a gate below -80 is 0 (torch:
    at most 1.5e-33 in magnitude).

    Args:
        gate, up: [..., I] bfloat16 CPU tensors of one shape, contiguous.

    Returns:
        [..., I] bfloat16, or None where it cannot run (other dtypes or devices, strides,
        shapes, no library): the caller uses torch ops.
    """
    if not swiglu_fits(gate, up):
        return None
    lib = library()
    h = torch.empty_like(gate)
    lib.swiglu_fwd_bf16(gate.data_ptr(), up.data_ptr(), h.data_ptr(), gate.numel(), torch.get_num_threads())
    return h


def swiglu_backward_bf16(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gradients ``(∂gate, ∂up)`` of ``h = silu(gate) * up`` for ``grad`` = ∂h, with torch's
    roundings (``layers.c``: its product's and ``silu_backward``'s), within two bf16 ulps of them.

    Args:
        grad, gate, up: [..., I] bfloat16 CPU tensors of one shape, contiguous.

    Returns:
        two [..., I] bfloat16 tensors, or None where it cannot run (see :func:`swiglu_bf16`).
    """
    if not swiglu_fits(grad, gate, up):
        return None
    lib = library()
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    lib.swiglu_bwd_bf16(grad.data_ptr(), gate.data_ptr(), up.data_ptr(), d_gate.data_ptr(), d_up.data_ptr(),
                        gate.numel(), torch.get_num_threads())
    return d_gate, d_up



def rmsnorm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rmsnorm_bf16` runs here: ``x`` [..., H] and ``weight`` [H] contiguous
    bfloat16 CPU tensors, and the library built."""
    return (x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16
            and x.is_contiguous() and weight.is_contiguous() and weight.dim() == 1 and x.dim() >= 1
            and x.shape[-1] == weight.shape[0] and library() is not None)


def rmsnorm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' Llama RMSNorm ``weight * (x · rsqrt(mean(x²) + eps)).to(bf16)`` (``layers.c``
    has the formulas and roundings).

    Args:
        x: [..., H] bfloat16 CPU, contiguous. weight: [H] bfloat16 CPU. eps: added to the mean
            square (``variance_epsilon``).

    Returns:
        ``(y [..., H] bfloat16, rstd [rows] float32)`` (rstd = 1 / sqrt(mean(x²) + eps) per row,
        for :func:`rmsnorm_backward_bf16`), or None where it cannot run (:func:`rmsnorm_fits`).
    """
    if not rmsnorm_fits(x, weight):
        return None
    h = weight.shape[0]
    y, rstd = torch.empty_like(x), torch.empty(x.numel() // max(h, 1), dtype=torch.float32)
    library().rmsnorm_fwd_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), rstd.numel(), h,
                               float(eps), torch.get_num_threads())
    return y, rstd


def rmsnorm_backward_bf16(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                          weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The gradients ``(∂x, ∂weight)`` of :func:`rmsnorm_bf16` for ``grad`` = ∂y.

    Args:
        grad, x: [..., H] bfloat16 CPU, contiguous. weight: [H] bfloat16. rstd: [rows] float32
            from :func:`rmsnorm_bf16`. weight_grad: whether to compute ∂weight.

    Returns:
        ``(∂x [..., H] bfloat16, ∂weight [H] bfloat16 or None)``, or None where it cannot run.
    """
    if not (rmsnorm_fits(x, weight) and rmsnorm_fits(grad, weight) and grad.shape == x.shape):
        return None
    h, threads = weight.shape[0], torch.get_num_threads()
    dx = torch.empty_like(x)
    part = torch.zeros(threads, h, dtype=torch.float32) if weight_grad else None
    library().rmsnorm_bwd_bf16(grad.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                               part.data_ptr() if part is not None else None, rstd.numel(), h, threads)
    return dx, part.sum(0).to(torch.bfloat16) if part is not None else None
