"""Cost curves of one GRPO training step of arealite's trainer (``FSDPEngine``).

A step is ``GRPO.update`` (arealite/algorithms/grpo.py), the call the RL loop makes per step:
advantages from the rewards, then ``FSDPEngine.train_batch`` with GRPO's loss (decoupled PPO
surrogate, token-mean) and one AdamW step. Its cost is measured as a function of

* model size: random models of real shapes (SmolLM2-135M, SmolLM2-360M, Qwen2.5-0.5B,
  Qwen2.5-1.5B) at group 4, response 64. Models of >= ``--lora-from-b`` billion parameters (by
  default the 1.5B only) train LoRA rank ``--lora-rank`` adapters: full fine-tuning's fp32 AdamW
  state would not fit comfortably in 24 GiB. The table marks those points "LoRA";
* group size (samples per prompt: 2, 4, 8, 16) at 135M, response 64;
* response length (32, 64, 128, 256 tokens) at 135M, group 4;
* trainer ranks (1 vs 2) at 135M, group 4, response 64: the 2-rank point is the same worker
  under ``torchrun --nproc_per_node=2`` (FSDP2 over gloo, ``--threads`` split over the ranks);
  the global batch is the same, its prompts split over the ranks as the RL loop's loader does.

A batch is ``--prompts`` prompts x group rows: a ``--prompt-len``-token prompt shared by its group
(the engine's prefix sharing runs it once) and a response of the point's length; random token
ids, random rewards (hence random group-normalised advantages), behaviour logprobs ``-ln(vocab)``
(a random model's, so importance weights are ~1). Each point runs in its own process (tree);
points shared by several curves run once. Per point: s/step (median of ``--steps`` timed steps
after 1 warm-up; wall time of the slowest rank), peak RSS (sum of the ranks' own ``VmHWM``),
tokens per step (all rows, prompt + response), model TFLOP per step as the engine counts them
(:data:`arealite.utils.perf.FLOPS`), GFLOP/s and MFU over :func:`arealite.utils.perf.gemm_peak`
of the compute dtype (summed over ranks). Per curve: the least-squares slope of log(s/step)
against log(x). Precision: ``--precision`` is the engine's ``mixed_precision`` (auto: bf16 where
the CPU has AVX-512 BF16/AMX); each point prints the resolved value.

    flock /tmp/arealite_heavy.lock .venv/bin/python benchmarks/cost_curves.py   # all curves
    .venv/bin/python benchmarks/cost_curves.py --curves group,length --steps 3
    .venv/bin/python benchmarks/cost_curves.py --tiny            # smoke test: tiny models, seconds
    .venv/bin/python benchmarks/cost_curves.py --from-json benchmarks/results/cost_curves_DATE.json

Output: tables, ``--json`` (default ``benchmarks/results/cost_curves_<date>.json``) and ``--plot``
(default ``docs/cost_curves.png``; ``--tiny`` writes both to the temp folder instead). The figures
belong in docs/performance.md with the date and the machine (the JSON's header).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # no "Writing model shards" bars
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from train_throughput import make_model_dir  # noqa: E402  (random Llama folder + tokenizer)
from generation_throughput import random_qwen  # noqa: E402  (random Qwen2 folder + tokenizer)
from vs_trl import machine, monitored  # noqa: E402  (machine header; process-tree runner)

# name: architecture, shape, nominal size [billions of parameters]
MODELS = {
    "SmolLM2-135M": ("llama", dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152), 0.135),
    "SmolLM2-360M": ("llama", dict(hidden=960, layers=32, heads=15, kv_heads=5, intermediate=2560, vocab=49152), 0.362),
    "Qwen2.5-0.5B": ("qwen2", dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936), 0.494),
    "Qwen2.5-1.5B": ("qwen2", dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936), 1.54),
}
TINY_SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
BASE = dict(model="SmolLM2-135M", group=4, response=64, ranks=1)  # the fixed values of each curve
CURVES = {"size": ("model", "parameters (M)"), "group": ("group", "group size"),
          "length": ("response", "response tokens"), "ranks": ("ranks", "trainer ranks")}


def build_model(name: str, path: str, tiny: bool) -> tuple[int, int]:
    """Write model ``name`` (tiny: :data:`TINY_SHAPE` in its architecture) to ``path``;
    returns (parameters, vocab)."""
    arch, shape, _ = MODELS[name]
    shape = TINY_SHAPE if tiny else shape
    n = make_model_dir(SimpleNamespace(**shape), path) if arch == "llama" else random_qwen(path, shape)
    return n, shape["vocab"]


def grpo_batch(prompts: int, group: int, prompt_len: int, response: int, vocab: int, rank: int = 0,
               world: int = 1) -> dict:
    """This rank's share (prompts ``rank::world``) of the global GRPO batch: rows of one prompt
    consecutive, prompt then response, ``loss_mask`` on the response, random rewards."""
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, vocab, (prompts, prompt_len), generator=g).repeat_interleave(group, 0),
                     torch.randint(0, vocab, (prompts * group, response), generator=g)], 1)
    rewards = torch.randn(prompts * group, generator=g)
    loss_mask = torch.zeros(ids.shape, dtype=torch.int32)
    loss_mask[:, prompt_len:] = 1
    rows = torch.tensor([p * group + j for p in range(rank, prompts, world) for j in range(group)])
    batch = {"input_ids": ids, "attention_mask": torch.ones(ids.shape, dtype=torch.bool), "loss_mask": loss_mask,
             "logprobs": -math.log(vocab) * loss_mask.float(), "rewards": rewards}
    return {k: v[rows] for k, v in batch.items()}


def peak_rss_bytes() -> float:
    """This process's peak resident memory since its exec (``VmHWM`` of /proc/self/status).
    Not ``ru_maxrss``: Linux carries that over from the forked parent's RSS at exec, so every
    point run after the parent built a large model reported the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def worker(spec: dict) -> dict:
    """One point in this process (one rank under torchrun): figures of ``spec``'s GRPO step."""
    import torch.distributed as dist

    from arealite.algorithms.grpo import GRPO
    from arealite.api.config import GRPOAlgoConfig, LoRAConfig, OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine
    from arealite.utils import perf

    torch.set_num_threads(spec["threads"])
    cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-6), mixed_precision=spec["precision"],
                            num_threads=spec["threads"], lora=LoRAConfig(rank=spec["lora_rank"]))
    engine = FSDPEngine(cfg)
    engine.initialize(spec["model_dir"])
    algo = GRPO(GRPOAlgoConfig(), engine, group_size=spec["group"])
    batch = grpo_batch(spec["prompts"], spec["group"], spec["prompt_len"], spec["response"], spec["vocab"],
                       engine.rank, engine.world_size)
    times, flops0 = [], 0.0
    for i in range(spec["steps"] + 1):
        dist.barrier()
        t = time.perf_counter()
        stats = algo.update(dict(batch))  # a copy: update() adds keys to its batch
        dt = torch.tensor(time.perf_counter() - t)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank's does
        times.append(float(dt))
        if i == 0:  # the warm-up step
            flops0 = perf.FLOPS.total
    dtype = torch.bfloat16 if engine.precision == "bf16" else torch.float32
    size = 8192 if engine.device.type == "cuda" else 512 if spec["tiny"] else 1536
    totals = torch.tensor([perf.FLOPS.total - flops0,
                           perf.gemm_peak(dtype, engine.device, size=size) * 1e9,
                           peak_rss_bytes()], dtype=torch.float64)
    dist.all_reduce(totals)  # over ranks: FLOPs, GEMM peak [FLOP/s], peak RSS [bytes]
    flops, peak, rss = (float(x) for x in totals)
    s_step = statistics.median(times[1:])
    flops /= spec["steps"]
    engine.destroy()
    return {"s_per_step": s_step, "step_times": times[1:], "warmup_s": times[0], "peak_rss_gib": rss / 2**30,
            "tokens": spec["prompts"] * spec["group"] * (spec["prompt_len"] + spec["response"]),
            "tflop": flops / 1e12, "gflops_per_s": flops / s_step / 1e9, "gemm_peak_gflops": peak / 1e9,
            "mfu": flops / s_step / peak, "precision": engine.precision, "n_microbatches": stats["n_microbatches"],
            "threads_per_rank": spec["threads"]}


def run_point(args, point: dict, model_dir: str, vocab: int, root: str) -> dict:
    """Run ``point`` in its own process (tree): python, or torchrun for several ranks."""
    spec = {**point, "model_dir": model_dir, "vocab": vocab, "prompts": args.prompts, "prompt_len": args.prompt_len,
            "steps": args.steps, "precision": args.precision, "tiny": args.tiny,
            "threads": max(1, args.threads // point["ranks"]),
            "lora_rank": args.lora_rank if MODELS[point["model"]][2] >= args.lora_from_b else 0}
    tag = "_".join(str(v) for v in point.values())
    spec_path, result_path = (os.path.join(root, f"{tag}.{ext}") for ext in ("spec.json", "result.json"))
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    launch = [sys.executable] if point["ranks"] == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={point['ranks']}"]
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])  # inherited by the worker (and torchrun's ranks)
    tree = monitored([*launch, os.path.abspath(__file__), "--worker", spec_path, result_path],
                     os.path.join(root, f"{tag}.log"))
    with open(result_path) as f:
        return {**point, **json.load(f), "lora_rank": spec["lora_rank"], "tree_peak_rss_gib": tree["peak_rss_gib"]}


def measure(args) -> dict:
    """Every point of ``args.curves`` (shared points once); model folders built on first use and
    deleted after their last."""
    base = dict(BASE, response=BASE["response"] // 8 if args.tiny else BASE["response"])
    curves = {"size": [dict(base, model=m) for m in MODELS], "group": [dict(base, group=g) for g in args.groups],
              "length": [dict(base, response=r) for r in args.lengths], "ranks": [dict(base, ranks=n) for n in (1, 2)]}
    curves = {c: curves[c] for c in args.curves}
    unique = list({tuple(p.values()): p for pts in curves.values() for p in pts}.values())
    root = tempfile.mkdtemp(prefix="arealite_cost_")
    models, done = {}, {}
    for i, p in enumerate(unique):
        if p["model"] not in models:
            models[p["model"]] = build_model(p["model"], os.path.join(root, p["model"]), args.tiny)
        n_params, vocab = models[p["model"]]
        r = run_point(args, p, os.path.join(root, p["model"]), vocab, root)
        done[tuple(p.values())] = {**r, "params": n_params}
        print(f"[{i + 1}/{len(unique)}] {label(done[tuple(p.values())], 'all')}: {r['s_per_step']:.3f} s/step",
              flush=True)
        if all(q["model"] != p["model"] for q in unique[i + 1:]):
            shutil.rmtree(os.path.join(root, p["model"]))
    shutil.rmtree(root, ignore_errors=True)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "torch": torch.__version__,
           "torch_threads": args.threads, "args": {k: v for k, v in vars(args).items() if k not in ("worker",)},
           "curves": {}}
    out["machine"]["avx512_bf16"] = "avx512_bf16" in out["machine"]["bf16_flags"]
    for c, pts in curves.items():
        rows = [done[tuple(p.values())] for p in pts]
        xs = [r["params"] / 1e6 if c == "size" else r[CURVES[c][0]] for r in rows]
        out["curves"][c] = {"x_name": CURVES[c][1], "x": xs, "points": rows, "slope": slope(xs, [r["s_per_step"] for r in rows])}
    return out


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) against log(x); None when x spans less than 1.5x."""
    if len(xs) < 2 or max(xs) < 1.5 * min(xs):
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def slope_words(curve: dict) -> str:
    """The curve's slope in words: "s/step ∝ x^0.93: about linear"."""
    b, x = curve["slope"], curve["x_name"]
    if b is None:
        return f"s/step vs {x}: no slope (x spans < 1.5x, e.g. --tiny's equal-size models)"
    words = ("about inversely proportional" if b <= -0.8 else "falls, less than proportionally" if b < -0.2
             else "about flat" if b < 0.2 else "sublinear" if b < 0.8 else "about linear" if b < 1.2
             else "superlinear" if b < 1.8 else "about quadratic or steeper")
    return f"s/step ∝ ({x})^{b:.2f}: {words}"


def label(r: dict, curve: str) -> str:
    """A point's name in ``curve``'s table (``all``: every coordinate)."""
    model = r["model"] + (f" (LoRA r{r['lora_rank']})" if r["lora_rank"] else "")
    parts = {"size": f"{model}, {r['params'] / 1e6:.1f} M", "group": f"G={r['group']}",
             "length": f"R={r['response']}", "ranks": f"{r['ranks']} rank{'s' * (r['ranks'] > 1)}"}
    if curve != "all":
        return parts[curve]
    return f"{model} G={r['group']} R={r['response']} {parts['ranks']}"


def report(res: dict) -> None:
    """Print the header, one table per curve and its slope."""
    m = res["machine"]
    print(f"\n{res['date']}  {m['cpu']}, {m['cores']} cores, avx512_bf16: {m['avx512_bf16']}; torch {res['torch']}, "
          f"{res['torch_threads']} threads (1 rank), {res['args']['prompts']} prompts x group, prompt "
          f"{res['args']['prompt_len']} tokens{', TINY models' if res['args']['tiny'] else ''}")
    for c, curve in res["curves"].items():
        print(f"\n[{c}: s/step vs {curve['x_name']}]")
        print(f"  {'point':<34}{'prec':>6}{'s/step':>9}{'peak GiB':>10}{'tokens':>8}{'TFLOP':>9}{'GFLOP/s':>9}{'MFU':>7}")
        for r in curve["points"]:
            print(f"  {label(r, c):<34}{r['precision']:>6}{r['s_per_step']:>9.3f}{r['peak_rss_gib']:>10.2f}"
                  f"{r['tokens']:>8}{r['tflop']:>9.3g}{r['gflops_per_s']:>9.1f}{100 * r['mfu']:>6.1f}%")
        print("  " + slope_words(curve))


def plot(res: dict, path: str) -> None:
    """One subplot per curve: s/step (left; log-log for size) and peak RSS GiB (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["curves"])
    cols = min(2, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, c in zip(axes.flat, names):
        curve = res["curves"][c]
        xs = curve["x"]
        ax.plot(xs, [r["s_per_step"] for r in curve["points"]], "o-", color="tab:blue")
        if c == "size":
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.minorticks_off()
        ax.set_xticks(xs, [f"{x:.3g}" for x in xs])
        ax.set_xlabel(curve["x_name"])
        ax.set_ylabel("s / step", color="tab:blue")
        ax.set_title(slope_words(curve), fontsize=8)
        twin = ax.twinx()
        twin.plot(xs, [r["peak_rss_gib"] for r in curve["points"]], "s--", color="tab:red")
        twin.set_ylabel("peak RSS (GiB)", color="tab:red")
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(f"GRPO step cost, FSDPEngine ({res['date']}, {res['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    """Measure (or, with ``--from-json``, reload) the curves; print them and write the JSON and plot."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--curves", type=lambda s: s.split(","), default=list(CURVES), help="size,group,length,ranks")
    p.add_argument("--steps", type=int, default=2, help="timed steps per point (after 1 warm-up)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per batch (over all ranks)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--groups", type=ints, default=[2, 4, 8, 16], help="group curve")
    p.add_argument("--lengths", type=ints, default=[32, 64, 128, 256], help="response-length curve")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 rank); split over ranks")
    p.add_argument("--precision", choices=["auto", "none", "bf16"], default="auto", help="mixed_precision")
    p.add_argument("--lora-from-b", type=float, default=1.0, help="LoRA for models of >= this many billion params")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="smoke test: tiny random models, lengths / 8")
    p.add_argument("--json", default=None, help="default benchmarks/results/cost_curves_<date>.json")
    p.add_argument("--plot", default=None, help="default docs/cost_curves.png")
    p.add_argument("--from-json", default=None, help="re-print and re-plot a saved JSON, no measuring")
    p.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)  # SPEC RESULT
    args = p.parse_args()
    if args.worker:
        with open(args.worker[0]) as f:
            res = worker(json.load(f))
        if int(os.environ.get("RANK", 0)) == 0:
            with open(args.worker[1], "w") as f:
                json.dump(res, f)
        return
    root = os.path.dirname(HERE)
    out_dir = tempfile.gettempdir() if args.tiny else None  # a smoke run never overwrites real results
    plot_path = args.plot or os.path.join(out_dir or os.path.join(root, "docs"), "cost_curves.png")
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
    else:
        if unknown := set(args.curves) - set(CURVES):
            p.error(f"--curves: unknown {sorted(unknown)}; choose from {list(CURVES)}")
        if "ranks" in args.curves and args.prompts % 2:
            p.error("--prompts must be even for the 2-rank point (whole prompts per rank)")
        if args.tiny:
            args.prompt_len = max(1, args.prompt_len // 8)
            args.lengths = [max(1, n // 8) for n in args.lengths]
        torch.set_num_threads(args.threads)
        res = measure(args)
        json_path = args.json or os.path.join(out_dir or os.path.join(root, "benchmarks", "results"),
                                              f"cost_curves_{res['date']}.json")
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"JSON: {json_path}")
    report(res)
    plot(res, plot_path)
    print(f"plot: {plot_path}")


if __name__ == "__main__":
    main()
