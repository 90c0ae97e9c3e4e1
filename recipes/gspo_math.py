"""Asynchronous GSPO on math: the GRPO recipe with GSPO's sequence-level ratio.

    torchrun --nproc_per_node=1 recipes/gspo_math.py
    python recipes/gspo_math.py --config recipes/configs/gspo_math.yaml

GSPO (arXiv 2507.18071) clips one length-normalised likelihood ratio per response instead of one
ratio per token; see ``arealite/algorithms/gspo.py``. The loop is
:func:`arealite.trainer.rl_loop.run_rl`; outputs under ``outputs/gspo_math/trial0/``.
"""

from __future__ import annotations

import sys

from arealite.algorithms.gspo import GSPO
from arealite.api.config import GSPOConfig
from arealite.trainer.rl_loop import main as run
from arealite.reward.math import math_reward
from arealite.workflow.rlvr import RLVRWorkflow


def main(argv: list[str] | None = None) -> dict:
    return run(GSPOConfig, GSPO.from_config, lambda c, tok, d: RLVRWorkflow(math_reward, c.gconfig, tok, dump_dir=d), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
