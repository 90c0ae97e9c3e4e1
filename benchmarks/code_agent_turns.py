"""Do feedback turns raise the solve rate? The code agent (arealite/workflow/code.py) evaluated
greedily with 1, 2, 3 ... turns on the same problems and the same model.

    python benchmarks/code_agent_turns.py                                  # embedded SmolLM2-135M, code test split
    python benchmarks/code_agent_turns.py --model outputs/code_grpo/trial0/final --turns 1,2,3
    python benchmarks/code_agent_turns.py --dataset humaneval --max-new-tokens 256

One of our servers is launched for the model; every setting runs one greedy episode per problem
(:meth:`CodeWorkflow.aevaluate`): turn 1 answers the task; while a visible test fails (the first
``--visible-tests``) and turns are left, the failing test and its error come back and the model
answers again; the hidden tests (all of them) decide. Prints, per turn limit, the fraction of
problems solved (``pass``), the mean reward and the mean turns taken, and the gain over one turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arealite.api.config import CodeTaskConfig, GenerationConfig, InferenceEngineConfig  # noqa: E402
from arealite.dataset.code_data import load_code  # noqa: E402
from arealite.inference.remote import RemoteInferenceEngine  # noqa: E402
from arealite.launcher.local import launch_servers  # noqa: E402
from arealite.utils.hf import load_tokenizer, resolve_model_path  # noqa: E402
from arealite.workflow.code import CodeWorkflow  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default="code", help="code (the synthetic test split) | humaneval")
    p.add_argument("--size", type=int, default=0, help="problems (0 = all)")
    p.add_argument("--turns", default="1,2,3", help="turn limits to compare, comma separated")
    p.add_argument("--visible-tests", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64, help="per turn")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    rows = load_code(args.dataset, "test", args.size or None, args.seed)
    cfg = InferenceEngineConfig(n_servers=1, server_threads=os.cpu_count() or 1)
    engine = RemoteInferenceEngine(cfg, launch_servers(cfg, path, tempfile.mkdtemp(prefix="code_turns_"), args.seed))
    engine.initialize()
    results = {}
    try:
        for turns in (int(t) for t in args.turns.split(",")):
            wf = CodeWorkflow(GenerationConfig(max_new_tokens=args.max_new_tokens, greedy=True), tok, max_turns=turns,
                              max_context_tokens=4096, code=CodeTaskConfig(visible_tests=args.visible_tests))
            results[turns] = asyncio.run(wf.aevaluate(engine, rows))
            print(f"max_turns {turns}: pass {results[turns]['pass']:.3f}, reward {results[turns]['reward']:.3f}, "
                  f"turns {results[turns]['turns']:.2f} ({len(rows)} problems)", flush=True)
    finally:
        engine.destroy()
    one = results[min(results)]["pass"]
    print(f"| max turns | solved | gain vs {min(results)} turn | mean turns |\n|---|---|---|---|")
    for t, r in results.items():
        print(f"| {t} | {r['pass']:.3f} | {r['pass'] - one:+.3f} | {r['turns']:.2f} |")
    out = {"model": path, "dataset": args.dataset, "problems": len(rows), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
