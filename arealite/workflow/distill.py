"""On-policy distillation rollouts: the student samples, a frozen teacher scores its tokens.

One episode = one prompt → ``gconfig.n_samples`` student completions; as each finishes, the
teacher (any :class:`~arealite.api.engine.InferenceEngine` with
:meth:`~arealite.api.engine.InferenceEngine.aprompt_logprobs`: our server or SGLang, its own
servers) returns log π_teacher of every generated token, under the same temperature, and a
verifier scores the completion for the logs → a group in GRPO's layout plus
``teacher_logprobs`` [N, T] (token-aligned: index t is token t; 0 on prompt and padding), which
:class:`arealite.algorithms.distill.OnPolicyDistillation` turns into per-token advantages.

A teacher call that fails (server down, timeout, a reply without the logprobs) drops the group,
counted as ``reward/teacher/failed``; ``max_consecutive_failures`` groups in a row raise.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Callable

import torch

from arealite.api.config import GenerationConfig
from arealite.api.engine import InferenceEngine
from arealite.api.io_struct import ModelRequest
from arealite.api.workflow import RolloutWorkflow
from arealite.reward.sources import FunctionReward, Sample
from arealite.utils.data import pad_and_stack
from arealite.utils.hf import tokenize_chat
from arealite.workflow.rlvr import build_trajectories, greedy_accuracy

logger = logging.getLogger("arealite.distill")


def check_same_tokenizer(student_tokenizer, teacher_tokenizer, teacher_path: str = "teacher.path") -> None:
    """Raises ValueError naming ``teacher_path`` unless both tokenizers map every token string to
    the same id and share EOS: the teacher scores the student's token ids as they are."""
    sv, tv = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if sv != tv:
        diff = len(set(sv.items()) ^ set(tv.items()))
        raise ValueError(f"{teacher_path}: the teacher's tokenizer differs from the student's ({len(tv)} vs "
                         f"{len(sv)} tokens, {diff} (token, id) pairs not shared); on-policy distillation "
                         "scores the student's token ids, so both need the same tokenizer")
    if student_tokenizer.eos_token_id != teacher_tokenizer.eos_token_id:
        raise ValueError(f"{teacher_path}: EOS differs (student {student_tokenizer.eos_token_id}, teacher "
                         f"{teacher_tokenizer.eos_token_id})")


class DistillWorkflow(RolloutWorkflow):
    """Student samples + teacher logprobs (module doc).

    Args:
        teacher: the frozen teacher's engine (never sent the student's weights).
        gconfig: the student's sampling; the teacher scores at ``gconfig.temperature``.
        tokenizer: the student's tokenizer (the teacher's must equal it: :func:`check_same_tokenizer`).
        reward_fn: ``fn(completion, answer) -> float`` logged as ``rollout/reward`` and used for
            the held-out accuracy (not trained on); rows then need ``answer``.
        owns_teacher: :meth:`close` destroys ``teacher``.
    """

    def __init__(self, teacher: InferenceEngine, gconfig: GenerationConfig, tokenizer,
                 reward_fn: Callable[[str, str], float], reward_timeout: float = 10.0,
                 owns_teacher: bool = False, max_consecutive_failures: int = 32):
        self.teacher, self.gconfig, self.tokenizer = teacher, gconfig, tokenizer
        self.reward_fn, self.owns_teacher = reward_fn, owns_teacher
        self.verifier = FunctionReward(reward_fn, reward_timeout)
        self.max_failures, self.failed_in_a_row = max_consecutive_failures, 0
        self._lock = threading.Lock()
        self._counts = {"calls": 0.0, "ok": 0.0, "failed": 0.0, "seconds": 0.0, "tokens": 0.0}

    def start(self) -> None:
        self.verifier.start()

    def close(self) -> None:
        self.verifier.close()
        if self.owns_teacher:
            self.teacher.destroy()

    async def aclose(self) -> None:
        await self.teacher.aclose()

    def reward_counters(self) -> dict[str, float]:
        with self._lock:
            out = {f"reward/teacher/{k}": v for k, v in self._counts.items()}
        out.update({f"reward/{k}": v for k, v in self.verifier.counters().items()})
        return out

    def _count(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counts[k] += v

    async def _teacher_logprobs(self, prompt_ids: list[int], output: list[int], rid: str) -> list[float] | None:
        start = time.perf_counter()
        try:
            lps = await self.teacher.aprompt_logprobs(prompt_ids + output, start=len(prompt_ids),
                                                      temperature=self.gconfig.temperature or 1.0, rid=rid)
        except (RuntimeError, OSError, asyncio.TimeoutError, ValueError) as e:
            self._count(calls=1, failed=1, seconds=time.perf_counter() - start)
            logger.warning("teacher scoring failed: %r", e)
            return None
        self._count(calls=1, ok=1, seconds=time.perf_counter() - start, tokens=len(output))
        return lps

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        for key in ("messages", "answer"):
            if key not in data:
                raise KeyError(f"dataset row has no {key!r} field; rows need 'messages' and 'answer'")
        prompt_ids = tokenize_chat(self.tokenizer, data["messages"])
        gconfig = replace(self.gconfig, n_samples=1)
        rid = uuid.uuid4().hex

        async def one():
            resp = await engine.agenerate(ModelRequest(input_ids=prompt_ids, gconfig=gconfig, rid=rid))
            text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            sample = Sample(data["messages"], text, prompt_ids, resp.output_tokens, data, resp.stop_reason != "length")
            teacher, reward = await asyncio.gather(
                self._teacher_logprobs(prompt_ids, resp.output_tokens, rid) if resp.output_len else _empty(),
                self.verifier.ascore(sample))
            return resp, teacher, reward

        results = await asyncio.gather(*[one() for _ in range(self.gconfig.n_samples)])
        if any(t is None for _, t, _ in results):
            self.failed_in_a_row += 1
            if self.failed_in_a_row > self.max_failures:
                raise RuntimeError(f"{self.failed_in_a_row} groups in a row lost a teacher call; check the teacher "
                                   "servers (teacher.* settings and their logs)")
            return None
        self.failed_in_a_row = 0
        resps = [r for r, _, _ in results]
        traj = build_trajectories(resps, [float(w) for _, _, w in results])
        P = len(prompt_ids)
        traj["teacher_logprobs"] = pad_and_stack([[0.0] * P + list(t) for _, t, _ in results], 0.0, torch.float32)
        return traj

    async def aevaluate(self, engine: InferenceEngine, rows: list[dict[str, Any]]) -> dict[str, float]:
        """Greedy held-out accuracy by ``reward_fn`` (as :meth:`RLVRWorkflow.aevaluate`)."""
        return await greedy_accuracy(engine, rows, self.tokenizer, self.gconfig, self.reward_fn)


async def _empty() -> list[float]:
    return []
