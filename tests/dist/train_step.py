"""Run by tests/test_fsdp.py and tests/test_critic.py under torchrun: train steps on a fixed
global batch for several engine settings, in one process group.

argv: model_dir out_path kind, with kind "actor" (one step of FSDPEngine per setting) or
"critic" (two MSE steps of FSDPCriticEngine per setting: with a zero-initialised head the first
step only moves the head). Each rank takes its contiguous share of the global batch; rank 0
writes, per setting, the losses, grad norms, micro-batch counts and the first values of a few
parameters after the steps as JSON to out_path."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from arealite.train_engine.fsdp import FSDPCriticEngine, FSDPEngine, init_distributed
from arealite.utils.proc import exit_without_teardown

# (max_tokens_per_mb, packing, skip): 162 real tokens → 1 micro-batch at 10_000, 4 at 41 (1 rank);
# skip (actor): the rows whose advantages are all 0 are left out, their weight passed as skipped_weight
SETTINGS = [(10_000, True, False), (41, True, False), (10_000, False, False), (41, False, False), (41, True, True)]


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
    adv = adv * torch.tensor([1, 0, 0, 1, 1, 1, 0, 1])[:, None]  # rows 1, 2, 6: zero loss and gradient
    returns = torch.randn(B, T, generator=g) * lm
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm, "advantages": adv.contiguous(),
            "returns": returns}


def actor_loss_fn(logprobs, mb):
    mask = mb["loss_mask"].float()
    assert mb["entropy"].shape == logprobs.shape and not mb["entropy"].requires_grad
    return -(logprobs * mb["advantages"] * mask).sum() / mask.sum()


def critic_loss_fn(values, mb):
    mask = mb["loss_mask"].float()
    return (((values - mb["returns"]) ** 2) * mask).sum() / mask.sum()


def main():
    model_dir, out_path, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batch()
    share = batch["input_ids"].shape[0] // world
    local = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
    results = {}
    for max_tokens, packing, skip in SETTINGS:
        if skip and kind != "actor":
            continue
        cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-3, gradient_clipping=1e9),
                                mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens, packing=packing))
        if kind == "actor":
            engine, loss_fn, n_steps = FSDPEngine(cfg, temperature=0.7), actor_loss_fn, 1
        else:
            engine, loss_fn, n_steps = FSDPCriticEngine(cfg), critic_loss_fn, 2
        engine.initialize(model_dir)
        weight_fn, rows, skipped = lambda mb: float(mb["loss_mask"].sum()), local, 0.0
        if skip:
            inert = (local["advantages"] == 0).all(1)
            rows = {k: v[~inert] for k, v in local.items()}
            skipped = weight_fn({k: v[inert] for k, v in local.items()})
        steps = [engine.train_batch(rows, loss_fn, weight_fn, skipped_weight=skipped) for _ in range(n_steps)]
        state = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        names = [n for n in sorted(state) if "layers.1." in n][:2] + [n for n in sorted(state) if "score" in n]
        results[f"{max_tokens}_{packing}" + ("_skip" if skip else "")] = {
            "loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
            "n_microbatches": steps[0]["n_microbatches"],
            "params": {n: state[n].flatten()[:64].tolist() for n in names}}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()  # results written, group destroyed: skip finalisation (see its docstring)
