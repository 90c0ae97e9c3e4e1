"""GRPO with the RL loop written out: the file to copy when you want to change the step.

    python recipes/grpo_custom_loop.py                       # same flags and YAML as grpo_math.py

``recipes/grpo_math.py`` calls the library loop, :func:`arealite.trainer.rl_loop.run_rl`. This
recipe builds the same parts (:func:`~arealite.trainer.rl_loop.setup_rl` → an
:class:`~arealite.trainer.rl_loop.RLRun`: the inference engine, the rollout executor, the actor,
the algorithm, the logger, ...) and runs the step loop itself, so the four phases are in your
hands: (1) wait for a batch of finished rollouts → (2) ``algorithm.update`` → (3) push the new
weights to the inference servers → (4) log, evaluate, save. As an example of a change it logs a
second view of the reward each step (``custom/group_solved_frac``: the share of prompts with at
least one rewarded sample; ``custom/response_tokens``: the mean sampled length). It trains exactly
like ``grpo_math.py`` (tests/test_user_engine.py: the same parameters after 3 steps). Change the
phases here, e.g. a curriculum (reorder or filter ``batch`` before the update) or a reward
schedule, and keep the rest.
"""

from __future__ import annotations

import sys
import time

import torch

from arealite.algorithms.grpo import GRPO
from arealite.api.config import GRPOConfig
from arealite.reward.math import math_reward
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import (RLRun, all_reduce, cores_used, end_step, finish, resume, setup_rl,
                                      step_stats)
from arealite.trainer.weight_update import sync_weights
from arealite.workflow.rlvr import RLVRWorkflow


def build_rlvr(config: GRPOConfig, tokenizer, dump_dir: str | None) -> RLVRWorkflow:
    """One prompt → ``gconfig.n_samples`` completions → math reward (math-verify, in a worker)."""
    return RLVRWorkflow(math_reward, config.gconfig, tokenizer, dump_dir=dump_dir)


def solved_stats(batch: dict[str, torch.Tensor], group_size: int) -> dict[str, float]:
    """The example customisation: ``custom/group_solved_frac`` (prompts of the batch with at least
    one sample rewarded > 0; the batch holds whole groups of ``group_size`` consecutive rows) and
    ``custom/response_tokens`` (mean sampled tokens per row), over all trainer ranks."""
    solved = (batch["rewards"].view(-1, group_size) > 0).any(dim=1)
    n_solved, n_groups, n_tokens, n_rows = all_reduce([float(solved.sum()), float(solved.numel()),
                                                       float(batch["loss_mask"].sum()), float(batch["rewards"].numel())])
    return {"custom/group_solved_frac": n_solved / n_groups, "custom/response_tokens": n_tokens / n_rows}


def train_written_out(run: RLRun) -> dict[str, float]:
    """:func:`arealite.trainer.rl_loop.train`, written out, plus :func:`solved_stats`."""
    config = run.config
    start_step = resume(run)  # a recover checkpoint, if --recover.mode auto found one
    summary = run.evaluate("start") if config.evaluator.at_start and not start_step else {}
    run.logger.last_eval = next(((k[:-6], v, 0.0) for k, v in summary.items() if k.endswith("_start")), None)
    for step in range(start_step, config.total_train_steps):
        t0, cores_before = time.time(), cores_used(run)
        # 1. A batch of finished rollouts, none older than step − rollout.max_head_offpolicyness.
        with run.waiting():
            batch = run.executor.prepare_batch(run.loader, run.workflow)
        t1 = time.time()
        # 2. The update (advantages, proximal logprobs, minibatches, optimizer steps).
        stats = run.algorithm.update(batch)
        t2 = time.time()
        # 3. The inference engine gets the new weights as version step + 1.
        if run.cores is not None:
            run.cores.release()
        sync_weights(run.actor, run.inference, run.executor, run.weight_dir, step + 1)
        t3 = time.time()
        # 4. Log (the library's statistics + ours), evaluate in the background, save.
        stats.update(step_stats(run, batch, step, (t0, t1, t2, t3), cores_before))
        stats.update(solved_stats(batch, config.gconfig.n_samples))
        end_step(run, step, stats)
    return finish(run, summary)


def main(argv: list[str] | None = None) -> dict:
    config = load_run_config(GRPOConfig, argv)  # flags + YAML; a cluster launcher's config read ends here
    return train_written_out(setup_rl(config, GRPO.from_config, build_rlvr))


if __name__ == "__main__":
    main(sys.argv[1:])
