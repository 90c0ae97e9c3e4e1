"""Asynchronous GRPO on math with a sandboxed Python tool (GSM8K-style problems).

    torchrun --nproc_per_node=1 recipes/tool_agent_math.py          # embedded defaults (CPU is fine)
    python recipes/tool_agent_math.py --config recipes/configs/tool_agent_math.yaml \
        --train_dataset.path openai/gsm8k --gconfig.max_new_tokens 192

The model may write a ```python block; it runs in :mod:`arealite.sandbox` (limits in ``sandbox.*``)
and its output comes back as a message; a turn without code is the final answer, scored by the
math reward (:mod:`arealite.workflow.tool_agent`). The loop is
:func:`arealite.trainer.rl_loop.run_rl`; ``rollouts/rollouts.jsonl`` has ``info.tool_calls``.
The config comes from :func:`arealite.trainer.entry.load_run_config`, so the recipe runs
unchanged under ``python -m arealite.launcher.ray|slurm`` (docs/cluster.md).
"""

from __future__ import annotations

import sys

from arealite.algorithms.grpo import GRPO
from arealite.api.config import ToolAgentGRPOConfig
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl
from arealite.workflow.tool_agent import ToolAgentMathWorkflow


def build_tool_agent(config: ToolAgentGRPOConfig, tokenizer, dump_dir: str | None) -> ToolAgentMathWorkflow:
    a = config.agent
    return ToolAgentMathWorkflow(config.gconfig, tokenizer, a.max_turns, a.turn_discount, a.max_context_tokens,
                                 sandbox=config.sandbox, tool_role=config.tool_role, dump_dir=dump_dir)


def main(argv: list[str] | None = None) -> dict:
    return run_rl(load_run_config(ToolAgentGRPOConfig, argv), GRPO.from_config, build_tool_agent)


if __name__ == "__main__":
    main(sys.argv[1:])
