"""``import arealite`` before torch backs torch's large CPU tensors with transparent huge pages
(``THP_MEM_ALLOC_ENABLE``, set in ``arealite/__init__.py``): a fresh 192 MiB tensor then takes
a few hundred page faults on its first write instead of one per 4 KiB page (49,152)."""

import os
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
