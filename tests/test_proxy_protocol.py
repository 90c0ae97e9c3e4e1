"""The proxy's reply and request rules, for the proxy (JSON and streamed) and ArealOpenAI alike:

* tool calls: ``function.arguments`` is a JSON string that decodes, exactly once, to an object,
  whatever form the model wrote the arguments in; a block whose arguments are not an object is
  not a tool call;
* sampling fields (arealite.agent.sampling): each one that would make the recorded logprobs
  wrong for RL is refused with a 400 in OpenAI's error shape naming the field and the fix;
  neutral values pass; fields that change nothing are ignored and named in a header.
"""

import asyncio
import json

import aiohttp
import pytest
from transformers import AutoTokenizer

from arealite.agent import ArealOpenAI
from arealite.agent.openai_client import parse_tool_calls
from arealite.agent.proxy import TrainingProxy
from arealite.agent.sampling import IGNORED_HEADER, SamplingError
from arealite.api.config import GenerationConfig
from test_proxy import ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MSGS = [{"role": "user", "content": "Q7"}]


def block(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


# (what the model wrote inside <tool_call>, the arguments string of the call, or None: no call)
ARGUMENT_CASES = [
    ('{"name": "f", "arguments": {"x": 1}}', '{"x": 1}'),  # an object
    ('{"name": "f", "arguments": "{\\"x\\": 1}"}', '{"x": 1}'),  # a string holding an object: decoded once
    ('{"name": "f", "arguments": "{\\"x\\":1,\\"y\\":[1,2]}"}', '{"x": 1, "y": [1, 2]}'),
    ('{"name": "f", "arguments": {}}', "{}"),
    ('{"name": "f"}', "{}"),  # no arguments
    ('{"name": "f", "arguments": null}', "{}"),
    ('{"name": "f", "arguments": "  "}', "{}"),
    ('{"name": "f", "arguments": "\\"{\\\\\\"x\\\\\\": 1}\\""}', None),  # a string of a string: not an object once decoded
    ('{"name": "f", "arguments": "[1, 2]"}', None),
    ('{"name": "f", "arguments": [1, 2]}', None),
    ('{"name": "f", "arguments": 3}', None),
    ('{"name": "f", "arguments": "not json"}', None),
    ('{"name": "", "arguments": {}}', None),
    ('{"name": 5, "arguments": {}}', None),
    ('{"arguments": {"x": 1}}', None),
    ('{"name": "f", "arguments": {"x": 1}', None),  # malformed JSON
]


@pytest.mark.parametrize("written,arguments", ARGUMENT_CASES)
def test_tool_call_arguments_decode_once_to_an_object(written, arguments):
    calls = parse_tool_calls("I will call it. " + block(written))
    if arguments is None:
        assert calls is None
        return
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "f", "arguments": arguments}
    assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)


def test_only_the_valid_blocks_of_a_reply_are_calls():
    text = block('{"name": "f", "arguments": "[1]"}') + block('{"name": "g", "arguments": "{\\"a\\": \\"b\\"}"}')
    assert [c["function"] for c in parse_tool_calls(text)] == [{"name": "g", "arguments": '{"a": "b"}'}]


def test_proxy_and_client_return_arguments_decoded_once_streamed_or_not(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    string_args = block('{"name": "f", "arguments": "{\\"x\\": 1}"}')
    bad_args = block('{"name": "f", "arguments": "[1, 2]"}')
    gconfig = GenerationConfig(temperature=1.0, max_new_tokens=64)

    async def main():
        proxy = await TrainingProxy(tok, gconfig).start()
        engine = ScriptedEngine(tok, lambda p: bad_args if "Q8" in p else string_args)
        url = proxy.open_session(engine).base_url + "/chat/completions"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(url, json={"messages": MSGS, "tools": TOOLS}) as r:
                    full = await r.json()
                async with http.post(url, json={"messages": MSGS, "tools": TOOLS, "stream": True}) as r:
                    events = [e for e in (await r.text()).split("\n\n") if e and e != "data: [DONE]"]
                async with http.post(url, json={"messages": [{"role": "user", "content": "Q8"}], "tools": TOOLS}) as r:
                    bad = await r.json()
        finally:
            await proxy.aclose()
        client = ArealOpenAI(ScriptedEngine(tok, lambda p: string_args), tok, gconfig)
        local = await client.chat.completions.create(messages=MSGS, tools=TOOLS)
        return full, [json.loads(e[len("data: "):]) for e in events], bad, local
    full, chunks, bad, local = asyncio.run(main())
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == string_args
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(d["index"], d["function"]) for d in deltas] == [(0, {"name": "f", "arguments": '{"x": 1}'})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(deltas[0]["function"]["arguments"]) == {"x": 1}  # one decode gives the object
    # arguments that are not an object: the text is the reply, no call, finished by "stop"
    assert bad["choices"][0]["message"] == {"role": "assistant", "content": bad_args}
    assert bad["choices"][0]["finish_reason"] == "stop"
    assert local.choices[0].finish_reason == "tool_calls"
    assert local.choices[0].message.tool_calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


# (field, a value that changes sampling or recording, a piece of the fix the message must give)
REFUSED = [
    ("temperature", 0.3, "omit temperature or send 1.0"),
    ("top_p", 0.9, "omit top_p or send 1"),
    ("top_k", 40, "omit top_k or send -1"),
    ("min_p", 0.05, "omit min_p or send 0"),
    ("presence_penalty", 0.5, "omit presence_penalty or send 0"),
    ("frequency_penalty", -0.2, "omit frequency_penalty or send 0"),
    ("repetition_penalty", 1.1, "omit repetition_penalty or send 1"),
    ("logit_bias", {"50": -100}, "omit logit_bias"),
    ("n", 2, "call it n times"),
    ("best_of", 3, "call it several times"),
    ("stop", ["\n"], "stop in the agent instead"),
    ("stop", "END", "stop in the agent instead"),
    ("response_format", {"type": "json_object"}, "omit response_format"),
    ("top_p", "high", "must be a number"),
]
NEUTRAL = {"temperature": 1.0, "top_p": 1, "top_k": -1, "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
           "repetition_penalty": 1, "logit_bias": {"50": 0}, "n": 1, "best_of": 1, "stop": [],
           "response_format": {"type": "text"}, "seed": None}
IGNORED = {"seed": 3, "logprobs": True, "user": "u1", "parallel_tool_calls": False}


def test_sampling_fields_are_refused_by_name_or_ignored_and_reported(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gconfig = GenerationConfig(temperature=1.0, max_new_tokens=8)

    async def main():
        proxy = await TrainingProxy(tok, gconfig).start()
        engine = ScriptedEngine(tok)
        session = proxy.open_session(engine)
        url = session.base_url + "/chat/completions"
        refused, ok = [], []
        try:
            async with aiohttp.ClientSession() as http:
                for field, value, _ in REFUSED:
                    async with http.post(url, json={"messages": MSGS, field: value}) as r:
                        refused.append((r.status, await r.json()))
                calls_after_refusals = engine.calls
                for body in ({"messages": MSGS}, {"messages": MSGS, **NEUTRAL}, {"messages": MSGS, **IGNORED}):
                    async with http.post(url, json=body) as r:
                        ok.append((r.status, r.headers.get(IGNORED_HEADER), await r.json()))
        finally:
            await proxy.aclose()
        return refused, calls_after_refusals, ok, proxy.stats
    refused, calls_after_refusals, ok, stats = asyncio.run(main())
    for (field, value, fix), (status, body) in zip(REFUSED, refused):
        err = body["error"]
        assert status == 400 and set(body) == {"error"} and set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", field, "unsupported_value")
        assert err["message"].startswith(f"'{field}'={value!r}") and fix in err["message"], err["message"]
    assert calls_after_refusals == 0 and stats["bad_requests"] == len(REFUSED)
    (s0, h0, plain), (s1, h1, neutral), (s2, h2, ignored) = ok
    assert (s0, s1, s2) == (200, 200, 200)
    assert (h0, h1, h2) == (None, None, "logprobs,parallel_tool_calls,seed,user")
    assert plain["choices"] == neutral["choices"] == ignored["choices"]  # nothing changed the reply
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "A7"}
    assert stats["ignored_params"] == 1


@pytest.mark.parametrize("field,value,fix", REFUSED)
def test_arealopenai_refuses_the_same_fields(tiny_model_dir, field, value, fix):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tok)
    client = ArealOpenAI(engine, tok, GenerationConfig(temperature=1.0, max_new_tokens=8))
    with pytest.raises(SamplingError, match=fix) as info:
        asyncio.run(client.chat.completions.create(messages=MSGS, **{field: value}))
    assert info.value.param == field and engine.calls == 0 and client.records == []


def test_session_gconfig_values_pass_and_the_openai_package_sees_the_param(tiny_model_dir):
    """A session's own (evaluation) top_p is accepted; the openai package's BadRequestError
    carries the field and code of a refusal."""
    openai = pytest.importorskip("openai")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def main():
        proxy = await TrainingProxy(tok, GenerationConfig(temperature=0.7, max_new_tokens=8)).start()
        engine = ScriptedEngine(tok)
        session = proxy.open_session(engine, GenerationConfig(temperature=0.7, top_p=0.95, max_new_tokens=8))
        try:
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as c:
                same = await c.chat.completions.create(model="m", messages=MSGS, top_p=0.95, temperature=0.7)
                with pytest.raises(openai.BadRequestError) as info:
                    await c.chat.completions.create(model="m", messages=MSGS, frequency_penalty=1.0)
        finally:
            await proxy.aclose()
        return same, info.value
    same, err = asyncio.run(main())
    assert same.choices[0].message.content == "A7"
    assert err.status_code == 400 and err.param == "frequency_penalty" and err.code == "unsupported_value"


def test_arealopenai_tool_choice_none_and_forced(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ScriptedEngine(tok, lambda p: block('{"name": "f", "arguments": {"x": 1}}'))
    client = ArealOpenAI(engine, tok, GenerationConfig(temperature=1.0, max_new_tokens=64))
    reply = asyncio.run(client.chat.completions.create(messages=MSGS, tools=TOOLS, tool_choice="none"))
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert client.records[0].tools is None  # generated without the tools
    with pytest.raises(SamplingError, match="only 'auto' and 'none'") as info:
        asyncio.run(client.chat.completions.create(messages=MSGS, tools=TOOLS, tool_choice="required"))
    assert info.value.param == "tool_choice" and engine.calls == 1
