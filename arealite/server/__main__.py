"""``python -m arealite.server``: command-line arguments, model loading and ``main``
(see the package docstring for the protocol)."""

from __future__ import annotations

import argparse
import logging

import torch
from aiohttp import web

from arealite.server.http import Server
from arealite.server.scheduler import Scheduler

logger = logging.getLogger("arealite.server")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m arealite.server",
                                description="A transformers-based generation server speaking a subset of "
                                            "SGLang's HTTP protocol.")
    p.add_argument("--model-path", required=True, help="HF causal-LM folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-batch-size", type=int, default=64, help="most running requests")
    p.add_argument("--max-prefill-tokens", type=int, default=1024,
                   help="prompt tokens prefilled per scheduler iteration (and per forward)")
    p.add_argument("--prefix-cache-tokens", type=int, default=8192,
                   help="KV of finished requests kept for later requests with the same prefix "
                        "(e.g. the next turn of an episode) [tokens]; 0 = off")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES) + ["auto"],
                   help="weights and KV cache (logits and logprobs are fp32 always); auto = "
                        "bfloat16 where bf16 is fast (a GPU, a CPU with AVX-512 BF16 or AMX), "
                        "else float32")
    p.add_argument("--no-packed-linear", action="store_true",
                   help="CPU: plain F.linear instead of oneDNN pre-packed weights (which cost one "
                        "more copy of the linear weights' memory)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--parent-pid", type=int, default=0,
                   help="exit when this process is gone (set by arealite's launcher); 0 = never")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--access-log", action="store_true",
                   help="log every HTTP request (aiohttp's access log; off by default: one line per "
                        "/generate floods the logs that launchers stream)")
    return p.parse_args(argv)


def build_scheduler(args) -> Scheduler:
    """Load the model (and its tokenizer, when the folder has one) and build the scheduler,
    whose constructor packs the linear weights and runs the start-up self-check."""
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM

    if args.dtype == "auto":
        from arealite.utils.perf import resolve_dtype

        args.dtype, why = resolve_dtype("auto", args.device)
        logger.info("--dtype auto -> %s (%s)", args.dtype, why)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=DTYPES[args.dtype])
    model.to(args.device).eval()
    if args.device == "cpu":  # build the decode-attention kernel now, not in the first request
        from arealite import native

        native.library()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    except Exception:  # noqa: BLE001 - token ids only; stop strings are then rejected
        tokenizer = None
    return Scheduler(model, args.max_batch_size, args.seed, args.weight_version, tokenizer,
                     args.max_prefill_tokens, args.prefix_cache_tokens,
                     use_packed_linear=not args.no_packed_linear)


def main(argv=None):
    """Load the model, start the scheduler thread and serve HTTP until interrupted."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.access_log:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if args.parent_pid:
        from arealite.utils.proc import exit_when_parent_dies

        exit_when_parent_dies(args.parent_pid)
    from arealite.utils.proc import run_in_short_lived_thread

    # every torch op of the start-up off the main thread: the scheduler thread is then the only
    # one with a libgomp pool, whose workers spin between ops (run_in_short_lived_thread)
    scheduler = run_in_short_lived_thread(build_scheduler, args)
    server = Server(scheduler, args.model_path)
    logger.info("serving %s on %s:%d", args.model_path, args.host, args.port)
    # handler_cancellation: a client that disconnects (e.g. timed out and moved to another
    # server) cancels its /generate handler, which aborts the request here.
    web.run_app(server.app(), host=args.host, port=args.port, print=None,
                handler_cancellation=True)




if __name__ == "__main__":
    main()
