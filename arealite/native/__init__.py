"""Native CPU kernels, built at first use with the machine's C compiler and called through
``ctypes`` (the C sources lie beside this file):

* :func:`decode_attention` (``decode_attention.c``): the server's decode attention over the slot
  KV cache;
* :func:`linear_bf16_f32` (``gemm_bf16.c``): ``x @ w.T`` of bfloat16 operands with float32
  sums *and a float32 result*, the LM head of a bf16 model (AVX-512 BF16 ``vdpbf16ps``);
* :func:`softmax_stats` and :func:`logprob_grad_bf16` (``logits.c``): the trainer's LM head
  after the GEMM (logprob, entropy and logsumexp of each row; the logprob gradient as bf16), two
  passes per row instead of 5-6 whole-chunk tensor ops and their temporaries;
* :mod:`arealite.native.layers` (``layers.c``): a bf16 model's SwiGLU activation
  and RMSNorm, one pass forward and one backward each, with torch's roundings.

Why decode attention: for one query token per row, torch's SDPA on CPU (its flash kernel) reads
every row up to the longest row's length and runs many tiny GEMMs; on a 2-core AVX-512 machine it
moved 7-14 GB/s over the KV cache and took 36-42 % of a bf16 decode step. The kernel reads each
row's own positions once for all query heads of a KV head (``python benchmarks/server_profile.py``;
docs/performance.md has the figures).

Why the GEMM: torch 2.13 has no CPU matmul of bf16 inputs with an fp32 output (``aten::mm.dtype``
has no CPU kernel; ``mm(out=fp32)`` is refused), so an fp32 LM head over bf16 hidden states had to
widen both operands and run the fp32 GEMM, 4-5x slower than bf16 on a CPU with AVX-512 BF16
(46 % of a bf16 RL step). Products of two bf16 numbers are exact in fp32, so this kernel's
logits equal the widened fp32 GEMM's up to the order of the fp32 sums
(``tests/test_native_gemm.py``; speed in docs/performance.md, ``benchmarks/train_profile.py``).
On a CPU with AMX, oneDNN's tile units do the same product faster through torch's fp32 matmul
with bf16 inputs allowed (``torch.backends.mkldnn.matmul.fp32_precision``): which of the two
runs is measured once per process, per row count (:func:`bf16_gemm_backend`).

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -ffast-math -fopenmp`` per source, linked
``-shared -fopenmp`` without ``-ffast-math`` (which would also turn on flush-to-zero in the
process, see ``_LINK``), into
``<cache_dir()>/kernels/`` under a name hashing the source, the flags, the compiler's version and
this CPU's flags, so a home directory shared by different machines never runs code built for
another CPU; concurrent builders are serialised by a file lock and the file appears by rename.
The library uses OpenMP, and is loaded only when torch's own ``libgomp.so.1`` is already
mapped: the dynamic linker then binds it to that library, so the kernel runs on torch's thread
pool (a second pool would make both pools sleep between parallel regions; see
:func:`arealite.utils.proc.run_in_short_lived_thread`).

When a kernel cannot be used (no compiler, a failed build, torch without libgomp, not Linux, a
CUDA tensor, an unsupported dtype or shape, a CPU with neither AVX-512 BF16 nor oneDNN bf16 for the GEMM,
``AREALITE_NATIVE_KERNELS=0``), its function returns None and the caller runs torch ops instead
(SDPA; the widened fp32 GEMM; a bf16 head in the server); a missing library's reason is logged
once at WARNING (INFO for the explicit opt-out).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time

import torch

logger = logging.getLogger("arealite.native")

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = tuple(os.path.join(_HERE, f) for f in ("decode_attention.c", "gemm_bf16.c", "logits.c", "layers.c"))
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")  # compile
# Link without -ffast-math: with it gcc links crtfastmath.o into the library, whose constructor
# turns on flush-to-zero in the thread that loads it, changing torch's results there (denormals
# become 0) and not in torch's other threads.
_LINK = ("-shared", "-fopenmp")
_OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


def _mapped_openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux ``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:  # address perms offset dev inode [path]
        paths = {parts[5] for parts in map(str.split, f) if len(parts) >= 6}
    return {p for p in paths if os.path.basename(p).startswith(_OPENMP_RUNTIMES)}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build(cc: str) -> str:
    """Compile the kernel (once per source, flags, compiler and CPU); returns the library path.

    Raises:
        RuntimeError: the compiler failed (its output, shortened, is in the message).
    """
    from arealite.utils.hf import cache_dir

    source = b""
    for src in _SOURCES:
        with open(src, "rb") as f:
            source += f.read() + b"\0"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    tag = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS + _LINK).encode(), version.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    path = os.path.join(out_dir, f"arealite-native-{tag}.so")
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ".build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with tempfile.TemporaryDirectory(dir=out_dir) as objs:
                steps = [[cc, *_FLAGS, "-c", src, "-o", os.path.join(objs, f"{i}.o")] for i, src in enumerate(_SOURCES)]
                steps.append([cc, *_LINK, "-o", tmp, *(s[-1] for s in steps), "-lm"])
                for cmd in steps:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    if proc.returncode != 0:
                        raise RuntimeError(f"{cc} exited with {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
            os.replace(tmp, path)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built at the first call in this process), or None when it
    cannot be used here (the reason is logged once)."""
    if os.environ.get("AREALITE_NATIVE_KERNELS", "1") == "0":
        logger.info("AREALITE_NATIVE_KERNELS=0: decode attention uses torch SDPA, a bf16 LM head "
                    "the fp32 GEMM")
        return None
    why = None
    if platform.system() != "Linux":
        why = f"native kernels are built on Linux only (this is {platform.system()})"
    else:
        cc = os.environ.get("CC", "cc")
        runtimes = _mapped_openmp_runtimes()
        if not any(os.path.basename(p).startswith("libgomp") for p in runtimes):
            why = f"torch's OpenMP runtime is not libgomp (mapped: {sorted(runtimes) or 'none'})"
        elif shutil.which(cc) is None:
            why = f"no C compiler {cc!r} on PATH (set CC, or install gcc)"
    if why is None:
        try:
            t0 = time.monotonic()
            path = _build(cc)
            lib = ctypes.CDLL(path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            why = f"building/loading {', '.join(_SOURCES)} failed: {e}"
        else:
            extra = _mapped_openmp_runtimes() - runtimes
            if extra:  # never expected: the soname matched torch's libgomp above
                why = f"the kernel library brought a second OpenMP runtime {sorted(extra)}"
    if why is not None:
        logger.warning("no native CPU kernels: decode attention uses torch SDPA, a bf16 LM head the "
                       "fp32 GEMM (both slower): %s", why)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.decode_attention_bf16, lib.decode_attention_f32):
        fn.argtypes = [p, p, p, p, p] + [i64] * 10 + [ctypes.c_float, ctypes.c_int, p, i64, i64, p, i64, i64, i64]
        fn.restype = ctypes.c_int
    lib.gemm_bf16_f32.argtypes = [p, i64, p, i64, p, i64, i64, i64, i64, ctypes.c_int]
    lib.pack_bf16_vnni.argtypes = [p, i64, i64, i64, p, ctypes.c_int]
    lib.gemm_bf16_f32_packed.argtypes = [p, i64, p, p, i64, i64, i64, i64, ctypes.c_int]
    lib.softmax_stats_f32.argtypes = [p, i64, p, i64, i64, ctypes.c_float, p, p, p, ctypes.c_int]
    lib.logprob_grad_bf16.argtypes = [p, i64, p, p, p, i64, i64, ctypes.c_float, p, i64, ctypes.c_int]
    lib.swiglu_fwd_bf16.argtypes = [p, p, p, i64, ctypes.c_int]
    lib.swiglu_bwd_bf16.argtypes = [p, p, p, p, p, i64, ctypes.c_int]
    lib.rmsnorm_fwd_bf16.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.rmsnorm_bwd_bf16.argtypes = [p, p, p, p, p, p, i64, i64, ctypes.c_int]
    for fn in (lib.gemm_bf16_f32, lib.pack_bf16_vnni, lib.gemm_bf16_f32_packed, lib.softmax_stats_f32,
               lib.logprob_grad_bf16, lib.swiglu_fwd_bf16, lib.swiglu_bwd_bf16, lib.rmsnorm_fwd_bf16,
               lib.rmsnorm_bwd_bf16):
        fn.restype = ctypes.c_int
    logger.info("native CPU kernels %s (ready in %.1f s)", path, time.monotonic() - t0)
    return lib


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, lens: torch.Tensor,
                     scale: float, k_new: torch.Tensor | None = None,
                     v_new: torch.Tensor | None = None) -> torch.Tensor | None:
    """Grouped-query attention of one query token per row over the slot KV cache, reading row
    ``r``'s positions ``[0, lens[r])`` only (Vaswani et al. 2017, eq. 1, per KV-head group),
    after writing this step's keys and values at position ``lens[r] - 1`` when given.

    Args:
        q: ``[b, hkv, g, d]`` queries (``g`` query heads per KV head, ``g <= 16``, ``d <= 256``),
            bfloat16 or float32, on the CPU.
        k_buf, v_buf: ``[rows >= b, hkv, capacity, d]`` key/value buffers of ``q``'s dtype, the
            last dimension contiguous (any other strides).
        lens: ``[b]`` int64 positions to attend per row, each in ``[1, capacity]`` (else None:
            the kernel reads and writes nothing).
        scale: the factor of ``q.k`` (``1/sqrt(d)`` for standard attention).
        k_new, v_new: optional ``[b, hkv, d]`` keys and values of this step (``q``'s dtype, last
            dimension contiguous, any other strides), written into the buffers at row ``r``,
            position ``lens[r] - 1`` before the attention (both or neither).

    Returns:
        ``[b, hkv, g, d]`` in ``q``'s dtype (fp32 scores, softmax and sums inside), or None when
        the kernel cannot run these inputs here (the caller writes the new keys and values
        itself and uses SDPA; the buffers may already hold them).
    """
    new = (k_new, v_new)
    if (q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float32)
            or k_buf.dtype != q.dtype or v_buf.dtype != q.dtype
            or k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1
            or (k_new is None) != (v_new is None)
            or (k_new is not None and any(t.dtype != q.dtype or t.shape != (q.shape[0], q.shape[1], q.shape[3])
                                          or t.stride(-1) != 1 for t in new))):
        return None
    lib = library()
    if lib is None:
        return None
    b, hkv, g, d = q.shape
    if any(t.dim() != 4 or t.shape[0] < b or t.shape[1] != hkv or t.shape[3] != d for t in (k_buf, v_buf)):
        return None
    q = q.contiguous()
    if lens.dtype != torch.int64 or not lens.is_contiguous():
        lens = lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    fn = lib.decode_attention_bf16 if q.dtype == torch.bfloat16 else lib.decode_attention_f32
    written = ((k_new.data_ptr(), *k_new.stride()[:2], v_new.data_ptr(), *v_new.stride()[:2])
               if k_new is not None else (None, 0, 0, None, 0, 0))
    rc = fn(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), out.data_ptr(), lens.data_ptr(),
            b, hkv, g, d, *k_buf.stride()[:3], *v_buf.stride()[:3], float(scale), torch.get_num_threads(),
            *written, min(k_buf.shape[2], v_buf.shape[2]))
    return out if rc == 0 else None


_GEMM_BACKENDS = ("native", "onednn")
_PROBE_ROWS = (2, 8, 12, 16, 32, 128)  # row counts timed; m rows use the choice of the first probe >= m
_PROBE_NK = (32768, 576)  # N, K of the timed products: a vocabulary-sized LM head


def _onednn_bf16_math() -> bool:
    """Whether torch can run an fp32 matmul through oneDNN with bf16 inputs
    (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``) on a CPU that multiplies bf16."""
    return (hasattr(torch.backends.mkldnn, "matmul") and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@contextlib.contextmanager
def _bf16_math():
    """oneDNN may round fp32 matmul inputs to bf16 (products exact, sums and output fp32) inside
    the block. The setting is process-wide: an fp32 matmul in another thread during the block
    would be rounded too (the trainer's and server's other threads multiply nothing)."""
    mm = torch.backends.mkldnn.matmul
    old = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = old


def bf16_math(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """A block in which CPU fp32 matmuls whose inputs are (or may be rounded to) bf16 numbers run
    on oneDNN's bf16 path, where :func:`bf16_gemm_backend` found that path fastest for many rows
    and ``x`` is a bfloat16 CPU tensor (the operand that decides the precision); a no-op block
    otherwise. For a bf16 model's fp32 GEMMs whose inputs are bf16 anyway or whose result is
    rounded to bf16 (the LM head's weight gradient: its logit gradient rounded to bf16, as
    autocast would)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and bf16_gemm_backend() == "onednn":
        return _bf16_math()
    return contextlib.nullcontext()


def _native_bf16_dot() -> bool:
    """Whether the native library runs here and was built with AVX-512 BF16 (its GEMM returns
    -1 otherwise)."""
    lib = library()
    if lib is None:
        return False
    a = torch.zeros(2, 2, dtype=torch.bfloat16)
    out = torch.empty(2, 2, dtype=torch.float32)
    return lib.gemm_bf16_f32(a.data_ptr(), 2, a.data_ptr(), 2, out.data_ptr(), 2, 2, 2, 2, 1) == 0


@functools.cache
def _gemm_plan() -> tuple[tuple[int, str], ...]:
    """``((max_rows, backend), ...)`` in increasing ``max_rows``, the last for any row count;
    empty when no backend can run here. See :func:`bf16_gemm_backend`.

    Raises:
        ValueError: ``AREALITE_BF16_GEMM`` is not ``auto``, ``native`` or ``onednn``.
    """
    want = os.environ.get("AREALITE_BF16_GEMM", "auto")
    if want not in ("auto", *_GEMM_BACKENDS):
        raise ValueError(f"AREALITE_BF16_GEMM must be auto, native or onednn, got {want!r}")
    found = [b for b, ok in (("native", _native_bf16_dot), ("onednn", _onednn_bf16_math))
             if want in ("auto", b) and ok()]
    if len(found) < 2:
        logger.info("bf16 -> fp32 GEMM: %s (AREALITE_BF16_GEMM=%s)", found[0] if found else "none, fp32 widening", want)
        return ((_PROBE_ROWS[-1], found[0]),) if found else ()
    n, k = _PROBE_NK
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = PackedBF16(w)
    plan, lines = [], []
    for m in _PROBE_ROWS:
        x = torch.randn(m, k, generator=g).bfloat16()
        times = {}
        for backend in found:
            best = float("inf")
            for i in range(4):  # the first one warms up (and packs)
                t = time.perf_counter()
                _linear(x, w, packed, backend)
                best = min(best, time.perf_counter() - t) if i else best
            times[backend] = best
        plan.append((m, min(times, key=times.get)))
        lines.append(f"{m} rows: " + ", ".join(f"{b} {1e3 * s:.2f} ms" for b, s in times.items()))
    merged = []  # neighbouring probes with the same winner as one entry
    for m, backend in plan:
        if merged and merged[-1][1] == backend:
            merged.pop()
        merged.append((m, backend))
    logger.info("bf16 -> fp32 GEMM: %s (measured [m,%d]x[%d,%d]: %s)",
                ", ".join(f"<= {m} rows {b}" for m, b in merged[:-1]) + (", " if len(merged) > 1 else "")
                + f"more rows {merged[-1][1]}", k, k, n, "; ".join(lines))
    return tuple(merged)


def bf16_gemm_backend(rows: int | None = None) -> str | None:
    """How :func:`linear_bf16_f32` multiplies ``rows`` rows on this machine (None: many rows),
    chosen once per process by measurement: ``"native"`` (``gemm_bf16.c``, AVX-512 BF16
    ``vdpbf16ps``) or ``"onednn"`` (torch's fp32 matmul with
    ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``: oneDNN rounds the inputs to bf16
    — exact here, they are bf16 numbers — and sums in fp32; on a CPU with AMX it runs on the tile
    units). Each available one multiplies ``[m, 576] · [576, 32768]`` (a vocabulary-sized head,
    pre-packed) three times for m = 2, 8, 12, 16, 32 and 128 (about 0.6 s, logged at INFO); a product
    of ``rows`` rows uses the faster at the first of those ``>= rows`` (128's beyond). The row count
    matters: on the 2-core Intel Xeon with AMX (2026-12-05) a [m, 576] · [576, 49152] LM head
    took 1.8 ms native against 7.9 ms oneDNN at 1 row (the native kernel streams the bf16
    weight; oneDNN reads its fp32 copy, twice the bytes), 5.5 against 8.3 at 12, and 13.7
    against 9.4 at 32 (docs/performance.md): a decode step's few rows and a training chunk's
    thousands want different kernels. (On a CPU without bf16 instructions oneDNN's path is its
    fp32 GEMM, as exact.)

    ``AREALITE_BF16_GEMM`` = ``native`` / ``onednn`` forces one for every row count (``auto``,
    the default, measures). Returns None when neither can run here (no AVX-512 BF16 or AMX, or
    both unavailable): the callers then widen to fp32.

    Raises:
        ValueError: ``AREALITE_BF16_GEMM`` is not ``auto``, ``native`` or ``onednn``.
    """
    plan = _gemm_plan()
    if not plan:
        return None
    if rows is not None:
        for max_rows, backend in plan[:-1]:
            if rows <= max_rows:
                return backend
    return plan[-1][1]


def _gemm_ok(*tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` (2-D bf16 CPU matrices, last dimension contiguous, even width) can go
    through the bf16 -> fp32 GEMM here."""
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 or t.dim() != 2
                           or t.shape[1] % 2 or t.stride(1) != 1 for t in tensors):
        return False
    return bf16_gemm_backend() is not None


def _pack(weight: torch.Tensor, backend: str) -> torch.Tensor | None:
    if backend == "onednn":
        return weight.float()  # oneDNN reorders it per call; the fp32 copy saves the widening
    lib = library()
    n, k = weight.shape
    packed = torch.empty(-(-n // 32) * 32 * k // 2, dtype=torch.int32)
    rc = lib.pack_bf16_vnni(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr(), torch.get_num_threads())
    return packed if rc == 0 else None


class PackedBF16:
    """A bf16 weight ``[N, K]`` prepared for :func:`linear_bf16_f32` (from :func:`pack_bf16`):
    each backend's form is built at its first use and kept: ``native``: ``ceil(N/32)`` VNNI
    panels of ``[K/2, 32]`` pairs (``ceil(N/32)·32·K`` bf16 values as int32 pairs; saves ~2.5 ms
    per call for a [49152, 576] head on 2 cores); ``onednn``: the [N, K] float32 copy (saves the
    widening, ~23 ms for that head). A server's head that sees both few and many rows holds
    both (3x the weight's bytes); a trainer's mostly one (its chunks have many rows; a last
    chunk of a few rows builds the other too).

    Raises (:meth:`form`):
        ValueError: the weight changed in place after packing (its version counter moved; not
            checked for inference tensors, which have none): the caller repacks after each
            weight change.
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()
        self.shape = tuple(weight.shape)
        self._version = None if self.weight.is_inference() else self.weight._version
        self._forms: dict[str, torch.Tensor | None] = {}

    def form(self, backend: str) -> torch.Tensor | None:
        """``backend``'s form of the weight (None where that backend cannot pack it)."""
        if self._version is not None and self.weight._version != self._version:
            raise ValueError("linear_bf16_f32: the weight changed in place since pack_bf16(weight); "
                             "repack it with pack_bf16(weight) after each change")
        if backend not in self._forms:
            self._forms[backend] = _pack(self.weight, backend)
        return self._forms[backend]


def _linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedBF16 | None, backend: str) -> torch.Tensor | None:
    (m, k), n = x.shape, weight.shape[0]
    if packed is not None and packed.shape != tuple(weight.shape):
        raise ValueError(f"linear_bf16_f32: packed holds a {list(packed.shape)} weight, not this "
                         f"[{n}, {k}] one; repack it with pack_bf16(weight)")
    form = packed.form(backend) if packed is not None else None
    if backend == "onednn":
        w32 = form if form is not None else weight.float()
        with _bf16_math():
            return torch.mm(x.float(), w32.t())
    lib = library()
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0 or n == 0:
        return out
    if form is not None:
        rc = lib.gemm_bf16_f32_packed(x.data_ptr(), x.stride(0), form.data_ptr(), out.data_ptr(),
                                      out.stride(0), m, n, k, torch.get_num_threads())
    else:
        rc = lib.gemm_bf16_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                               out.data_ptr(), out.stride(0), m, n, k, torch.get_num_threads())
    return out if rc == 0 else None


def pack_bf16(weight: torch.Tensor) -> PackedBF16 | None:
    """``weight`` [N, K] bf16 prepared for :func:`linear_bf16_f32` on this machine's backends
    (:class:`PackedBF16`), for a weight multiplied many times between changes (the server's LM
    head; the trainer's head across its chunks). None where the GEMM cannot run (see
    :func:`linear_bf16_f32`)."""
    if not _gemm_ok(weight):
        return None
    return PackedBF16(weight)


def linear_bf16_f32(x: torch.Tensor, weight: torch.Tensor, packed: PackedBF16 | None = None) -> torch.Tensor | None:
    """``x @ weight.T`` of bfloat16 operands as float32: every product is exact (a bf16 x bf16
    product fits fp32's mantissa) and summed in fp32, so the result equals
    ``x.float() @ weight.float().T`` up to the order of the fp32 additions (relative ~1e-6).
    Multiplied by :func:`bf16_gemm_backend` for ``x``'s row count (the native AVX-512 BF16
    kernel or oneDNN).

    Args:
        x: ``[M, K]`` bfloat16 on the CPU, last dimension contiguous, ``K`` even.
        weight: ``[N, K]`` bfloat16 on the CPU, last dimension contiguous (an ``nn.Linear``
            weight, e.g. the LM head's ``[vocab, hidden]``).
        packed: optional :func:`pack_bf16` of ``weight`` (its current values: the caller
            repacks after the weight changes).

    Returns:
        ``[M, N]`` float32, or None when it cannot run here (not bf16, a CUDA tensor, odd ``K``,
        a CPU with neither AVX-512 BF16 nor oneDNN bf16): the caller then widens and uses the
        fp32 GEMM.

    Raises:
        ValueError: ``packed`` is not the packing of a weight of ``weight``'s shape, or its
            weight changed in place since.
    """
    if not _gemm_ok(x, weight) or x.shape[1] != weight.shape[1]:
        return None
    with torch.profiler.record_function("arealite::gemm_bf16_f32"):  # named in profiles
        return _linear(x, weight, packed, bf16_gemm_backend(x.shape[0]))


def _logits_ok(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """fp32 [M, V] CPU logits (last dimension contiguous) and [M] labels in [0, V).

    Raises:
        ValueError: a label outside ``[0, V)`` (torch's gather would raise too).
    """
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1 or logits.shape[1] == 0 or labels.shape != logits.shape[:1]):
        return False
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[1]):
        raise ValueError(f"labels must lie in [0, {logits.shape[1]}) (the vocabulary), got "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    return True


def softmax_stats(logits: torch.Tensor, labels: torch.Tensor, scale: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per row of ``z = scale · logits``: ``(logprob of labels, entropy, logsumexp)``, each [M]
    float32, in two passes over the row (``logits.c`` has the formulas).

    Args:
        logits: [M, V] float32 on the CPU, last dimension contiguous (not modified).
        labels: [M] integer token ids in ``[0, V)``.
        scale: ``1 / temperature`` (> 0).

    Returns:
        the three [M] tensors, or None when the library is not available (the caller uses
        torch ops).

    Raises:
        ValueError: a label outside ``[0, V)``.
    """
    if not _logits_ok(logits, labels) or (lib := library()) is None:
        return None
    labels = labels.to(torch.int64).contiguous()
    m, v = logits.shape
    lp, ent, lse = (torch.empty(m, dtype=torch.float32) for _ in range(3))
    lib.softmax_stats_f32(logits.data_ptr(), logits.stride(0), labels.data_ptr(), m, v, float(scale),
                          lp.data_ptr(), ent.data_ptr(), lse.data_ptr(), torch.get_num_threads())
    return lp, ent, lse


def logprob_grad_bf16(logits: torch.Tensor, lse: torch.Tensor, grad_logprobs: torch.Tensor,
                      labels: torch.Tensor, scale: float = 1.0, out: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
    """``∂(Σ_i g_i · logprob_i) / ∂logits`` = ``scale · g_i · (onehot(labels_i) − softmax(scale ·
    logits_i))`` [M, V], rounded once to bfloat16 (to nearest even), in one pass per row.

    Args:
        logits: [M, V] float32 on the CPU, last dimension contiguous.
        lse: [M] float32 logsumexp of ``scale · logits`` per row (from :func:`softmax_stats`).
        grad_logprobs: [M] the gradient ``g`` of each row's logprob.
        labels: [M] integer token ids in ``[0, V)``.
        scale: ``1 / temperature`` (> 0).
        out: optional [M, V] bfloat16 CPU tensor, last dimension contiguous, rows not
            overlapping, written and returned (e.g. rows of a larger buffer).

    Returns:
        [M, V] bfloat16, or None when the library is not available.

    Raises:
        ValueError: a label outside ``[0, V)``, or ``out`` not a [M, V] bf16 CPU tensor with a
            contiguous last dimension and rows apart.
    """
    if not _logits_ok(logits, labels) or (lib := library()) is None:
        return None
    labels = labels.to(torch.int64).contiguous()
    lse, g = lse.float().contiguous(), grad_logprobs.float().contiguous()
    m, v = logits.shape
    if out is None:
        out = torch.empty(m, v, dtype=torch.bfloat16)
    elif (out.shape != (m, v) or out.dtype != torch.bfloat16 or out.device.type != "cpu"
          or (v > 1 and out.stride(1) != 1) or (m > 1 and out.stride(0) < v)):
        raise ValueError(f"logprob_grad_bf16: out must be a [{m}, {v}] bfloat16 CPU tensor with a "
                         f"contiguous last dimension, got {list(out.shape)} {out.dtype} on {out.device}")
    lib.logprob_grad_bf16(logits.data_ptr(), logits.stride(0), lse.data_ptr(), g.data_ptr(), labels.data_ptr(),
                          m, v, float(scale), out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out

