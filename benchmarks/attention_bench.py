"""Attention of short rows, forward + backward of one layer: torch's SDPA (the CPU flash kernel,
through transformers' ``sdpa_attention_forward``, which repeats K and V for grouped-query
attention) against :func:`arealite.train_engine.short_attention.short_attention` (four batched
GEMMs with P kept), on the shapes the trainer packs; also each one's largest error against a
float64 reference of the same inputs.

    flock /tmp/arealite_heavy.lock .venv/bin/python benchmarks/attention_bench.py [--dtype float32]

Shapes (R rows x H query heads / H_kv key-value heads x Lq queries x Lk keys x d):
SmolLM2-135M's heads (9 / 3, d 64) on README command 1's prefix-shared rows (a 40-token prompt
and 8 completions of 24 tokens under a dense mask: 232 x 232), on unshared causal rows of 64-512
tokens, and Qwen2.5-1.5B's (12 / 2, d 128) suffix segments of 64 queries over 128 keys. Median of
``--repeats`` after 3 warm-ups, the two implementations alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from arealite.train_engine.short_attention import fits, short_attention  # noqa: E402


def prefix_shared_mask(prompt: int, group: int, completion: int) -> torch.Tensor:
    """[C, C] bool (True = attend) of one packed row [prompt | completion 1 | ... | completion G]."""
    c = prompt + group * completion
    keep = torch.zeros(c, c, dtype=torch.bool)
    keep[:prompt, :prompt] = torch.ones(prompt, prompt, dtype=torch.bool).tril_()
    for i in range(group):
        s = prompt + i * completion
        keep[s:s + completion, :prompt] = True
        keep[s:s + completion, s:s + completion] = torch.ones(completion, completion, dtype=torch.bool).tril_()
    return keep


CASES = {  # name: (R, H, H_kv, Lq, Lk, d, mask kind)
    "135M command 1 row (40 + 8 x 24, dense mask)": (8, 9, 3, 232, 232, 64, "shared"),
    "135M causal rows of 64": (32, 9, 3, 64, 64, 64, "causal"),
    "135M causal rows of 128": (16, 9, 3, 128, 128, 64, "causal"),
    "135M causal rows of 256": (4, 9, 3, 256, 256, 64, "causal"),
    "135M causal rows of 512": (1, 9, 3, 512, 512, 64, "causal"),
    "1.5B suffix segments (64 over 128 keys)": (8, 12, 2, 64, 128, 128, "suffix"),
}


def inputs(case, dtype):
    r, h, hk, lq, lk, d, kind = case
    q = torch.randn(r, h, lq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(r, hk, lk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(r, hk, lk, d, dtype=dtype, requires_grad=True)
    if kind == "shared":
        keep = prefix_shared_mask(40, 8, 24)[None, None].expand(r, 1, lq, lk)
    elif kind == "suffix":  # each suffix query sees the prompt (first lk - lq keys) and itself causally
        keep = torch.ones(lq, lk, dtype=torch.bool).tril_(lk - lq)[None, None].expand(r, 1, lq, lk)
    else:
        keep = None
    return q, k, v, keep, kind == "causal"


def sdpa(module, q, k, v, keep, causal):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(module, q, k, v, keep, scaling=q.shape[-1] ** -0.5, is_causal=causal)
    return out.transpose(1, 2)  # [R, H, Lq, d]


def ours(module, q, k, v, keep, causal):
    return short_attention(q, k, v, keep, q.shape[-1] ** -0.5, is_causal=causal)


def step(fn, module, q, k, v, keep, causal, grad):
    for t in (q, k, v):
        t.grad = None
    t0 = time.perf_counter()
    fn(module, q, k, v, keep, causal).backward(grad)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"{args.dtype}, {args.threads} threads, torch {torch.__version__}; ms per layer (forward + backward), "
          "max |error| of O, dQ, dK, dV against float64")
    for name, case in CASES.items():
        q, k, v, keep, causal = inputs(case, dtype)
        module = type("Attn", (), {"num_key_value_groups": case[1] // case[2], "is_causal": causal, "training": True})()
        used = "" if fits(q, k, 0.0) else "  (the engine keeps SDPA here: short_attention.fits)"
        grad = torch.randn_like(q)
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        out_ref = sdpa(module, *ref, keep, causal)
        out_ref.backward(grad.double())
        errors, times = {}, {"sdpa": [], "ours": []}
        for label, fn in (("sdpa", sdpa), ("ours", ours)):
            for t in (q, k, v):
                t.grad = None
            out = fn(module, q, k, v, keep, causal)
            out.backward(grad)
            errors[label] = [float((a.detach().double() - b.detach()).abs().max()) for a, b in
                             ((out, out_ref), *((t.grad, u.grad) for t, u in zip((q, k, v), ref)))]
        for i in range(3 + args.repeats):
            for label, fn in (("sdpa", sdpa), ("ours", ours))[:: 1 if i % 2 else -1]:
                dt = step(fn, module, q, k, v, keep, causal, grad)
                if i >= 3:
                    times[label].append(dt)
        a, b = (1e3 * statistics.median(times[x]) for x in ("sdpa", "ours"))
        print(f"{name:<42} sdpa {a:6.1f}  ours {b:6.1f}  ({a / b:.2f}x)   errors sdpa "
              + " ".join(f"{e:.1e}" for e in errors["sdpa"]) + "  ours " + " ".join(f"{e:.1e}" for e in errors["ours"]) + used)


if __name__ == "__main__":
    main()
