"""fp32 vs bf16: the train-inference logprob mismatch each precision creates, and its speed here.

SmolLM2-135M-Instruct samples ``--prompts`` completions of ``--max-new-tokens`` tokens (HF
``generate`` in fp32, temperature ``--temperature``) for arithmetic questions; then the same
token sequences are scored by

* the trainer: ``FSDPEngine.forward`` (1 rank) with ``mixed_precision`` none (fp32) and bf16
  (FSDP2 bf16 compute, fp32 LM head and logprobs);
* the server's computation: the HF model in fp32 or bf16 with oneDNN packed linears, the
  logits' ``log_softmax(logits.float() / T)`` (what ``arealite.server`` samples from); in bf16
  with the server's fp32 LM head (:func:`arealite.server.packed_linear.fp32_lm_head`, where the
  native kernel runs) and, as "server bf16 head", with the bf16 head it had before.

Printed for each pair over the completion tokens: mean, p99 and max ``|Δ log p|`` and the mean
mismatch KL ``k3 = exp(Δ) − 1 − Δ`` with ``Δ = log p_server − log p_trainer`` (Schulman's k3
estimator of KL(trainer ‖ server) under the server's samples), plus each scorer's seconds. On an
AVX2-only CPU bf16 is emulated (slow); on a GPU or an AVX-512 BF16 CPU it is the fast path.

    python benchmarks/precision.py                    # 8 prompts x 64 tokens, ~2 min on 2 AVX2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arealite.api.config import TrainEngineConfig  # noqa: E402
from arealite.dataset.math_data import make_arithmetic_dataset  # noqa: E402
from arealite.server import packed_linear  # noqa: E402
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402
from arealite.utils.hf import load_tokenizer, resolve_model_path, tokenize_chat  # noqa: E402


def sample(path, tok, args):
    """``(batch, prompt_lens)``: right-padded ``input_ids``/``attention_mask``/``loss_mask``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = make_arithmetic_dataset("test", args.prompts, seed=args.seed)
    torch.manual_seed(args.seed)
    seqs, masks = [], []
    for row in rows:
        prompt = tokenize_chat(tok, row["messages"])
        out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=args.temperature,
                             top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                             pad_token_id=tok.pad_token_id)[0].tolist()
        seqs.append(out)
        masks.append([0] * len(prompt) + [1] * (len(out) - len(prompt)))
    T = max(map(len, seqs))
    batch = {"input_ids": torch.zeros(len(seqs), T, dtype=torch.long),
             "attention_mask": torch.zeros(len(seqs), T, dtype=torch.bool),
             "loss_mask": torch.zeros(len(seqs), T, dtype=torch.int)}
    for i, (s, m) in enumerate(zip(seqs, masks)):
        batch["input_ids"][i, :len(s)] = torch.tensor(s)
        batch["attention_mask"][i, :len(s)] = True
        batch["loss_mask"][i, :len(s)] = torch.tensor(m)
    return batch


def trainer_logprobs(path, batch, mp, temperature):
    engine = FSDPEngine(TrainEngineConfig(mixed_precision=mp), temperature=temperature, trainable=False)
    engine.initialize(path)
    t = time.perf_counter()
    out = engine.forward(batch)
    return out, time.perf_counter() - t


@torch.inference_mode()
def server_logprobs(path, batch, dtype, temperature, fp32_head=True):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if fp32_head:
        packed_linear.fp32_lm_head(model)  # the server's: no-op for fp32 or without the kernel
    if packed_linear.available("cpu", dtype):
        packed_linear.pack_linears(model)
    out = torch.zeros(batch["input_ids"].shape)
    t = time.perf_counter()
    for i in range(len(out)):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i:i + 1, :n]
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, -1)
        out[i, 1:n] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return out, time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path("")
    tok = load_tokenizer(path)
    batch = sample(path, tok, args)
    mask = batch["loss_mask"].bool()
    scores = {}
    for name, fn in (("trainer fp32", lambda: trainer_logprobs(path, batch, "none", args.temperature)),
                     ("trainer bf16", lambda: trainer_logprobs(path, batch, "bf16", args.temperature)),
                     ("server fp32", lambda: server_logprobs(path, batch, torch.float32, args.temperature)),
                     ("server bf16", lambda: server_logprobs(path, batch, torch.bfloat16, args.temperature)),
                     ("server bf16 head", lambda: server_logprobs(path, batch, torch.bfloat16, args.temperature,
                                                                  fp32_head=False))):
        scores[name] = fn()
    print(f"SmolLM2-135M, {args.prompts} completions, {int(mask.sum())} completion tokens, "
          f"T={args.temperature}, {args.threads} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    for name, (_, secs) in scores.items():
        print(f"  {name:<16} scored in {secs:6.2f} s")
    for a, b in (("trainer fp32", "server fp32"), ("trainer bf16", "server bf16"),
                 ("trainer bf16", "server bf16 head"), ("trainer fp32", "server bf16"),
                 ("trainer fp32", "trainer bf16")):
        d = (scores[b][0] - scores[a][0])[mask].double()
        k3 = (d.exp() - 1 - d).mean()
        print(f"  {a} vs {b:<16}: |Δ log p| mean {d.abs().mean():.2e}  p99 {d.abs().quantile(0.99):.2e}  "
              f"max {d.abs().max():.2e}   mismatch KL (k3) {k3:.2e}")


if __name__ == "__main__":
    main()
