"""An agent written only against the `openai` package, trained unchanged in its own process.

    python recipes/agents/openai_agent.py --config recipes/configs/proxy_agent.yaml   # train (GRPO)
    OPENAI_BASE_URL=... OPENAI_API_KEY=... python recipes/agents/openai_agent.py --agent < row.json

Training runs this same file with ``--agent`` once per episode: the proxy's session URL and key
come in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, the data row as JSON on stdin, and the agent
posts its reward to ``AREALITE_REWARD_URL`` (any language can do this: it is plain HTTP).
Like every recipe it gets its config from :func:`arealite.trainer.entry.load_run_config`, so it
runs unchanged under ``python -m arealite.launcher.ray|slurm`` (docs/cluster.md).
"""

import json
import os
import sys

AGENT = "--agent"


def run_agent() -> None:
    import httpx
    from openai import OpenAI

    from arealite.reward.math import math_reward

    data = json.load(sys.stdin)
    client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    messages = list(data["messages"])
    reward = 0.0
    for turn in range(2):  # answer; if wrong, hear so and retry once
        text = client.chat.completions.create(model="policy", messages=messages, max_tokens=24).choices[0].message.content
        if math_reward(text, data["answer"]) > 0:
            reward = 0.9**turn
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Wrong. Try again."}]
    httpx.post(os.environ["AREALITE_REWARD_URL"], json={"reward": reward}).raise_for_status()


def build(config, tokenizer, dump_dir):
    from arealite.agent.proxy_workflow import ProxyAgentWorkflow

    return ProxyAgentWorkflow([sys.executable, os.path.abspath(__file__), AGENT], tokenizer, config.gconfig,
                              config=config.proxy, dump_dir=dump_dir)


if __name__ == "__main__":
    if AGENT in sys.argv:
        run_agent()
    else:
        from arealite.algorithms.grpo import GRPO
        from arealite.api.config import ProxyAgentGRPOConfig
        from arealite.trainer.entry import load_run_config
        from arealite.trainer.rl_loop import run_rl

        run_rl(load_run_config(ProxyAgentGRPOConfig, sys.argv[1:]), GRPO.from_config, build)
