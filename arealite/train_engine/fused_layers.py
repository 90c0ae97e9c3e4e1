"""transformers' Llama-formula SwiGLU MLPs and RMSNorms with native passes on the CPU.

Both work on whole activations and torch runs them as chains of elementwise ops, each a pass
over [tokens, width] tensors:

* the MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020, "GLU Variants Improve Transformer",
  eq. 5; Llama, Qwen2/3, Mistral and ~130 transformers models), whose activation works on the
  widest tensors of the model ([tokens, intermediate]: 1536 wide for SmolLM2-135M, 8960 for
  Qwen2.5-1.5B): 2 ops forward (silu, product) and 3 backward;
* the RMSNorm ``weight * (x · rsqrt(mean(x²) + eps)).to(dtype)`` (Zhang & Sennrich 2019; two per
  decoder layer, and Qwen3's per-head query and key norms): 8 ops forward, about as many backward.

For a bf16 model on the CPU, :func:`install` gives such modules forwards that run
:mod:`arealite.native.layers` instead: one pass forward and one backward each, the same roundings
(results within two bf16 ulps of torch's, most of them equal), and less saved for backward (the
MLP keeps ``gate`` and ``up``, not ``silu(gate)``; the norm keeps ``x`` and one fp32 per row).
Other dtypes and devices run torch's ops. On the 2-core Xeon with AMX (2026-12-05): SwiGLU on
[1856, 8960], forward 24.6 -> 6.2 ms, forward + backward 45 -> 15 ms
(``python benchmarks/layers_bench.py`` has both layers).

A module is swapped only when its class's ``forward`` has the very source of transformers'
``LlamaMLP.forward`` (with a SiLU ``act_fn``) or ``LlamaRMSNorm.forward``, so a model whose MLP
or norm computes anything else (Gemma's ``1 + weight``, OLMo2's order of product and cast,
gelu) keeps its own.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
import torch.nn.functional as F

from arealite.native import layers


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return layers.swiglu_bf16(gate, up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grads = layers.swiglu_backward_bf16(grad.contiguous(), gate, up)
        return grads if grads is not None else _torch_grads(lambda g, u: F.silu(g) * u, (gate, up), grad)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = layers.rmsnorm_bf16(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        grads = layers.rmsnorm_backward_bf16(grad.contiguous(), x, weight, rstd, ctx.needs_input_grad[1])
        if grads is None:
            grads = _torch_grads(lambda a, w: _torch_rms_norm(a, w, ctx.eps), (x, weight), grad)
        return grads[0], grads[1] if ctx.needs_input_grad[1] else None, None


def _torch_grads(fn, inputs, grad):
    """The gradients of ``fn(*inputs)`` for ``grad`` through torch's ops (where a kernel cannot
    run at backward: never expected, the inputs were checked in forward)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, grad)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, differentiable.

    Args:
        gate, up: [..., I] tensors of one shape and dtype (the gate and up projections).

    Returns:
        [..., I] in their dtype: the native passes for contiguous bf16 CPU tensors
        (:func:`arealite.native.layers.swiglu_fits`), ``F.silu(gate) * up`` otherwise.
    """
    if layers.swiglu_fits(gate, up):
        return _SwiGLU.apply(gate, up)
    return torch.nn.functional.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)``,
    differentiable in ``x`` and ``weight``.

    Args:
        x: [..., H]. weight: [H]. eps: added to the mean square.

    Returns:
        [..., H]: the native passes for contiguous bf16 CPU tensors
        (:func:`arealite.native.layers.rmsnorm_fits`), torch's ops (transformers' formula)
        otherwise.
    """
    if layers.rmsnorm_fits(x, weight):
        return _RMSNorm.apply(x, weight, float(eps))
    return _torch_rms_norm(x, weight, eps)


@functools.cache
def _reference_sources() -> tuple[str, str]:
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    return _source(LlamaMLP), _source(LlamaRMSNorm)


@functools.cache
def _source(cls: type) -> str | None:
    """``cls.forward``'s source, whitespace collapsed (None where it cannot be read)."""
    try:
        return re.sub(r"\s+", " ", inspect.getsource(cls.forward)).strip()
    except (OSError, TypeError):
        return None


def _is_silu(act: object) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Give each Llama-formula SwiGLU MLP and RMSNorm of ``model`` (module docstring) a forward
    through :func:`swiglu` / :func:`rms_norm`, by switching its class to a subclass that
    overrides ``forward`` (as FSDP2's ``fully_shard`` does). Not an instance attribute: the
    ``kernels`` package, which transformers calls at each ``model.train()``/``eval()`` for the
    layers it may replace with hub kernels (RMSNorm among them), deletes those. A ``deepcopy``
    keeps the class. The projections and the weight are looked up at each call, so PEFT's LoRA
    layers wrapped around the projections later, and FSDP's unsharded parameters, are used.
    Other modules are left alone. Returns ``model``."""
    mlp_src, norm_src = _reference_sources()
    for module in model.modules():
        src = _source(type(module))
        if src == mlp_src and _is_silu(getattr(module, "act_fn", None)):
            module.__class__ = _subclass(type(module), _mlp_forward)
        elif src == norm_src:
            module.__class__ = _subclass(type(module), _norm_forward)
    return model


@functools.cache
def _subclass(cls: type, forward) -> type:
    """``cls`` with ``forward``, named ``Fused<cls>`` (one per class)."""
    return type(f"Fused{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)
