"""Trajectory segments through the proxy and ArealOpenAI:

* a chat template that rewrites earlier turns (Qwen3-style: past reasoning dropped) is served,
  not refused: a call whose fresh prompt does not extend the recorded ids token for token starts
  a new segment; one whose prompt does extends it;
* AReaL#1498: a client that times out and retries the same messages leaves an orphan call that
  is never recorded; the retry extends the trajectory exactly as a single call would.
"""

import asyncio
import re

import aiohttp
import pytest
from transformers import AutoTokenizer

from arealite.agent import ArealOpenAI
from arealite.agent.proxy import TrainingProxy
from arealite.agent.proxy_workflow import ProxyAgentWorkflow
from arealite.api.config import GenerationConfig
from arealite.api.io_struct import ModelResponse
from arealite.workflow.multi_turn import episodes_to_batch
from test_proxy import ScriptedEngine

# ChatML like SmolLM2's, but as Qwen3's template treats reasoning: an assistant turn that is not
# the last loses its <think>...</think>; the last one always shows a (possibly empty) think block.
REWRITING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set c = m['content'] -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- if loop.last -%}{%- set c = '<think>\\n\\n</think>\\n\\n' + c -%}{%- endif -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")

REPLIES = {"Q1": "<think>carry the 1</think>A1", "Q2": "A2", "Q3": "<think>check</think>A3"}


def rewriting_tokenizer(path):
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = REWRITING_TEMPLATE
    return tok


def reply_to_last_question(prompt):
    return REPLIES[re.findall(r"Q\d", prompt)[-1]]


def render(tok, messages):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


async def three_questions(data, base_url, api_key):
    """An agent on plain HTTP: three questions, each reply sent back as returned."""
    messages = []
    async with aiohttp.ClientSession() as http:
        for q in ("Q1", "Q2", "Q3"):
            messages.append({"role": "user", "content": q})
            async with http.post(base_url + "/chat/completions", json={"messages": messages}) as r:
                assert r.status == 200, await r.text()
                messages.append((await r.json())["choices"][0]["message"])
    return 1.0


def test_template_that_rewrites_earlier_turns_starts_a_new_segment_instead_of_failing(tiny_model_dir):
    tok = rewriting_tokenizer(tiny_model_dir)
    gconfig = GenerationConfig(n_samples=1, temperature=1.0, max_new_tokens=32)
    sessions = []

    class Keep(ProxyAgentWorkflow):  # the library's workflow, keeping each session to inspect
        async def _reward(self, session, result, data):
            sessions.append(session)
            return await super()._reward(session, result, data)
    batch = asyncio.run(Keep(three_questions, tok, gconfig).arun_episode(ScriptedEngine(tok, reply_to_last_question), {}))
    r1, r2, r3 = client_records = sessions[0].client.records
    m1 = [{"role": "user", "content": "Q1"}]
    m2 = m1 + [{"role": "assistant", "content": REPLIES["Q1"]}, {"role": "user", "content": "Q2"}]
    m3 = m2 + [{"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"}]
    assert [r.prompt_ids for r in client_records] == [render(tok, m1), render(tok, m2), render(tok, m3)]
    assert [r.output_ids for r in client_records] == [ids(tok, REPLIES[q]) for q in ("Q1", "Q2", "Q3")]
    # turn 2's prompt shows turn 1 without its reasoning: not an extension -> a new segment;
    # turn 3's prompt shows turn 2 exactly as sampled -> it extends turn 2
    assert "carry the 1" not in tok.decode(r2.prompt_ids)
    assert (r1.parent, r2.parent, r3.parent) == (None, None, r2.id)
    assert [[r.id for r in c] for c in sessions[0].client.chains()] == [[r1.id], [r2.id, r3.id]]
    # the session's trained row: the last segment, sampled ids masked in, each with its logprobs
    expected = r3.prompt_ids + r3.output_ids
    mask = [0] * len(r2.prompt_ids) + [1] * len(r2.output_ids) + [0] * (len(r3.prompt_ids) - len(r2.prompt_ids)
                                                                         - len(r2.output_ids)) + [1] * len(r3.output_ids)
    assert batch["input_ids"][0].tolist() == expected and batch["loss_mask"][0].tolist() == mask
    assert batch["turns"].tolist() == [2.0] and batch["rewards"].tolist() == [1.0]
    sampled = batch["logprobs"][0][batch["loss_mask"][0].bool()].tolist()
    assert sampled == pytest.approx(r2.output_logprobs + r3.output_logprobs)
    # every segment as its own sample
    first, last = sessions[0].client.export_episodes(1.0)
    assert first.input_ids == r1.prompt_ids + r1.output_ids and first.loss_mask == [0] * len(r1.prompt_ids) + \
        [1] * len(r1.output_ids)
    assert last.input_ids == expected and last.loss_mask == mask and (first.turns, last.turns) == (1, 2)


class SlowOnce(ScriptedEngine):
    """ScriptedEngine whose calls take ``delays.pop(0)`` seconds first (0 once empty);
    ``started`` counts calls, ``cancelled`` those cancelled while waiting. With ``finish_anyway`` a cancelled call
    still returns its reply (a backend that completes in the same instant)."""

    def __init__(self, tok, delays, finish_anyway=False):
        super().__init__(tok)
        self.delays, self.finish_anyway, self.cancelled, self.started = list(delays), finish_anyway, 0, 0

    async def agenerate(self, req):
        self.started += 1
        delay = self.delays.pop(0) if self.delays else 0.0
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            if not self.finish_anyway:
                raise
        return await super().agenerate(req)


async def conversation(post):
    """Q1, Q2, Q3 with each reply sent back; ``post(body)`` returns the reply message."""
    messages = []
    for q in ("Q1", "Q2", "Q3"):
        messages.append({"role": "user", "content": q})
        messages.append(await post({"messages": messages}))
    return messages


def reference_episode(tok, gconfig):
    """The same conversation, once per call, in process: what the retried session must equal."""
    client = ArealOpenAI(ScriptedEngine(tok), tok, gconfig)

    async def post(body):
        m = (await client.chat.completions.create(**body)).choices[0].message
        return {"role": "assistant", "content": m.content}
    asyncio.run(conversation(post))
    return episodes_to_batch([client.export_episode(1.0)])


@pytest.mark.parametrize("finish_anyway", [False, True])
def test_retry_after_a_client_timeout_leaves_no_orphan_in_the_trajectory(tiny_model_dir, finish_anyway):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gconfig = GenerationConfig(temperature=1.0, max_new_tokens=8)
    engine = SlowOnce(tok, [0.0, 3.0], finish_anyway)  # the second call (Q2) outlasts the client's timeout

    async def main():
        proxy = await TrainingProxy(tok, gconfig).start()
        session = proxy.open_session(engine)
        url = session.base_url + "/chat/completions"
        timeouts = []
        try:
            async with aiohttp.ClientSession() as http:
                async def post(body):  # an SDK's behaviour: a 1 s timeout, then the same request again
                    for _ in range(2):
                        try:
                            async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                                return (await r.json())["choices"][0]["message"]
                        except asyncio.TimeoutError:
                            timeouts.append(body["messages"][-1]["content"])
                    raise AssertionError("the retry timed out too")
                await conversation(post)
            for _ in range(100):  # the orphan finishes (or is cancelled) on its own time
                if proxy.stats["orphans"]:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # nothing else arrives late
        finally:
            await proxy.aclose()
        return session, timeouts, proxy.stats
    session, timeouts, stats = asyncio.run(main())
    assert timeouts == ["Q2"] and engine.started == 4 and engine.cancelled == 1
    assert stats["orphans"] == 1 and stats["engine_errors"] == 0
    records = session.client.records
    assert [r.text for r in records] == ["A1", "A2", "A3"]  # the orphan's reply is not among them
    assert [r.parent for r in records] == [None, records[0].id, records[1].id]
    got, expected = episodes_to_batch([session.client.export_episode(1.0)]), reference_episode(tok, gconfig)
    for key in ("input_ids", "loss_mask", "logprobs", "versions", "turns"):
        assert got[key].tolist() == expected[key].tolist(), key


def test_in_process_call_cancelled_by_a_timeout_records_nothing(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gconfig = GenerationConfig(temperature=1.0, max_new_tokens=8)
    engine = SlowOnce(tok, [0.0, 5.0])
    client = ArealOpenAI(engine, tok, gconfig)

    async def post(body):
        for _ in range(2):
            try:
                m = (await asyncio.wait_for(client.chat.completions.create(**body), 0.3)).choices[0].message
                return {"role": "assistant", "content": m.content}
            except asyncio.TimeoutError:
                pass
        raise AssertionError("the retry timed out too")
    asyncio.run(conversation(post))
    assert engine.started == 4 and engine.cancelled == 1 and [r.text for r in client.records] == ["A1", "A2", "A3"]
    got, expected = episodes_to_batch([client.export_episode(1.0)]), reference_episode(tok, gconfig)
    assert got["input_ids"].tolist() == expected["input_ids"].tolist()
    assert got["loss_mask"].tolist() == expected["loss_mask"].tolist()
