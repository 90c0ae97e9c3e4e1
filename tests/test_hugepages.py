"""Page faults of large CPU tensors, counted in subprocesses:

* ``import arealite`` before torch backs torch's large CPU tensors with transparent huge pages
  (``THP_MEM_ALLOC_ENABLE``, set in ``arealite/__init__.py``): a fresh 192 MiB tensor then takes
  a few hundred page faults on its first write instead of one per 4 KiB page (49,152);
* :func:`arealite.utils.perf.keep_freed_memory` (a CPU train engine calls it): a 192 MiB tensor
  allocated and freed again and again reuses its pages, with no page fault once the heap has room."""

import os
import platform
import subprocess
import sys

import pytest

_THP = "/sys/kernel/mm/transparent_hugepage/enabled"

_PROBE = """
import resource, sys
import arealite, torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(1024, 49152).fill_(1.0)   # 192 MiB, first touch
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(sys.platform != "linux" or not os.path.exists(_THP) or "[madvise]" not in open(_THP).read(),
                    reason="the kernel's huge pages are not 'madvise' (with 'always' every run gets them)")
def test_importing_arealite_first_backs_large_tensors_with_huge_pages():
    pages_4k = 1024 * 49152 * 4 // 4096
    off = _faults("0")  # the user's override is kept
    on = _faults(None)  # arealite's default
    assert off >= 0.9 * pages_4k, off
    assert on < pages_4k / 10, (on, off)


_REUSE_PROBE = """
import resource, sys
from arealite.utils import perf
import torch
print(perf.keep_freed_memory())
faults = []
for _ in range(int(sys.argv[1])):   # a 192 MiB tensor, freed at once, allocated again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(1024, 49152).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def _reuse(keep: str, rounds: int) -> tuple[str, list[int]]:
    env = dict(os.environ, AREALITE_KEEP_FREED_MEMORY=keep)
    out = subprocess.run([sys.executable, "-c", _REUSE_PROBE, str(rounds)], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.strip().splitlines()[-2:]
    return applied, [int(f) for f in faults.split()]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_kept_freed_memory_is_reused_without_page_faults():
    """The steady state is compared. glibc's ``posix_memalign`` asks for the size plus the 2 MiB
    alignment, and small objects (the tensor's own) can land right after a freed block, so the
    heap may grow for a new block several times before a freed hole fits one: on a 2-core EPYC,
    across 87 heap layouts (a bytearray of 20 kB-2 MB allocated first), the last growth came at
    round 0 in most and at round 15 at worst. The last 8 of 40 rounds are counted."""
    pages_2m = 1024 * 49152 * 4 // (2 << 20)  # at least one fault per 2 MiB (huge pages), or per 4 KiB
    applied, off = _reuse("0", 4)  # glibc's default: the block is unmapped at free, mapped afresh
    assert applied == "False" and min(off[1:]) >= pages_2m, (applied, off)
    applied, on = _reuse("1", 40)
    assert applied == "True" and sum(on[-8:]) <= 8, (applied, on)


def test_a_cpu_train_engine_keeps_freed_memory(tiny_model_dir):
    from arealite.api.config import TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine
    from arealite.utils import perf

    perf.keep_freed_memory.cache_clear()
    engine = FSDPEngine(TrainEngineConfig())
    engine.initialize(tiny_model_dir)
    try:
        assert perf.keep_freed_memory.cache_info().currsize == (engine.device.type == "cpu")  # called on the CPU only
    finally:
        engine.destroy()
