"""arealite: lightweight, algorithm-first, fully asynchronous RL for large language models.

Layers (imports only point downward): ``api`` (contracts) → ``rollout`` (asynchronous executor)
→ ``engine`` (FSDP2 trainer, HTTP client, generation server) → ``algorithms`` / ``workflow`` /
``reward`` / ``dataset`` → ``recipes/`` (explicit training loops).
"""

import os as _os

# Before torch is imported: torch's CPU allocator then backs each tensor of >= 2 MB with
# transparent huge pages (madvise), so a fresh buffer faults in 2 MB pages instead of 4 KB ones.
# A new [1024, 49152] fp32 tensor (an LM-head logits chunk) took 60 ms of page faults before its
# first write, 11 ms with this (49,153 against ~600 faults; 2-core Xeon, 2026-12-06,
# docs/performance.md). No effect where torch was imported first, or where the kernel's THP is
# "never"; THP_MEM_ALLOC_ENABLE=0 in the environment turns it off. Servers and ranks this
# process launches inherit it.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
