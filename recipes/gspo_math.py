"""Asynchronous GSPO on math: the loop of ``grpo_math.py`` with GSPO's sequence-level ratio.

    torchrun --nproc_per_node=1 recipes/gspo_math.py
    python recipes/gspo_math.py --config recipes/configs/gspo_math.yaml

GSPO (arXiv 2507.18071) clips one length-normalised likelihood ratio per response instead of one
ratio per token; see ``arealite/algorithms/gspo.py``. Everything else — asynchronous rollouts,
staleness bound, weight sync, logging, outputs under ``outputs/gspo_math/trial0/`` — is the
GRPO recipe's loop, read ``recipes/grpo_math.py`` top to bottom.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_math import main  # noqa: E402  (the shared explicit loop)

from arealite.algorithms.gspo import GSPO  # noqa: E402
from arealite.api.config import GSPOConfig  # noqa: E402


def build_gspo(config: GSPOConfig, actor, ref, model_path: str) -> GSPO:
    """GSPO on the actor (and optional frozen reference); group size = gconfig.n_samples."""
    return GSPO(config.algo, actor, group_size=config.gconfig.n_samples, ref=ref,
                max_new_tokens=config.gconfig.max_new_tokens)


if __name__ == "__main__":
    main(sys.argv[1:], GSPOConfig, build_gspo)
