"""GRPO against learned rewards: a reward model, an LLM judge, a verifier, or a weighted sum.

    python recipes/rm_math.py --train_dataset.path pairs.jsonl                    # 1. train a reward model
    torchrun --nproc_per_node=1 recipes/grpo_rlhf.py \\
        --reward.reward_model.path outputs/rm_math/trial0/final                  # 2. RL against it alone
    python recipes/grpo_rlhf.py --reward.judge.path /models/judge --reward.verifier_weight 0.5
    python recipes/grpo_rlhf.py --reward.judge.url http://host:8000/v1 --reward.judge.model judge   # any OpenAI API
    python recipes/grpo_rlhf.py --reward.reward_model.url host:8000 --reward.reward_model.protocol get_reward
    python benchmarks/rlhf_demo.py                                                # the whole loop, on CPU

The loop is :func:`arealite.trainer.rl_loop.main` (async GRPO, staleness rules, weight sync);
only the reward differs from ``recipes/grpo_math.py``. :func:`build_reward` turns the
``reward`` section into one :class:`~arealite.reward.sources.CombinedReward` of the sources
that are set — a reward-model server (launched by trainer rank 0 from ``reward_model.path``, or
at ``reward_model.url``), an LLM judge (its own servers: ``judge.engine``, launched from
``judge.path`` when it has no addresses; never sent the policy's weights; or an OpenAI-compatible
API at ``judge.url``), the math verifier
and a length penalty — and every component is logged per step as ``rollout/reward_<name>``
(the verifier too at weight 0: reward hacking shows as ``rollout/reward_rm`` rising while
``rollout/reward_verifier`` does not). Each sample is scored as soon as it finishes; a sample a
learned source cannot score drops its group (``reward/<source>/failed_<reason>``,
``rollout/rejected``). The held-out ``eval/accuracy`` is always the verifier's.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from arealite.algorithms.grpo import GRPO
from arealite.api.config import GenerationConfig, RLHFConfig
from arealite.launcher.local import launch_reward_server, make_inference_engine
from arealite.reward.math import math_reward
from arealite.reward.sources import (CombinedReward, FunctionReward, LengthPenalty, LLMJudge, OpenAIJudge,
                                     RemoteRewardModel)
from arealite.trainer.rl_loop import main as run
from arealite.utils.hf import load_tokenizer
from arealite.workflow.rlvr import RLVRWorkflow


def check_reward_config(config: RLHFConfig) -> None:
    """Raises ValueError naming the ``reward.*`` field of a reward that cannot work (before any
    server starts)."""
    r = config.reward
    if r.reward_model.path and r.reward_model.url:
        raise ValueError("reward.reward_model: set path (launch a server) or url (a running one), not both")
    if r.reward_model.path and not os.path.exists(os.path.join(r.reward_model.path, "config.json")):
        raise ValueError(f"reward.reward_model.path: {r.reward_model.path} is not a model folder (no config.json)")
    if r.judge.path and not os.path.exists(os.path.join(r.judge.path, "config.json")):
        raise ValueError(f"reward.judge.path: {r.judge.path} is not a model folder (no config.json)")
    if r.judge.path and r.judge.url:
        raise ValueError("reward.judge: set path (our servers) or url (an OpenAI-compatible API), not both")
    if r.judge.url and not r.judge.model:
        raise ValueError("reward.judge.model: an OpenAI-compatible judge (reward.judge.url) needs the model name")
    learned = [bool(r.reward_model.path or r.reward_model.url), bool(r.judge.path or r.judge.url)]
    weights = [r.reward_model.weight if learned[0] else 0.0, r.judge.weight if learned[1] else 0.0,
               r.verifier_weight, r.length_penalty]
    if not any(w != 0 for w in weights):
        raise ValueError("reward: no source pays anything; set --reward.reward_model.path/url, --reward.judge.path "
                         "or --reward.verifier_weight (recipes/grpo_math.py trains on the verifier alone)")


def _broadcast(value):
    obj = [value]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def build_reward(config: RLHFConfig, tokenizer, log_dir: str) -> CombinedReward:
    """The run's reward source (module doc). Collective: rank 0 launches the servers and every
    rank gets their addresses."""
    r = config.reward
    check_reward_config(config)
    parts = [(FunctionReward(math_reward, name="verifier"), r.verifier_weight)]
    if r.reward_model.path or r.reward_model.url:
        rm = r.reward_model
        url = rm.url or _broadcast(launch_reward_server(rm.path, log_dir, rm.server_threads, rm.max_batch_size)
                                   if dist.get_rank() == 0 else None)
        rm_tok = load_tokenizer(rm.path) if rm.protocol == "get_reward" and rm.path else None
        if rm.protocol == "get_reward" and rm_tok is None:
            rm_tok = tokenizer  # a remote text-protocol RM: the policy's chat template builds its text
        parts.append((RemoteRewardModel(url, rm.protocol, rm_tok, rm.timeout, max_concurrency=rm.max_concurrency,
                                        name="rm"), rm.weight))
    j = r.judge
    if j.url:
        parts.append((OpenAIJudge(j.url, j.model, os.environ.get(j.api_key_env, ""), max_tokens=j.max_new_tokens,
                                  rubric=j.rubric, max_score=j.max_score, use_reference=j.use_reference,
                                  timeout=j.timeout, max_concurrency=j.max_concurrency, name="judge"), j.weight))
    if j.path:
        engine = make_inference_engine(j.engine, j.path, os.path.join(log_dir, "judge"), config.seed + 1000)
        gconfig = GenerationConfig(max_new_tokens=j.max_new_tokens, greedy=True)
        parts.append((LLMJudge(engine, load_tokenizer(j.path), rubric=j.rubric, max_score=j.max_score,
                               use_reference=j.use_reference, gconfig=gconfig, timeout=j.timeout,
                               max_concurrency=j.max_concurrency, name="judge", owns_engine=True), j.weight))
    if r.length_penalty:
        parts.append((LengthPenalty(r.length_penalty), 1.0))
    return CombinedReward(parts)


def build_workflow(config: RLHFConfig, tokenizer, dump_dir: str | None) -> RLVRWorkflow:
    """One prompt → ``gconfig.n_samples`` completions, each scored by :func:`build_reward` as it
    finishes; held-out accuracy by the verifier."""
    reward = build_reward(config, tokenizer, os.path.join(config.output_dir, "logs"))
    return RLVRWorkflow(reward, config.gconfig, tokenizer, dump_dir=dump_dir, eval_fn=math_reward)


def main(argv: list[str] | None = None) -> dict:
    return run(RLHFConfig, GRPO.from_config, build_workflow, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
