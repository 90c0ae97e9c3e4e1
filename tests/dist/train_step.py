"""Run by tests/test_fsdp.py under torchrun: one train_batch on a fixed global batch.

Each rank takes its contiguous share of the global batch; rank 0 writes loss and grad norm
(and the first parameter values after the step) as JSON to argv[2]."""

import json
import sys

import torch
import torch.distributed as dist

from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from arealite.engine.fsdp import FSDPEngine, init_distributed


def global_batch():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 40
    lengths = [40, 7, 23, 12, 31, 5, 18, 26]  # very different lengths
    ids = torch.randint(0, 1000, (B, T), generator=g)
    am = torch.zeros(B, T, dtype=torch.bool)
    lm = torch.zeros(B, T, dtype=torch.int32)
    for i, n in enumerate(lengths):
        am[i, :n] = True
        lm[i, 3:n] = 1
    adv = (torch.rand(B, 1, generator=g) + 0.5).expand(B, T) * lm  # positive: no cancellation in the loss
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm, "advantages": adv.contiguous()}


def loss_fn(logprobs, mb):
    mask = mb["loss_mask"].float()
    return -(logprobs * mb["advantages"] * mask).sum() / mask.sum()


def main():
    model_dir, out_path, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-3, gradient_clipping=1e9),
                            mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens))
    engine = FSDPEngine(cfg, temperature=0.7)
    engine.initialize(model_dir)
    batch = global_batch()
    share = batch["input_ids"].shape[0] // world
    local = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
    stats = engine.train_batch(local, loss_fn, lambda mb: float(mb["loss_mask"].sum()))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        name = sorted(state)[3]
        json.dump({**stats, "param_name": name, "param": state[name].flatten()[:64].tolist()}, open(out_path, "w"))
    engine.destroy()


if __name__ == "__main__":
    main()
