"""Page faults of large CPU tensors, counted in subprocesses:

* ``import arealite`` before torch backs torch's large CPU tensors with transparent huge pages
  (``THP_MEM_ALLOC_ENABLE``, set in ``arealite/__init__.py``): a fresh 192 MiB tensor then takes
  a few hundred page faults on its first write instead of one per 4 KiB page (49,152);
* :func:`arealite.utils.perf.keep_freed_memory` (a CPU train engine calls it): a 192 MiB tensor
  allocated after one of the same size was freed reuses its pages, with no page fault."""

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
import resource
from arealite.utils import perf
import torch
print(perf.keep_freed_memory())
torch.empty(1024, 49152).fill_(1.0)   # 192 MiB, freed at once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(1024, 49152).fill_(2.0)   # the same size again
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _reuse(keep: str) -> tuple[str, int]:
    env = dict(os.environ, AREALITE_KEEP_FREED_MEMORY=keep)
    out = subprocess.run([sys.executable, "-c", _REUSE_PROBE], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()[-2:]
    return applied, int(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_kept_freed_memory_is_reused_without_page_faults():
    pages_2m = 1024 * 49152 * 4 // (2 << 20)  # at least one fault per 2 MiB (huge pages), or per 4 KiB
    applied, off = _reuse("0")  # glibc's default: the block is unmapped at free, mapped afresh
    assert applied == "False" and off >= pages_2m, (applied, off)
    applied, on = _reuse("1")
    assert applied == "True" and on <= 8, (applied, on)


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
