"""Where one GRPO training step's time goes, and the MFU it could reach if only the matmuls ran.

The step is ``GRPO.update`` (the RL loop's call) on a batch shaped like README command 1's:
``--prompts`` prompts x ``--group`` samples, a ``--prompt-len``-token prompt shared by its group
(prefix sharing runs it once) and ``--response``-token responses; a random model of SmolLM2-135M's
shape (``--model``, see :data:`cost_curves.MODELS`), LoRA rank ``--lora-rank`` (0 = full
fine-tuning), ``--precision`` as the engine's ``mixed_precision`` (auto: bf16 where the CPU has
AVX-512 BF16/AMX). After ``--warmup`` steps one step runs under ``torch.profiler``; its operators'
self time is grouped into

* matmul: ``aten::mm/addmm/bmm/baddbmm`` (and their in-place forms: LoRA's fused product, the
  LM head's weight gradient; counted as "other ops" before 2026-12-06) and the native bf16 -> fp32 LM-head GEMM
  (``arealite::gemm_bf16_f32``, :func:`arealite.native.linear_bf16_f32`);
* attention: torch's SDPA kernels, forward and backward;
* copies/casts: ``aten::copy_``, ``_to_copy``, ``cat``, ``fill_``, ``index*``/``scatter*``/``gather``;
* everything else: elementwise ops (norms, activations, rotary, LoRA scaling, softmax of the
  head), reductions, the optimizer's ops, Python and autograd bookkeeping (the step's wall time
  minus the profiled operators).

Printed: the step's wall time, the engine's model FLOPs (:data:`arealite.utils.perf.FLOPS`), the
MFU of each timed step over :func:`arealite.utils.perf.gemm_peak` of the compute dtype measured
right after it (the GEMM rate of an AMX host moves 2-4x within minutes), that of the profiled
step, the share of each group, and
two bounds: the MFU if everything but matmul and attention took no time, and if everything but
matmul did (attention FLOPs still counted; short CPU rows attend with batched matmuls, counted
as matmul: :mod:`arealite.train_engine.short_attention`). The profiled step is 5-15 % slower
than an unprofiled one.

    flock /tmp/arealite_heavy.lock .venv/bin/python benchmarks/train_profile.py
    .venv/bin/python benchmarks/train_profile.py --precision none      # fp32
    .venv/bin/python benchmarks/train_profile.py --lora-rank 0         # full fine-tuning
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import arealite  # noqa: E402,F401 - before torch, as in the recipes: its allocator setting (arealite/__init__.py)
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()

from cost_curves import MODELS, build_model, grpo_batch  # noqa: E402

GROUPS = {
    "matmul": lambda n: n in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
                              "aten::baddbmm_", "arealite::gemm_bf16_f32"),
    "attention": lambda n: "scaled_dot_product" in n or "flash_attention" in n,
    "copies/casts": lambda n: n in ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::fill_", "aten::gather",
                                    "aten::index", "aten::index_put_", "aten::index_select", "aten::scatter_add_",
                                    "aten::masked_scatter", "aten::index_copy"),
}


def group_of(name: str) -> str:
    return next((g for g, test in GROUPS.items() if test(name)), "other ops")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M", choices=list(MODELS))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--response", type=int, default=24)
    p.add_argument("--lora-rank", type=int, default=16, help="0 = full fine-tuning")
    p.add_argument("--precision", choices=["auto", "none", "bf16"], default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed unprofiled steps (median), then 1 profiled")
    p.add_argument("--top", type=int, default=12, help="operators listed")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from torch.profiler import profile

    from arealite.algorithms.grpo import GRPO
    from arealite.api.config import GRPOAlgoConfig, LoRAConfig, OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine
    from arealite.utils import perf

    with tempfile.TemporaryDirectory() as model_dir:
        _, vocab = build_model(args.model, model_dir, tiny=False)
        cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-6), mixed_precision=args.precision,
                                num_threads=args.threads, lora=LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank))
        engine = FSDPEngine(cfg)
        engine.initialize(model_dir)
        algo = GRPO(GRPOAlgoConfig(), engine, group_size=args.group)
        batch = grpo_batch(args.prompts, args.group, args.prompt_len, args.response, vocab)
        dtype = torch.bfloat16 if engine.precision == "bf16" else torch.float32
        times, peaks, step_mfu = [], [], []
        for i in range(args.warmup + args.steps):
            flops0 = perf.FLOPS.total
            t = time.perf_counter()
            algo.update(dict(batch))
            times.append(time.perf_counter() - t)
            if i >= args.warmup:  # the GEMM rate of this moment (the host's drifts: docs/performance.md)
                peaks.append(perf.gemm_peak(dtype, engine.device, cached=False) * 1e9)
                step_mfu.append((perf.FLOPS.total - flops0) / times[-1] / peaks[-1])
        last = statistics.median(times[args.warmup:])
        flops0 = perf.FLOPS.total
        with profile() as prof:
            t = time.perf_counter()
            algo.update(dict(batch))
            wall = time.perf_counter() - t
        flops = perf.FLOPS.total - flops0
        peak = perf.gemm_peak(dtype, engine.device, cached=False) * 1e9  # FLOP/s, after the profiled step
        engine.destroy()

    events = prof.key_averages()
    by_group = {g: 0.0 for g in (*GROUPS, "other ops")}
    for ev in events:
        by_group[group_of(ev.key)] += ev.self_cpu_time_total / 1e6  # s
    profiled = sum(by_group.values())
    by_group["other ops"] += max(0.0, wall - profiled)  # Python, autograd engine, waits
    print(f"{args.model} random init, LoRA rank {args.lora_rank or '0 (full fine-tuning)'}, {engine.precision}, "
          f"{args.threads} threads; {args.prompts} prompts x {args.group} samples, prompt {args.prompt_len} + "
          f"response {args.response} tokens; torch {torch.__version__}")
    print(f"step {last:.2f} s (median of {args.steps} unprofiled), {wall:.2f} s profiled; model FLOPs "
          f"{flops / 1e12:.3f} TFLOP; {flops / last / 1e9:.0f} GFLOP/s; GEMM peak {peak / 1e9:.0f} GFLOP/s "
          f"({dtype}, after the profiled step); MFU {100 * flops / wall / peak:.1f} % (profiled step)")
    print("each timed step over the GEMM peak measured right after it: MFU "
          + ", ".join(f"{100 * m:.1f} %" for m in step_mfu) + f" (median {100 * statistics.median(step_mfu):.1f} %; "
          f"peaks {min(peaks) / 1e9:.0f}-{max(peaks) / 1e9:.0f} GFLOP/s)")
    for g, s in by_group.items():
        print(f"  {g:<13} {s:6.2f} s  {100 * s / wall:5.1f} %")
    mm, attn = by_group["matmul"], by_group["attention"]
    print(f"MFU if only matmul and attention took time: {100 * flops / (mm + attn) / peak:.1f} %; "
          f"if only matmul did: {100 * flops / mm / peak:.1f} %")
    print(f"top {args.top} operators by self time:")
    for ev in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"  {ev.self_cpu_time_total / 1e6:6.3f} s  {ev.count:6d} calls  [{group_of(ev.key)}] {ev.key[:70]}")


if __name__ == "__main__":
    main()
