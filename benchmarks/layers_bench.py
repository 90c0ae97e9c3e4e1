"""The SwiGLU activation and the RMSNorm of a bf16 model on the CPU: transformers' torch ops
against :mod:`arealite.native.layers` (:mod:`arealite.train_engine.fused_layers`), forward and
forward + backward, on the shapes of README command 1's batch (1856 tokens) for SmolLM2-135M and
Qwen2.5-1.5B. The two alternate call by call; medians of ``--repeats``.

    flock /tmp/arealite_heavy.lock .venv/bin/python benchmarks/layers_bench.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arealite.train_engine import fused_layers  # noqa: E402


def hf_swiglu(gate, up):
    return F.silu(gate) * up


def hf_rmsnorm(x, weight, eps=1e-5):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward(SimpleNamespace(weight=weight, variance_epsilon=eps), x)


def timed(fn, inputs, grad, backward):
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    t = time.perf_counter()
    out = fn(*leaves)
    if backward:
        out.backward(grad)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1856)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    cases = []
    for model, hidden, inter in (("SmolLM2-135M", 576, 1536), ("Qwen2.5-1.5B", 1536, 8960)):
        gate, up = (torch.randn(args.tokens, inter, generator=g).bfloat16().requires_grad_() for _ in range(2))
        cases.append((f"{model} SwiGLU [{args.tokens}, {inter}]", hf_swiglu, fused_layers.swiglu, (gate, up),
                      torch.randn(args.tokens, inter, generator=g).bfloat16()))
        x = torch.randn(args.tokens, hidden, generator=g).bfloat16().requires_grad_()
        w = (1 + torch.randn(hidden, generator=g) / 4).bfloat16().requires_grad_()
        cases.append((f"{model} RMSNorm [{args.tokens}, {hidden}] (weight trains)", hf_rmsnorm,
                      lambda x, w: fused_layers.rms_norm(x, w, 1e-5), (x, w),
                      torch.randn(args.tokens, hidden, generator=g).bfloat16()))
    print(f"torch {torch.__version__}, {args.threads} threads, bf16; median ms (torch -> native, speed-up)")
    for name, ref, fast, inputs, grad in cases:
        line = []
        for backward in (False, True):
            times = {"torch": [], "native": []}
            for i in range(2 * args.repeats + 2):
                which = "torch" if i % 2 else "native"
                dt = timed(ref if which == "torch" else fast, inputs, grad, backward)
                if i >= 2:
                    times[which].append(dt)
            a, b = (1e3 * statistics.median(times[k]) for k in ("torch", "native"))
            line.append(f"{'fwd+bwd' if backward else 'fwd'} {a:.2f} -> {b:.2f} ({a / b:.1f}x)")
        print(f"{name}: " + ", ".join(line))


if __name__ == "__main__":
    main()
