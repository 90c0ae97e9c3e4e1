"""Asynchronous GRPO for a search agent: BM25 search over a generated encyclopedia, then an answer.

    torchrun --nproc_per_node=1 recipes/search_agent.py --config recipes/configs/search_agent.yaml

Each question is about a fictional person (the model cannot know the answer): the agent writes
``<search>query</search>``, gets the top passages in ``<information>``, may search again (two-hop
"country" questions need the city's passage too) and ends with ``<answer>...</answer>``; reward = exact
match (:mod:`arealite.env.search`). One BM25 index per process, shared by every episode and cached on
disk. The loop is :func:`arealite.trainer.rl_loop.run_rl`; ``rollout/tool_calls``, ``rollout/correct``
and the ``rollout/ended_*`` reasons are logged per step, ``rollouts/rollouts.jsonl`` has every episode.
"""

from __future__ import annotations

import functools
import sys

from arealite.algorithms.grpo import GRPO
from arealite.api.config import SearchAgentConfig
from arealite.env.search import SearchEnv, load_search_questions, make_encyclopedia, search_stops, shared_index
from arealite.env.tools import stop_at
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl
from arealite.workflow.multi_turn import END_REASONS, MultiTurnWorkflow

INFO_KEYS = ("tool_calls", "tool_errors", "answered", "correct", *(f"ended_{r}" for r in END_REASONS))


def build_search_agent(config: SearchAgentConfig, tokenizer, dump_dir: str | None) -> MultiTurnWorkflow:
    s, a = config.search, config.agent
    index = shared_index(make_encyclopedia(s.seed, s.n_people, s.n_cities))  # built once per process
    env = functools.partial(SearchEnv, index, s.k, s.format_reward, a.tool_timeout, config.tool_role, s.call_format)
    env()  # a bad search.call_format / agent.tool_timeout fails here, before any rollout
    return MultiTurnWorkflow(lambda data: env(), config.gconfig, tokenizer, a.max_turns, a.turn_discount,
                             a.max_context_tokens, truncate_fn=stop_at(search_stops(s.call_format)),
                             dump_dir=dump_dir, info_keys=INFO_KEYS, max_episode_seconds=a.max_episode_seconds)


def main(argv: list[str] | None = None) -> dict:
    config = load_run_config(SearchAgentConfig, argv)
    return run_rl(config, GRPO.from_config, build_search_agent,
                  dataset_loader=functools.partial(load_search_questions, task=config.search))


if __name__ == "__main__":
    main(sys.argv[1:])
