"""Each agent example under recipes/agents/ (the openai package in a subprocess, the OpenAI Agents
SDK with a function tool, LangGraph on langchain-openai, the multiplication tool agent, the search
agent with OpenAI function calling over BM25) runs one
episode through the proxy against a scripted engine, with the reward and turns its logic implies;
plus the multiplication data set's split and reward."""

import asyncio
import os
import runpy

import pytest
from transformers import AutoTokenizer

from arealite.api.config import GenerationConfig, ProxyAgentGRPOConfig
from arealite.dataset.multiplication import (load_multiplication, make_multiplication_dataset,
                                             multiplication_reward, pair_split)
from conftest import REPO_ROOT, env_without_dist
from test_proxy import ScriptedEngine

ROW = {"messages": [{"role": "user", "content": "What is 12 + 30?\nAnswer with just the number."}], "answer": "42"}
MUL = {"question": "What is 123 * 45?", "answer": "5535",
       "messages": [{"role": "user", "content": "What is 123 * 45?\nAnswer with just the number."}]}


def retry_reply(prompt):  # wrong first, right after the feedback
    return "It is 42" if "Wrong. Try again." in prompt else "41"


def tool_reply(prompt):  # call the tool, then answer with its result
    if "<|im_start|>tool" in prompt:
        return "The product is 5535."
    return '<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 45}}</tool_call>'


from arealite.api.config import SearchTaskConfig  # noqa: E402
from arealite.env.search import load_search_questions  # noqa: E402

SEARCH = load_search_questions("search", "test", 1, 0, task=SearchTaskConfig(kinds=("city",)))[0]


def search_reply(prompt):  # call search with the person's name, then answer with the city it returned
    if "<|im_start|>tool" in prompt:
        return f"<answer>{SEARCH['answer']}</answer>" if f"city of {SEARCH['answer']}." in prompt else "no"
    return '<tool_call>{"name": "search", "arguments": {"query": "' + SEARCH["person"] + '"}}</tool_call>'


def code_reply(prompt):  # a program that prints the product (its output is the answer)
    return "```python\nprint(123 * 45)\n```" if "Use Python" in prompt else "no code"


@pytest.mark.parametrize("example,needs,row,reply,reward,turns", [
    ("openai_agent.py", "openai", ROW, retry_reply, 0.9, 2),
    ("langgraph_agent.py", "langgraph", ROW, retry_reply, 0.9, 2),
    ("openai_agents_sdk.py", "agents", MUL, tool_reply, 1.0, 2),
    ("multiply_tool.py", "openai", MUL, code_reply, 1.0, 1),
    ("search_openai.py", "openai", SEARCH, search_reply, 1.0, 2),
])
def test_agent_example_runs_one_episode_through_the_proxy(tiny_model_dir, example, needs, row, reply, reward, turns):
    pytest.importorskip(needs, reason=f"recipes/agents/{example} needs {needs}")
    pytest.importorskip("langchain_openai" if needs == "langgraph" else needs)
    module = runpy.run_path(os.path.join(REPO_ROOT, "recipes", "agents", example), run_name="example")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = ProxyAgentGRPOConfig(gconfig=GenerationConfig(n_samples=2, temperature=0.7, max_new_tokens=64))
    workflow = module["build"](config, tok, None)
    batch = asyncio.run(workflow.arun_episode(ScriptedEngine(tok, reply), row))
    assert batch["rewards"].tolist() == pytest.approx([reward, reward]) and batch["turns"].tolist() == [turns] * 2
    masked = tok.decode(batch["input_ids"][0][~batch["loss_mask"][0].bool()].tolist())
    fed_back = {retry_reply: "Wrong. Try again.", tool_reply: "<|im_start|>tool\n5535", code_reply: "Use Python",
                search_reply: f"<|im_start|>tool\n[1] {SEARCH['person']} was"}
    assert fed_back[reply] in masked  # feedback / tool output / instructions: in the trajectory, out of the loss
    if example == "multiply_tool.py":  # the same reply without running the code scores 0: the tool decides
        assert module["multiplication_reward"]("```python\nprint(123 * 45)\n```", "5535") == 0.0


def test_multiplication_task_split_and_exact_reward():
    train, test = make_multiplication_dataset("train", 300, seed=3), make_multiplication_dataset("test", 100, seed=3)
    assert train == make_multiplication_dataset("train", 300, seed=3)  # seeded
    pairs = lambda rows: {tuple(int(x) for x in r["question"][8:-1].split(" * ")) for r in rows}
    assert not pairs(train) & pairs(test) and len(pairs(train)) == 300  # disjoint, distinct
    assert all(pair_split(a, b) == "test" for a, b in pairs(test))
    for (a, b), r in zip(sorted(pairs(test)), sorted(test, key=lambda r: r["question"])):
        assert 100 <= a <= 9999 and 100 <= b <= 9999
    assert all(r["answer"] == str(eval(r["question"][8:-1])) for r in train)
    assert multiplication_reward("So 123 * 45 = 5,535", "5535") == 1.0
    assert multiplication_reward("5535 is close, it is 5536", "5535") == 0.0
    assert multiplication_reward("no idea", "5535") == 0.0
    assert load_multiplication("multiplication", "test", 5, 3) == test[:5]
    with pytest.raises(ValueError, match="split"):
        make_multiplication_dataset("valid", 5)


def test_multiply_tool_recipe_trains_through_the_proxy_and_logs_session_counters(tiny_model_dir, tmp_path):
    """Two GRPO steps of recipes/agents/multiply_tool.py on one rank (tiny random model, our server):
    every step logs the proxy's cumulative session counters, summed over ranks."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, os.path.join(REPO_ROOT, "recipes", "agents", "multiply_tool.py"),
           "--config", os.path.join(REPO_ROOT, "recipes", "configs", "multiply_tool.yaml"),
           "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "2",
           "--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8", "--rollout.consumer_batch_size", "2",
           "--train_dataset.batch_size", "2", "--valid_dataset.size", "2", "--evaluator.at_start", "False"]
    # an earlier in-process FSDPEngine test leaves RANK / MASTER_PORT in os.environ (its TCPStore
    # holds that port): the recipe must make its own 1-rank group
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env_without_dist())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [s for s in map(json.loads, open(tmp_path / "multiply_tool" / "trial0" / "stats.jsonl")) if "summary" not in s]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert s["workflow/timed_out"] == 0 and s["workflow/failed"] == 0
        # 2 prompts × 2 sessions trained per step; more may have finished ahead (η = 1)
        assert s["workflow/episodes"] >= 4 * (s["step"] + 1)


def test_search_agent_written_with_openai_trains_through_the_proxy(tiny_model_dir, tmp_path):
    """Two GRPO steps of recipes/agents/search_openai.py (OpenAI function calling over the BM25 index,
    the openai package) on one rank with the tiny random model: every session is trained, none fails."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, os.path.join(REPO_ROOT, "recipes", "agents", "search_openai.py"),
           "--config", os.path.join(REPO_ROOT, "recipes", "configs", "proxy_agent.yaml"),
           "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path), "--total_train_steps", "2",
           "--train_dataset.path", "search", "--valid_dataset.path", "search", "--valid_dataset.size", "2",
           "--gconfig.n_samples", "2", "--rollout.consumer_batch_size", "2", "--train_dataset.batch_size", "2",
           "--evaluator.at_start", "False"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env_without_dist())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [s for s in map(json.loads, open(tmp_path / "proxy_agent" / "trial0" / "stats.jsonl")) if "summary" not in s]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert s["workflow/timed_out"] == 0 and s["workflow/failed"] == 0 and s["workflow/episodes"] >= 4 * (s["step"] + 1)
        assert s["rollout/n_samples"] == 4 and 1 <= s["rollout/turns"] <= 4
    rollouts = [json.loads(line) for line in open(tmp_path / "proxy_agent" / "trial0" / "rollouts" / "rollouts.jsonl")]
    assert all(r["answer"] for r in rollouts) and "held-out greedy evaluation after training" in proc.stdout
