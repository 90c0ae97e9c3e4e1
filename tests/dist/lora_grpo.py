"""Run by tests/test_lora.py under torchrun: LoRA GRPO steps on fixed synthetic groups, with the
weights pushed to one of our servers after every step and recover checkpoints.

    torchrun --nproc_per_node=N tests/dist/lora_grpo.py MODEL_DIR RUN_DIR SERVER_ADDR SYNC TOTAL

SYNC is ``disk`` or ``distributed``. The engine composes LoRA (rank 4, PEFT) with packing,
several micro-batches, gradient checkpointing, the chunked LM head (16-token chunks) and the
reference = the actor with its adapters disabled (``algo.kl_coef 0.1``). The global batch of
step s (8 rows, 2 groups of 4, seeded by s) is split contiguously over the ranks; its behaviour
logprobs are the actor's own. After each update and push, rank 0 samples 12 tokens from the
server (temperature 0.7, with logprobs), and every rank recomputes them with the actor.

Rank 0 appends one JSON line per step to ``RUN_DIR/steps.jsonl`` (loss, grad norm, max |server −
trainer| logprob) and at the end writes ``RUN_DIR/final.pt`` (the adapters, the number of
frozen tensors that differ bitwise from MODEL_DIR, the trainer's greedy tokens of PROMPT) and
``actor.save(RUN_DIR/final)`` (PEFT adapter folder + merged model). Resumes from
``RUN_DIR/recover`` (``recover.mode auto``); ``KILL_AT=k`` SIGKILLs every rank right after
checkpoint step k.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import arealite.utils.recover as recover
from arealite.algorithms.grpo import GRPO
from arealite.api.config import (GRPOAlgoConfig, InferenceEngineConfig, LoRAConfig, MicroBatchSpec, OptimizerConfig,
                                 RecoverConfig, TrainEngineConfig)
from arealite.train_engine.fsdp import FSDPEngine, init_distributed
from arealite.train_engine.lora import LoRAReference, trainable_state
from arealite.inference.remote import RemoteInferenceEngine, post_json
from arealite.trainer.weight_update import sync_weights
from arealite.utils.proc import exit_without_teardown

PROMPT = [1, 17, 300, 4000, 25, 9]
TEMPERATURE = 0.7


def global_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    B, T, P = 8, 30, 4
    lengths = torch.randint(P + 3, T + 1, (B,), generator=g).tolist()
    ids = torch.randint(1, 1000, (B, T), generator=g)
    am = torch.zeros(B, T, dtype=torch.bool)
    lm = torch.zeros(B, T, dtype=torch.int32)
    for i, n in enumerate(lengths):
        am[i, :n] = True
        lm[i, P:n] = 1
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]) if step % 2 == 0 else \
        torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm, "rewards": rewards}


def server_vs_trainer(actor, addr: str, rank: int) -> float:
    """Max |server logprob − trainer recompute| over 12 sampled tokens (rank 0's value)."""
    box = [None]
    if rank == 0:
        out = post_json(addr, "/generate", {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
            "temperature": TEMPERATURE, "max_new_tokens": 12, "ignore_eos": True}})
        box = [(out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]])]
    dist.broadcast_object_list(box, src=0)
    ids, lps = box[0]
    seq = torch.tensor([PROMPT + ids])
    lm = torch.zeros_like(seq, dtype=torch.int32)
    lm[0, len(PROMPT):] = 1
    mine = actor.forward({"input_ids": seq, "attention_mask": torch.ones_like(seq, dtype=torch.bool), "loss_mask": lm})
    return float((mine[0, len(PROMPT):] - torch.tensor(lps)).abs().max())


@torch.no_grad()
def trainer_greedy(actor, n: int = 8) -> list[int]:
    """Greedy tokens of PROMPT from the actor's own (sharded, adapted) model; every rank."""
    actor.model.eval()
    ids = torch.tensor([PROMPT])
    for _ in range(n):
        logits = actor.model(input_ids=ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids[0, len(PROMPT):].tolist()


def main():
    model_dir, run_dir, addr, sync, total = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    kill_at = int(os.environ.get("KILL_AT", -1))
    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(run_dir, exist_ok=True)
    root = os.path.join(run_dir, "recover")
    rcfg = RecoverConfig(mode="auto", freq_steps=1, keep_last=1)
    path = recover.resolve_checkpoint(rcfg, root)

    cfg = TrainEngineConfig(
        optimizer=OptimizerConfig(lr=2e-2, warmup_steps=1, lr_scheduler="cosine", weight_decay=0.1),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=60, logits_chunk_size=16), gradient_checkpointing=True,
        lora=LoRAConfig(rank=4, alpha=8.0))
    torch.manual_seed(0)  # the adapters' random init (rank 0's, broadcast): the same for 1 and 2 ranks
    actor = FSDPEngine(cfg, temperature=TEMPERATURE)
    actor.initialize(model_dir, total)
    algo = GRPO(GRPOAlgoConfig(kl_coef=0.1), actor, group_size=4, ref=LoRAReference(actor))
    rollout = RemoteInferenceEngine(InferenceEngineConfig(weight_sync=sync, request_timeout=60), [addr])
    weight_dir = os.path.join(run_dir, "weight_update")
    start = recover.load_checkpoint(path, {"actor": actor}) if path else 0
    if rank == 0:
        print(f"start step {start}", flush=True)
    if start:
        sync_weights(actor, rollout, None, weight_dir, start)
    share = 8 // world
    for step in range(start, total):
        batch = {k: v[rank * share:(rank + 1) * share] for k, v in global_batch(step).items()}
        batch["logprobs"] = actor.forward(batch)  # on-policy behaviour logprobs
        stats = algo.update(batch)
        sync_weights(actor, rollout, None, weight_dir, step + 1)
        diff = server_vs_trainer(actor, addr, rank)
        if rank == 0:
            with open(os.path.join(run_dir, "steps.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"],
                                    "kl_ref": stats.get("actor/kl_ref"), "server_diff": diff}) + "\n")
        recover.save_checkpoint(root, step + 1, {"actor": actor}, keep_last=rcfg.keep_last)
        if step + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    adapters = trainable_state(actor.model)
    full = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    greedy = trainer_greedy(actor)
    actor.save(os.path.join(run_dir, "final"))
    if rank == 0:
        from safetensors.torch import load_file

        base = load_file(os.path.join(model_dir, "model.safetensors"))
        frozen = {k.replace(".base_layer.", "."): v for k, v in full.items() if "lora_" not in k}
        torch.save({"adapters": adapters, "greedy": greedy, "n_frozen": len(frozen),
                    "frozen_differ": [k for k, v in frozen.items() if k in base and not torch.equal(v, base[k])],
                    "frozen_missing": [k for k in base if k not in frozen]},
                   os.path.join(run_dir, "final.pt"))
    actor.destroy()


if __name__ == "__main__":
    main()
    exit_without_teardown()  # results written: skip finalisation (see its docstring)
