"""Core sharing on vs off (``rollout.share_idle_cores``) on the same asynchronous GRPO workload.

Runs ``recipes/grpo_math.py`` (η = 1, one server thread) twice, identical except
``--rollout.share_idle_cores``, one after the other, and prints the median seconds per step (the
first step left out), the training time, how long the trainer held the server's core, the
machine's busy fraction per core over the run, and the ratio.

    python benchmarks/core_sharing.py                    # SmolLM2-135M, 6 steps, 8 prompts × 8 (the default demo's batch)
    python benchmarks/core_sharing.py --steps 4 --prompts 4 --samples 4

Run it with nothing else on the machine: the busy fractions are machine-wide.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_vs_sync import parse_workload_args, run  # noqa: E402


def main() -> None:
    args = parse_workload_args(__doc__, prompts=8, samples=8)
    with tempfile.TemporaryDirectory() as root:
        results = {share: run(f"share{share}", ["--rollout.share_idle_cores", str(share)], args, root)
                   for share in (False, True)}
    for share, r in results.items():
        print(f"share_idle_cores={share}: {r['s_per_step']:.1f} s/step (median) | train {r['train_s']:.1f}s "
              f"generation wait {r['gen_wait_s']:.1f}s weight sync {r['sync_s']:.1f}s | trainer on the server's "
              f"core {r['shared_s']:.1f}s, servers on the trainer's core {r['lent_s']:.1f}s | cores busy mean {r['cpu_busy_mean']:.2f} min {r['cpu_busy_min']:.2f} "
              f"| max staleness {r['staleness_max']:.0f}")
    print(f"ratio s/step shared/static: {results[True]['s_per_step'] / results[False]['s_per_step']:.2f}x")


if __name__ == "__main__":
    main()
