"""Tool-using math agent: the model may run Python in the sandbox before answering.

Protocol (plain text, works with any chat template): a turn that contains a fenced block

    ```python
    print(48 / 2 + 48)
    ```

is cut right after the closing fence (a stop string: the sampled ids after it are dropped), the
code runs in :mod:`arealite.sandbox`, and its output comes back as a message
``Output:\\n```output\\n...\\n```\\n`` plus :data:`AFTER_OUTPUT` (role ``tool_role``). A turn
without a code block is the final answer, scored by :func:`arealite.reward.math.math_reward`; the
episode also ends after ``max_turns`` model turns (reward 0 if the last turn was still code). Sandbox violations (time,
memory, processes, network, output size) come back to the model as ``[sandbox error] ...``;
they never reach the trainer.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from arealite.api.cli import check_section
from arealite.api.config import GenerationConfig
from arealite.api.env import Environment, StepResult
from arealite.reward.math import math_reward
from arealite.reward.worker import RewardWorker
from arealite.sandbox import SandboxConfig, arun_python, resolve_mode
from arealite.workflow.multi_turn import MultiTurnWorkflow
from arealite.workflow.reward_owner import OwnsRewardWorker

logger = logging.getLogger("arealite.tool_agent")

CODE_BLOCK_RE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)

# A one-shot format example: without it SmolLM2-135M-Instruct wrote a code block for 0/6 GSM8K
# problems; with it for 4/8 (GSM8K) and 7/8 (embedded arithmetic), sampled at temperature 0.7.
TOOL_INSTRUCTION = ("\nUse Python to compute it. Reply with only a Python code block that prints the result, "
                    "like this:\n```python\nprint(3 * 4 + 5)\n```")
AFTER_OUTPUT = "If this is the result, reply with just the final number; otherwise fix the code."


def extract_code(text: str) -> str | None:
    """The first fenced ```python block of ``text`` (its body), or None."""
    m = CODE_BLOCK_RE.search(text)
    return m.group(1) if m else None


def truncate_after_code(tokenizer, ids: list[int]) -> int:
    """Number of leading ``ids`` whose decoded text first contains a complete ```python block
    (``len(ids)`` when there is none): the stop string of a code turn."""
    if extract_code(tokenizer.decode(ids, skip_special_tokens=True)) is None:
        return len(ids)
    lo, hi = 1, len(ids)  # the property "prefix contains a block" is monotone in the length
    while lo < hi:
        mid = (lo + hi) // 2
        if extract_code(tokenizer.decode(ids[:mid], skip_special_tokens=True)) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


class PythonToolMathEnv(Environment):
    """Math with a sandboxed Python tool (see the module docstring).

    Args:
        reward_worker: runs ``math_reward`` with a timeout.
        sandbox: limits of each code run.
        tool_role: role of the tool-output message ("user" suits templates without a tool role,
            e.g. SmolLM2's; "tool" for templates that have one).
        instruction: how to call the tool; appended to the row's ``question`` (or, without one,
            to its last message, which replaces the dataset's answer-format instruction).

    ``info`` counts ``tool_calls`` and ``tool_errors`` per episode.
    """

    def __init__(self, reward_worker: RewardWorker, sandbox: SandboxConfig | None = None, tool_role: str = "user",
                 instruction: str = TOOL_INSTRUCTION):
        self.reward_worker, self.sandbox, self.tool_role = reward_worker, sandbox or SandboxConfig(), tool_role
        self.instruction = instruction

    async def areset(self, data: dict[str, Any]) -> list[dict[str, str]]:
        for key in ("messages", "answer"):
            if key not in data:
                raise KeyError(f"dataset row has no {key!r} field; rows need 'messages' and 'answer'")
        self.answer = data["answer"]
        messages = [dict(m) for m in data["messages"]]
        if "question" in data:  # rows of arealite.dataset.math_data: the bare problem text
            messages[-1]["content"] = data["question"] + self.instruction
        else:
            messages[-1]["content"] += self.instruction
        return messages

    async def astep(self, completion: str) -> StepResult:
        code = extract_code(completion)
        if code is None:
            reward = await self.reward_worker.acompute(math_reward, completion, self.answer)
            return StepResult(reward=reward, done=True, info={"tool_calls": 0})
        result = await arun_python(code, self.sandbox)
        content = f"Output:\n```output\n{result.observation()}\n```\n{AFTER_OUTPUT}"
        return StepResult(messages=[{"role": self.tool_role, "content": content}],
                          info={"tool_calls": 1, "tool_errors": int(not result.ok)})


class ToolAgentMathWorkflow(OwnsRewardWorker, MultiTurnWorkflow):
    """:class:`MultiTurnWorkflow` on :class:`PythonToolMathEnv`, code turns cut after the block.

    ``max_turns`` counts every model turn (code turns and the answer); ``turn_discount`` defaults
    to 1 (tool calls are not penalised). Owns ``reward_worker`` (:meth:`close` kills it).
    """

    def __init__(self, gconfig: GenerationConfig, tokenizer, max_turns: int = 3, turn_discount: float = 1.0,
                 max_context_tokens: int = 1024, sandbox: SandboxConfig | None = None, tool_role: str = "user",
                 reward_timeout: float = 10.0, dump_dir: str | None = None):
        sandbox = sandbox or SandboxConfig()
        check_section(sandbox, "sandbox.")  # a bad sandbox.* field fails here, before any rollout
        self.sandbox_mode = resolve_mode(sandbox)  # "namespace" | "rlimit"; raises if unavailable
        logger.info("tool agent: sandbox mode %s", self.sandbox_mode)
        super().__init__(lambda data: PythonToolMathEnv(self.reward_worker, sandbox, tool_role), gconfig, tokenizer,
                         max_turns, turn_discount, max_context_tokens, truncate_fn=truncate_after_code,
                         dump_dir=dump_dir)
        self.reward_worker = RewardWorker(timeout=reward_timeout)
        self.reward_fn = math_reward  # what the worker runs (OwnsRewardWorker.start imports it early)
