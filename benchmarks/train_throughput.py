"""Training throughput of ``FSDPEngine.train_batch`` against a plain PyTorch loop, and packed vs
padded micro-batches on a variable-length batch.

* Engine vs plain: the same random Llama, the same fixed batch of equal-length rows (no
  padding), the same token-mean policy-gradient loss, AdamW and gradient clipping. The plain loop
  is ``model(ids).logits → log_softmax/T → gather → loss → backward → clip → step`` (full fp32
  logits); the engine runs FSDP2 (1 rank), packing and the chunked LM head. Goal: ≥ 0.97×.
* Packed vs padded: the engine on a batch whose lengths are uniform in [T/8, T]; prints the
  padding fraction of the padded layout and the speed-up of packing. The bound 1/(1 − fraction)
  applies to the backbone only: the engine never runs the LM head on padding (nor on prompt
  tokens) in either layout, and the optimizer step does not depend on tokens.

Steps alternate between the two contenders; each figure is the fastest timed step (``timeit``'s
rule: on a shared machine the other processes only ever add time), the median follows in
brackets. tokens/s counts real tokens only. On CPU the clock is this process's CPU time
(``time.process_time``, all threads) by default, which other processes on a shared machine do
not inflate; ``--clock wall`` uses wall time (the default on GPU). Single process, CPU float32
here; on a GPU add ``--bf16`` (FSDP2 ``MixedPrecisionPolicy``; the plain loop then runs under
``torch.autocast(bfloat16)``).

    flock /tmp/arealite_heavy.lock .venv/bin/python benchmarks/train_throughput.py
    python benchmarks/train_throughput.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 \\
        --intermediate 4864 --vocab 151936 --batch 16 --seq-len 1024 --bf16   # Qwen2.5-0.5B shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arealite.algorithms.functional import gather_logprobs  # noqa: E402
from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig  # noqa: E402
from arealite.engine.fsdp import FSDPEngine  # noqa: E402

TEMPERATURE = 0.7
CLOCK = time.perf_counter  # set in main()
PROMPT_FRAC = 0.125  # set in main()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    # default shape: the LM head is ~25% of the FLOPs, as in SmolLM2-135M / Qwen2.5-0.5B
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8, help="rows per batch")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (the longest row)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per contender (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-frac", type=float, default=0.125,
                   help="leading fraction of each row without loss (the engine skips the LM head there)")
    p.add_argument("--clock", choices=["cpu", "wall"], default=None,
                   help="cpu = process CPU time (default on CPU), wall = wall time (default on GPU)")
    p.add_argument("--bf16", action="store_true", help="GPU: bf16 compute (engine mixed_precision='bf16')")
    return p.parse_args()


def make_model_dir(args, path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))  # the engine saves a tokenizer
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    return n


def make_batch(args, lengths):
    g = torch.Generator().manual_seed(1)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(0, args.vocab, (B, T), generator=g)
    am = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        am[i, :n] = True
    lm = am.int()
    lm[:, : int(T * PROMPT_FRAC)] = 0  # the "prompt": no loss there
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm, "advantages": adv}


def loss_fn(logprobs, mb):
    mask = mb["loss_mask"].float()
    return -(logprobs * mb["advantages"] * mask).sum() / mask.sum()


def n_loss_tokens(mb):
    return float(mb["loss_mask"].sum())


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_step(engine, batch):
    def step():
        sync()
        t = CLOCK()
        engine.train_batch(batch, loss_fn, n_loss_tokens)
        sync()
        return CLOCK() - t
    return step


def plain_step(model, opt, batch, device, bf16):
    batch = {k: v.to(device) for k, v in batch.items()}

    def step():
        sync()
        t = CLOCK()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                           use_cache=False).logits
        loss = loss_fn(gather_logprobs(logits, batch["input_ids"], TEMPERATURE), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        return CLOCK() - t
    return step


def race(contenders: dict, steps: int) -> tuple[dict, dict]:
    """Alternate the contenders step by step (after a warm-up step each); returns the fastest
    and the median seconds per step of each."""
    times = {k: [] for k in contenders}
    for i in range(steps + 1):
        for k, f in contenders.items():
            dt = f()
            if i > 0:
                times[k].append(dt)
    return {k: min(v) for k, v in times.items()}, {k: statistics.median(v) for k, v in times.items()}


def report(name: str, tokens: int, best: float, median: float) -> None:
    print(f"  {name:<19}: {tokens / best:9.1f} tokens/s ({best:.2f} s/step; median {median:.2f})")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    global CLOCK, PROMPT_FRAC
    PROMPT_FRAC = args.prompt_frac
    clock = args.clock or ("wall" if device.type == "cuda" else "cpu")
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter
    tmp = tempfile.mkdtemp(prefix="arealite_bench_")
    n_params = make_model_dir(args, tmp)
    print(f"model: random Llama {n_params / 1e6:.1f} M params (hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}); {device}, {'bf16' if args.bf16 else 'float32'}, {args.threads} threads, {clock} clock")

    def new_engine(packing: bool):
        cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-5, gradient_clipping=1.0),
                                mb_spec=MicroBatchSpec(max_tokens_per_mb=args.batch * args.seq_len, packing=packing),
                                mixed_precision="bf16" if args.bf16 else "none")
        e = FSDPEngine(cfg, temperature=TEMPERATURE)
        e.initialize(tmp)
        return e

    # 1) engine vs plain loop, equal lengths (no padding either way)
    from transformers import AutoModelForCausalLM

    full = make_batch(args, [args.seq_len] * args.batch)
    tokens = int(full["attention_mask"].sum())
    model = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-5,
                            weight_decay=0.0, **({"fused": True} if device.type == "cuda" else {}))
    engine = new_engine(packing=True)
    t, med = race({"plain": plain_step(model, opt, full, device, args.bf16), "engine": engine_step(engine, full)},
                  args.steps)
    print(f"[equal lengths, {args.batch}×{args.seq_len} = {tokens} tokens/step]")
    report("plain PyTorch loop", tokens, t["plain"], med["plain"])
    report("FSDPEngine", tokens, t["engine"], med["engine"])
    print(f"  engine / plain     : {t['plain'] / t['engine']:.3f}×  "
          f"(medians {med['plain'] / med['engine']:.3f}×; goal ≥ 0.97×)")
    if device.type == "cuda":
        flops = 6 * n_params * tokens / t["engine"]
        peak = 989e12 if args.bf16 else 67e12  # H100/H200 dense bf16 / fp32 (non-tensor-core) peak
        print(f"  engine MFU         : {100 * flops / peak:.1f}% (6·N·tokens/s over {peak / 1e12:.0f} TFLOP/s; "
              "attention FLOPs not counted)")
    del model, opt

    # 2) packed vs padded on a variable-length batch
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(args.seq_len // 8, args.seq_len + 1, (args.batch,), generator=g).tolist()
    lengths[0] = args.seq_len
    var = make_batch(args, lengths)
    real = int(var["attention_mask"].sum())
    pad_frac = 1 - real / (len(lengths) * max(lengths))
    padded = new_engine(packing=False)
    t, med = race({"packed": engine_step(engine, var), "padded": engine_step(padded, var)}, args.steps)
    print(f"[variable lengths {min(lengths)}..{max(lengths)}, {real} real tokens, padding fraction {pad_frac:.2f}]")
    report("packed", real, t["packed"], med["packed"])
    report("padded", real, t["padded"], med["padded"])
    print(f"  packed / padded    : {t['padded'] / t['packed']:.3f}×  (medians {med['padded'] / med['packed']:.3f}×; "
          f"1/(1 − padding) = {1 / (1 - pad_frac):.3f}× if all work scaled with padded tokens; "
          "the LM head on loss tokens and the optimizer step do not)")
    engine.destroy()


if __name__ == "__main__":
    main()
