"""Per-step logging: a console line, tensorboard scalars and a ``stats.jsonl`` (rank 0 only)."""

from __future__ import annotations

import json
import os
import time


class StatsLogger:
    """Writes ``log_dir/stats.jsonl`` and tensorboard events under ``log_dir/tensorboard``.

    Args:
        log_dir: output folder (created).
        rank: only rank 0 writes; other ranks are no-ops.
        total_steps: for the ``step k/N`` console prefix.
    """

    CONSOLE_KEYS = (
        ("reward", "rollout/reward", "{:.3f}"),
        ("staleness", "rollout/staleness_max", "{:.0f}"),
        ("overlap", "rollout/overlap_frac", "{:.2f}"),
        ("loss", "actor/loss", "{:.4f}"),
        ("gnorm", "actor/grad_norm", "{:.3f}"),
        ("gen_wait", "time/gen_wait_s", "{:.1f}s"),
        ("train", "time/train_s", "{:.1f}s"),
        ("sync", "time/weight_sync_s", "{:.1f}s"),
        ("tok/s", "perf/trained_tokens_per_s", "{:.0f}"),
    )

    def __init__(self, log_dir: str, rank: int = 0, total_steps: int = 0):
        self.rank, self.total_steps = rank, total_steps
        self.writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.writer = SummaryWriter(os.path.join(log_dir, "tensorboard"))
            self.jsonl = open(os.path.join(log_dir, "stats.jsonl"), "a")

    def commit(self, step: int, stats: dict[str, float]) -> None:
        """Log scalar ``stats`` of training step ``step`` (0-based)."""
        if self.rank != 0:
            return
        for k, v in stats.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **stats}) + "\n")
        self.jsonl.flush()
        parts = [f"step {step + 1}/{self.total_steps}"]
        parts += [f"{name} {fmt.format(stats[key])}" for name, key, fmt in self.CONSOLE_KEYS if key in stats]
        print(" | ".join(parts), flush=True)

    def summary(self, step: int, stats: dict[str, float]) -> None:
        """Log end-of-run scalars at ``step`` and print them on one ``summary:`` line."""
        if self.rank != 0:
            return
        for k, v in stats.items():
            self.writer.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), "summary": stats}) + "\n")
        self.jsonl.flush()
        print("summary: " + " | ".join(f"{k} {v:.4g}" for k, v in stats.items()), flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.jsonl.close()
