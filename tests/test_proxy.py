"""The OpenAI-compatible training proxy: agents written against the real client libraries (the
``openai`` package in another process, the OpenAI Agents SDK) give the same trajectories as the
in-process client, trainable ones (the trainer reproduces the server's logprobs), through the
executor's staleness accounting; hanging sessions and malformed requests fail clearly without
losing or mixing episodes."""

import asyncio
import json
import re
import sys
import textwrap
import time

import pytest
import torch
from transformers import AutoTokenizer

from arealite.agent import ArealOpenAI
from arealite.agent.proxy import TrainingProxy
from arealite.agent.proxy_workflow import ProxyAgentWorkflow
from arealite.api.config import GenerationConfig, InferenceEngineConfig, ProxyConfig, TrainEngineConfig
from arealite.api.io_struct import ModelResponse
from arealite.rollout.executor import WorkflowExecutor
from arealite.utils.hf import tokenize_chat
from arealite.workflow.multi_turn import episodes_to_batch

openai = pytest.importorskip("openai", reason="the proxy tests need the openai package (pip install openai)")

ROW = {"question": "What is 12 + 30?", "answer": "42"}


class ScriptedEngine:
    """Deterministic in the prompt: replies ``A<n>`` for the last ``Q<n>`` of the prompt (``ok``
    if none; ``reply_fn(prompt_text)`` overrides), logprob -(i+1)/10 for the i-th id, version
    ``len(prompt) % 7``. ``calls`` counts requests; ``live`` / ``peak`` the concurrent ones."""

    def __init__(self, tok, reply_fn=None):
        self.tok, self.reply_fn = tok, reply_fn
        self.calls, self.live, self.peak = 0, 0, 0

    def get_version(self) -> int:
        return 0

    async def agenerate(self, req):
        self.calls += 1
        self.live += 1
        self.peak = max(self.peak, self.live)
        await asyncio.sleep(0.01)
        self.live -= 1
        prompt = self.tok.decode(req.input_ids)
        if self.reply_fn is not None:
            reply = self.reply_fn(prompt)
        else:
            q = re.findall(r"Q(\d+)", prompt)
            reply = f"A{q[-1]}" if q else "ok"
        out = self.tok(reply, add_special_tokens=False)["input_ids"][: req.gconfig.max_new_tokens - 1]
        out = out + [self.tok.eos_token_id]
        return ModelResponse(req.input_ids, out, [-(i + 1) / 10 for i in range(len(out))],
                             [len(req.input_ids) % 7] * len(out), "stop")


# The same three-turn agent twice: against the in-process client, and as a script that only knows
# the openai package (its own process; base URL, key and reward URL from the environment).
async def in_process_agent(client, data) -> float:
    messages = [{"role": "user", "content": data["question"]}]
    first = await client.chat.completions.create(messages=messages, max_completion_tokens=6)
    messages += [first.choices[0].message, {"role": "user", "content": "Are you sure? Answer again."}]
    second = await client.chat.completions.create(messages=messages, max_completion_tokens=6)
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "tool", "content": "calculator: 42"}]
    third = await client.chat.completions.create(messages=messages, max_completion_tokens=6)
    return float(data["answer"] in third.choices[0].message.content) + 0.5


OPENAI_AGENT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import httpx
    from openai import OpenAI

    data = json.load(sys.stdin)
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    messages = [{"role": "user", "content": data["question"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_completion_tokens=6)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Are you sure? Answer again."}]
    stream = client.chat.completions.create(model="policy", messages=messages, max_completion_tokens=6, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": "calculator: 42"}]
    third = client.chat.completions.create(model="policy", messages=messages, max_completion_tokens=6)
    reward = float(data["answer"] in third.choices[0].message.content) + 0.5
    httpx.post(os.environ["AREALITE_REWARD_URL"], json={"reward": reward}).raise_for_status()
""")


@pytest.fixture
def agent_script(tmp_path):
    path = tmp_path / "openai_agent.py"
    path.write_text(OPENAI_AGENT_SCRIPT)
    return [sys.executable, str(path)]


def test_openai_agent_in_a_subprocess_records_what_the_in_process_client_records(tiny_model_dir, agent_script):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gconfig = GenerationConfig(n_samples=1, temperature=0.7, max_new_tokens=6)
    client = ArealOpenAI(ScriptedEngine(tok, lambda p: f"it is {len(p) % 50}"), tok, gconfig)
    reward = asyncio.run(in_process_agent(client, ROW))
    expected = episodes_to_batch([client.export_episode(reward)])
    assert [r.parent for r in client.records] == [None, client.records[0].id, client.records[1].id]

    workflow = ProxyAgentWorkflow(agent_script, tok, gconfig)
    got = asyncio.run(workflow.arun_episode(ScriptedEngine(tok, lambda p: f"it is {len(p) % 50}"), ROW))
    assert sorted(got) == sorted(expected)
    for key in expected:  # ids, masks, logprobs, versions, reward (posted by the agent), turns
        assert torch.equal(got[key], expected[key]), key
    assert got["rewards"].tolist() == [0.5] and got["turns"].tolist() == [3.0]
    assert workflow.stats == {"episodes": 1, "timed_out": 0, "failed": 0}


def test_proxy_episodes_are_trainable_and_counted_by_the_executor(engine, tiny_model_dir, agent_script):
    """Real server (tiny model, sampled at T=0.7) behind the proxy, the openai-package agent in its
    own process, the episode run by the WorkflowExecutor: the trainer's recomputed logprobs equal
    the server's, versions are the engine's, and the executor counted the episode."""
    from arealite.train_engine.fsdp import FSDPEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gconfig = GenerationConfig(n_samples=2, temperature=0.7, max_new_tokens=6)
    workflow = ProxyAgentWorkflow(agent_script, tok, gconfig)
    executor = WorkflowExecutor(InferenceEngineConfig(consumer_batch_size=1, max_head_offpolicyness=0), engine)
    executor.initialize()
    try:
        executor.submit(ROW, workflow)
        batch = executor.wait(1, timeout=120)
    finally:
        executor.destroy()
    assert executor.staleness.stat.accepted == 1 and executor.staleness.stat.submitted == 1
    assert batch["input_ids"].shape[0] == 2 and batch["turns"].tolist() == [3.0, 3.0]
    first_prompt = tokenize_chat(tok, [{"role": "user", "content": ROW["question"]}])
    for row in range(2):
        T = int(batch["attention_mask"][row].sum())
        mask = batch["loss_mask"][row, :T].bool()
        assert batch["input_ids"][row, : len(first_prompt)].tolist() == first_prompt
        assert (batch["versions"][row, :T][mask] == 0).all() and (batch["versions"][row, :T][~mask] == -1).all()
        assert "calculator: 42" in tok.decode(batch["input_ids"][row, :T][~mask].tolist())
    actor = FSDPEngine(TrainEngineConfig(path=tiny_model_dir), temperature=0.7)
    actor.initialize(tiny_model_dir)
    recomputed = actor.forward(batch)
    sampled = batch["loss_mask"].bool()
    assert sampled.sum() >= 6
    assert (recomputed[sampled] - batch["logprobs"][sampled]).abs().max().item() < 1e-4


def test_openai_agents_sdk_agent_with_a_function_tool(tiny_model_dir):
    agents = pytest.importorskip("agents", reason="needs the OpenAI Agents SDK (pip install openai-agents)")
    agents.set_tracing_disabled(True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = []

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append((a, b))
        return a * b

    async def sdk_agent(data, base_url, api_key):
        model = agents.OpenAIChatCompletionsModel(model="policy",
                                                  openai_client=openai.AsyncOpenAI(base_url=base_url, api_key=api_key))
        agent = agents.Agent(name="calc", instructions="Use the multiply tool.", tools=[multiply], model=model)
        result = await agents.Runner.run(agent, data["question"], max_turns=4)
        return float(data["answer"] in result.final_output)

    def reply(prompt):  # call the tool first; answer once its result is in the prompt
        if "<|im_start|>tool" not in prompt:
            return '<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 45}}</tool_call>'
        return "The product is 5535."
    gconfig = GenerationConfig(n_samples=1, temperature=1.0, max_new_tokens=64)
    workflow = ProxyAgentWorkflow(sdk_agent, tok, gconfig)
    batch = asyncio.run(workflow.arun_episode(ScriptedEngine(tok, reply), {"question": "123*45?", "answer": "5535"}))
    assert calls == [(123, 45)]  # the tool call was parsed and run by the SDK
    assert batch["rewards"].tolist() == [1.0] and batch["turns"].tolist() == [2.0]  # one chain, two calls
    ids, mask = batch["input_ids"][0].tolist(), batch["loss_mask"][0].bool()
    sampled_text = tok.decode(torch.tensor(ids)[mask].tolist())
    masked_text = tok.decode(torch.tensor(ids)[~mask].tolist())
    assert '"name": "multiply"' in sampled_text and "The product is 5535." in sampled_text
    assert "<|im_start|>tool\n5535<|im_end|>" in masked_text  # the tool result: fed back, not trained on
    assert '"name": "multiply"' in masked_text.split("<|im_start|>user")[0]  # tools described in the system prompt


def test_hanging_session_times_out_and_no_episode_is_lost_or_mixed(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hung_urls = []

    async def agent(data, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            reply = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": data["question"]}], max_tokens=8)
            if data.get("hang"):
                hung_urls.append(base_url)
                await asyncio.sleep(3600)
            return float(reply.choices[0].message.content == data["answer"])

    rows = [{"question": f"Q{i}", "answer": f"A{i}", "hang": i == 2} for i in range(5)]
    engine = ScriptedEngine(tok)
    workflow = ProxyAgentWorkflow(agent, tok, GenerationConfig(n_samples=2, max_new_tokens=8),
                                  config=ProxyConfig(session_timeout=5.0),  # ample for a scripted reply on a loaded machine
                                  dump_dir=str(tmp_path / "rollouts"))
    executor = WorkflowExecutor(InferenceEngineConfig(consumer_batch_size=1, max_concurrent_rollouts=5,
                                                      max_head_offpolicyness=4), engine)
    executor.initialize()
    try:
        for row in rows:
            executor.submit(row, workflow)
        batch = executor.wait(4, timeout=60)
        stat = executor.staleness.stat
        deadline = time.monotonic() + 30
        while stat.rejected == 0 and time.monotonic() < deadline:  # the hung group ends after its timeout
            time.sleep(0.05)
        assert (stat.submitted, stat.accepted, stat.rejected, stat.failed) == (5, 4, 1, 0)
        assert workflow.stats == {"episodes": 8, "timed_out": 2, "failed": 0}
        assert workflow.counters() == {"episodes": 8.0, "timed_out": 2.0, "failed": 0.0}  # logged as workflow/*
        assert engine.peak >= 2  # sessions really ran concurrently
        import httpx  # a late request of the timed-out session is refused, never recorded elsewhere
        late = httpx.post(hung_urls[0] + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert late.status_code == 404 and "unknown or closed session" in late.json()["error"]["message"]
    finally:
        executor.destroy()
    assert len(hung_urls) == 2
    questions = []
    for row in range(8):  # each trajectory holds its own question and the reply to it, nothing else
        T = int(batch["attention_mask"][row].sum())
        text = tok.decode(batch["input_ids"][row, :T].tolist())
        q = re.findall(r"Q(\d+)", text)
        assert len(q) == 1 and re.findall(r"A(\d+)", text) == q and batch["rewards"][row] == 1.0
        questions.append(int(q[0]))
    assert sorted(questions) == [0, 0, 1, 1, 3, 3, 4, 4]  # groups intact; the hung group is gone whole
    records = [json.loads(x) for x in open(tmp_path / "rollouts" / "rollouts.jsonl")]
    assert sorted(r["answer"] for r in records) == ["A0", "A1", "A3", "A4"]  # one line per finished group
    for r in records:
        assert r["rewards"] == [1.0, 1.0] and r["turns"] == [1, 1] and r["texts"] == [[r["answer"]]] * 2
        assert [len(vs) for vs in r["versions"]] == [1, 1]  # each reply's tokens carry one weight version
        assert r["start_time"] <= r["end_time"]


def test_malformed_requests_get_a_clear_400_and_unknown_sessions_404(tiny_model_dir):
    import aiohttp

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "user", "content": "Q7"}]
    bad = [  # body, the field the error must name
        ({"model": "m"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
        ({"messages": msgs, "n": 2}, "n"),
        ({"messages": msgs, "max_tokens": 0}, "max_tokens"),
        ({"messages": msgs, "top_p": "high"}, "top_p"),
        ({"messages": msgs, "stream": "yes"}, "stream"),
        ({"messages": msgs, "tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"messages": msgs, "tool_choice": "required"}, "tool_choice"),
        ({"messages": msgs, "stop": ["\n"]}, "stop"),
        ({"messages": msgs, "temperature": 0.3}, "temperature"),  # not the trainer's temperature
    ]

    async def main():
        proxy = await TrainingProxy(tok, GenerationConfig(temperature=1.0, max_new_tokens=8)).start()
        engine = ScriptedEngine(tok)
        session = proxy.open_session(engine)
        url = session.base_url + "/chat/completions"
        try:
            async with aiohttp.ClientSession() as http:
                for body, param in bad:
                    async with http.post(url, json=body) as r:
                        err = (await r.json())["error"]
                        assert r.status == 400 and err["param"] == param and param.split("[")[0] in err["message"], body
                async with http.post(url, data=b"{not json") as r:
                    assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
                async with http.post(session.base_url[:-3] + "/reward", json={"reward": "high"}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "reward"
                async with http.post(proxy.url + "/s/nope/v1/chat/completions", json={"messages": msgs}) as r:
                    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
                async with http.get(session.base_url + "/models") as r:
                    assert (await r.json())["data"][0]["id"] == "arealite"
                assert engine.calls == 0 and session.client.records == []  # nothing bad reached the engine
                # a good call, routed by the API key instead of the path; then the same call streamed
                headers = {"Authorization": f"Bearer {session.id}"}
                async with http.post(proxy.url + "/v1/chat/completions", json={"messages": msgs}, headers=headers) as r:
                    full = await r.json()
                async with http.post(url, json={"messages": msgs, "stream": True,
                                                "stream_options": {"include_usage": True}}) as r:
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    events = [line for line in (await r.text()).split("\n\n") if line]
        finally:
            await proxy.aclose()
        assert full["choices"][0]["message"] == {"role": "assistant", "content": "A7"}
        assert full["choices"][0]["finish_reason"] == "stop" and full["usage"]["completion_tokens"] == \
            len(tok("A7", add_special_tokens=False)["input_ids"]) + 1  # + EOS
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "A7"
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
        assert proxy.stats["bad_requests"] == len(bad) + 2 and proxy.stats["unknown_session"] == 1
    asyncio.run(main())
    with pytest.raises(ValueError, match="proxy.session_timeout"):
        ProxyAgentWorkflow(lambda *a: 0.0, tok, GenerationConfig(), config=ProxyConfig(session_timeout=0))
