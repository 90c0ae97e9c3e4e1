"""RLVR: single-turn generation with a verifiable reward (math answer checking).

One episode = one prompt → chat template → ``gconfig.n_samples`` concurrent completions →
rewards computed in a worker process with a timeout → a GRPO group of trajectories.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Callable

import torch

from arealite.api.config import GenerationConfig
from arealite.api.engine import InferenceEngine
from arealite.api.io_struct import ModelRequest, ModelResponse
from arealite.api.workflow import RolloutWorkflow
from arealite.reward.worker import RewardWorker
from arealite.utils.data import pad_and_stack
from arealite.utils.hf import tokenize_chat
from arealite.workflow.reward_owner import OwnsRewardWorker


def build_trajectories(resps: list[ModelResponse], rewards: list[float]) -> dict[str, torch.Tensor]:
    """Pack responses into the token-aligned layout of :mod:`arealite.api.io_struct`.

    Row i is ``prompt + output_i``; with P prompt and L_i output tokens:
    ``loss_mask[i, P:P+L_i] = 1``, ``logprobs[i, P+j] = output_logprobs[j]``,
    ``versions[i, P+j] = output_versions[j]``, prompt versions -1, padding 0 (right).

    Returns: ``input_ids`` [N, T] int64, ``attention_mask`` [N, T] bool, ``loss_mask`` [N, T]
    int32, ``logprobs`` [N, T] float32, ``versions`` [N, T] int64, ``rewards`` [N] float32,
    ``no_eos`` [N] bool (true when the response was cut by the token budget).
    """
    seqs, masks, lps, vers = [], [], [], []
    for r in resps:
        p, n = len(r.input_tokens), r.output_len
        seqs.append(r.input_tokens + r.output_tokens)
        masks.append([0] * p + [1] * n)
        lps.append([0.0] * p + r.output_logprobs)
        vers.append([-1] * p + r.output_versions)
    input_ids = pad_and_stack(seqs, 0, torch.int64)
    attention_mask = pad_and_stack([[1] * len(s) for s in seqs], 0, torch.bool)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": pad_and_stack(masks, 0, torch.int32),
        "logprobs": pad_and_stack(lps, 0.0, torch.float32),
        "versions": pad_and_stack(vers, -1, torch.int64),
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "no_eos": torch.tensor([r.stop_reason == "length" for r in resps]),
    }


class RLVRWorkflow(OwnsRewardWorker, RolloutWorkflow):
    """Single-turn RL with a verifiable reward.

    Args:
        reward_fn: picklable ``fn(completion_text: str, answer: str) -> float`` (module-level),
            run in a worker process; a crash or a timeout gives reward 0 and a warning.
        gconfig: sampling parameters; ``n_samples`` completions per prompt.
        tokenizer: HF tokenizer with a chat template.
        reward_timeout: seconds per reward call.
        dump_dir: if set, every episode is appended to ``dump_dir/rollouts.jsonl`` (prompt,
            completions, rewards, per-token versions, timestamps).

    Dataset rows must have ``messages`` (chat list) and ``answer``.
    """

    def __init__(self, reward_fn: Callable[[str, str], float], gconfig: GenerationConfig, tokenizer,
                 reward_timeout: float = 10.0, dump_dir: str | None = None):
        self.reward_fn, self.gconfig, self.tokenizer = reward_fn, gconfig, tokenizer
        self.reward_worker = RewardWorker(timeout=reward_timeout)
        self.dump_path = os.path.join(dump_dir, "rollouts.jsonl") if dump_dir else None
        self._dump_lock = threading.Lock()
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        for key in ("messages", "answer"):
            if key not in data:
                raise KeyError(f"dataset row has no {key!r} field; rows need 'messages' and 'answer'")
        start = time.time()
        prompt_ids = tokenize_chat(self.tokenizer, data["messages"])
        gconfig = replace(self.gconfig, n_samples=1)
        rid = uuid.uuid4().hex  # one rid per prompt: all samples go to the same server
        resps = await asyncio.gather(*[
            engine.agenerate(ModelRequest(input_ids=prompt_ids, gconfig=gconfig, rid=rid))
            for _ in range(self.gconfig.n_samples)
        ])
        texts = [self.tokenizer.decode(r.output_tokens, skip_special_tokens=True) for r in resps]
        rewards = await asyncio.gather(*[self.reward_worker.acompute(self.reward_fn, t, data["answer"]) for t in texts])
        if self.dump_path:
            self._dump(data, texts, rewards, resps, start)
        return build_trajectories(resps, list(rewards))

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> dict[str, float]:
        """Greedy held-out accuracy through ``engine`` (one completion per row, from a fresh event
        loop, e.g. inside a recipe). Returns ``{"accuracy": fraction of rows whose completion
        gets reward > 0.5}`` (reward computed in-process with ``reward_fn``)."""
        greedy = replace(self.gconfig, greedy=True, n_samples=1)
        try:
            resps = await asyncio.gather(*[
                engine.agenerate(ModelRequest(input_ids=tokenize_chat(self.tokenizer, r["messages"]), gconfig=greedy))
                for r in rows
            ])
        finally:
            await engine.aclose()  # e.g. an HTTP session bound to this event loop
        texts = [self.tokenizer.decode(x.output_tokens, skip_special_tokens=True) for x in resps]
        scores = [self.reward_fn(t, r["answer"]) for t, r in zip(texts, rows)]
        return {"accuracy": sum(s > 0.5 for s in scores) / max(1, len(rows))}

    def _dump(self, data, texts, rewards, resps, start) -> None:
        record = {
            "prompt": data["messages"][-1]["content"],
            "answer": data["answer"],
            "completions": texts,
            "rewards": rewards,
            "versions": [sorted(set(r.output_versions)) for r in resps],
            "stop_reasons": [r.stop_reason for r in resps],
            "start_time": start,
            "end_time": time.time(),
        }
        with self._dump_lock, open(self.dump_path, "a") as f:
            f.write(json.dumps(record) + "\n")
