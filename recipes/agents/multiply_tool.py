"""GRPO on 3–4 digit multiplication with a Python tool, the agent written with the `openai` package
and trained through the proxy (a task the model cannot do without the tool).

    python recipes/agents/multiply_tool.py --config recipes/configs/multiply_tool.yaml
    python recipes/agents/multiply_tool.py --config recipes/configs/multiply_tool.yaml --eval-only [--no-tool]

Program of thought (Chen et al. 2022, arXiv 2211.12588): the system prompt describes the tool; a
reply with a ```python block is run in `arealite.sandbox` and what it prints is the answer; a
reply without code is its own answer. Reward 1 if the answer's last integer is the exact product
(`multiplication_reward`). `--eval-only` prints the greedy held-out success of `actor.path`
(`--no-tool`: the bare question, no tool). Like every recipe it gets its config from
`arealite.trainer.entry.load_run_config`, so it runs unchanged under
`python -m arealite.launcher.ray|slurm` (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import sys

from openai import AsyncOpenAI

from arealite.agent.proxy_workflow import ProxyAgentWorkflow
from arealite.algorithms.grpo import GRPO
from arealite.api.config import ProxyAgentGRPOConfig
from arealite.dataset.multiplication import load_multiplication, multiplication_reward
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl
from arealite.sandbox import SandboxConfig, arun_python
from arealite.workflow.tool_agent import extract_code

SYSTEM = ("You have a Python tool: a ```python code block in your reply is run, and what it prints is your "
          "answer.")
INSTRUCTION = "\nUse Python: reply with only a Python code block that prints the answer."
MAX_TOKENS = 48
SANDBOX = SandboxConfig(timeout=5.0, cpu_time=5, memory_mb=512)


async def tool_agent(data: dict, base_url: str, api_key: str, system: bool = True) -> float:
    """Program-of-thought: a reply with a code block is answered by what the code prints."""
    messages = [{"role": "user", "content": data["question"] + INSTRUCTION}]
    if system:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
    text = reply.choices[0].message.content
    code = extract_code(text)
    if code is None:
        return multiplication_reward(text, data["answer"])
    result = await arun_python(code, SANDBOX)
    return multiplication_reward(result.output if result.ok else "", data["answer"])


async def tool_agent_no_system(data: dict, base_url: str, api_key: str) -> float:
    return await tool_agent(data, base_url, api_key, system=False)


async def no_tool_agent(data: dict, base_url: str, api_key: str) -> float:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(model="policy", messages=data["messages"], max_tokens=MAX_TOKENS)
    return multiplication_reward(reply.choices[0].message.content, data["answer"])


def build(config: ProxyAgentGRPOConfig, tokenizer, dump_dir, agent=tool_agent) -> ProxyAgentWorkflow:
    return ProxyAgentWorkflow(agent, tokenizer, config.gconfig, config=config.proxy, dump_dir=dump_dir)


def evaluate(config: ProxyAgentGRPOConfig, tool: bool = True) -> dict:
    """Greedy held-out success of ``config.actor.path`` on ``valid_dataset`` (one local server)."""
    from arealite.inference.remote import RemoteInferenceEngine
    from arealite.launcher.local import launch_servers
    from arealite.utils.hf import load_tokenizer, resolve_model_path

    path = resolve_model_path(config.actor.path)
    rows = load_multiplication(config.valid_dataset.path, "test", config.valid_dataset.size, config.seed)
    engine = RemoteInferenceEngine(config.rollout, launch_servers(config.rollout, path, config.output_dir + "/eval_logs"))
    engine.initialize()
    try:
        workflow = build(config, load_tokenizer(path), None, tool_agent if tool else no_tool_agent)
        return asyncio.run(workflow.aevaluate(engine, rows))
    finally:
        engine.destroy()


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {f for f in ("--eval-only", "--no-tool") if f in argv}
    config = load_run_config(ProxyAgentGRPOConfig, [a for a in argv if a not in flags])
    if "--eval-only" in flags:
        result = evaluate(config, tool="--no-tool" not in flags)
        print(f"held-out greedy ({'no tool' if '--no-tool' in flags else 'tool'}): {result}", flush=True)
        return result
    return run_rl(config, GRPO.from_config, build, dataset_loader=load_multiplication)


if __name__ == "__main__":
    main()
