"""Code RL (arealite/workflow/code.py, recipes/code_grpo.py): a scripted model against real
sandboxed tests — single turn, the feedback agent (the failing visible test comes back, the hidden
tests decide), the counters — and the recipe's 2 GRPO steps on 2 ranks with a tiny random model,
single-turn and multi-turn."""

import asyncio
import json
import os

import pytest
from transformers import AutoTokenizer

from arealite.api.cli import ConfigError
from arealite.api.config import CodeTaskConfig, GenerationConfig
from arealite.reward.code import problem_answer
from arealite.workflow.code import CodeWorkflow

from conftest import REPO_ROOT
from test_agent_recipes import SMALL, _torchrun
from test_multi_turn import ScriptedEngine

PROBLEM = {"tests": ["assert plus_k(1) == 8", "assert plus_k(0) == 7", "assert plus_k(-7) == 0",
                     "assert plus_k(100) == 107"], "entry_point": "plus_k"}
ROW = {"messages": [{"role": "user", "content": "Write a Python function `plus_k(x)` that returns x plus 7."}],
       "answer": problem_answer(PROBLEM)}
RIGHT = "```python\ndef plus_k(x):\n    return x + 7\n```"
WRONG = "```python\ndef plus_k(x):\n    return x + 6\n```"
# Passes the two visible tests (plus_k(1), plus_k(0)) but not the hidden plus_k(-7) == 0.
OVERFIT = "```python\ndef plus_k(x):\n    return {1: 8, 0: 7}.get(x, -1)\n```"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _episode(workflow, script, tok):
    engine = ScriptedEngine(tok, script)
    traj = asyncio.run(workflow.arun_episode(engine, ROW))
    return traj, engine


def test_single_turn_rewards_by_the_hidden_tests(tok):
    wf = CodeWorkflow(GenerationConfig(n_samples=3, max_new_tokens=64), tok, max_turns=1)
    traj, engine = _episode(wf, [RIGHT, WRONG, OVERFIT], tok)
    assert traj["rewards"].tolist() == [1.0, 0.0, 0.0] and traj["turns"].tolist() == [1.0] * 3
    c = wf.reward_counters()
    assert (c["reward/code_pass"], c["reward/code_wrong_answer"], c["reward/code_programs"]) == (1.0, 2.0, 3.0)
    assert c["reward/code_score_s"] > 0 and set(c) == {f"reward/code_{o}" for o in (
        "pass", "wrong_answer", "syntax_error", "timeout", "runtime_error", "memory", "output_limit",
        "sandbox_refused", "programs", "score_s")}


def test_fraction_mode_pays_the_share_of_hidden_tests(tok):
    wf = CodeWorkflow(GenerationConfig(n_samples=1, max_new_tokens=64), tok, max_turns=1,
                      code=CodeTaskConfig(fraction=True))
    traj, _ = _episode(wf, [OVERFIT], tok)
    assert traj["rewards"].tolist() == [0.5]  # plus_k(1), plus_k(0) pass; plus_k(-7), plus_k(100) fail


def test_feedback_agent_shows_the_failing_visible_test_then_scores_the_fix(tok):
    wf = CodeWorkflow(GenerationConfig(n_samples=1, max_new_tokens=64), tok, max_turns=3, turn_discount=0.5,
                      code=CodeTaskConfig(visible_tests=2))
    traj, engine = _episode(wf, [WRONG, RIGHT], tok)
    assert traj["turns"].tolist() == [2.0] and traj["rewards"].tolist() == [0.5]  # solved at turn 2: 1 · 0.5
    feedback = tok.decode(engine.requests[1][len(engine.requests[0]) + len(engine.outputs[0]):])
    assert "assert plus_k(1) == 8" in feedback and "AssertionError" in feedback
    assert "plus_k(-7)" not in feedback  # hidden tests are never shown
    c = wf.reward_counters()
    assert (c["reward/code_pass"], c["reward/code_programs"]) == (1.0, 3.0)  # visible run, visible + hidden runs


def test_visible_pass_ends_the_episode_on_the_hidden_verdict(tok):
    """Passing the visible tests is not enough: the hidden ones decide, and the episode ends."""
    wf = CodeWorkflow(GenerationConfig(n_samples=1, max_new_tokens=64), tok, max_turns=3)
    traj, engine = _episode(wf, [OVERFIT, RIGHT], tok)
    assert traj["turns"].tolist() == [1.0] and traj["rewards"].tolist() == [0.0] and len(engine.requests) == 1
    assert wf.reward_counters()["reward/code_wrong_answer"] == 1.0


def test_last_turn_is_scored_and_a_crash_before_the_tests_gets_its_own_feedback(tok):
    wf = CodeWorkflow(GenerationConfig(n_samples=1, max_new_tokens=64), tok, max_turns=2)
    traj, engine = _episode(wf, ["```python\ndef plus_k(x)\n    return x\n```", WRONG], tok)
    assert traj["turns"].tolist() == [2.0] and traj["rewards"].tolist() == [0.0]
    feedback = tok.decode(engine.requests[1][len(engine.requests[0]) + len(engine.outputs[0]):])
    assert "failed before the tests ran" in feedback and "SyntaxError" in feedback
    c = wf.reward_counters()
    assert (c["reward/code_wrong_answer"], c["reward/code_syntax_error"]) == (1.0, 0.0)  # the final program counts


def test_evaluation_keeps_its_own_counters(tok):
    wf = CodeWorkflow(GenerationConfig(n_samples=1, max_new_tokens=64), tok, max_turns=1)
    res = asyncio.run(wf.aevaluate(ScriptedEngine(tok, [RIGHT, WRONG]), [ROW, ROW]))
    assert (res["pass"], res["solved"], res["turns"]) == (0.5, 0.5, 1.0)
    assert wf.reward_counters()["reward/code_programs"] == 0.0


def test_bad_code_settings_name_the_field(tok):
    with pytest.raises(ConfigError, match="^code.visible_tests"):
        CodeWorkflow(GenerationConfig(), tok, code=CodeTaskConfig(visible_tests=0))
    with pytest.raises(ConfigError, match="^code.max_parallel"):
        CodeWorkflow(GenerationConfig(), tok, code=CodeTaskConfig(max_parallel=0))


@pytest.mark.parametrize("max_turns", [1, 2])
def test_code_recipe_two_steps_on_two_ranks(tiny_model_dir, tmp_path, max_turns):
    config = os.path.join(REPO_ROOT, "recipes", "configs", "code_grpo.yaml")
    proc = _torchrun("code_grpo.py", ["--config", config, "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
                                      "--agent.max_turns", str(max_turns), *SMALL], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / "code_grpo" / "trial0"
    rows = [json.loads(line) for line in open(out / "stats.jsonl")]
    steps = [s for s in rows if "summary" not in s]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:  # a random model writes no valid program: every episode uses every turn
        assert s["rollout/turns"] == float(max_turns) and s["rollout/reward"] == 0.0
        assert s["reward/code_pass"] == 0.0 and s["reward/code_programs"] >= 4 * 2
    last = steps[-1]
    finals = sum(last[f"reward/code_{o}"] for o in ("wrong_answer", "syntax_error", "timeout", "runtime_error",
                                                    "memory", "output_limit", "sandbox_refused", "pass"))
    # Every turn runs one program and the last one decides; episodes still in flight when the step
    # logged have run programs but have no final outcome yet.
    assert finals * max_turns <= last["reward/code_programs"]
    rollouts = [json.loads(line) for line in open(out / "rollouts" / "rollouts.jsonl")]
    assert all(info["runs"] == max_turns for r in rollouts for info in r["info"])  # finished episodes: exact
    assert all(len(t) == max_turns for r in rollouts for t in r["texts"])
    assert all(sum(v for k, v in info.items() if k.startswith("outcome_")) == 1 for r in rollouts for info in r["info"])
    assert os.path.exists(out / "final" / "config.json")
