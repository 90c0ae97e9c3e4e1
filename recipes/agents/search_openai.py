"""The search agent written with the `openai` package, trained through the proxy: OpenAI function
calling (``tools=[search]``, ``tool_calls``, ``role: tool`` replies) against the same encyclopedia and
BM25 index as recipes/search_agent.py.

    python recipes/agents/search_openai.py --config recipes/configs/proxy_agent.yaml \
        --train_dataset.path search --valid_dataset.path search

The proxy turns the model's Hermes ``<tool_call>`` text into ``message.tool_calls`` and renders the
``tool`` messages with the policy's chat template, so the agent below is what one writes for any
OpenAI-compatible server; reward = exact match of the final answer (``<answer>`` tags or the whole
reply). Like every recipe it gets its config from `arealite.trainer.entry.load_run_config`.
"""

from __future__ import annotations

import functools
import json
import sys

from openai import AsyncOpenAI

from arealite.agent.proxy_workflow import ProxyAgentWorkflow
from arealite.algorithms.grpo import GRPO
from arealite.api.config import ProxyAgentGRPOConfig, SearchTaskConfig
from arealite.env.search import exact_match, extract_answer, load_search_questions, make_encyclopedia, search_tool, \
    shared_index
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl

TASK = SearchTaskConfig()  # the encyclopedia of recipes/search_agent.py's defaults
SYSTEM = ("Answer questions about an encyclopedia you have never seen. Call the search function first, "
          "then give only the answer as <answer>...</answer>.")
MAX_TURNS, MAX_TOKENS = 4, 48


async def search_agent(data: dict, base_url: str, api_key: str) -> float:
    """Up to ``MAX_TURNS`` chat calls; each reply's tool calls run ``search`` and come back as ``tool``
    messages; the first reply without one is the answer."""
    tool = search_tool(shared_index(make_encyclopedia(TASK.seed, TASK.n_people, TASK.n_cities)), TASK.k)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": data["question"]}]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[tool.schema()],
                                                         max_tokens=MAX_TOKENS)
            message = reply.choices[0].message
            if not message.tool_calls:
                text = message.content or ""
                return exact_match(extract_answer(text) or text, data["answer"])
            messages.append({"role": "assistant", "content": message.content or "",
                             "tool_calls": [c.model_dump() for c in message.tool_calls]})
            for call in message.tool_calls:
                query = json.loads(call.function.arguments).get("query", "")
                output = await tool.acall({"query": query}) if call.function.name == "search" else "Error: unknown tool"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 0.0


def build(config: ProxyAgentGRPOConfig, tokenizer, dump_dir) -> ProxyAgentWorkflow:
    return ProxyAgentWorkflow(search_agent, tokenizer, config.gconfig, config=config.proxy, dump_dir=dump_dir)


def main(argv: list[str] | None = None) -> dict:
    config = load_run_config(ProxyAgentGRPOConfig, argv)
    return run_rl(config, GRPO.from_config, build, dataset_loader=functools.partial(load_search_questions, task=TASK))


if __name__ == "__main__":
    main(sys.argv[1:])
