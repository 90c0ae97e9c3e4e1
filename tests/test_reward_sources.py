"""Reward sources: a combined reward's components and weights, failures that drop a group (never a
guessed value) and stop a run that only fails, an LLM judge with scripted replies (parseable,
unparseable, timeout) and its cost counters, the remote reward model against a dead server, and a
3-step GRPO run on 2 ranks rewarded by a tiny judge served by our server."""

import asyncio
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, env_without_dist
from arealite.api.config import GenerationConfig
from arealite.api.engine import InferenceEngine
from arealite.api.io_struct import ModelResponse
from arealite.reward.sources import (CombinedReward, LengthPenalty, LLMJudge, RemoteRewardModel, RewardFailure,
                                     RewardSource, Sample, parse_judge_score)


class Scripted(RewardSource):
    """Returns the next scripted value; an Exception instance is raised."""

    failure_keys = ("timeout",)

    def __init__(self, name, values):
        super().__init__(name)
        self.values = list(values)

    async def _score(self, sample):
        v = self.values.pop(0)
        if isinstance(v, Exception):
            raise v
        return v


def sample(text="5", answer="5", ids=(7, 8, 9)):
    return Sample([{"role": "user", "content": "What is 2+3?"}], text, [1, 2], list(ids), {"answer": answer})


def test_combined_reward_components_weights_and_counters():
    rm, ver, length = Scripted("rm", [0.8, 1.5]), Scripted("verifier", [1.0, 0.0]), LengthPenalty(0.01)
    combo = CombinedReward([(rm, 2.0), (ver, 0.0), (length, 1.0)])
    total, parts = asyncio.run(combo.ascore_parts(sample()))
    assert parts == {"rm": 0.8, "verifier": 1.0, "length": -0.03}
    assert total == pytest.approx(2.0 * 0.8 + 0.0 * 1.0 - 0.03)
    assert asyncio.run(combo.ascore(sample(ids=[1]))) == pytest.approx(3.0 - 0.01)
    c = combo.counters()
    assert c["total/calls"] == 2 and c["total/ok"] == 2 and c["total/score_sum"] == pytest.approx(1.57 + 2.99)
    assert c["rm/calls"] == 2 and c["rm/score_sum"] == pytest.approx(2.3) and c["verifier/ok"] == 2
    assert combo.components() == ("rm", "verifier", "length")
    with pytest.raises(ValueError, match="distinct"):
        CombinedReward([(rm, 1.0), (Scripted("rm", []), 1.0)])


def test_a_failed_component_fails_the_sample_and_keys_never_change():
    rm = Scripted("rm", [RewardFailure("timeout"), RewardFailure("weird_reason")])
    combo = CombinedReward([(rm, 1.0), (Scripted("verifier", [1.0, 1.0]), 0.0)])
    keys = set(combo.counters())
    for _ in range(2):
        with pytest.raises(RewardFailure):
            asyncio.run(combo.ascore_parts(sample()))
    c = combo.counters()
    assert set(c) == keys  # summed over ranks: a key never appears mid-run
    assert (c["rm/failed_timeout"], c["rm/failed_other"], c["rm/ok"], c["total/failed_timeout"]) == (1, 1, 0, 1)


@pytest.mark.parametrize("text,score", [
    ("Score: 7", 0.7), ("The answer is right. Score: 10", 1.0), ("Score: 3/5", 0.6), ("**Score:** 4", 0.4),
    ("score = 2 ... wait, Score: 9", 0.9), ("\\boxed{8}", 0.8), ("I give it 6/10", 0.6), ("Rating: 5", 0.5),
    ("Score: 11", None), ("Score: -1", None), ("great answer", None), ("", None),
])
def test_parse_judge_score(text, score):
    got = parse_judge_score(text, 10)
    assert got == (pytest.approx(score) if score is not None else None)


class ScriptedEngine(InferenceEngine):
    """Replies with scripted texts (tokenized); ``"SLEEP"`` never answers in time."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def agenerate(self, req):
        self.prompts.append(self.tokenizer.decode(req.input_ids))
        text = self.replies.pop(0)
        if text == "SLEEP":
            await asyncio.sleep(10)
        toks = self.tokenizer.encode(text, add_special_tokens=False)
        return ModelResponse(list(req.input_ids), toks, [0.0] * len(toks), [0] * len(toks), "stop")

    def pause_generation(self): ...
    def continue_generation(self): ...
    def update_weights(self, meta): ...


def test_judge_with_scripted_replies(tiny_model_dir):
    from arealite.utils.hf import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    eng = ScriptedEngine(tok, ["Reasoning... Score: 7", "I cannot decide.", "SLEEP", "Score: 10/10"])
    judge = LLMJudge(eng, tok, timeout=0.5, rubric="Be strict.")

    async def run():
        out = []
        for _ in range(4):
            try:
                out.append(await judge.ascore(sample("The sum is 5.", answer="5")))
            except RewardFailure as e:
                out.append(e.reason)
        return out

    assert asyncio.run(run()) == [pytest.approx(0.7), "unparseable", "timeout", 1.0]
    p = eng.prompts[0]
    assert "What is 2+3?" in p and "The sum is 5." in p and "Reference answer: 5" in p and "Be strict." in p
    c = judge.counters()
    assert (c["judge/calls"], c["judge/ok"], c["judge/failed_unparseable"], c["judge/failed_timeout"]) == (4, 2, 1, 1)
    assert c["judge/prompt_tokens"] > 0 and c["judge/completion_tokens"] > 0 and c["judge/score_sum"] == pytest.approx(1.7)
    no_ref = LLMJudge(ScriptedEngine(tok, []), tok, use_reference=False)
    assert "Reference answer" not in no_ref.prompt(sample())


def test_remote_reward_model_dead_server_and_bad_reply_are_counted_failures():
    from arealite.utils.proc import free_port

    rm = RemoteRewardModel(f"127.0.0.1:{free_port()}", timeout=2, retries=2)

    async def score_then_close():
        try:
            return await rm.ascore(sample())
        finally:
            await rm.aclose()

    with pytest.raises(RewardFailure) as e:
        asyncio.run(score_then_close())
    assert e.value.reason == "connection" and rm.counters()["rm/failed_connection"] == 1
    assert rm.body(sample()) == ("/classify", {"input_ids": [1, 2, 7, 8, 9]})  # exact token ids
    for bad in ({"x": 1}, [{"embedding": []}], {"embedding": [float("nan")]}):
        with pytest.raises(RewardFailure, match="unexpected reply|non-finite") as e:
            rm.parse(bad)
        assert e.value.reason == "bad_reply"
    assert RemoteRewardModel("h:1", "get_reward", tokenizer=object()).parse({"rewards": [0.25]}) == 0.25
    with pytest.raises(ValueError, match="protocol"):
        RemoteRewardModel("h:1", "grpc")


def test_workflow_drops_a_group_with_an_unscored_sample_and_stops_after_many(tiny_model_dir):
    from arealite.utils.hf import load_tokenizer
    from arealite.workflow.rlvr import RLVRWorkflow

    tok = load_tokenizer(tiny_model_dir)

    class Echo(InferenceEngine):
        async def agenerate(self, req):
            toks = tok.encode("5", add_special_tokens=False) + [tok.eos_token_id]
            return ModelResponse(list(req.input_ids), toks, [-0.5] * len(toks), [3] * len(toks), "stop")

        def pause_generation(self): ...
        def continue_generation(self): ...
        def update_weights(self, meta): ...

    row = {"messages": [{"role": "user", "content": "2+3?"}], "answer": "5"}
    g = GenerationConfig(n_samples=2, max_new_tokens=4)
    ok = CombinedReward([(Scripted("rm", [0.3, 0.9]), 1.0), (Scripted("verifier", [1.0, 0.0]), 0.0)])
    traj = asyncio.run(RLVRWorkflow(ok, g, tok, eval_fn=lambda c, a: 1.0).arun_episode(Echo(), row))
    assert traj["rewards"].tolist() == pytest.approx([0.3, 0.9])
    assert traj["reward_rm"].tolist() == pytest.approx([0.3, 0.9]) and traj["reward_verifier"].tolist() == [1.0, 0.0]
    failing = CombinedReward([(Scripted("rm", [0.3, RewardFailure("timeout")] + [RewardFailure("timeout")] * 8), 1.0),
                              (Scripted("verifier", [1.0] * 10), 0.0)])
    wf = RLVRWorkflow(failing, g, tok, eval_fn=lambda c, a: 1.0, max_consecutive_failures=3)
    assert asyncio.run(wf.arun_episode(Echo(), row)) is None  # one sample unscored: the group is dropped
    assert asyncio.run(wf.arun_episode(Echo(), row)) is None and asyncio.run(wf.arun_episode(Echo(), row)) is None
    with pytest.raises(RuntimeError, match="could not score.*rm/failed_timeout"):
        asyncio.run(wf.arun_episode(Echo(), row))
    assert wf.reward_counters()["reward/rm/failed_timeout"] == 7
    with pytest.raises(ValueError, match="eval_fn"):
        asyncio.run(RLVRWorkflow(ok, g, tok).aevaluate(Echo(), [row]))


def _sft_constant_judge(tiny_model_dir, out, reply="Score: 7"):
    """A tiny judge that always answers ``reply``: recipes/sft_math.py on judge prompts."""
    from arealite.dataset.math_data import load_dataset
    from arealite.utils.hf import load_tokenizer

    judge = LLMJudge(None, load_tokenizer(tiny_model_dir))
    rows = []
    for r in load_dataset(None, "train", 64, 0):
        for resp in (r["answer"], str(int(r["answer"]) + 1)):
            s = Sample(r["messages"], resp, data=r)
            rows.append({"messages": [{"role": "user", "content": judge.prompt(s)},
                                      {"role": "assistant", "content": reply}]})
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "judge.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(REPO_ROOT, "recipes", "sft_math.py"), "--actor.path", tiny_model_dir, "--fileroot", out,
           "--train_dataset.path", path, "--train_dataset.batch_size", "16", "--total_train_steps", "40",
           "--actor.optimizer.lr", "3e-3", "--evaluator.freq_steps", "0", "--evaluator.at_start", "False",
           "--evaluator.at_end", "False", "--valid_dataset.path", path, "--valid_dataset.size", "4"]
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=900, env=env_without_dist(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return os.path.join(out, "sft_math", "trial0", "final")


def test_judge_rewarded_grpo_three_steps_two_ranks_with_our_server_as_judge(tiny_model_dir, tmp_path):
    judge = _sft_constant_judge(tiny_model_dir, str(tmp_path / "judge"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO_ROOT, "recipes", "grpo_rlhf.py"), "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
           "--total_train_steps", "3", "--gconfig.n_samples", "2", "--gconfig.max_new_tokens", "8",
           "--rollout.consumer_batch_size", "4", "--train_dataset.batch_size", "4", "--valid_dataset.size", "4",
           "--reward.judge.path", judge, "--reward.judge.max_new_tokens", "8", "--reward.length_penalty", "0.001"]
    proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=900,
                          env=env_without_dist(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [s for s in map(json.loads, open(tmp_path / "grpo_rlhf" / "trial0" / "stats.jsonl")) if "summary" not in s]
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["rollout/reward_judge"] == pytest.approx(0.7)  # the judge's "Score: 7", parsed from its server's reply
        assert -0.008 - 1e-9 <= s["rollout/reward_length"] <= -0.001 + 1e-9  # −0.001 × (1 … 8 tokens)
        assert s["rollout/reward"] == pytest.approx(0.7 + s["rollout/reward_length"], abs=1e-6)
        assert "rollout/reward_verifier" in s and s["reward/judge/failed_unparseable"] == 0
        assert s["reward/judge/ok"] >= 8 and s["reward/judge/completion_tokens"] > 0
    assert os.path.exists(tmp_path / "grpo_rlhf" / "trial0" / "logs" / "judge" / "server0.log")


def test_openai_compatible_judge_against_a_scripted_chat_server():
    """OpenAIJudge: the rubric prompt as one user message, the key as a Bearer header, the score
    from choices[0].message.content, the cost from usage; a 500 is retried, a 400 is not, and a
    reply of the wrong shape or without a score is counted."""
    import threading

    from aiohttp import web

    from arealite.reward.sources import OpenAIJudge
    from arealite.utils.proc import free_port

    seen, replies = [], [(200, "Looks right. Score: 8"), (500, ""), (200, "Score: 3"), (400, "bad"),
                         (200, {"oops": 1}), (200, "no verdict")]

    async def chat(request):
        seen.append((request.headers.get("Authorization"), await request.json()))
        status, content = replies.pop(0)
        if status != 200:
            return web.json_response({"error": {"message": content}}, status=status)
        if isinstance(content, dict):
            return web.json_response(content)
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": content}}],
                                  "usage": {"prompt_tokens": 50, "completion_tokens": 6}})

    port = free_port()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        judge = OpenAIJudge(f"http://127.0.0.1:{port}/v1", "judge-model", api_key="sk-test", max_tokens=16, retries=2)

        async def run():
            out = []
            try:
                for _ in range(4):
                    try:
                        out.append(await judge.ascore(sample("The sum is 5.")))
                    except RewardFailure as e:
                        out.append(e.reason)
            finally:
                await judge.aclose()
            return out

        assert asyncio.run(run()) == [pytest.approx(0.8), pytest.approx(0.3), "http", "bad_reply"]
        auth, body = seen[0]
        assert auth == "Bearer sk-test" and body["model"] == "judge-model" and body["max_tokens"] == 16
        assert body["temperature"] == 0 and len(body["messages"]) == 1 and "The sum is 5." in body["messages"][0]["content"]
        assert len(seen) == 5  # the 500 was retried once, the 400 was not
        c = judge.counters()
        assert (c["judge/ok"], c["judge/failed_http"], c["judge/failed_bad_reply"]) == (2, 1, 1)
        assert (c["judge/prompt_tokens"], c["judge/completion_tokens"]) == (100, 12)
        async def unparseable():
            try:
                return await judge.ascore(sample())
            finally:
                await judge.aclose()

        with pytest.raises(RewardFailure, match="no score"):
            asyncio.run(unparseable())
        assert judge.counters()["judge/failed_unparseable"] == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
