"""Code RL: the model writes a program, unit tests in the sandbox decide the reward; with more than
one turn, a code agent that fixes its own failures.

One episode (:class:`CodeEnv` under :class:`~arealite.workflow.multi_turn.MultiTurnWorkflow`,
token-in token-out as every multi-turn episode):

1. the model answers the row's prompt (a task statement, or a HumanEval signature + docstring);
2. its program (:func:`arealite.reward.code.extract_code`) runs against the problem's first
   ``visible_tests`` tests in the sandbox;
3. if one fails and turns are left, the failing test and its error come back as a user message
   (:data:`FEEDBACK`) and the model answers again;
4. otherwise — every visible test passed, or this was the last turn — the program runs against
   *all* the problem's tests (the hidden ones included), and that decides the episode's reward:
   1.0 when every test passes (or the fraction passed, ``fraction=True``), times
   ``turn_discount ** (turns - 1)``.

With ``max_turns = 1`` this is plain single-turn code RL: the hidden tests score the one answer.

Programs run in :mod:`arealite.sandbox` through :func:`arealite.reward.code.ascore_code` (one
sandbox process per program, bounded in time, memory, processes, file size and output; no network),
at most ``max_parallel`` at a time per event loop. The sandbox *is* the worker pool here: the
program never runs in the rollout process, so the process-pool hop of
:class:`~arealite.reward.worker.RewardWorker` would add nothing but a copy.

Counters (:meth:`CodeWorkflow.reward_counters`, logged every step as ``reward/<name>``, summed over
ranks, cumulative): ``code_programs`` (programs run, visible and hidden runs both), the final
outcome of each episode ``code_<outcome>`` for every outcome of
:data:`arealite.reward.code.OUTCOMES`, and ``code_score_s`` (sandbox wall seconds, summed over
programs; divided by the step time it is the share of rollout time spent scoring). Each episode's
``info`` (in ``rollouts/rollouts.jsonl`` with every turn's text, which is what the extractor saw)
has ``runs`` and ``outcome_<name>`` of its final program.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import threading
import time
from dataclasses import replace
from typing import Any

from arealite.api.cli import check_section
from arealite.api.config import CodeTaskConfig, GenerationConfig, SandboxConfig
from arealite.api.env import Environment, StepResult
from arealite.reward.code import OUTCOMES, CodeResult, ascore_code, test_source, visible_problem
from arealite.sandbox import resolve_mode
from arealite.workflow.multi_turn import MultiTurnWorkflow, summarize_episodes

FEEDBACK = ("Your function failed this test:\n```python\n{test}\n```\nError: {detail}\n"
            "Fix the function. Reply with only the corrected function in a ```python code block.")
FEEDBACK_NO_TEST = ("Your program failed before the tests ran.\nError: {detail}\n"
                    "Fix the function. Reply with only the corrected function in a ```python code block.")


class _Scorer:
    """``ascore_code`` with at most ``max_parallel`` programs in flight per event loop (the rollout
    loop and the background evaluator each run their own) and thread-safe counters."""

    def __init__(self, sandbox: SandboxConfig, fraction: bool, max_parallel: int):
        self.sandbox, self.fraction, self.max_parallel = sandbox, fraction, max_parallel
        self._sems: dict[int, asyncio.Semaphore] = {}
        self._lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter({f"code_{o}": 0 for o in OUTCOMES})
        self.counts.update({"code_programs": 0})
        self.score_s = 0.0

    async def score(self, completion: str, problem: dict, fraction: bool | None = None) -> CodeResult:
        loop = id(asyncio.get_running_loop())
        with self._lock:
            sem = self._sems.setdefault(loop, asyncio.Semaphore(self.max_parallel))
        async with sem:
            t0 = time.monotonic()
            res = await ascore_code(completion, problem, self.fraction if fraction is None else fraction, self.sandbox)
            with self._lock:
                self.score_s += time.monotonic() - t0
                self.counts["code_programs"] += 1
        return res

    def final(self, outcome: str) -> None:
        with self._lock:
            self.counts[f"code_{outcome}"] += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {**{f"reward/{k}": float(v) for k, v in self.counts.items()}, "reward/code_score_s": self.score_s}


class CodeEnv(Environment):
    """One code episode (module docstring).

    Args:
        scorer: shared by the episodes of a workflow (bounded parallelism, counters).
        visible_tests: how many of the problem's tests the feedback may reveal (the first k).
        max_turns: the workflow's turn limit (the last turn is scored on the hidden tests even
            when a visible test fails).
    """

    def __init__(self, scorer: _Scorer, visible_tests: int, max_turns: int):
        self.scorer, self.visible_tests, self.max_turns = scorer, visible_tests, max_turns
        self.turn = 0

    async def areset(self, data: dict[str, Any]) -> list[dict[str, str]]:
        for key in ("messages", "answer"):
            if key not in data:
                raise KeyError(f"dataset row has no {key!r} field; code rows need 'messages' and 'answer' "
                               "(the problem's JSON, arealite.reward.code.problem_answer)")
        self.problem = json.loads(data["answer"]) if isinstance(data["answer"], str) else dict(data["answer"])
        self.visible = visible_problem(self.problem, self.visible_tests)  # a malformed problem fails here
        return [dict(m) for m in data["messages"]]

    async def astep(self, completion: str) -> StepResult:
        self.turn += 1
        last = self.turn >= self.max_turns
        if not last:
            seen = await self.scorer.score(completion, self.visible, fraction=False)
            if seen.outcome != "pass":
                detail = seen.detail or seen.outcome
                text = (FEEDBACK.format(test=test_source(self.visible, seen.failed), detail=detail) if seen.failed >= 0
                        else FEEDBACK_NO_TEST.format(detail=detail))
                return StepResult(messages=[{"role": "user", "content": text}], reward=0.0,
                                  info={"runs": 1, "visible_fail": 1})
        hidden = await self.scorer.score(completion, self.problem)
        self.scorer.final(hidden.outcome)
        return StepResult(reward=hidden.reward, done=True,
                          info={"runs": 1 + int(not last), f"outcome_{hidden.outcome}": 1})


class CodeWorkflow(MultiTurnWorkflow):
    """GRPO groups of :class:`CodeEnv` episodes (``gconfig.n_samples`` per row).

    Args:
        gconfig: sampling parameters of every turn.
        tokenizer: HF tokenizer with an append-only chat template.
        max_turns: 1 = single-turn code RL; more = the feedback agent.
        turn_discount: reward factor per extra turn, in (0, 1].
        max_context_tokens: the episode stops before a turn that would exceed this [tokens].
        code: ``visible_tests``, ``fraction``, ``max_parallel`` (:class:`~arealite.api.config.CodeTaskConfig`).
        sandbox: limits of one program run (all its tests in one call).
        dump_dir: if set, each group goes to ``dump_dir/rollouts.jsonl``.

    Raises:
        ValueError (``ConfigError``): a bad ``code.*``, ``sandbox.*`` or ``agent.*`` field (named),
            before any rollout; RuntimeError: ``sandbox.mode='namespace'`` where it is unavailable.
    """

    def __init__(self, gconfig: GenerationConfig, tokenizer, max_turns: int = 1, turn_discount: float = 1.0,
                 max_context_tokens: int = 1024, code: CodeTaskConfig | None = None,
                 sandbox: SandboxConfig | None = None, dump_dir: str | None = None):
        code = code or CodeTaskConfig()
        sandbox = sandbox or SandboxConfig(max_output_bytes=1 << 16)
        check_section(code, "code.")
        check_section(sandbox, "sandbox.")
        self.sandbox_mode = resolve_mode(sandbox)
        self.code, self.sandbox = code, sandbox
        self.scorer = _Scorer(sandbox, code.fraction, code.max_parallel)
        super().__init__(lambda data: CodeEnv(self.scorer, code.visible_tests, max_turns), gconfig, tokenizer,
                         max_turns, turn_discount, max_context_tokens, dump_dir=dump_dir)

    def reward_counters(self) -> dict[str, float]:
        """``reward/code_*`` of the training episodes (module docstring); evaluations keep their own."""
        return self.scorer.snapshot()

    async def aevaluate(self, engine, rows: list[dict[str, Any]]) -> dict[str, float]:
        """One greedy episode per row with its own counters (the training counters stay
        training's). Returns ``{"reward", "solved", "turns"}`` (as every multi-turn workflow) and
        ``pass``: the fraction of rows whose final program passed every test."""
        scorer = _Scorer(self.sandbox, self.code.fraction, self.code.max_parallel)
        greedy = copy.copy(self)
        greedy.gconfig = replace(self.gconfig, greedy=True, n_samples=1)
        greedy.env_factory = lambda data: CodeEnv(scorer, self.code.visible_tests, self.max_turns)
        res = await summarize_episodes(greedy.run_one, engine, rows)
        return {**res, "pass": scorer.counts["code_pass"] / max(1, len(rows))}
