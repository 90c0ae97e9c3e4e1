"""RLVR and RL against learned rewards: single-turn generation scored by any reward source.

One episode = one prompt → chat template → ``gconfig.n_samples`` concurrent completions, each
scored as it finishes (a verifier in a worker process with a timeout, a reward-model server, an
LLM judge, or a weighted combination: :mod:`arealite.reward.sources`) → a GRPO group of trajectories.
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
from arealite.reward.sources import FunctionReward, RewardFailure, RewardSource, Sample
from arealite.utils.data import pad_and_stack
from arealite.utils.hf import tokenize_chat


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


async def greedy_accuracy(engine: InferenceEngine, rows: list[dict[str, Any]], tokenizer, gconfig: GenerationConfig,
                          score_fn: Callable[[str, str], float]) -> dict[str, float]:
    """``{"accuracy": fraction of rows whose greedy completion gets score_fn(text, answer) > 0.5}``
    through ``engine`` (one completion per row, ``gconfig`` with greedy decoding); closes the
    engine's resources of the running event loop at the end (a fresh loop, e.g. an evaluation)."""
    greedy = replace(gconfig, greedy=True, n_samples=1)
    try:
        resps = await asyncio.gather(*[
            engine.agenerate(ModelRequest(input_ids=tokenize_chat(tokenizer, r["messages"]), gconfig=greedy))
            for r in rows
        ])
    finally:
        await engine.aclose()  # e.g. an HTTP session bound to this event loop
    texts = [tokenizer.decode(x.output_tokens, skip_special_tokens=True) for x in resps]
    scores = [score_fn(t, r["answer"]) for t, r in zip(texts, rows)]
    return {"accuracy": sum(s > 0.5 for s in scores) / max(1, len(rows))}


class RLVRWorkflow(RolloutWorkflow):
    """Single-turn RL against a reward: a verifier, a reward model, an LLM judge or a combination.

    Args:
        reward_fn: a picklable module-level ``fn(completion_text: str, answer: str) -> float``
            (run in a worker process: a crash or a timeout gives reward 0 and a warning), or any
            :class:`~arealite.reward.sources.RewardSource` (:class:`RemoteRewardModel`,
            :class:`LLMJudge`, :class:`CombinedReward`, ...).
        gconfig: sampling parameters; ``n_samples`` completions per prompt.
        tokenizer: HF tokenizer with a chat template.
        reward_timeout: seconds per call of a function reward.
        dump_dir: if set, every episode is appended to ``dump_dir/rollouts.jsonl`` (prompt,
            completions, rewards and their components, per-token versions, timestamps).
        eval_fn: ``fn(completion, answer) -> float`` of the held-out accuracy (:meth:`aevaluate`);
            default ``reward_fn`` when it is a function. A learned reward is never the yardstick:
            with one, pass the verifier here.
        max_consecutive_failures: after this many groups in a row dropped for a failed score, the
            episode raises RuntimeError (the executor then stops the run after repeated failures)
            instead of sampling forever against a reward source that is down or never parses.

    Each sample is scored as soon as its generation finishes. If a source cannot score a sample
    (:class:`~arealite.reward.sources.RewardFailure`, counted by the source), the episode is
    rejected — the group never trains on a guessed reward. With a :class:`CombinedReward`, each
    component's per-sample value is also returned as ``reward_<name>`` [N] (logged per step as
    ``rollout/reward_<name>``). Dataset rows must have ``messages`` (and ``answer`` for
    verifiers and reference-based judges).
    """

    def __init__(self, reward_fn: "Callable[[str, str], float] | RewardSource", gconfig: GenerationConfig,
                 tokenizer, reward_timeout: float = 10.0, dump_dir: str | None = None,
                 eval_fn: Callable[[str, str], float] | None = None, max_consecutive_failures: int = 32):
        self.gconfig, self.tokenizer = gconfig, tokenizer
        self.max_failures, self.failed_in_a_row = max_consecutive_failures, 0
        self.reward = reward_fn if isinstance(reward_fn, RewardSource) else FunctionReward(reward_fn, reward_timeout)
        self.eval_fn = eval_fn if eval_fn is not None else (None if isinstance(reward_fn, RewardSource) else reward_fn)
        parts = self.reward.components()
        self.part_names = parts if len(parts) > 1 else ()  # logged as rollout/reward_<name>
        self.stat_keys = type(self).stat_keys + tuple(f"reward_{n}" for n in self.part_names)
        self.dump_path = os.path.join(dump_dir, "rollouts.jsonl") if dump_dir else None
        self._dump_lock = threading.Lock()
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)

    def start(self) -> None:
        self.reward.start()

    def reward_counters(self) -> dict[str, float]:
        return {f"reward/{k}": v for k, v in self.reward.counters().items()}

    def close(self) -> None:
        self.reward.close()

    async def aclose(self) -> None:
        await self.reward.aclose()

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        if "messages" not in data:
            raise KeyError("dataset row has no 'messages' field; rows need 'messages' (and 'answer' for a verifier)")
        if isinstance(self.reward, FunctionReward) and "answer" not in data:
            raise KeyError("dataset row has no 'answer' field; rows need 'messages' and 'answer'")
        start = time.time()
        prompt_ids = tokenize_chat(self.tokenizer, data["messages"])
        gconfig = replace(self.gconfig, n_samples=1)
        rid = uuid.uuid4().hex  # one rid per prompt: all samples go to the same server

        async def one():  # generate, then score at once: scoring overlaps the other samples' decoding
            resp = await engine.agenerate(ModelRequest(input_ids=prompt_ids, gconfig=gconfig, rid=rid))
            text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            sample = Sample(data["messages"], text, prompt_ids, resp.output_tokens, data, resp.stop_reason != "length")
            try:
                return resp, text, await self.reward.ascore_parts(sample)
            except RewardFailure:
                return resp, text, None

        results = await asyncio.gather(*[one() for _ in range(self.gconfig.n_samples)])
        if any(parts is None for _, _, parts in results):
            self.failed_in_a_row += 1  # a sample has no score: drop the whole group (counted by the source)
            if self.failed_in_a_row > self.max_failures:
                failed = {k: v for k, v in self.reward.counters().items() if "/failed_" in k and v}
                raise RuntimeError(f"{self.failed_in_a_row} groups in a row had a sample the reward could not "
                                   f"score ({failed}); check the reward servers' logs (reward.* settings)")
            return None
        self.failed_in_a_row = 0
        resps = [r for r, _, _ in results]
        rewards = [p[0] for _, _, p in results]
        if self.dump_path:
            self._dump(data, [t for _, t, _ in results], rewards, resps, start, [p[1] for _, _, p in results])
        traj = build_trajectories(resps, rewards)
        for name in self.part_names:
            traj[f"reward_{name}"] = torch.tensor([p[1][name] for _, _, p in results], dtype=torch.float32)
        return traj

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> dict[str, float]:
        """Greedy held-out accuracy through ``engine`` (one completion per row, from a fresh event
        loop, e.g. inside a recipe). Returns ``{"accuracy": fraction of rows whose completion
        gets ``eval_fn`` > 0.5}`` (computed in-process).

        Raises: ValueError: no ``eval_fn`` (a learned reward and no verifier given)."""
        if self.eval_fn is None:
            raise ValueError("RLVRWorkflow: a learned reward needs eval_fn= (the verifier of the held-out "
                             "accuracy), or turn the evaluations off (--evaluator.at_start False ...)")
        return await greedy_accuracy(engine, rows, self.tokenizer, self.gconfig, self.eval_fn)

    def _dump(self, data, texts, rewards, resps, start, parts=None) -> None:
        record = {
            "prompt": data["messages"][-1]["content"],
            "answer": data.get("answer"),
            "completions": texts,
            "rewards": rewards,
            "versions": [sorted(set(r.output_versions)) for r in resps],
            "stop_reasons": [r.stop_reason for r in resps],
            "start_time": start,
            "end_time": time.time(),
        }
        if parts is not None and len(parts[0]) > 1:
            record["reward_parts"] = parts
        with self._dump_lock, open(self.dump_path, "a") as f:
            f.write(json.dumps(record) + "\n")
