"""Asynchronous GRPO on multi-turn math: answer; if wrong, the environment says so; try again.

    torchrun --nproc_per_node=1 recipes/multi_turn_math.py          # embedded defaults (CPU is fine)
    python recipes/multi_turn_math.py --config recipes/configs/multi_turn_math.yaml --agent.max_turns 3

One episode = up to ``agent.max_turns`` model turns against
:class:`arealite.workflow.multi_turn.MathFeedbackEnv`; reward = 1 · ``agent.turn_discount``^(turns−1)
when solved, else 0. The trajectory is token-in token-out (sampled ids + tokenised feedback,
feedback masked out of the loss). Per step: take a batch of finished episodes (at most
``rollout.max_head_offpolicyness`` versions old) → GRPO update → weight sync → log
``rollout/reward`` and ``rollout/turns``. ``tool_agent_math.py`` runs this same loop with another
workflow. Outputs under ``fileroot/experiment_name/trial_name/`` as in ``grpo_math.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
import time

import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_math import all_reduce, load_dataset_or_explain, rollout_stats, sync_weights  # noqa: E402

from arealite.algorithms.grpo import GRPO  # noqa: E402
from arealite.api.config import MultiTurnGRPOConfig, load_config, to_dict  # noqa: E402
from arealite.engine.fsdp import FSDPEngine, init_distributed  # noqa: E402
from arealite.launcher.local import make_inference_engine, trainer_threads  # noqa: E402
from arealite.utils.hf import load_tokenizer, resolve_model_path  # noqa: E402
from arealite.utils.stats_logger import StatsLogger  # noqa: E402
from arealite.workflow.multi_turn import MultiTurnMathWorkflow, MultiTurnWorkflow  # noqa: E402


def build_multi_turn(config: MultiTurnGRPOConfig, tokenizer, dump_dir: str | None) -> MultiTurnWorkflow:
    a = config.agent
    return MultiTurnMathWorkflow(config.gconfig, tokenizer, a.max_turns, a.turn_discount, a.max_context_tokens,
                                 dump_dir=dump_dir)


def train(config, build_workflow) -> dict:
    """The training loop shared by the agent recipes; ``build_workflow(config, tokenizer, dump_dir)``
    returns a workflow with ``aevaluate(engine, rows)`` (a :class:`MultiTurnWorkflow`, or an
    :class:`arealite.agent.OpenAIAgentWorkflow`; see docs/custom_agent.md)."""
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(config.seed + rank)
    torch.manual_seed(config.seed)
    if config.train_dataset.batch_size % world or config.rollout.consumer_batch_size % world:
        raise ValueError(f"train_dataset.batch_size and rollout.consumer_batch_size must be divisible by {world} ranks")

    # Data, model, tokenizer and the workflow's own checks, before anything expensive or written.
    train_rows = load_dataset_or_explain("train_dataset", config.train_dataset, "train", config.seed)
    valid_rows = load_dataset_or_explain("valid_dataset", config.valid_dataset, "test", config.seed)
    model_path = resolve_model_path(config.actor.path)
    tokenizer = load_tokenizer(model_path)
    out = config.output_dir
    workflow = build_workflow(config, tokenizer, os.path.join(out, "rollouts") if rank == 0 else None)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(config), f)
    sampler = DistributedSampler(train_rows, num_replicas=world, rank=rank, shuffle=config.train_dataset.shuffle, seed=config.seed)
    dataloader = StatefulDataLoader(train_rows, batch_size=config.train_dataset.batch_size // world, sampler=sampler,
                                    collate_fn=lambda rows: rows)

    # Engines: inference servers, FSDP2 actor (+ reference when kl_coef > 0), GRPO.
    torch.set_num_threads(config.actor.num_threads or trainer_threads(config.rollout, world))
    rollout = make_inference_engine(config.rollout, model_path, os.path.join(out, "logs"), config.seed)
    actor = FSDPEngine(config.actor, temperature=config.gconfig.temperature)
    actor.initialize(model_path, config.total_train_steps)
    ref = None
    if config.algo.kl_coef > 0:
        ref = FSDPEngine(config.actor, temperature=config.gconfig.temperature, trainable=False)
        ref.initialize(model_path)
    # Each turn has its own max_new_tokens budget, so the overlong penalty's L_max is per turn.
    algo = GRPO(config.algo, actor, group_size=config.gconfig.n_samples, ref=ref,
                max_new_tokens=config.gconfig.max_new_tokens)
    stats_logger = StatsLogger(out, rank, config.total_train_steps)
    weight_dir = os.path.join(out, "weight_update")

    def evaluate(when: str) -> dict:  # greedy episodes on the held-out rows (rank 0)
        if rank != 0:
            return {}
        res = asyncio.run(workflow.aevaluate(rollout, valid_rows))
        print(f"held-out greedy episodes {when} training: reward {res['reward']:.3f}, solved {res['solved']:.3f}, "
              f"turns {res['turns']:.2f} ({len(valid_rows)} problems)", flush=True)
        return {f"eval/{k}_{when}": v for k, v in res.items()}

    summary = evaluate("start") if config.evaluator.at_start else {}
    prev_train_end, trained_samples, run_start = 0.0, 0, time.time()
    for step in range(config.total_train_steps):
        version = step  # weights the servers hold = completed updates
        t0 = time.time()
        batch = rollout.prepare_batch(dataloader, workflow)  # 1. finished episodes (asynchronous)
        t1 = time.time()
        stats = algo.update(batch)  # 2. GRPO update
        t2 = time.time()
        # 3. Weight sync: pause → push → servers load → version bump → resume.
        sync_weights(actor, rollout, weight_dir, version + 1)
        t3 = time.time()
        # 4. Logging: reward, turns per episode, staleness, time split.
        stats.update(rollout_stats(batch, version, prev_train_end, rollout))
        turns_sum, n = all_reduce([float(batch["turns"].sum()), float(batch["turns"].numel())])
        stats["rollout/turns"] = turns_sum / n
        trained_samples += int(stats["rollout/n_samples"])
        stats.update({"time/gen_wait_s": t1 - t0, "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2,
                      "perf/trained_samples_per_s": trained_samples / (t3 - run_start)})
        stats = {f"actor/{k}" if "/" not in k else k: v for k, v in stats.items()}
        prev_train_end = t2
        if config.saver.freq_steps and (step + 1) % config.saver.freq_steps == 0:
            actor.save(os.path.join(out, "checkpoints", f"step{step + 1}"))
        stats_logger.commit(step, stats)

    loop_time = time.time() - run_start
    actor.save(os.path.join(out, "final"))
    if rank == 0:
        shutil.rmtree(weight_dir, ignore_errors=True)  # the last weight-sync copy (= final/)
    if config.evaluator.at_end:
        summary.update(evaluate("end"))
    summary.update(steps=config.total_train_steps, trained_samples=trained_samples,
                   trained_samples_per_s=trained_samples / loop_time)
    stats_logger.summary(config.total_train_steps, {k: float(v) for k, v in summary.items()})
    stats_logger.close()
    rollout.destroy()
    if getattr(workflow, "reward_worker", None) is not None:
        workflow.reward_worker.close()
    actor.destroy()
    return summary


def main(argv: list[str] | None = None) -> dict:
    return train(load_config(MultiTurnGRPOConfig, argv), build_multi_turn)


if __name__ == "__main__":
    main(sys.argv[1:])
