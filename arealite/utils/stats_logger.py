"""Per-step logging: a console progress line, tensorboard scalars, a ``stats.jsonl`` and, when
asked, Weights & Biases (rank 0 only).

The console line: ``step k/N``, the key metrics, the ETA (mean wall time of the last
``ETA_WINDOW`` steps × steps left) and the last held-out score (``eval/*``, with the weight
version it evaluated). wandb is an optional import (``pip install wandb`` or the package's
``wandb`` extra); ``WANDB_MODE=offline`` (or ``logger.wandb.mode offline``) writes the run under
``log_dir/wandb`` without network. Rank 0 also measures the CPU (:mod:`arealite.utils.cpu`): each
step's record gets ``cpu/busy_core{i}``, ``cpu/busy_mean``, ... (since the previous step), the
summary ``cpu/run_*`` (since the logger was created) and a ``cpu over the run:`` console line.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from arealite.utils.cpu import CpuSampler, format_run_stats

ETA_WINDOW = 10  # steps averaged for the ETA


def require_wandb() -> Any:
    """Import wandb, or raise a clear error.

    Raises:
        ImportError: wandb is not installed (names the config field and the fix).
    """
    try:
        import wandb
    except ImportError:
        raise ImportError("logger.wandb.project is set but wandb is not installed: pip install wandb "
                          "(or pip install 'arealite[wandb]'), or drop --logger.wandb.project") from None
    return wandb


def format_eta(seconds: float) -> str:
    """``h:mm:ss`` of a duration in seconds (``"?"`` when unknown)."""
    if not seconds >= 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StatsLogger:
    """Writes ``log_dir/stats.jsonl`` and tensorboard events under ``log_dir/tensorboard``.

    Args:
        log_dir: output folder (created).
        rank: only rank 0 writes; other ranks are no-ops.
        total_steps: for the ``step k/N`` console prefix and the ETA.
        wandb_config: ``logger.wandb`` (``project`` "" = no wandb; ``entity``, ``name``, ``mode``).
        run_config: the run's config as a dict, stored with the wandb run.

    Raises:
        ImportError: wandb requested and not installed (:func:`require_wandb`).
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
        ("mfu", "perf/mfu", "{:.0%}"),
    )

    def __init__(self, log_dir: str, rank: int = 0, total_steps: int = 0, wandb_config: Any = None,
                 run_config: dict | None = None):
        self.rank, self.total_steps = rank, total_steps
        self.writer = None
        self.wandb_run = None
        self._commit_times: list[float] = []
        self.last_eval: tuple[str, float, float | None] | None = None  # (key, value, version)
        self.cpu: CpuSampler | None = None
        if rank == 0:
            self.cpu = CpuSampler().start()
            from torch.utils.tensorboard import SummaryWriter

            project = getattr(wandb_config, "project", "") if wandb_config is not None else ""
            wandb = require_wandb() if project else None  # before any file is written
            os.makedirs(log_dir, exist_ok=True)
            self.writer = SummaryWriter(os.path.join(log_dir, "tensorboard"))
            self.jsonl = open(os.path.join(log_dir, "stats.jsonl"), "a")
            if wandb is not None:
                self.wandb_run = wandb.init(project=project, entity=wandb_config.entity or None,
                                            name=wandb_config.name or None, mode=wandb_config.mode or None,
                                            dir=log_dir, config=run_config or {})

    def _eta(self, step: int, stats: dict[str, float]) -> float:
        now = time.time()
        self._commit_times.append(now)
        times = self._commit_times[-(ETA_WINDOW + 1):]
        if len(times) >= 2:
            per_step = (times[-1] - times[0]) / (len(times) - 1)
        else:  # the first step of this process: its own time split
            per_step = sum(stats.get(k, 0.0) for k in ("time/gen_wait_s", "time/train_s", "time/weight_sync_s"))
        return per_step * max(self.total_steps - step - 1, 0)

    def commit(self, step: int, stats: dict[str, float]) -> None:
        """Log scalar ``stats`` of training step ``step`` (0-based)."""
        if self.rank != 0:
            return
        stats = {**stats, **self.cpu.mark()}
        for k, v in stats.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **stats}) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(stats, step=step)
        scores = [k for k in stats if k.startswith("eval/") and k not in ("eval/version", "eval/time_s")]
        if scores:
            self.last_eval = (scores[0], stats[scores[0]], stats.get("eval/version"))
        parts = [f"step {step + 1}/{self.total_steps}"]
        parts += [f"{name} {fmt.format(stats[key])}" for name, key, fmt in self.CONSOLE_KEYS if key in stats]
        parts.append(f"eta {format_eta(self._eta(step, stats))}")
        if self.last_eval is not None:
            key, value, version = self.last_eval
            label = "" if version is None else f" (v{version:.0f}{', before training' if version == 0 else ''})"
            parts.append(f"held-out {key[5:]} {value:.3f}{label}")
        print(" | ".join(parts), flush=True)

    def summary(self, step: int, stats: dict[str, float]) -> None:
        """Log end-of-run scalars at ``step`` and print them on one ``summary:`` line."""
        if self.rank != 0:
            return
        for k, v in stats.items():
            self.writer.add_scalar(k, v, step)
        cpu = self.cpu.run_stats()
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), "summary": {**stats, **cpu}}) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.summary.update({**stats, **cpu})
        print("summary: " + " | ".join(f"{k} {v:.4g}" for k, v in stats.items()), flush=True)
        print(format_run_stats(cpu), flush=True)

    def close(self) -> None:
        if self.cpu is not None:
            self.cpu.stop()
        if self.writer is not None:
            self.writer.close()
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
