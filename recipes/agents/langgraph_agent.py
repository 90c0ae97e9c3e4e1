"""A LangGraph agent on LangChain's `ChatOpenAI` (langchain-openai), trained unchanged through the proxy.

    python recipes/agents/langgraph_agent.py --config recipes/configs/proxy_agent.yaml

The graph answers, checks the answer, and on a wrong one adds feedback and answers again (at
most two answers). ``ChatOpenAI`` is pointed at the session's ``base_url`` / ``api_key``; the
graph's messages go back to the proxy unchanged, so each episode is one token-exact trajectory.
Like every recipe it gets its config from :func:`arealite.trainer.entry.load_run_config`, so it
runs unchanged under ``python -m arealite.launcher.ray|slurm`` (docs/cluster.md).
"""

import sys

from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph

from arealite.agent.proxy_workflow import ProxyAgentWorkflow
from arealite.algorithms.grpo import GRPO
from arealite.api.config import ProxyAgentGRPOConfig
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl
from arealite.reward.math import math_reward


def make_graph(llm: ChatOpenAI, answer: str):
    async def respond(state: MessagesState):
        return {"messages": [await llm.ainvoke(state["messages"])]}

    def check(state: MessagesState):
        wrong = math_reward(state["messages"][-1].content, answer) == 0
        return "retry" if wrong and len(state["messages"]) < 3 else END

    graph = StateGraph(MessagesState)
    graph.add_node("respond", respond)
    graph.add_node("retry", lambda state: {"messages": [HumanMessage("Wrong. Try again.")]})
    graph.add_edge(START, "respond")
    graph.add_conditional_edges("respond", check, ["retry", END])
    graph.add_edge("retry", "respond")
    return graph.compile()


async def langgraph_agent(data: dict, base_url: str, api_key: str) -> float:
    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_tokens=24, max_retries=0)
    state = await make_graph(llm, data["answer"]).ainvoke({"messages": list(data["messages"])})
    answers = [m for m in state["messages"] if m.type == "ai"]
    return 0.9 ** (len(answers) - 1) * math_reward(answers[-1].content, data["answer"])


def build(config: ProxyAgentGRPOConfig, tokenizer, dump_dir) -> ProxyAgentWorkflow:
    return ProxyAgentWorkflow(langgraph_agent, tokenizer, config.gconfig, config=config.proxy, dump_dir=dump_dir)


if __name__ == "__main__":
    run_rl(load_run_config(ProxyAgentGRPOConfig, sys.argv[1:]), GRPO.from_config, build)
