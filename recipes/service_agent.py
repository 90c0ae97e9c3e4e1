"""Asynchronous GRPO for a customer-service agent: a τ-bench-style store, its tools and policy, and a
simulated customer.

    torchrun --nproc_per_node=1 recipes/service_agent.py --config recipes/configs/service_agent.yaml

Each task is one customer with one goal (cancel a pending order, return a delivered one, ask an
order's status). The agent calls the store's tools (``<cancel_pending_order>#W1 | no longer
needed</cancel_pending_order>``; ``retail.call_format hermes`` for JSON calls) and talks to the
customer (a deterministic :class:`~arealite.env.retail.ScriptedUser`); reward = τ-bench's: the final
database equals the goal database and the required information was said
(:mod:`arealite.env.retail`). Policy violations are logged as ``rollout/policy_violations``.
"""

from __future__ import annotations

import functools
import sys

from arealite.algorithms.grpo import GRPO
from arealite.api.config import ServiceAgentConfig
from arealite.env.retail import RetailEnv, ScriptedUser, load_retail_db, make_retail_tasks, retail_stops
from arealite.env.tools import stop_at
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl
from arealite.workflow.multi_turn import END_REASONS, MultiTurnWorkflow

INFO_KEYS = ("tool_calls", "tool_errors", "policy_violations", "user_turns", "db_match",
             *(f"ended_{r}" for r in END_REASONS))


def load_tasks(path, split: str = "train", size: int | None = None, seed: int = 0, *, config: ServiceAgentConfig):
    """``dataset_loader`` of the recipe: ``path`` "retail" (or unset) = tasks on the store of
    ``retail.db_seed`` for "train", on another store (``db_seed + 1``: other customers and orders) for
    the held-out split; default sizes 256 / 32.

    Raises:
        ValueError: any other path.
    """
    if path not in (None, "", "retail"):
        raise ValueError("the service agent's tasks are generated: use path 'retail' (or leave it unset)")
    r = config.retail
    db = load_retail_db(r.db_seed + (split != "train"), r.n_users)
    return make_retail_tasks(size or (256 if split == "train" else 32), seed, db, r.difficulty, tuple(r.intents))


def build_service_agent(config: ServiceAgentConfig, tokenizer, dump_dir: str | None) -> MultiTurnWorkflow:
    r, a = config.retail, config.agent
    env = functools.partial(RetailEnv, lambda task: ScriptedUser(r.max_user_turns), a.tool_timeout, config.tool_role,
                            strict_policy=r.strict_policy, call_format=r.call_format, demos=r.demos,
                            demo_intents=tuple(r.intents))
    stops = retail_stops(r.call_format)  # a bad retail.call_format fails here, before any rollout
    return MultiTurnWorkflow(lambda data: env(), config.gconfig, tokenizer, a.max_turns, a.turn_discount,
                             a.max_context_tokens, truncate_fn=stop_at(stops), dump_dir=dump_dir,
                             info_keys=INFO_KEYS, max_episode_seconds=a.max_episode_seconds)


def main(argv: list[str] | None = None) -> dict:
    config = load_run_config(ServiceAgentConfig, argv)
    return run_rl(config, GRPO.from_config, build_service_agent,
                  dataset_loader=functools.partial(load_tasks, config=config))


if __name__ == "__main__":
    main(sys.argv[1:])
