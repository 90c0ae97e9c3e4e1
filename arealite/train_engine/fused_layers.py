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
Other dtypes and devices run transformers' own forward. On the 2-core Xeon with AMX (2026-12-06,
``python benchmarks/layers_bench.py``), forward + backward on 1856 tokens: SwiGLU 3.2 -> 2.8 ms
(SmolLM2-135M) and 21.3 -> 15.1 ms (Qwen2.5-1.5B), RMSNorm 3.2 -> 0.8 and 20.4 -> 2.2 ms.

A module is swapped only when its class's ``forward`` reads exactly :data:`MLP_SOURCE` (with a
plain SiLU ``act_fn``) or :data:`NORM_SOURCE`, transformers' Llama forwards, so a model whose
MLP or norm computes anything else (Gemma's ``1 + weight``, OLMo2's order of product and cast,
gelu, clamps, extra scales) keeps its own.
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


# transformers' LlamaMLP.forward and LlamaRMSNorm.forward (5.x), whitespace collapsed: the
# formulas the native passes compute. A module is swapped only if its class's forward reads
# exactly so; tests/test_fused_layers.py checks that the installed transformers' Llama forwards
# still do (an upgrade that changes them fails a test instead of changing the numbers).
MLP_SOURCE = ("def forward(self, x): down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * "
              "self.up_proj(x)) return down_proj")
NORM_SOURCE = ("def forward(self, hidden_states: torch.Tensor) -> torch.Tensor: input_dtype = "
               "hidden_states.dtype hidden_states = hidden_states.to(torch.float32) variance = "
               "hidden_states.pow(2).mean(-1, keepdim=True) hidden_states = hidden_states * "
               "torch.rsqrt(variance + self.variance_epsilon) return self.weight * hidden_states.to(input_dtype)")


@functools.cache
def _source(cls: type) -> str | None:
    """``cls.forward``'s source, whitespace collapsed (None where it cannot be read)."""
    try:
        return re.sub(r"\s+", " ", inspect.getsource(cls.forward)).strip()
    except (OSError, TypeError):
        return None


def _is_silu(act: object) -> bool:
    """A plain SiLU module (torch's or transformers'), without hooks or its own forward."""
    from transformers.activations import SiLUActivation

    return (type(act) in (torch.nn.SiLU, SiLUActivation) and "forward" not in vars(act)
            and not (act._forward_hooks or act._forward_pre_hooks))


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Give each Llama-formula SwiGLU MLP and RMSNorm of ``model`` (module docstring) a forward
    through the native passes, by switching its class to a ``Fused<class>`` subclass that
    overrides ``forward`` (as FSDP2's ``fully_shard`` does); where the passes cannot run (not
    bf16, not the CPU) that forward calls transformers' own. Not an instance attribute: for a
    model loaded with ``from_pretrained`` while the ``kernels`` package is installed,
    transformers kernelizes the layers it may swap for hub kernels (RMSNorm among them) when
    ``train()``/``eval()`` change the mode, and with no hub kernel deletes their instance
    ``forward``. A ``deepcopy``, ``pickle`` and ``torch.save`` of the model keep the class. The
    projections and the weight are looked up at each call, so PEFT's LoRA layers wrapped around
    the projections later, and FSDP's unsharded parameters, are used.
    Other modules are left alone. Returns ``model``."""
    for module in model.modules():
        src = _source(type(module))
        if src == MLP_SOURCE and _is_silu(getattr(module, "act_fn", None)):
            module.__class__ = _subclass(type(module), _mlp_forward)
        elif src == NORM_SOURCE:
            module.__class__ = _subclass(type(module), _norm_forward)
    return model


@functools.cache
def _subclass(cls: type, forward) -> type:
    """``cls`` with ``forward``, named ``Fused<cls>`` (one per class). Its instances pickle as
    (``cls``, ``forward``, state): unpickling makes the subclass again (:func:`_rebuilt`)."""
    return type(f"Fused{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__,
                                                 "__reduce_ex__": _reduce_ex})


def _reduce_ex(self: torch.nn.Module, protocol: int):
    cls = type(self)
    if cls.__dict__.get("__reduce_ex__") is not _reduce_ex:  # a subclass made of ours: the default
        return object.__reduce_ex__(self, protocol)
    return _rebuilt, (cls.__mro__[1], cls.forward), self.__dict__


def _rebuilt(cls: type, forward) -> torch.nn.Module:
    """An empty instance of ``Fused<cls>`` (pickle then restores its state)."""
    return object.__new__(_subclass(cls, forward))


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if layers.swiglu_fits(gate, up):
        return self.down_proj(_SwiGLU.apply(gate, up))
    return self.down_proj(self.act_fn(gate) * up)  # transformers' expression


def _norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if layers.rmsnorm_fits(hidden_states, self.weight):
        return _RMSNorm.apply(hidden_states, self.weight, float(self.variance_epsilon))
    return super(type(self), self).forward(hidden_states)  # transformers' own
