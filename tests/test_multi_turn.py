"""Multi-turn and tool-agent workflows: token-in token-out trajectories with exact masks.

A scripted engine plays the model (its "sampled" ids are the tokenised script plus EOS, with
distinct logprobs and versions per turn), so every expected value is known exactly."""

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from arealite.api.config import GenerationConfig
from arealite.api.io_struct import ModelResponse
from arealite.sandbox import SandboxConfig
from arealite.workflow.multi_turn import MathFeedbackEnv, MultiTurnMathWorkflow, chat_segment_ids
from arealite.utils.hf import tokenize_chat
from arealite.workflow.tool_agent import ToolAgentMathWorkflow, extract_code, truncate_after_code


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ScriptedEngine:
    """Answers call i with ``script[i]`` (tokenised, + EOS unless ``no_eos``); logprob of the j-th
    token of call i is -(i + 1) - j / 100, its version is 10 + i. Records every request."""

    def __init__(self, tok, script, no_eos=False):
        self.tok, self.script, self.no_eos = tok, list(script), no_eos
        self.requests, self.outputs = [], []

    async def agenerate(self, req):
        i = len(self.requests)
        self.requests.append(list(req.input_ids))
        out = self.tok(self.script[i], add_special_tokens=False)["input_ids"] + ([] if self.no_eos else [self.tok.eos_token_id])
        self.outputs.append(out)
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=out,
                             output_logprobs=[-(i + 1) - j / 100 for j in range(len(out))],
                             output_versions=[10 + i] * len(out), stop_reason="length" if self.no_eos else "stop")


ROW = {"messages": [{"role": "user", "content": "What is 12 + 30?\nAnswer with just the number."}], "answer": "42"}


def _run(workflow, engine, row=ROW):
    async def main():
        return await workflow.arun_episode(engine, row)
    try:
        return asyncio.run(main())
    finally:
        workflow.reward_worker.close()


@pytest.mark.parametrize("ends_with_eos", [True, False])
def test_appended_segments_equal_the_template_of_the_whole_conversation(tok, ends_with_eos):
    user, reply, feedback = ROW["messages"][0], "The answer is 41.", {"role": "user", "content": "Wrong, again."}
    sampled = tok(reply, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if ends_with_eos else [])
    ids = tokenize_chat(tok, [user]) + sampled + chat_segment_ids(tok, [feedback], sampled[-1])
    expected = tokenize_chat(tok, [user, {"role": "assistant", "content": reply}, feedback])
    assert ids == expected


def test_every_turn_prompt_is_a_prefix_and_logprobs_line_up_with_sampled_ids(tok):
    gconfig = GenerationConfig(n_samples=1, max_new_tokens=32)
    workflow = MultiTurnMathWorkflow(gconfig, tok, max_turns=3, turn_discount=0.5)
    engine = ScriptedEngine(tok, ["It is 41.", "Then 43.", "It is 42."])
    traj = _run(workflow, engine)
    T = int(traj["attention_mask"].sum())
    ids, mask = traj["input_ids"][0, :T].tolist(), traj["loss_mask"][0, :T]
    # 1. the ids fed at each turn are an exact prefix of the final trajectory
    assert len(engine.requests) == 3
    for req in engine.requests:
        assert ids[: len(req)] == req
    # each turn's sampled ids sit right after its prompt, with loss_mask 1, their logprobs and version
    for i, (req, out) in enumerate(zip(engine.requests, engine.outputs)):
        span = slice(len(req), len(req) + len(out))
        assert ids[span] == out
        assert mask[span].tolist() == [1] * len(out)
        assert traj["logprobs"][0, span].tolist() == pytest.approx([-(i + 1) - j / 100 for j in range(len(out))])
        assert traj["versions"][0, span].tolist() == [10 + i] * len(out)
    # 2. everything else (prompt, feedback, template) is masked: loss 0, logprob 0, version -1
    sampled = mask.bool()
    assert int(sampled.sum()) == sum(len(o) for o in engine.outputs)
    assert (traj["logprobs"][0, :T][~sampled] == 0).all() and (traj["versions"][0, :T][~sampled] == -1).all()
    feedback = tok.decode(torch.tensor(ids)[:T][~sampled].tolist())
    assert feedback.count(MathFeedbackEnv.FEEDBACK) == 2
    # reward: correct at the third turn → 1 · 0.5²
    assert traj["rewards"].tolist() == [0.25] and traj["turns"].tolist() == [3.0]


def test_correct_first_answer_ends_the_episode_with_full_reward(tok):
    workflow = MultiTurnMathWorkflow(GenerationConfig(n_samples=2, max_new_tokens=32), tok, max_turns=3)
    engine = ScriptedEngine(tok, ["42", "42"])
    traj = _run(workflow, engine)
    assert traj["rewards"].tolist() == [1.0, 1.0] and traj["turns"].tolist() == [1.0, 1.0]
    assert traj["input_ids"].shape[0] == 2 and len(engine.requests) == 2


def test_wrong_until_max_turns_gives_zero_reward_and_no_trailing_feedback(tok):
    workflow = MultiTurnMathWorkflow(GenerationConfig(n_samples=1, max_new_tokens=32), tok, max_turns=2)
    engine = ScriptedEngine(tok, ["1", "2"], no_eos=True)
    traj = _run(workflow, engine)
    T = int(traj["attention_mask"].sum())
    assert traj["rewards"].tolist() == [0.0] and traj["turns"].tolist() == [2.0]
    assert traj["no_eos"].tolist() == [True]
    assert traj["loss_mask"][0, T - 1] == 1  # the trajectory ends with the last sampled token
    # without EOS the assistant turn is closed by the template (masked) before the feedback
    second = engine.requests[1]
    assert tok.eos_token_id in second[len(engine.requests[0]) + len(engine.outputs[0]):]


def test_bad_turn_settings_name_the_field(tok):
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnMathWorkflow(GenerationConfig(), tok, max_turns=0)
    with pytest.raises(ValueError, match="turn_discount"):
        MultiTurnMathWorkflow(GenerationConfig(), tok, turn_discount=0.0)


def test_bad_sandbox_setting_names_the_field(tok):
    with pytest.raises(ValueError, match="sandbox.max_output_bytes"):
        ToolAgentMathWorkflow(GenerationConfig(), tok, sandbox=SandboxConfig(max_output_bytes=0))


def test_code_block_extraction_and_truncation(tok):
    text = "Let me compute.\n```python\nprint(6 * 7)\n```\nThe answer is"
    assert extract_code(text) == "print(6 * 7)\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    k = truncate_after_code(tok, ids)
    assert tok.decode(ids[:k]).endswith("```") and extract_code(tok.decode(ids[: k - 1])) is None
    assert truncate_after_code(tok, tok("no code", add_special_tokens=False)["input_ids"]) == 2


def test_tool_agent_runs_code_in_the_sandbox_and_masks_its_output(tok):
    gconfig = GenerationConfig(n_samples=1, max_new_tokens=64)
    workflow = ToolAgentMathWorkflow(gconfig, tok, max_turns=4, sandbox=SandboxConfig(timeout=2.0, cpu_time=1))
    engine = ScriptedEngine(tok, [
        "```python\nprint(12 + 30)\n```\nignored tail",   # cut after the fence
        "```python\nwhile True:\n    pass\n```",           # hostile: contained, reported
        "The answer is 42",
    ])
    traj = _run(workflow, engine)
    T = int(traj["attention_mask"].sum())
    ids, mask = traj["input_ids"][0, :T].tolist(), traj["loss_mask"][0, :T].bool()
    for req in engine.requests:
        assert ids[: len(req)] == req
    assert "ignored tail" not in tok.decode(ids)
    assert traj["rewards"].tolist() == [1.0] and traj["turns"].tolist() == [3.0]
    tool_text = tok.decode(torch.tensor(ids)[~mask].tolist())
    assert "Output:\n```output\n42\n```" in tool_text
    assert "[sandbox error]" in tool_text and ("timeout" in tool_text or "CPU time limit" in tool_text)
    sampled_text = tok.decode(torch.tensor(ids)[mask].tolist())
    assert "Output:" not in sampled_text and "print(12 + 30)" in sampled_text
