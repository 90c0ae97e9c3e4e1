"""Where one decode step of our server's scheduler spends its time, and what each fix buys.

Builds :class:`arealite.server.scheduler.Scheduler` on the model with ``--rows`` running rows
whose KV already holds ``--kv-len`` tokens, then times whole decode steps (forward of every
row's last token + sampling + bookkeeping) for two variants, interleaved ``--reps`` times in
one process (median reported):

* ``plain``: ``F.linear`` (MKL) and SDPA decode attention -- the server before issue 33
  (``--no-packed-linear``, ``AREALITE_NATIVE_KERNELS=0``);
* ``packed``: oneDNN pre-packed linear weights (:mod:`arealite.server.packed_linear`), SDPA;
* ``native``: packed linear weights and the native decode-attention kernel
  (:mod:`arealite.native`) -- today's server;
* ``onednn-head`` (bf16, where both GEMM backends run): ``native`` with the fp32 LM head on
  oneDNN at every row count -- the server on the AMX machine before its head took the row-count
  plan of :func:`arealite.native.bf16_gemm_backend` (2026-12-05).

Then one profile (``torch.profiler``) of today's server groups the step's CPU time into the
linear layers, attention, sampling and the rest, and prints the GEMM rate of the step's linear
layers against a large square GEMM of the same dtype and threads.

    python benchmarks/server_profile.py                      # SmolLM2-135M, 32 rows x 200 tokens, 2 threads
    python benchmarks/server_profile.py --rows 8 --kv-len 600
    python benchmarks/server_profile.py --dtype bfloat16     # where the CPU has AVX-512 BF16 / AMX
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from arealite import native

from arealite.server.messages import Request
from arealite.server.protocol import SamplingParams
from arealite.server.scheduler import Scheduler

GROUPS = {  # profiler op name -> group
    "mkldnn::_linear_pointwise": "linear", "aten::mm": "linear", "aten::addmm": "linear",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "arealite::decode_attention": "attention",
}
VARIANTS = {"plain": (False, False), "packed": (True, False), "native": (True, True), "onednn-head": (True, True)}
# -> (packed linears, native attention)


@contextlib.contextmanager
def _head_backend(variant: str):
    """Within the block a ``onednn-head`` variant's LM head multiplies on oneDNN at every row count."""
    chosen = native.bf16_gemm_backend
    if variant == "onednn-head":
        native.bf16_gemm_backend = lambda rows=None: "onednn"
    try:
        yield
    finally:
        native.bf16_gemm_backend = chosen


@contextlib.contextmanager
def _decode_attention(use_native: bool, profiled: bool = False):
    """Within the block the server's decode attention is SDPA (``use_native`` False) or the native
    kernel, under a profiler label when ``profiled`` (a ctypes call is not a torch op)."""
    kernel = native.decode_attention

    def labelled(*a, **kw):
        with torch.profiler.record_function("arealite::decode_attention"):
            return kernel(*a, **kw)

    native.decode_attention = (labelled if profiled else kernel) if use_native else (lambda *a, **kw: None)
    try:
        yield
    finally:
        native.decode_attention = kernel


def _scheduler(model, rows: int, kv_len: int, packed: bool, headroom: int) -> Scheduler:
    """A scheduler whose ``rows`` rows hold about ``kv_len`` tokens each, with KV room for
    ``headroom`` more (the decode steps the benchmark runs; each variant holds its own cache, so a
    fixed 4096 tokens of room took 24 GB for 64 rows of SmolLM2-135M in bf16 over four variants)."""
    s = Scheduler(model, max_batch_size=max(rows, 1), use_packed_linear=packed)
    s._rows = []
    for i in range(rows):
        params = SamplingParams(temperature=1.0, max_new_tokens=10 ** 9, ignore_eos=True)
        r = Request(f"r{i}", list(range(1, kv_len + 1)), params, False, None, None)
        r.kv_len, r.last, r.kv_epoch = kv_len - (i % 7), 5, 0  # rows of slightly different lengths
        s._rows.append(r)
    s.cache.ensure(rows, kv_len + headroom, 0, 0)
    return s


def _time_steps(s: Scheduler, steps: int) -> float:
    """Mean seconds per decode step over ``steps`` steps (KV lengths grow by ``steps``)."""
    with torch.inference_mode():
        s._decode_step()
        t = time.perf_counter()
        for _ in range(steps):
            s._decode_step()
        return (time.perf_counter() - t) / steps


def _gemm_rate(m: int, k: int, n: int, dtype, packed: bool) -> float:
    """GFLOP/s of an [m, k] x [k, n] product (packed oneDNN weight or ``F.linear``)."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    if packed:
        wp = torch.ops.mkldnn._reorder_linear_weight(w, m)
        f = lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")  # noqa: E731
    else:
        f = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
    for _ in range(3):
        f()
    n_iter, t = 10, time.perf_counter()
    for _ in range(n_iter):
        f()
    return 2 * m * k * n * n_iter / (time.perf_counter() - t) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="HF folder; '' = SmolLM2-135M-Instruct")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--kv-len", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=15, help="operators listed from the profile")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's weights and KV (the server's --dtype)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    from transformers import AutoModelForCausalLM

    from arealite.utils.hf import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    variants = [v for v in VARIANTS if v != "onednn-head" or (
        dtype == torch.bfloat16 and native._native_bf16_dot() and native._onednn_bf16_math())]
    models = {v: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval() for v in variants}
    headroom = (args.reps + 2) * (args.steps + 1) + 16  # timed, profiled and sampled steps, a margin
    scheds = {v: _scheduler(m, args.rows, args.kv_len, VARIANTS[v][0], headroom) for v, m in models.items()}
    cfg = models["plain"].config
    if native.library() is None:
        print("  (the native kernel is not available here: 'native' runs SDPA; see the warning above)")
    print(f"{path}: {args.rows} rows x ~{args.kv_len} cached tokens, {args.threads} threads, "
          f"{args.dtype}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    times = {v: [] for v in scheds}
    for _ in range(args.reps):
        for v, s in scheds.items():
            with _decode_attention(VARIANTS[v][1]), _head_backend(v):
                times[v].append(_time_steps(s, args.steps))
    base = statistics.median(times["plain"])
    for v, ts in times.items():
        med = statistics.median(ts)
        print(f"  {v:<11} {med * 1000:7.1f} ms/step  {args.rows / med:6.1f} tok/s  "
              f"({base / med:.2f}x plain)")

    from torch.profiler import ProfilerActivity, profile

    s = scheds["native"]
    with torch.inference_mode(), _decode_attention(True, profiled=True), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            s._decode_step()
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    groups: dict[str, float] = {}
    for e in prof.key_averages():
        groups[GROUPS.get(e.key, "other")] = groups.get(GROUPS.get(e.key, "other"), 0.0) + e.self_cpu_time_total
    with torch.inference_mode():
        logits = s._forward_decode()
        t = time.perf_counter()
        for _ in range(args.steps):
            s._sample_and_append(s._rows, logits)
        t_sample = (time.perf_counter() - t) / args.steps
    print(f"  profile of native, {args.steps} steps (self CPU time of the ops):")
    for g in ("linear", "attention", "other"):
        print(f"    {g:<10} {100 * groups.get(g, 0.0) / total:5.1f} %")
    print(f"    sampling alone (one step, [{args.rows}, {cfg.vocab_size}] logits): {t_sample * 1000:.1f} ms")
    print(f"  top {args.top} ops by self CPU time, ms per step:")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"    {e.self_cpu_time_total / 1e3 / args.steps:7.2f}  {e.count // args.steps:5d} calls  "
              f"[{GROUPS.get(e.key, 'other')}] {e.key[:60]}")
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    for name, (m, k, n) in {"mlp up": (args.rows, h, i), "lm head": (args.rows, h, v),
                            "square 2048": (2048, 2048, 2048)}.items():
        print(f"  GEMM {name:<12} [{m}x{k}]x[{k}x{n}] {args.dtype}: F.linear {_gemm_rate(m, k, n, dtype, False):6.1f}"
              f"  packed {_gemm_rate(m, k, n, dtype, True):6.1f} GFLOP/s")


if __name__ == "__main__":
    from arealite.utils.proc import run_in_short_lived_thread

    # as in the server (arealite/server/__main__.py): all torch work in one non-main thread, the
    # process's only libgomp pool, allocating from a per-thread glibc arena
    run_in_short_lived_thread(main)
