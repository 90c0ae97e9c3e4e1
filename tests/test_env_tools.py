"""The tool contract (arealite/env/tools.py), the search agent's world (arealite/env/search.py) and the
episode limits of MultiTurnWorkflow: exact token-in/token-out trajectories with tool output masked out,
BM25 scores equal to a hand-written Okapi BM25, and timed-out / failed tools or episodes that end with a
counted reason and lose nothing else."""

import asyncio
import math
import re

import pytest
from transformers import AutoTokenizer

from arealite.api.config import GenerationConfig
from arealite.api.env import StepResult
from arealite.env.search import (BM25Index, SearchEnv, exact_match, extract_answer, f1_score, in_split,
                                 make_encyclopedia, make_search_questions, normalize_answer, search_stops,
                                 shared_index)
from arealite.env.tools import Tool, ToolEnv, ToolError, parse_tool_calls, stop_at, tools_prompt
from arealite.workflow.multi_turn import END_REASONS, MultiTurnWorkflow
from test_proxy import ScriptedEngine

INFO_KEYS = ("tool_calls", "tool_errors", "correct", *(f"ended_{r}" for r in END_REASONS))


class EchoEnv(ToolEnv):
    """Tools: ``add(a, b)``, ``fail()`` (a domain error), ``hang()`` (sleeps), ``crash()`` (the tool breaks);
    a turn without a call ends the episode with reward 1."""

    def __init__(self, call_format="hermes", tool_timeout=0.5):
        async def hang():
            await asyncio.sleep(30)

        def fail():
            raise ToolError("no such record")

        def crash():
            raise RuntimeError("index file missing")

        schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}
        tools = [Tool("add", "add two numbers", schema, lambda a, b: str(int(a) + int(b))),
                 Tool("fail", "always a domain error", {"type": "object", "properties": {}}, fail),
                 Tool("hang", "never returns", {"type": "object", "properties": {}}, hang),
                 Tool("crash", "breaks", {"type": "object", "properties": {}}, crash)]
        super().__init__(tools, tool_timeout=tool_timeout, call_format=call_format)

    async def areset(self, data):
        return [{"role": "user", "content": data["q"]}]

    async def aon_text(self, completion):
        return StepResult(reward=1.0, done=True)


def run(coro):
    return asyncio.run(coro)


def test_hermes_and_tag_calls_run_the_tools_and_errors_go_back_as_text():
    env = EchoEnv("hermes")
    step = run(env.astep('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
                         '<tool_call>{"name": "fail", "arguments": {}}</tool_call>'
                         '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                         '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'))
    assert not step.done and step.info == {"tool_calls": 4, "tool_errors": 3}
    content = step.messages[0]["content"]
    assert content.startswith("<tool_response>\n42\n</tool_response>\n<tool_response>\nError: no such record")
    assert "Error: unknown tool 'nope'" in content and "Error: bad arguments for add" in content
    assert [(c.name, c.ok) for c in env.calls] == [("add", True), ("fail", False), ("nope", False), ("add", False)]

    tags = EchoEnv("tags")
    step = run(tags.astep("first <add>2 | 40</add> then <add>1</add>"))
    assert step.messages[0]["content"] == "<information>42\nError: add takes 2 arguments (a | b), got 1</information>"
    assert step.info == {"tool_calls": 2, "tool_errors": 1}
    assert tags.render_call("add", {"a": 2, "b": 40}) == "<add>2 | 40</add>"
    assert tags.stops() == ("</add>", "</fail>", "</hang>", "</crash>") and env.stops() == ("</tool_call>",)
    assert run(tags.astep("no call here")).done  # a turn without a call goes to aon_text


def test_tool_schema_and_prompt_are_openai_function_form():
    env = EchoEnv()
    schema = env.tools[0].schema()
    assert schema == {"type": "function", "function": {"name": "add", "description": "add two numbers",
                                                       "parameters": env.tools[0].parameters}}
    prompt = tools_prompt(env.tools)
    assert '{"type": "function", "function": {"name": "add"' in prompt and "<tool_call>" in prompt
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')[0][
        "function"]["arguments"] == '{"a": 1, "b": 2}'  # a JSON-string argument object is decoded once
    with pytest.raises(ValueError, match="tool_timeout"):
        EchoEnv(tool_timeout=0)
    with pytest.raises(ValueError, match="call_format"):
        EchoEnv(call_format="xml")


def test_stop_at_cuts_right_after_the_first_stop_string(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("<search>Doru Vask</search> and then <information>made up</information>", add_special_tokens=False)[
        "input_ids"]
    k = stop_at(search_stops("tags"))(tok, ids)
    assert tok.decode(ids[:k]) == "<search>Doru Vask</search>"
    assert stop_at(("</answer>",))(tok, ids) == len(ids)  # no stop string: everything is kept


@pytest.mark.parametrize("tool,reason", [("hang", "tool_timeout"), ("crash", "tool_failed")])
def test_a_timed_out_or_failed_tool_ends_only_its_episode_with_a_counted_reason(tiny_model_dir, tool, reason):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    call = f'<tool_call>{{"name": "{tool}", "arguments": {{}}}}</tool_call>'

    def reply(prompt):  # the row "bad" calls the broken tool; "good" adds, then answers
        if "bad" in prompt:
            return call
        return "the sum is 42" if "<tool_response>" in prompt else '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'

    gconfig = GenerationConfig(n_samples=1, max_new_tokens=48)
    wf = MultiTurnWorkflow(lambda d: EchoEnv(), gconfig, tok, max_turns=3, turn_discount=1.0,
                           truncate_fn=stop_at(("</tool_call>",)), info_keys=INFO_KEYS)
    engine = ScriptedEngine(tok, reply)

    async def both():
        return await asyncio.gather(wf.run_one(engine, {"q": "bad"}), wf.run_one(engine, {"q": "good"}))

    bad, good = run(both())
    assert bad.reward == 0.0 and bad.turns == 1 and bad.info == {"tool_calls": 1, "tool_errors": 0, f"ended_{reason}": 1}
    sampled = [t for t, m in zip(bad.input_ids, bad.loss_mask) if m]
    assert tok.decode(sampled) == call  # the turn that called the tool is kept, token for token
    assert good.reward == 1.0 and good.turns == 2 and good.info["ended_done"] == 1 and good.info["tool_calls"] == 1
    batch = run(wf.arun_episode(engine, {"q": "bad"}))
    assert batch[f"ended_{reason}"].tolist() == [1.0] and batch["ended_done"].tolist() == [0.0]
    assert wf.stat_keys == ("turns", *INFO_KEYS)


def test_episode_wall_time_limit_cancels_the_turn_in_flight(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    class SlowSecondTurn(ScriptedEngine):
        async def agenerate(self, req):
            if self.calls >= 1:
                await asyncio.sleep(30)
            return await super().agenerate(req)

    wf = MultiTurnWorkflow(lambda d: EchoEnv(), GenerationConfig(n_samples=1, max_new_tokens=48), tok, max_turns=3,
                           truncate_fn=stop_at(("</tool_call>",)), max_episode_seconds=0.5)
    engine = SlowSecondTurn(tok, lambda p: '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    ep = run(wf.run_one(engine, {"q": "x"}))
    assert ep.turns == 1 and ep.reward == 0.0 and ep.info["ended_time_limit"] == 1 and len(ep.requests) == 1
    assert "<tool_response>\n3\n</tool_response>" in tok.decode(ep.input_ids)  # the first turn and its output stay
    with pytest.raises(ValueError, match="max_episode_seconds"):
        MultiTurnWorkflow(lambda d: EchoEnv(), GenerationConfig(), tok, max_episode_seconds=0)


# --- the search agent's world ---------------------------------------------------------------------------

def test_encyclopedia_is_seeded_and_questions_are_answerable_from_the_passages():
    enc = make_encyclopedia(3, n_people=50, n_cities=8, n_countries=3)
    assert make_encyclopedia(3, n_people=50, n_cities=8, n_countries=3).passages == enc.passages
    assert make_encyclopedia(4, n_people=50, n_cities=8, n_countries=3).passages != enc.passages
    assert len(enc.passages) == 58 and len(set(enc.people) | set(enc.cities)) == 58
    rows = make_search_questions(enc, 8, seed=1)
    assert [r["kind"] for r in rows] == ["city", "year", "profession", "country"] * 2
    for r in rows:
        person = enc.people[r["person"]]
        passage = next(p for p in enc.passages if p.startswith(r["person"] + " was"))
        if r["kind"] == "country":  # two hops: the person's city, then the city's passage
            assert r["hops"] == 2 and r["answer"] == enc.cities[person["city"]]["country"]
            assert any(p.startswith(f"{person['city']} is a city in {r['answer']},") for p in enc.passages)
        else:
            assert r["hops"] == 1 and r["answer"] in passage
    train = {r["person"] for r in make_search_questions(enc, split="train")}
    test = {r["person"] for r in make_search_questions(enc, split="test")}
    assert train.isdisjoint(test) and train | test == set(enc.people) and test == {p for p in enc.people
                                                                                      if in_split(p, "test")}
    with pytest.raises(ValueError, match="kinds"):
        make_search_questions(enc, 2, kinds=("colour",))


def test_answer_normalisation_exact_match_and_f1():
    assert normalize_answer("The  Bremor!") == "bremor" and exact_match("the bremor.", "Bremor") == 1.0
    assert exact_match("Bremor city", "Bremor") == 0.0
    assert f1_score("Bremor city", "Bremor") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert f1_score("Tosk", "Bremor") == 0.0
    assert extract_answer("<answer>x</answer> no, <answer> Bremor </answer>") == "Bremor"
    assert extract_answer("Bremor") is None


def okapi_bm25(corpus: list[list[str]], query: list[str], k1=1.5, b=0.75) -> list[float]:
    """Lucene's BM25 as Kamphuis et al. 2020 (ECIR, "Which BM25 do you mean?") write it:
    Σ_t idf(t) · tf / (tf + k1 · (1 − b + b · |d| / avgdl)), idf(t) = ln(1 + (N − n_t + 0.5) / (n_t + 0.5))."""
    n_docs, avgdl = len(corpus), sum(map(len, corpus)) / len(corpus)
    scores = []
    for doc in corpus:
        s = 0.0
        for term in set(query):
            n = sum(term in d for d in corpus)
            tf = doc.count(term)
            if tf:
                idf = math.log(1 + (n_docs - n + 0.5) / (n + 0.5))
                s += idf * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))
        scores.append(s)
    return scores


def test_bm25_matches_a_hand_written_okapi_bm25_and_finds_the_known_passages(tmp_path):
    passages = ["Doru Vask painter Bremor", "Lina Pell chemist Tosk", "Doru Pell poet Bremor Bremor",
                "Bremor city Ostrelia", "Tosk city Ostrelia"]
    index = BM25Index(passages)
    words = [re.findall(r"\w+", p.lower()) for p in passages]
    for query in ["Doru Vask", "Bremor", "Pell Tosk", "Ostrelia city"]:
        expected = okapi_bm25(words, re.findall(r"\w+", query.lower()))
        hits = index.search(query, k=5)
        assert {d for d, _ in hits} == {i for i, s in enumerate(expected) if s > 0}  # every matching passage
        assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)  # best first
        for d, score in hits:
            assert score == pytest.approx(expected[d], rel=1e-5)
    assert index.search("Doru Vask", k=1)[0][0] == 0 and index.search("nothing matches", k=3) == []

    cached = BM25Index(passages, str(tmp_path / "idx"))
    again = BM25Index(passages, str(tmp_path / "idx"))
    assert not cached.loaded_from_cache and again.loaded_from_cache
    assert again.search("Pell Tosk", 3) == cached.search("Pell Tosk", 3) == index.search("Pell Tosk", 3)
    assert not BM25Index(passages[:4], str(tmp_path / "idx")).loaded_from_cache  # other passages: rebuilt


def test_search_episode_is_exact_token_in_token_out_with_tool_output_masked(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = make_encyclopedia(0, n_people=40, n_cities=6, n_countries=2)
    index = shared_index(enc, str(tmp_path))
    assert shared_index(enc, str(tmp_path)) is index  # one index per process, shared by every episode
    row = make_search_questions(enc, 1, seed=0, kinds=("country",))[0]
    city = enc.people[row["person"]]["city"]
    replies = [f"<search>{row['person']}</search> I will now make up the result",
               f"<search>{city}</search>", f"<answer>{row['answer']}</answer>"]

    def reply(prompt):
        return replies[prompt.count("<information>[") - 2]  # the two demonstrations hold one each

    wf = MultiTurnWorkflow(lambda d: SearchEnv(index), GenerationConfig(n_samples=2, max_new_tokens=32), tok,
                           max_turns=4, turn_discount=1.0, max_context_tokens=2048,
                           truncate_fn=stop_at(search_stops()), info_keys=INFO_KEYS)
    batch = run(wf.arun_episode(ScriptedEngine(tok, reply), row))
    assert batch["rewards"].tolist() == [1.0, 1.0] and batch["turns"].tolist() == [3.0, 3.0]
    assert batch["tool_calls"].tolist() == [2.0, 2.0] and batch["correct"].tolist() == [1.0, 1.0]
    ids, mask = batch["input_ids"][0], batch["loss_mask"][0].bool()
    n = int(batch["attention_mask"][0].sum())
    sampled = tok.decode(ids[:n][mask[:n]].tolist())
    assert sampled == replies[0].split(" I will")[0] + replies[1] + replies[2]  # cut at </search>, </answer>
    masked = tok.decode(ids[:n][~mask[:n]].tolist())
    person_passage = next(p for p in enc.passages if p.startswith(row["person"] + " was"))
    assert f"<information>[1] {person_passage}" in masked and f"{city} is a city in {row['answer']}" in masked
    # the whole trajectory is the chat template of the conversation: nothing was re-tokenised differently
    env = SearchEnv(index)
    conv = run(env.areset(row))
    for text in replies[:2]:
        cut = text.split(" I will")[0]
        conv += [{"role": "assistant", "content": cut}, *run(env.astep(cut)).messages]
    conv.append({"role": "assistant", "content": replies[2]})
    assert tok.decode(ids[:n].tolist()) + "<|im_end|>\n" == tok.apply_chat_template(conv, tokenize=False)
    assert "logprobs" in batch and float(batch["logprobs"][0][~mask].abs().sum()) == 0.0


def test_search_env_rewards_only_an_exact_answer():
    env = SearchEnv(BM25Index(["Doru Vask was a poet born in 1901 in the city of Bremor."]), format_reward=0.1)
    run(env.areset({"question": "In which city was Doru Vask born?", "answer": "Bremor"}))
    assert run(env.aon_text("<answer>the Bremor</answer>")).reward == 1.0
    wrong = run(env.aon_text("<answer>Tosk</answer>"))
    assert wrong.reward == 0.1 and wrong.info == {"answered": 1, "correct": 0.0}
    assert run(env.aon_text("Bremor")).reward == 0.0  # no answer tags: not answered
    step = run(env.astep("<search>Doru Vask</search>"))
    assert step.messages[0]["content"] == "<information>[1] Doru Vask was a poet born in 1901 in the city of Bremor.</information>"
    with pytest.raises(KeyError, match="question"):
        run(env.areset({"answer": "x"}))
