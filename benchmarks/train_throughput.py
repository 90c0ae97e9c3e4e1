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

LoRA vs full fine-tuning (``--lora``, rank ``--lora-rank``, the 7 default target modules): each in
its own process (peak RSS is per process), on the same batch of equal-length rows: tokens/s,
peak RSS (``ru_maxrss``: model, optimizer state, activations), the optimizer state, and the weight
sync of one update — disk: what the trainer writes (LoRA: a PEFT adapter folder; full: the HF
folder) in bytes and seconds, plus the server's load of it (LoRA: the merge W0 + s·B A into its
kept base copy, :func:`arealite.server.weights.load_weights_from_disk`); distributed:
the bytes broadcast (LoRA: lora_A/lora_B only) and the trainer-side gather time (1 rank: no
network in these figures).

    flock /tmp/arealite_heavy.lock .venv/bin/python benchmarks/train_throughput.py
    flock /tmp/arealite_heavy.lock .venv/bin/python benchmarks/train_throughput.py --lora
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
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402
from arealite.utils import perf  # noqa: E402

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
    p.add_argument("--bf16", action="store_true",
                   help="bf16 compute (engine mixed_precision='bf16'; the plain loop under autocast); "
                        "fast on a GPU or a CPU with AVX-512 BF16 / AMX only")
    p.add_argument("--lora", action="store_true", help="LoRA vs full fine-tuning instead (see the docstring)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-worker", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
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


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if f.endswith((".safetensors", ".bin")))


def lora_worker(args) -> dict:
    """One contender of ``--lora`` (in its own process): figures as a dict."""
    import resource

    from arealite.api.config import LoRAConfig
    from arealite.train_engine import lora
    from arealite.server.weights import load_weights_from_disk
    from transformers import AutoModelForCausalLM

    use_lora = args.lora_worker == "lora"
    cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-5, gradient_clipping=1.0),
                            mb_spec=MicroBatchSpec(max_tokens_per_mb=args.batch * args.seq_len),
                            mixed_precision="bf16" if args.bf16 else "none",
                            lora=LoRAConfig(rank=args.lora_rank if use_lora else 0, alpha=2.0 * args.lora_rank))
    engine = FSDPEngine(cfg, temperature=TEMPERATURE)
    engine.initialize(args.model_dir)
    batch = make_batch(args, [args.seq_len] * args.batch)
    tokens = int(batch["attention_mask"].sum())
    times = [engine_step(engine, batch)() for _ in range(args.steps + 1)][1:]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    opt_bytes = sum(t.numel() * t.element_size() for st in engine.optimizer.state.values()
                    for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    out = os.path.join(tempfile.mkdtemp(prefix="arealite_sync_"), "w")
    t = time.perf_counter()
    (lora.save_adapter if use_lora else FSDPEngine.save)(engine, out)
    t_save = time.perf_counter() - t
    server_model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    t = time.perf_counter()
    load_weights_from_disk(server_model, out)
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    sent = list(lora.sync_tensors(engine.model, merged=False)) if use_lora else \
        [(n, p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data) for n, p in engine.model.named_parameters()]
    t_gather = time.perf_counter() - t
    return {"tokens_per_s": tokens / min(times), "median_s": statistics.median(times), "peak_rss": rss,
            "optimizer_bytes": opt_bytes, "trainable": trainable, "disk_bytes": _dir_bytes(out),
            "disk_save_s": t_save, "server_load_s": t_load,
            "dist_bytes": sum(x.numel() * x.element_size() for _, x in sent), "dist_gather_s": t_gather}


def lora_vs_full(args, model_dir: str, n_params: int) -> None:
    """Run both contenders as subprocesses and print the comparison."""
    import json
    import subprocess

    res = {}
    for mode in ("full", "lora"):
        cmd = [sys.executable, os.path.abspath(__file__), "--lora-worker", mode, "--model-dir", model_dir] + [
            a for a in sys.argv[1:] if a != "--lora"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    tokens = args.batch * args.seq_len
    print(f"[LoRA rank {args.lora_rank} (q,k,v,o,gate,up,down) vs full fine-tuning, {args.batch}×{args.seq_len} = "
          f"{tokens} tokens/step, {args.steps} timed steps]")
    rows = [("trainable params", lambda r: f"{r['trainable'] / 1e6:.3f} M"),
            ("tokens/s (best)", lambda r: f"{r['tokens_per_s']:.1f}"),
            ("s/step (median)", lambda r: f"{r['median_s']:.2f}"),
            ("peak RSS", lambda r: f"{r['peak_rss'] / 2**20:.0f} MiB"),
            ("AdamW state", lambda r: f"{r['optimizer_bytes'] / 2**20:.2f} MiB"),
            ("disk sync: bytes", lambda r: f"{r['disk_bytes'] / 2**20:.3f} MiB"),
            ("disk sync: save", lambda r: f"{r['disk_save_s'] * 1e3:.0f} ms"),
            ("disk sync: server load", lambda r: f"{r['server_load_s'] * 1e3:.0f} ms"),
            ("distributed: bytes", lambda r: f"{r['dist_bytes'] / 2**20:.3f} MiB"),
            ("distributed: gather", lambda r: f"{r['dist_gather_s'] * 1e3:.1f} ms")]
    print(f"  {'':<24}{'full':>14}{'LoRA':>14}")
    for name, fmt in rows:
        print(f"  {name:<24}{fmt(res['full']):>14}{fmt(res['lora']):>14}")
    print(f"  LoRA / full tokens/s: {res['lora']['tokens_per_s'] / res['full']['tokens_per_s']:.3f}×; "
          f"sync bytes ÷ {res['full']['dist_bytes'] / res['lora']['dist_bytes']:.0f}")


def main():
    global CLOCK, PROMPT_FRAC
    args = parse_args()
    if args.lora_worker:
        PROMPT_FRAC = args.prompt_frac
        torch.set_num_threads(args.threads)
        CLOCK = time.process_time if (args.clock or "cpu") == "cpu" and not torch.cuda.is_available() else time.perf_counter
        import json

        print(json.dumps(lora_worker(args)))
        return
    torch.set_num_threads(args.threads)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    PROMPT_FRAC = args.prompt_frac
    clock = args.clock or ("wall" if device.type == "cuda" else "cpu")
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter
    tmp = tempfile.mkdtemp(prefix="arealite_bench_")
    n_params = make_model_dir(args, tmp)
    print(f"model: random Llama {n_params / 1e6:.1f} M params (hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}); {device}, {'bf16' if args.bf16 else 'float32'}, {args.threads} threads, {clock} clock")
    if args.lora:
        return lora_vs_full(args, tmp, n_params)

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
    # MFU: the engine's own model-FLOP count of one step (arealite.utils.perf: 2·N per token, the
    # attention pairs, the LM head on loss positions only; x3 for forward + backward) over the
    # measured GEMM rate of the same dtype and threads
    before = perf.FLOPS.total
    engine.train_batch(full, loss_fn, n_loss_tokens)
    step_flops = perf.FLOPS.total - before
    peak = perf.gemm_peak(torch.bfloat16 if args.bf16 else torch.float32, device,
                          size=8192 if device.type == "cuda" else 1536) * 1e9
    print(f"  engine model FLOPs : {step_flops / 1e12:.3f} TFLOP/step (6·N·tokens would say "
          f"{6 * n_params * tokens / 1e12:.3f}); {step_flops / t['engine'] / 1e9:.1f} GFLOP/s")
    print(f"  engine MFU         : {100 * step_flops / t['engine'] / peak:.1f}% of the measured "
          f"{'bf16' if args.bf16 else 'fp32'} GEMM rate {peak / 1e9:.1f} GFLOP/s "
          f"({torch.get_num_threads()} threads{', CPU clock' if clock == 'cpu' else ''})")
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
