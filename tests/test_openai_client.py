"""An agent written only against the OpenAI-style client yields trainable trajectories: exact
token prefixes across calls, masks on sampled ids only, server versions, and logprobs that the
trainer reproduces."""

import asyncio
import logging

import pytest
import torch
from transformers import AutoTokenizer

from arealite.agent import ArealOpenAI, OpenAIAgentWorkflow
from arealite.api.config import GenerationConfig, TrainEngineConfig
from arealite.api.io_struct import ModelResponse
from arealite.train_engine.fsdp import FSDPEngine
from arealite.workflow.multi_turn import episodes_to_batch
from arealite.utils.hf import tokenize_chat

ROW = {"question": "What is 12 + 30?", "answer": "42"}


async def three_turn_agent(client, data) -> float:
    """A plain OpenAI-style agent: answer, get challenged, see a tool result, answer again."""
    messages = [{"role": "user", "content": data["question"]}]
    first = await client.chat.completions.create(messages=messages, max_tokens=6)
    messages += [first.choices[0].message, {"role": "user", "content": "Are you sure? Answer again."}]
    second = await client.chat.completions.create(messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "tool", "content": "calculator: 42"}]
    third = await client.chat.completions.create(messages=messages, max_tokens=6, temperature=0.7)
    return float(data["answer"] in third.choices[0].message.content)


def test_agent_on_the_client_yields_trainable_trajectories(engine, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gconfig = GenerationConfig(n_samples=2, temperature=0.7, max_new_tokens=6)
    clients = []

    class Recording(OpenAIAgentWorkflow):  # the library's workflow, keeping each client to inspect
        async def run_one(self, eng, data):
            client = ArealOpenAI(eng, tok, gconfig)
            clients.append(client)
            return client.export_episode(await self.agent_fn(client, data))
    workflow = Recording(three_turn_agent, tok, gconfig)

    async def main():
        try:
            return await workflow.arun_episode(engine, ROW)
        finally:
            await engine.aclose()
    batch = asyncio.run(main())
    assert batch["input_ids"].shape[0] == 2 and batch["turns"].tolist() == [3.0, 3.0]
    for row, client in enumerate(clients):
        recs = client.records
        assert [r.parent for r in recs] == [None, recs[0].id, recs[1].id]  # one chain, no re-tokenisation
        T = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :T].tolist()
        mask = batch["loss_mask"][row, :T]
        assert ids == recs[-1].prompt_ids + recs[-1].output_ids
        assert recs[0].prompt_ids == tokenize_chat(tok, [{"role": "user", "content": ROW["question"]}])
        for r in recs:
            span = slice(len(r.prompt_ids), len(r.prompt_ids) + len(r.output_ids))
            assert ids[: len(r.prompt_ids)] == r.prompt_ids  # every prompt is a prefix of the trajectory
            assert ids[span] == r.output_ids and mask[span].tolist() == [1] * len(r.output_ids)
            assert batch["logprobs"][row, span].tolist() == pytest.approx(r.output_logprobs)
            assert batch["versions"][row, span].tolist() == r.output_versions == [0] * len(r.output_ids)  # server v0
        assert int(mask.sum()) == sum(len(r.output_ids) for r in recs) > 0
        assert (batch["versions"][row, :T][~mask.bool()] == -1).all()
        assert "calculator: 42" in tok.decode(torch.tensor(ids)[~mask.bool()].tolist())
    # trainable: the trainer's logprobs of the recorded tokens equal the server's
    actor = FSDPEngine(TrainEngineConfig(path=tiny_model_dir), temperature=0.7)
    actor.initialize(tiny_model_dir)
    recomputed = actor.forward(batch)
    sampled = batch["loss_mask"].bool()
    assert (recomputed[sampled] - batch["logprobs"][sampled]).abs().max().item() < 1e-4


class EchoEngine:
    """Returns the ids of ``reply`` + EOS with logprob -0.5 and version 7."""

    def __init__(self, tok, reply="ok"):
        self.tok, self.reply = tok, reply

    async def agenerate(self, req):
        out = self.tok(self.reply, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return ModelResponse(input_tokens=req.input_ids, output_tokens=out, output_logprobs=[-0.5] * len(out),
                             output_versions=[7] * len(out), stop_reason="stop")


def test_rewritten_history_starts_a_new_chain_and_only_the_last_is_exported(tiny_model_dir, caplog):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = ArealOpenAI(EchoEngine(tok), tok, GenerationConfig(temperature=0.7))

    async def agent():
        msgs = [{"role": "user", "content": "hi"}]
        a = await client.chat.completions.create(messages=msgs)
        msgs += [a.choices[0].message, {"role": "user", "content": "more"}]
        await client.chat.completions.create(messages=msgs)
        # the agent summarises: the earlier reply is changed, so this is a fresh prompt
        await client.chat.completions.create(messages=[{"role": "user", "content": "summary: ok"}])
    asyncio.run(agent())
    assert [len(c) for c in client.chains()] == [2, 1]
    with caplog.at_level(logging.WARNING, logger="arealite.agent"):
        ep = client.export_episode(1.0)
    assert "2 of 3 calls" in caplog.text
    assert ep.turns == 1 and ep.input_ids == tokenize_chat(tok, [{"role": "user", "content": "summary: ok"}]) + \
        tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    batch = episodes_to_batch([ep])
    assert batch["loss_mask"].sum() == 2 and batch["logprobs"][batch["loss_mask"].bool()].tolist() == [-0.5, -0.5]
    assert batch["versions"][batch["loss_mask"].bool()].tolist() == [7, 7]


def test_client_rejects_what_it_cannot_train_on(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = ArealOpenAI(EchoEngine(tok), tok, GenerationConfig(temperature=0.7))
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="gconfig.temperature"):
        asyncio.run(client.chat.completions.create(messages=msgs, temperature=1.0))
    with pytest.raises(ValueError, match="'n'=2"):
        asyncio.run(client.chat.completions.create(messages=msgs, n=2))
    with pytest.raises(RuntimeError, match="no chat.completions.create call"):
        client.export_episode(0.0)


def test_the_documented_example_agent_runs_and_is_at_most_40_lines(tiny_model_dir):
    import os
    import re
    import sys

    from conftest import REPO_ROOT

    doc = open(os.path.join(REPO_ROOT, "docs", "custom_agent.md")).read()
    code = re.search(r"```python\n(.*?)```", doc, re.DOTALL).group(1)
    assert len(code.strip().splitlines()) <= 40
    assert "sys.path" not in code  # a user's agent file imports only the package
    namespace = {"__name__": "my_agent"}
    exec(compile(code, "my_agent.py", "exec"), namespace)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    from arealite.api.config import MultiTurnGRPOConfig

    config = MultiTurnGRPOConfig(gconfig=GenerationConfig(n_samples=1, temperature=0.7))
    workflow = namespace["build"](config, tok, None)
    row = {"messages": [{"role": "user", "content": "What is 12 + 30?"}], "answer": "42"}
    for reply, turns, reward in [("41", 2.0, 0.0), ("It is 42", 1.0, 1.0)]:
        batch = asyncio.run(workflow.arun_episode(EchoEngine(tok, reply), row))
        assert batch["turns"].tolist() == [turns] and batch["rewards"].tolist() == [reward]
        n_reply = len(tok(reply, add_special_tokens=False)["input_ids"]) + 1
        assert int(batch["loss_mask"].sum()) == turns * n_reply
