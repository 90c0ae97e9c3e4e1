"""Held-out accuracy of a model on a math dataset (greedy decoding).

Command line (any HF folder, e.g. a checkpoint written by a recipe)::

    python -m arealite.evaluate --model-path outputs/grpo_math/trial0/final --size 200
    python -m arealite.evaluate                       # the embedded default model
    python -m arealite.evaluate --dataset ../shared/data/gsm8k/test.jsonl --max-new-tokens 256

Prints ``accuracy X/N = p`` and a JSON line. Uses HF ``generate`` (left padding, greedy), so it is
independent of our server and trainer; ``RLVRWorkflow.aevaluate`` does the same through a
running inference engine inside a recipe.
"""

from __future__ import annotations

import argparse
import json

import torch

from arealite.dataset.math_data import load_dataset
from arealite.reward.math import math_reward
from arealite.utils.hf import tokenize_chat


@torch.no_grad()
def evaluate_hf(model_path: str, rows: list[dict], max_new_tokens: int = 24, batch_size: int = 32) -> float:
    """Greedy accuracy of ``model_path`` on ``rows`` (``messages``/``answer``) with HF generate.

    Returns: fraction in [0, 1] of rows whose completion gets ``math_reward`` 1.
    """
    from transformers import AutoModelForCausalLM

    from arealite.utils.hf import load_tokenizer

    tok = load_tokenizer(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        prompts = [tokenize_chat(tok, r["messages"]) for r in chunk]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        for r, seq in zip(chunk, out[:, width:]):
            correct += math_reward(tok.decode(seq, skip_special_tokens=True), r["answer"]) > 0.5
    return correct / max(1, len(rows))


def main(argv: list[str] | None = None) -> dict:
    from arealite.utils.hf import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="", help="HF model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default=None, help="jsonl (GSM8K/MATH format); default: embedded arithmetic test split")
    p.add_argument("--size", type=int, default=200, help="number of held-out problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = all cores)")
    args = p.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    path = resolve_model_path(args.model_path)
    rows = load_dataset(args.dataset, "test", args.size, args.seed)
    acc = evaluate_hf(path, rows, args.max_new_tokens)
    n = len(rows)
    print(f"accuracy {round(acc * n)}/{n} = {acc:.3f}  ({path})")
    result = {"model_path": path, "accuracy": acc, "n": n}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
