"""Model FLOPs, the machine's measured GEMM rate, MFU, and the choice of compute precision.

* :func:`forward_flops`: the matmul FLOPs of one transformer forward (PaLM, Chowdhery et al.
  2022, appendix B: ``2·N`` per token for the ``N`` matmul parameters, plus attention
  ``2·2·n_layers·d_attn`` per attended (query, key) pair); a training step is 3x the forward
  with full fine-tuning (forward, gradient of the activations, gradient of the weights) and 2x
  with LoRA (frozen weights get no weight gradient). Recomputation (gradient checkpointing) is
  not counted: this is *model* FLOPs utilisation, as in PaLM.
* :func:`gemm_peak`: GFLOP/s of a large square GEMM in the given dtype on this process's
  threads, measured once per process (the denominator of MFU: a measured, not a datasheet,
  peak).
* :data:`FLOPS`: the model FLOPs this process's train engines ran (``FSDPEngine`` adds to it;
  the RL loop logs ``perf/model_tflops`` and ``perf/mfu`` per step from its increase).
* :func:`fast_bf16` / :func:`resolve_precision` / :func:`resolve_dtype`: bf16 compute where the hardware multiplies
  bf16 fast (a GPU; a CPU with AVX-512 BF16 or AMX), fp32 elsewhere (on an AVX2-only CPU bf16
  GEMM is ~7x *slower* than fp32: ``benchmarks/server_profile.py``).
* :func:`keep_freed_memory`: a CPU trainer's process keeps the memory it frees for its next
  step instead of giving it back to the kernel (and paying page faults for it again).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import time

import torch

logger = logging.getLogger("arealite.perf")


class _FlopCounter:
    """Model FLOPs run by this process's train engines (a plain running total)."""

    def __init__(self):
        self.total = 0.0

    def add(self, flops: float) -> None:
        self.total += float(flops)


FLOPS = _FlopCounter()
_PEAKS: dict = {}


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that enter a matmul per token: all of ``model``'s but the input embedding
    (a lookup) and the output embedding (the LM head, counted per head position instead)."""
    skip = set()
    for emb in (model.get_input_embeddings(), model.get_output_embeddings()):
        if emb is not None:
            skip.update(id(p) for p in emb.parameters())
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def flop_shape(model: torch.nn.Module) -> dict:
    """The keyword arguments of :func:`forward_flops` that describe ``model`` (an unsharded HF
    model): matmul parameters, layers, query width, and the LM head's size (0 for a scalar head)."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    head = model.get_output_embeddings()
    return {"n_params": matmul_params(model), "n_layers": cfg.num_hidden_layers,
            "d_attn": cfg.num_attention_heads * head_dim, "hidden": cfg.hidden_size,
            "vocab": head.weight.shape[0] if head is not None else 0}


def forward_flops(n_params: int, tokens: int, attn_pairs: int, n_layers: int, d_attn: int,
                  head_positions: int = 0, hidden: int = 0, vocab: int = 0) -> float:
    """FLOPs of one forward: ``2·n_params·tokens + 4·n_layers·d_attn·attn_pairs +
    2·hidden·vocab·head_positions`` (PaLM appendix B; ``d_attn`` = query heads x head dim,
    ``attn_pairs`` the causal (query, key) pairs actually attended, ``head_positions`` the
    positions that get logits)."""
    return (2.0 * n_params * tokens + 4.0 * n_layers * d_attn * attn_pairs
            + 2.0 * hidden * vocab * head_positions)


def causal_pairs(length: int, prefix: int = 0) -> int:
    """(query, key) pairs of ``length`` causal tokens that also see ``prefix`` earlier tokens."""
    return length * prefix + length * (length + 1) // 2


def gemm_peak(dtype: torch.dtype, device: torch.device | str = "cpu", size: int = 1536, cached: bool = True) -> float:
    """Measured GFLOP/s of a ``size``-square GEMM in ``dtype`` on ``device`` with this process's
    current torch threads (best of 6 after a warm-up: other work only ever adds time), cached per
    (device, dtype, threads); ``cached=False`` measures again (a benchmark beside each timed
    step, on a host whose GEMM rate drifts: docs/performance.md)."""
    device = torch.device(device)
    key = (device.type, dtype, torch.get_num_threads())
    if key not in _PEAKS or not cached:
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn(size, size, dtype=dtype, device=device)
        best = float("inf")
        for i in range(7):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - t)
        _PEAKS[key] = 2.0 * size ** 3 / best / 1e9
    return _PEAKS[key]


def cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def fast_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether bf16 matmuls are fast on ``device``, and why: CUDA with bf16 support, or a CPU
    with ``avx512_bf16`` or ``amx_bf16`` (there oneDNN runs bf16 GEMM at ~4x fp32); not an
    AVX2-only CPU, which converts bf16 in software."""
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "CUDA bf16" if ok else "this GPU has no bf16"
    flags = cpu_flags() & {"avx512_bf16", "amx_bf16"}
    if flags:
        return True, "CPU has " + " and ".join(sorted(flags))
    return False, "CPU has no avx512_bf16 / amx_bf16 (bf16 GEMM is slower than fp32 here)"


def resolve_dtype(requested: str, device: torch.device | str) -> tuple[str, str]:
    """A server's weight dtype name: ``"auto"`` -> ``"bfloat16"`` where :func:`fast_bf16` holds,
    else ``"float32"``; any other name is returned unchanged. Returns ``(dtype, reason)``."""
    if requested != "auto":
        return requested, "asked for"
    ok, why = fast_bf16(device)
    return ("bfloat16" if ok else "float32"), why


def resolve_precision(requested: str, device: torch.device | str, what: str) -> str:
    """``"auto"`` -> ``"bf16"`` where :func:`fast_bf16` holds, else ``"none"`` (fp32); an
    explicit ``"bf16"``/``"none"`` is kept (``bf16`` without fast bf16 is warned about). Logs
    the choice with its reason (``what`` names the config field)."""
    ok, why = fast_bf16(device)
    if requested == "bf16" and not ok:
        logger.warning("%s=bf16 without fast bf16 (%s): slower than fp32 here", what, why)
    if requested != "auto":
        return requested
    choice = "bf16" if ok else "none"
    logger.info("%s=auto -> %s (%s)", what, choice, why)
    return choice


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc <malloc.h>


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep the memory this process frees for its later allocations, as
    a CUDA caching allocator does on a GPU and as the jemalloc/tcmalloc settings of PyTorch's
    CPU performance tuning guide do: ``mallopt(M_MMAP_MAX, 0)`` (no block gets a mapping of its
    own, which ``free`` would unmap) and ``mallopt(M_TRIM_THRESHOLD, 2**31 - 1)`` (the heap's
    free top is not returned below 2 GiB). Once per process; returns whether it applied.

    Why: a training step allocates and frees the same large tensors every step (an LM-head
    logits chunk [1024, 49152] fp32 is 192 MiB). By default glibc maps each large block on its
    own (above a threshold that starts at 128 KiB and grows to at most 32 MiB) and unmaps it at
    ``free``, and gives the heap's free top back, so the next step faults those pages in again;
    on a VM whose balloon reports free pages to its host (the 2-core Zen 4 EPYC, 2026-12-06)
    the host must back them again too: the LM head's kept logit gradient, 100 MiB, took
    110-150 ms to write into fresh pages and 12 ms into kept ones. There, with
    ``python benchmarks/train_profile.py --steps 8 --warmup 2`` (command 1's update) run
    alternately with and without this, LoRA took 3.92 s per step against 4.05-4.14 s (MFU 61 %
    against 57-58 %) and full fine-tuning (``--lora-rank 0``) 5.5 s against 6.5-7.1 s (FSDP's
    casts and copies 0.3-0.4 s against 1.5 s). The cost: the process stays at its peak memory
    between steps, and the peak grows a little (40 LoRA steps of random shapes: 3.98 against
    3.83 GiB). A lone large block allocated and freed in a loop can make the heap grow several
    times before a freed hole fits it (``posix_memalign`` asks for the size plus the alignment):
    up to 15 more 192 MiB blocks in 1 of 87 heap layouts (docs/performance.md).

    Does nothing (returns False) with ``AREALITE_KEEP_FREED_MEMORY=0`` in the environment, or
    where the C library is not glibc (musl, macOS). Raises nothing.
    """
    if os.environ.get("AREALITE_KEEP_FREED_MEMORY", "1") == "0":
        logger.info("malloc: freed memory goes back to the kernel (AREALITE_KEEP_FREED_MEMORY=0)")
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    logger.info("malloc: freed memory %s in the process (glibc mallopt; AREALITE_KEEP_FREED_MEMORY=0 "
                "turns it off)", "stays" if ok else "could not be kept")
    return ok
