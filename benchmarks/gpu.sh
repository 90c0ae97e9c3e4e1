#!/usr/bin/env bash
# GPU checks of issue 33, as one short script for a lent device (an H200 through the `device`
# tool's `run`, or any CUDA machine with torch + transformers + peft + aiohttp installed):
#   bash benchmarks/gpu.sh            # writes its log to ${OUT:-/tmp}/gpu_bench.log, ~6 min on an H200
# Randomly initialised models of real shapes only (no download): nothing here needs a model hub.
#   1. the machine: GPU, torch, measured bf16 / fp32 GEMM rates (arealite.utils.perf.gemm_peak),
#      whether flash-attn is importable;
#   2. the trainer: FSDPEngine.train_batch on a Qwen2.5-1.5B-shaped random Llama-style model in
#      bf16 (FSDP2 MixedPrecisionPolicy, fp32 master weights, fp32 LM head), 8 x 1024 tokens,
#      model-FLOPs MFU over the measured bf16 GEMM rate, against a plain PyTorch loop;
#   3. the server: arealite.server in bf16 on a Qwen2.5-0.5B-shaped random model, 16 x up-to-512
#      tokens, tokens/s vs HF generate, then one full weight update over NCCL (distributed) and
#      over disk.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
LOG="$OUT/gpu_bench.log"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  echo "== 1. machine ($(date -u +%FT%TZ))"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  "$PY" - <<'PY'
import importlib.util, torch
from arealite.utils import perf
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("flash_attn importable:", importlib.util.find_spec("flash_attn") is not None)
print("fast bf16:", perf.fast_bf16("cuda"))
for dt in (torch.bfloat16, torch.float32):
    print(f"GEMM 8192^3 {dt}: {perf.gemm_peak(dt, 'cuda', size=8192) / 1e3:.0f} TFLOP/s")
PY
  echo "== 2. trainer, Qwen2.5-1.5B shape, bf16"
  timeout 240 "$PY" benchmarks/train_throughput.py --hidden 1536 --layers 28 --heads 12 --kv-heads 2 \
    --intermediate 8960 --vocab 151936 --batch 8 --seq-len 1024 --steps 3 --bf16 --clock wall
  echo "== 3. server, Qwen2.5-0.5B shape, bf16, NCCL and disk weight updates"
  timeout 240 "$PY" benchmarks/generation_throughput.py --model random-qwen2.5-0.5b --device cuda \
    --dtype bfloat16 --prompts 16 --group-size 1 --output-len 64 512
} 2>&1 | tee "$LOG"
