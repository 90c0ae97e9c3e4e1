"""On-policy distillation on math: the student (``actor``) samples, a frozen teacher scores each
sampled token, and the per-token reverse KL is the advantage.

    torchrun --nproc_per_node=1 recipes/grpo_math.py                    # README command 1: a teacher
    torchrun --nproc_per_node=1 recipes/distill_math.py \\
        --teacher.path outputs/grpo_math/trial0/final                   # distil it into the starting model
    python recipes/distill_math.py --teacher.path T --teacher.engine.addresses host:30000   # running servers

The loop is :func:`arealite.trainer.rl_loop.main` (async rollouts, ``max_head_offpolicyness``,
weight sync to the student's servers); the rollout is
:class:`~arealite.workflow.distill.DistillWorkflow` (teacher logprobs of the student's tokens
through :meth:`~arealite.api.engine.InferenceEngine.aprompt_logprobs`), the update
:class:`~arealite.algorithms.distill.OnPolicyDistillation` (GRPO's surrogate with
A_t = log π_teacher − log π_behav). The teacher's tokenizer must equal the student's (checked
before any server starts). Logged: ``actor/reverse_kl`` per step, ``rollout/reward`` (the
verifier, not trained on), ``reward/teacher/*`` (calls, failures, seconds); ``eval/accuracy``
held-out by the verifier.
"""

from __future__ import annotations

import os
import sys

from arealite.algorithms.distill import OnPolicyDistillation
from arealite.api.config import DistillConfig
from arealite.launcher.local import make_inference_engine
from arealite.reward.math import math_reward
from arealite.trainer.rl_loop import main as run
from arealite.utils.hf import load_tokenizer
from arealite.workflow.distill import DistillWorkflow, check_same_tokenizer


def build_distill(config: DistillConfig, tokenizer, dump_dir: str | None) -> DistillWorkflow:
    """Check the teacher, start (or connect to) its servers, and roll out against it. Collective."""
    path = config.teacher.path
    if not path or not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"teacher.path: {path!r} is not a model folder (no config.json); pass the teacher, e.g. "
                         "the final/ folder of a grpo_math run")
    check_same_tokenizer(tokenizer, load_tokenizer(path))
    teacher = make_inference_engine(config.teacher.engine, path, os.path.join(config.output_dir, "logs", "teacher"),
                                    config.seed + 1000)
    return DistillWorkflow(teacher, config.gconfig, tokenizer, math_reward, owns_teacher=True)


def main(argv: list[str] | None = None) -> dict:
    return run(DistillConfig, OnPolicyDistillation.from_config, build_distill, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
