"""Reward models: the Bradley–Terry loss on hand-made pairs, the reward engine's score = transformers'
sequence-classification forward, the surrogate's gradient = the direct loss's, the reward-model
server's /classify and /get_reward = an in-process forward, its errors, and recipes/rm_math.py on
2 ranks (the saved folder loads with from_pretrained and serves)."""

import json
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

from conftest import REPO_ROOT, env_without_dist
from arealite.algorithms.reward_model import BradleyTerry, bt_loss, check_pairs, reward_batch, sequence_scores


def test_bt_loss_and_accuracy_on_hand_made_pairs():
    r_w, r_l = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    got = bt_loss(r_w, r_l)
    want = [math.log1p(math.exp(-2.0)), math.log(2.0), math.log1p(math.exp(2.0))]  # −log σ(d) = log(1 + e^{−d})
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bt_loss(r_w, r_l, margin=1.0)[0], torch.tensor(math.log1p(math.exp(-1.0))))
    torch.testing.assert_close(bt_loss(r_w, r_l, center_coef=0.5)[2], torch.tensor(math.log1p(math.exp(2.0))))
    torch.testing.assert_close(bt_loss(r_w, r_l, center_coef=0.5)[0], torch.tensor(math.log1p(math.exp(-2.0)) + 0.5 * 4))
    with pytest.raises(ValueError, match="margin"):
        bt_loss(r_w, r_l, margin=-1)
    algo = BradleyTerry.__new__(BradleyTerry)
    algo.margin, algo.center_coef = 0.0, 0.0
    rows = torch.stack([r_w, r_l], 1).reshape(-1)  # [w0, l0, w1, l1, w2, l2]
    losses, coef, sums = algo.pair_stats(rows)
    assert float(sums["accuracy"]) == 1.5  # 1 right, 1 tie (½), 1 wrong
    assert float(sums["margin"]) == 2.0 + 0.0 - 2.0 and float(sums["n_pairs"]) == 3
    # ∂ℓ/∂r_w = −σ(−d), ∂ℓ/∂r_l = +σ(−d)
    sig = [1 / (1 + math.exp(2.0)), 0.5, 1 / (1 + math.exp(-2.0))]
    torch.testing.assert_close(coef, torch.tensor([-sig[0], sig[0], -sig[1], sig[1], -sig[2], sig[2]]))


def test_reward_batch_layout_and_checks():
    b = reward_batch([[5, 6, 7], [8]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 0, 1], [0, 1, 0, 0]]  # the extra token after each sequence
    out = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    assert sequence_scores(out, b["loss_mask"]).tolist() == [3.0, 5.0]
    check_pairs(b)
    with pytest.raises(ValueError, match="even"):
        check_pairs(reward_batch([[1]], 0))
    bad = dict(b, loss_mask=b["attention_mask"].int())
    with pytest.raises(ValueError, match="exactly one"):
        check_pairs(bad)
    with pytest.raises(ValueError, match="at least one token"):
        reward_batch([[]], 0)


def save_tiny_rm(path: str, seed: int = 3) -> str:
    """A tiny random LlamaForSequenceClassification (1 label, random non-zero head) + tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from conftest import save_tiny_model

    save_tiny_model(path + "_lm", seed=seed)
    tok = AutoTokenizer.from_pretrained(path + "_lm")
    from arealite.utils.hf import reward_pad_id

    cfg = LlamaConfig.from_pretrained(path + "_lm", num_labels=1, pad_token_id=reward_pad_id(tok))
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def hf_scores(path: str, seqs: list[list[int]]) -> list[float]:
    """Each sequence alone through transformers' own sequence-classification forward."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs]


SEQS = [[1, 50, 60, 70, 80, 2], [1, 9, 2], [1, 300, 301, 302, 303, 304, 305, 306, 2], [1, 44, 45, 2]]


def test_reward_engine_scores_equal_transformers_forward_and_train_step_matches_direct_loss(tmp_path):
    from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPRewardEngine

    path = save_tiny_rm(str(tmp_path / "rm"))
    batch = reward_batch(SEQS, pad_id=0)
    for packing in (True, False):
        eng = FSDPRewardEngine(TrainEngineConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=12, packing=packing),
                                                 optimizer=OptimizerConfig(lr=1e-2, gradient_clipping=0.0)))
        eng.initialize(path)
        got = sequence_scores(eng.forward(batch), batch["loss_mask"])
        torch.testing.assert_close(got, torch.tensor(hf_scores(path, SEQS)), rtol=1e-5, atol=1e-5)
    # the surrogate's gradient is the BT loss's: compare the head's gradient with autograd of the
    # direct loss on an unsharded copy (1 rank: the local shard is the whole parameter)
    from transformers import AutoModelForSequenceClassification

    ref = AutoModelForSequenceClassification.from_pretrained(path)
    r = torch.stack([ref(input_ids=torch.tensor([s])).logits[0, 0] for s in SEQS])
    bt_loss(r[0::2], r[1::2]).mean().backward()
    algo = BradleyTerry(eng)
    grads = {}
    eng.optimizer.step = lambda *a, **k: grads.update(w=eng.model.score.weight.grad.to_local().clone())
    stats = algo.update(batch)
    torch.testing.assert_close(grads["w"], ref.score.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(stats["loss"]), bt_loss(r[0::2], r[1::2]).mean().detach(), rtol=1e-5, atol=1e-6)


def test_new_head_is_zero_and_saved_engine_loads_as_sequence_classifier(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from arealite.api.config import OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPRewardEngine

    eng = FSDPRewardEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-2)))
    eng.initialize(tiny_model_dir)
    batch = reward_batch(SEQS, pad_id=0)
    assert sequence_scores(eng.forward(batch), batch["loss_mask"]).abs().sum() == 0  # zero head
    algo = BradleyTerry(eng)
    first = algo.update(batch)
    for _ in range(5):
        last = algo.update(batch)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and last["loss"] < first["loss"]
    eng.save(str(tmp_path / "saved"))
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0  # not EOS (2): HF reads the final EOS
    got = sequence_scores(eng.forward(batch), batch["loss_mask"])
    torch.testing.assert_close(got, torch.tensor(hf_scores(str(tmp_path / "saved"), SEQS)), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def rm_server(tmp_path_factory):
    from arealite.launcher.local import launch_reward_server

    path = save_tiny_rm(str(tmp_path_factory.mktemp("rm") / "rm"))
    addr = launch_reward_server(path, str(tmp_path_factory.mktemp("rmlogs")), threads=1, max_batch_size=8)
    return path, addr


def _post(addr, endpoint, body):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{addr}{endpoint}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_classify_and_get_reward_equal_in_process_forward(rm_server):
    from transformers import AutoTokenizer

    path, addr = rm_server
    want = hf_scores(path, SEQS)
    status, one = _post(addr, "/classify", {"input_ids": SEQS[0]})
    assert status == 200 and one["index"] == 0 and one["meta_info"]["prompt_tokens"] == len(SEQS[0])
    assert abs(one["embedding"][0] - want[0]) <= 1e-5
    status, many = _post(addr, "/classify", {"model": "any", "input_ids": SEQS})
    assert status == 200 and [m["index"] for m in many] == [0, 1, 2, 3]
    assert max(abs(m["embedding"][0] - w) for m, w in zip(many, want)) <= 1e-5
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>", "hello world"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    want_text = hf_scores(path, ids)
    status, by_text = _post(addr, "/classify", {"text": texts})
    assert status == 200 and max(abs(m["embedding"][0] - w) for m, w in zip(by_text, want_text)) <= 1e-5
    status, rew = _post(addr, "/get_reward", {"query": texts, "prompts": ["ignored", "ignored"]})
    assert status == 200 and rew["rewards"] == rew["scores"]
    assert max(abs(a - b) for a, b in zip(rew["rewards"], want_text)) <= 1e-5
    # concurrent requests are batched together and each still gets its own score
    results = [None] * 16

    def call(i):
        results[i] = _post(addr, "/classify", {"input_ids": SEQS[i % 4]})[1]["embedding"][0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(abs(v - want[i % 4]) for i, v in enumerate(results)) <= 1e-5
    import urllib.request

    info = json.loads(urllib.request.urlopen(f"http://{addr}/get_model_info").read())
    assert info["is_generation"] is False and info["max_batch"] > 1 and info["forwards"] < info["sequences"]


def test_remote_reward_model_source_reads_both_protocols_of_our_server(rm_server):
    """The reward source the RL loop uses, against the live server: exact token ids over
    /classify, and the chat-templated text over /get_reward, each equal to transformers' forward."""
    import asyncio

    from arealite.reward.sources import RemoteRewardModel, Sample, rm_text
    from arealite.utils.hf import load_tokenizer

    path, addr = rm_server
    tok = load_tokenizer(path)
    s = Sample([{"role": "user", "content": "What is 2+3?"}], "5", [1, 50, 60], [70, 80, 2])
    by_ids, by_text = RemoteRewardModel(addr), RemoteRewardModel(addr, "get_reward", tokenizer=tok)

    async def both():
        try:
            return await by_ids.ascore(s), await by_text.ascore(s)
        finally:
            await by_ids.aclose()
            await by_text.aclose()

    got_ids, got_text = asyncio.run(both())
    assert abs(got_ids - hf_scores(path, [[1, 50, 60, 70, 80, 2]])[0]) <= 1e-5
    text_ids = tok(rm_text(tok, s), add_special_tokens=False)["input_ids"]
    assert text_ids[-1] == tok.eos_token_id  # the completion ended: EOS is part of what is scored
    assert abs(got_text - hf_scores(path, [text_ids])[0]) <= 1e-5
    assert by_ids.counters()["rm/ok"] == 1 and by_text.counters()["rm/ok"] == 1


@pytest.mark.parametrize("body,field", [
    ({}, "text"), ({"text": "a", "input_ids": [1]}, "text"), ({"text": ""}, "text"), ({"text": []}, "text"),
    ({"input_ids": []}, "input_ids"), ({"input_ids": [1, "x"]}, "input_ids"), ({"input_ids": [[1], [10**9]]}, "input_ids[1]"),
    ({"input_ids": list(range(1, 1100))}, "input_ids"), ([1, 2], "body"),
])
def test_server_bad_classify_bodies_are_400_naming_the_field(rm_server, body, field):
    status, reply = _post(rm_server[1], "/classify", body)
    assert status == 400 and reply["success"] is False and reply["error"]["field"] == field


def test_server_bad_get_reward_bodies_and_non_reward_folder(rm_server, tiny_model_dir, tmp_path):
    from arealite.launcher.local import launch_reward_server

    for body in ({}, {"query": []}, {"query": [3]}):
        status, reply = _post(rm_server[1], "/get_reward", body)
        assert status == 400 and reply["error"]["field"].startswith("query")
    with pytest.raises(ValueError, match="reward_model.path.*not a reward model"):
        launch_reward_server(tiny_model_dir, str(tmp_path))  # a causal LM: refused before starting


def test_rm_recipe_two_ranks_trains_and_final_serves(tiny_model_dir, tmp_path):
    """recipes/rm_math.py, 2 ranks, embedded arithmetic pairs: the logged pair accuracy and loss,
    held-out accuracy at start/end, final/ loads as a 1-label classifier whose scores equal the
    reward server's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO_ROOT, "recipes", "rm_math.py"), "--actor.path", tiny_model_dir, "--fileroot", str(tmp_path),
           "--total_train_steps", "4", "--evaluator.freq_steps", "2", "--train_dataset.batch_size", "4",
           "--valid_dataset.size", "6", "--valid_dataset.batch_size", "2", "--actor.optimizer.lr", "1e-3"]
    proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=900,
                          env=env_without_dist(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(l) for l in open(tmp_path / "rm_math" / "trial0" / "stats.jsonl")]
    steps = [r for r in rows if "summary" not in r]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert steps[0]["actor/loss"] == pytest.approx(math.log(2), abs=1e-5)  # zero head: every pair ties
    assert steps[0]["actor/accuracy"] == 0.5 and all(s["actor/n_pairs"] == 4 for s in steps)
    assert "eval/accuracy" in steps[1] and rows[-1]["summary"]["eval/n_pairs_end"] == 6
    assert rows[-1]["summary"]["eval/accuracy_start"] == 0.5
    final = str(tmp_path / "rm_math" / "trial0" / "final")
    from arealite.launcher.local import launch_reward_server

    addr = launch_reward_server(final, str(tmp_path / "logs"))
    _, many = _post(addr, "/classify", {"input_ids": SEQS})
    want = hf_scores(final, SEQS)
    assert max(abs(m["embedding"][0] - w) for m, w in zip(many, want)) <= 1e-5
    assert len(set(round(w, 6) for w in want)) > 1  # trained: no longer the zero head
