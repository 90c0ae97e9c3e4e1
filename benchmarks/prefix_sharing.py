"""Prefix sharing on vs off (``actor.mb_spec.prefix_sharing``): one ``FSDPEngine.train_batch``
of a GRPO-shaped batch, ``--prompts`` groups of ``--samples`` rows that share a prompt of
``--prompt-len`` tokens, completions uniform in [``--min-completion``, ``--max-completion``]
tokens (random token ids; the work does not depend on their values).

Prints per setting the packed tokens the backbone runs, the seconds per ``train_batch``
(fastest of ``--steps`` timed steps after one warm-up, alternating the two settings; the median
in brackets) and the ratio. The default shape is issue 15's benchmark workload with GSM8K
prompts in SmolLM2's chat template (8 prompts × 4 samples, about 110 prompt tokens, ≤ 64 new).

    python benchmarks/prefix_sharing.py                 # SmolLM2-135M, 1 thread
    python benchmarks/prefix_sharing.py --threads 2 --samples 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF model folder ('' = the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=110)
    p.add_argument("--min-completion", type=int, default=10)
    p.add_argument("--max-completion", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="timed steps per setting (after 1 warm-up each)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine
    from arealite.utils.hf import resolve_model_path

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows, masks = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(10, 40000, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.samples):
            n = int(torch.randint(args.min_completion, args.max_completion + 1, (1,), generator=g))
            rows.append(prompt + torch.randint(10, 40000, (n,), generator=g).tolist())
            masks.append([0] * args.prompt_len + [1] * n)
    T = max(map(len, rows))
    batch = {"input_ids": torch.zeros(len(rows), T, dtype=torch.long),
             "attention_mask": torch.zeros(len(rows), T, dtype=torch.bool),
             "loss_mask": torch.zeros(len(rows), T, dtype=torch.int)}
    for i, (r, m) in enumerate(zip(rows, masks)):
        batch["input_ids"][i, :len(r)] = torch.tensor(r)
        batch["attention_mask"][i, :len(r)] = True
        batch["loss_mask"][i, :len(r)] = torch.tensor(m)
    adv = torch.randn(len(rows), 1, generator=g)

    def loss_fn(lp, mb):
        return -(lp * adv[: lp.shape[0]] * mb["loss_mask"]).sum() / mb["loss_mask"].sum()

    path = resolve_model_path(args.model)
    engines = {}
    for share in (False, True):
        e = FSDPEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-6),
                                         mb_spec=MicroBatchSpec(prefix_sharing=share)))
        e.initialize(path)
        engines[share] = e
    lengths = batch["attention_mask"].sum(1).tolist()
    from arealite.train_engine.packing import unit_length

    packed = {s: sum(unit_length(u, lengths) for u in e._units(batch, lengths)) for s, e in engines.items()}
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(args.steps + 1):
        for share, e in engines.items():
            t0 = time.perf_counter()
            st = e.train_batch(batch, loss_fn, lambda mb: float(mb["loss_mask"].sum()))
            if step:
                times[share].append(time.perf_counter() - t0)
            print(f"prefix_sharing={share} step {step}: {time.perf_counter() - t0:.1f}s "
                  f"({st['n_microbatches']:.0f} micro-batches)", flush=True)
    for share in (False, True):
        print(f"prefix_sharing={share}: {packed[share]} packed tokens | {min(times[share]):.1f} s/train_batch "
              f"(median {statistics.median(times[share]):.1f})")
    print(f"ratio shared/unshared: tokens {packed[True] / packed[False]:.2f}x, "
          f"time {min(times[True]) / min(times[False]):.2f}x ({args.threads} threads)")


if __name__ == "__main__":
    main()
