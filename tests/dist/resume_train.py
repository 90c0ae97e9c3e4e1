"""Run by tests/test_recover.py under torchrun: a deterministic training loop with recover
checkpoints after every step, which can SIGKILL itself.

    torchrun --nproc_per_node=2 tests/dist/resume_train.py MODEL_DIR RUN_DIR TOTAL_STEPS

A fixed synthetic dataset of 24 token rows (row ``id`` known), ``DistributedSampler(shuffle=True,
seed=7)`` + ``StatefulDataLoader`` (4 rows per rank per step: 3 steps per epoch), a weighted
token-mean NLL through ``FSDPEngine.train_batch`` (the per-row weights come from
``torch.rand``, so an unrestored RNG changes the result), AdamW with warmup + cosine LR.
The loop resumes with ``recover.mode=auto`` from ``RUN_DIR/recover``. Rank 0 appends the row
ids each step consumed (all ranks) to ``RUN_DIR/consumed.jsonl`` before that step's checkpoint,
and at the end writes the full parameters to ``RUN_DIR/final_params.pt``.

Kill switches (env): ``KILL_AT=k`` with ``KILL_MODE=after_save`` — every rank SIGKILLs itself
right after checkpoint ``step{k}`` is complete; ``KILL_MODE=during_save`` — rank 0 SIGKILLs
itself while writing checkpoint ``step{k}``, after all shards are written but before the
``COMPLETE`` marker (the half-written checkpoint must be ignored).
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import arealite.utils.recover as recover
from arealite.api.config import OptimizerConfig, RecoverConfig, TrainEngineConfig
from arealite.dataset.loader import EpochLoader
from arealite.train_engine.fsdp import FSDPEngine, init_distributed
from arealite.utils.data import pad_and_stack
from arealite.utils.proc import exit_without_teardown

N_ROWS, ROWS_PER_RANK = 24, 4


def dataset() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 21, (N_ROWS,), generator=g).tolist()
    return [{"id": i, "tokens": torch.randint(1, 1000, (n,), generator=g).tolist()} for i, n in enumerate(lengths)]


def make_batch(rows: list[dict]) -> dict[str, torch.Tensor]:
    ids = pad_and_stack([r["tokens"] for r in rows], 0, torch.long)  # [B, T]
    am = pad_and_stack([[1] * len(r["tokens"]) for r in rows], 0, torch.bool)
    lm = am.clone().int()
    lm[:, 0] = 0  # the first token has no logprob
    weight = torch.rand(len(rows), 1).expand_as(ids).contiguous()  # [B, T] from the RNG
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "weight": weight}


def loss_fn(logprobs: torch.Tensor, mb: dict) -> torch.Tensor:
    mask = mb["loss_mask"].float()
    return -(logprobs * mb["weight"] * mask).sum() / mask.sum()


def main():
    model_dir, run_dir, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kill_at, kill_mode = int(os.environ.get("KILL_AT", -1)), os.environ.get("KILL_MODE", "")
    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(run_dir, "recover")
    os.makedirs(run_dir, exist_ok=True)
    rcfg = RecoverConfig(mode="auto", freq_steps=1, keep_last=2)
    path = recover.resolve_checkpoint(rcfg, root)

    rows = dataset()
    sampler = DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = EpochLoader(StatefulDataLoader(rows, batch_size=ROWS_PER_RANK, sampler=sampler,
                                                    collate_fn=lambda r: r))
    cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2, lr_scheduler="cosine",
                                                      weight_decay=0.1))
    engine = FSDPEngine(cfg)
    engine.initialize(model_dir, total)
    torch.manual_seed(1234 + rank)
    start = recover.load_checkpoint(path, {"actor": engine}, {"data": loader}) if path else 0
    if rank == 0:
        print(f"start step {start} (checkpoint {path}), version {start}", flush=True)  # version = completed steps

    if kill_mode == "during_save":
        write_marker = recover._write_marker

        def killing_write_marker(tmp, step, world_size):
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            write_marker(tmp, step, world_size)

        recover._write_marker = killing_write_marker

    for step in range(start, total):
        rows_now = loader.next()
        batch = make_batch(rows_now)
        stats = engine.train_batch(batch, loss_fn, lambda mb: float(mb["loss_mask"].sum()))
        ids = [None] * world
        dist.all_gather_object(ids, [r["id"] for r in rows_now])
        if rank == 0:
            with open(os.path.join(run_dir, "consumed.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "epoch": loader.epoch, "ids": ids, "loss": stats["loss"]}) + "\n")
        recover.save_checkpoint(root, step + 1, {"actor": engine}, {"data": loader}, keep_last=rcfg.keep_last)
        if kill_mode == "after_save" and step + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    state = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"params": state, "version": total}, os.path.join(run_dir, "final_params.pt"))
    engine.destroy()


if __name__ == "__main__":
    main()
    exit_without_teardown()  # results written: skip finalisation (see its docstring)
