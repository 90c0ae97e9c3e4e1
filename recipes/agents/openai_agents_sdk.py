"""An OpenAI Agents SDK agent with one function tool, trained unchanged through the proxy.

    python recipes/agents/openai_agents_sdk.py --config recipes/configs/proxy_agent.yaml \
        --train_dataset.path multiplication --valid_dataset.path multiplication --gconfig.max_new_tokens 64

The SDK talks Chat Completions to the proxy (``OpenAIChatCompletionsModel`` on an ``AsyncOpenAI``
client); the proxy describes the tool in the system prompt (SmolLM2's chat template ignores
``tools``) and parses ``<tool_call>{...}</tool_call>`` replies into tool calls; the tool's result
comes back as a ``tool`` message, masked out of the loss. Reward: the workflow's ``reward_fn`` on
the last reply (exact product). Like every recipe it gets its config from :func:`arealite.trainer.entry.load_run_config`, so it
runs unchanged under ``python -m arealite.launcher.ray|slurm`` (docs/cluster.md).
"""

import sys

from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from arealite.agent.proxy_workflow import ProxyAgentWorkflow
from arealite.algorithms.grpo import GRPO
from arealite.api.config import ProxyAgentGRPOConfig
from arealite.dataset.multiplication import load_multiplication, multiplication_reward
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl

set_tracing_disabled(True)  # no trace upload: the machine is offline


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly."""
    return a * b


async def sdk_agent(data: dict, base_url: str, api_key: str) -> float | None:
    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key))
    agent = Agent(name="calculator", instructions="Use the multiply tool, then answer with just the number.",
                  tools=[multiply], model=model)
    try:
        await Runner.run(agent, data["question"], max_turns=3)
    except MaxTurnsExceeded:  # still calling tools after 3 turns: no answer
        return 0.0
    return None  # the reward comes from reward_fn on the last reply


def build(config: ProxyAgentGRPOConfig, tokenizer, dump_dir) -> ProxyAgentWorkflow:
    return ProxyAgentWorkflow(sdk_agent, tokenizer, config.gconfig, config=config.proxy, dump_dir=dump_dir,
                              reward_fn=lambda data, text: multiplication_reward(text, data["answer"]))


if __name__ == "__main__":
    run_rl(load_run_config(ProxyAgentGRPOConfig, sys.argv[1:]), GRPO.from_config, build, dataset_loader=load_multiplication)
