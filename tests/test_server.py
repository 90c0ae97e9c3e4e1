"""End-to-end tests of arealite.server against a tiny random Llama on CPU.

The server runs as a subprocess; every expected value is recomputed with the HF model
in this process (``model.generate`` or a teacher-forced forward).
"""

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arealite.server.protocol import SamplingParams, parse_generate_request
from arealite.server.sampling import sample_next_tokens
from arealite.utils.proc import free_port
import slow_server

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 128
EOS = 2


def _tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=EOS,
                      # Larger than the default 0.02 so greedy outputs are not one repeated token.
                      initializer_range=0.5)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny models with different random weights, saved to disk: {name: (model, dir)}."""
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = _tiny_model(seed)
        path = tmp_path_factory.mktemp(f"model_{name}")
        model.save_pretrained(path)
        out[name] = (model, str(path))
    return out


@pytest.fixture(scope="module")
def server(models):
    """Base URL of a running server on model "a"; killed at teardown."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        # >= 5 ms per decode step: 200 tokens take >= 1 s, so a pause at 0.5 s lands mid-way.
        slow_server.command(0.005, "--model-path", models["a"][1],
                            "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
                            "--max-batch-size", "64", "--dtype", "float32", "--seed", "1"),
        cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stderr.read().decode()[-3000:])
        try:
            if _get(url + "/health") == {"status": "ok"}:
                break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("server did not become healthy")
        time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url, body, timeout=60):
    """POST ``body`` (dict, or raw bytes); return (status, parsed JSON)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _generate(url, input_ids, **sp):
    status, out = _post(url + "/generate", {"input_ids": input_ids, "sampling_params": sp,
                                            "return_logprob": True})
    assert status == 200, out
    return out


def _logprobs(out):
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(x is None for _, _, x in lps)
    return [lp for lp, _, _ in lps]


def _hf_greedy(model, prompt, n):
    """Greedy tokens and per-step logprobs from HF generate, never stopping at EOS."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                             min_new_tokens=0, pad_token_id=0, eos_token_id=None,
                             return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == n
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def _teacher_forced_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    step_logits = logits[len(prompt) - 1:-1] / temperature
    return torch.log_softmax(step_logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


PROMPT = [5, 17, 99, 3, 42, 7, 64, 11]


def test_health_and_model_info(server, models):
    info = _get(server + "/get_model_info")
    assert info == {"model_path": models["a"][1], "weight_version": 0, "is_generation": True,
                    "vocab_size": VOCAB, "max_batch_size": 64}


def test_greedy_matches_hf_generate(server, models):
    model = models["a"][0]
    out = _generate(server, PROMPT, temperature=0, max_new_tokens=24, ignore_eos=True)
    tokens, logprobs = _hf_greedy(model, PROMPT, 24)
    assert out["output_ids"] == tokens
    assert _logprobs(out) == pytest.approx(logprobs, abs=1e-5)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 24
    assert meta["weight_version"] == 0 and meta["id"]


def test_concurrent_requests_match_solo_runs(server):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist()
               for n in (3, 30, 7, 18, 1, 25, 12, 9)]
    # Different lengths so rows leave the batch at different steps.
    lengths = [10 + 3 * i for i in range(len(prompts))]
    solo = [_generate(server, p, temperature=0, max_new_tokens=n, ignore_eos=True)
            for p, n in zip(prompts, lengths)]
    barrier = threading.Barrier(len(prompts))

    def fire(i):
        barrier.wait()
        time.sleep(0.01 * i)  # staggered arrivals also exercise joining a running batch
        return _generate(server, prompts[i], temperature=0, max_new_tokens=lengths[i],
                         ignore_eos=True)

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(fire, range(len(prompts))))
    for s, t in zip(solo, together):
        assert t["output_ids"] == s["output_ids"]
        assert _logprobs(t) == pytest.approx(_logprobs(s), abs=1e-4)


def test_request_joins_running_batch(server):
    """Continuous batching: a request arriving mid-decode joins the running batch (its
    prompt is longer than the running row's whole cache) and both match solo runs."""
    short, long_prompt = [9, 8, 7], list(range(10, 50))
    solo_a = _generate(server, short, temperature=0, max_new_tokens=80, ignore_eos=True)
    solo_b = _generate(server, long_prompt, temperature=0, max_new_tokens=20, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_generate, server, short, temperature=0, max_new_tokens=80,
                        ignore_eos=True)
        time.sleep(0.15)  # >= 5 ms per step on the test server: `a` is still decoding
        assert not a.done()
        b = _generate(server, long_prompt, temperature=0, max_new_tokens=20, ignore_eos=True)
        assert not a.done()  # b ran while a was running
        a = a.result(timeout=60)
    for solo, got in ((solo_a, a), (solo_b, b)):
        assert got["output_ids"] == solo["output_ids"]
        assert _logprobs(got) == pytest.approx(_logprobs(solo), abs=1e-4)


def test_sampling_logprobs_are_after_temperature(server, models):
    model = models["a"][0]
    for extra in ({}, {"top_k": 20, "top_p": 0.8}):
        out = _generate(server, PROMPT, temperature=0.7, max_new_tokens=30, ignore_eos=True,
                        **extra)
        expected = _teacher_forced_logprobs(model, PROMPT, out["output_ids"], 0.7)
        assert _logprobs(out) == pytest.approx(expected.tolist(), abs=1e-4)
    # Filtering shapes the sampling distribution only: every token is within the top 20.
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out["output_ids"]])).logits[0]
    top20 = logits[len(PROMPT) - 1:-1].topk(20, dim=-1).indices
    assert all(t in row for t, row in zip(out["output_ids"], top20.tolist()))


def test_stop_token_ids(server, models):
    full = _generate(server, PROMPT, temperature=0, max_new_tokens=24, ignore_eos=True)
    ids = full["output_ids"]
    i = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    out = _generate(server, PROMPT, temperature=0, max_new_tokens=24, ignore_eos=True,
                    stop_token_ids=[ids[i]])
    assert out["output_ids"] == ids[:i + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[i]}
    assert _logprobs(out) == pytest.approx(_logprobs(full)[:i + 1], abs=1e-5)


def test_max_new_tokens_zero(server):
    out = _generate(server, PROMPT, max_new_tokens=0)
    assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


BAD_REQUESTS = [
    (b"not json", "body"),
    ([1, 2, 3], "body"),
    ({"sampling_params": {}}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": "hello"}, "input_ids"),
    ({"input_ids": [1, 2.5]}, "input_ids"),
    ({"input_ids": [1, VOCAB]}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"input_ids": [1], "sampling_params": [1]}, "sampling_params"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 2.5}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
     "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1.0}},
     "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": 2}},
     "sampling_params.stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": ["a"]}},
     "sampling_params.stop_token_ids"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 157}},
     "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": {"stop": 3}}, "sampling_params.stop"),
    ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    # this server's model folder has no tokenizer: stop strings cannot be matched
    ({"input_ids": [1], "sampling_params": {"stop": ["\n"]}}, "sampling_params.stop"),
]


@pytest.mark.parametrize("body,field", BAD_REQUESTS)
def test_malformed_requests_get_400(server, body, field):
    status, out = _post(server + "/generate", body)
    assert status == 400
    assert out["error"]["field"] == field and out["error"]["message"]


def test_error_messages_say_how_to_fix():
    with pytest.raises(ValueError, match="lower max_new_tokens to at most 156"):
        parse_generate_request({"input_ids": [1] * 100, "sampling_params":
                                {"max_new_tokens": 200}}, VOCAB, 256)
    with pytest.raises(ValueError, match="need a tokenizer"):
        parse_generate_request({"input_ids": [1], "sampling_params": {"stop": "x"}}, VOCAB, 256,
                               has_tokenizer=False)
    _, params, _, _ = parse_generate_request({"input_ids": [1], "sampling_params": {"stop": "x"}}, VOCAB, 256)
    assert params.stop == ("x",)
    with pytest.raises(ValueError, match="one request per sample"):
        parse_generate_request({"input_ids": [1], "sampling_params": {"n": 4}}, VOCAB, 256)
    ids, params, logprob, rid = parse_generate_request(
        {"input_ids": [1], "sampling_params": {"frequency_penalty": 1.0}, "rid": "x"},
        VOCAB, 256)
    assert params == SamplingParams() and not logprob and rid == "x"


def test_bad_weight_path_is_rejected(server, tmp_path):
    status, out = _post(server + "/update_weights_from_disk",
                        {"model_path": str(tmp_path / "nope"), "weight_version": 9})
    assert status == 400 and out["success"] is False and out["message"]
    wrong = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, tie_word_embeddings=True))
    wrong.save_pretrained(tmp_path / "wrong")
    status, out = _post(server + "/update_weights_from_disk",
                        {"model_path": str(tmp_path / "wrong"), "weight_version": 9})
    assert status == 400 and "shape" in out["message"]
    out = _generate(server, PROMPT, temperature=0, max_new_tokens=3)
    assert out["meta_info"]["weight_version"] == 0
    assert _get(server + "/health") == {"status": "ok"}


def test_pause_aborts_running_and_holds_new_requests(server):
    n = len(PROMPT)
    with ThreadPoolExecutor(5) as pool:
        running = [pool.submit(_generate, server, PROMPT[: n - i], temperature=1.0,
                               max_new_tokens=200, ignore_eos=True) for i in range(4)]
        time.sleep(0.5)
        status, reply = _post(server + "/pause_generation", {})
        assert status == 200
        assert reply["status"] == "ok" and reply["num_aborted_requests"] == 4
        for f in running:
            out = f.result(timeout=10)
            k = len(out["output_ids"])
            assert 0 < k < 200
            assert out["meta_info"]["finish_reason"] == {"type": "abort",
                                                         "message": "Abort by pause_generation"}
            assert len(_logprobs(out)) == k == out["meta_info"]["completion_tokens"]
        held = pool.submit(_generate, server, PROMPT, temperature=0, max_new_tokens=5)
        time.sleep(1.0)
        assert not held.done()
        status, reply = _post(server + "/continue_generation", {})
        assert status == 200 and reply["status"] == "ok"
        out = held.result(timeout=30)
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert len(out["output_ids"]) == 5


def test_update_weights_from_disk(server, models, tmp_path):
    model_b, _ = models["b"]
    path_b = str(tmp_path / "sharded")
    model_b.save_pretrained(path_b, max_shard_size="20KB")  # exercises the index.json path
    assert os.path.exists(os.path.join(path_b, "model.safetensors.index.json"))
    status, out = _post(server + "/update_weights_from_disk",
                        {"model_path": path_b, "weight_version": 5})
    assert status == 200 and out["success"] is True and out["num_paused_requests"] == 0
    try:
        out = _generate(server, PROMPT, temperature=0, max_new_tokens=16, ignore_eos=True)
        tokens, logprobs = _hf_greedy(model_b, PROMPT, 16)
        assert out["output_ids"] == tokens
        assert _logprobs(out) == pytest.approx(logprobs, abs=1e-5)
        assert out["meta_info"]["weight_version"] == 5
        assert _get(server + "/get_model_info")["weight_version"] == 5
    finally:  # restore model "a" for any later test
        _post(server + "/update_weights_from_disk",
              {"model_path": models["a"][1], "weight_version": 0})


def test_update_weights_while_generating(server, models):
    """A running request survives a weight update and continues with the new weights."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_generate, server, PROMPT, temperature=0, max_new_tokens=200,
                              ignore_eos=True)
        time.sleep(0.2)
        status, _ = _post(server + "/update_weights_from_disk",
                          {"model_path": models["b"][1], "weight_version": 7})
        assert status == 200
        out = running.result(timeout=60)
    try:
        assert len(out["output_ids"]) == 200
        assert out["meta_info"]["weight_version"] == 7
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    finally:
        _post(server + "/update_weights_from_disk",
              {"model_path": models["a"][1], "weight_version": 0})


def test_sample_next_tokens_filters_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    temps = torch.tensor([0.0, 1.0, 1.0])
    top_p = torch.tensor([1.0, 0.7, 1.0])
    top_k = torch.tensor([-1, -1, 1])
    g = torch.Generator().manual_seed(0)
    seen = [set() for _ in range(3)]
    for _ in range(200):
        tokens, logprobs = sample_next_tokens(logits, temps, top_p, top_k, g)
        for row, t in enumerate(tokens.tolist()):
            seen[row].add(t)
        assert torch.allclose(logprobs, logits[0, tokens], atol=1e-6)
    assert seen == [{0}, {0, 1}, {0}]


def test_client_that_goes_away_frees_its_row(server):
    """A /generate whose client disconnects (here: a 0.3 s client timeout on a >= 1 s request)
    is aborted on the server instead of running to max_new_tokens."""
    with pytest.raises(OSError):  # socket.timeout / TimeoutError
        _post(server + "/generate", {"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True}}, timeout=0.3)
    deadline = time.time() + 0.6
    while _get(server + "/get_server_info")["running_requests"] and time.time() < deadline:
        time.sleep(0.05)
    info = _get(server + "/get_server_info")
    assert info["running_requests"] == 0 and info["waiting_requests"] == 0


def test_weight_version_as_string_and_bad_truncate_size(server, models):
    status, out = _post(server + "/update_weights_from_disk",
                        {"model_path": models["a"][1], "weight_version": "0"})
    assert status == 200 and out["success"], out
    status, out = _post(server + "/update_weights_from_disk",
                        {"model_path": models["a"][1], "weight_version": "v1"})
    assert status == 400 and "weight_version" in out["message"]
    status, out = _post(server + "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "x"})
    assert status == 400 and out["error"]["field"] == "truncate_size"


def test_set_num_threads_applies_on_the_scheduler_thread(server, models):
    """``POST /set_num_threads`` changes the count the scheduler thread reads back, generation
    gives the same greedy tokens with either count, bad bodies get 400, and the client's
    ``set_server_threads`` sends it only to our server (backend "local")."""
    from arealite.api.config import InferenceEngineConfig
    from arealite.inference.remote import RemoteInferenceEngine

    addr = server.removeprefix("http://")
    one = _generate(server, PROMPT, max_new_tokens=12, temperature=0.0)
    try:
        status, out = _post(server + "/set_num_threads", {"num_threads": 2})
        assert status == 200 and out == {"status": "ok", "num_threads": 2, "previous": 1}
        assert _get(server + "/get_server_info")["num_threads"] == 2
        two = _generate(server, PROMPT, max_new_tokens=12, temperature=0.0)
        assert two["output_ids"] == one["output_ids"]
        assert _logprobs(two) == pytest.approx(_logprobs(one), abs=1e-4)
        for body in ({}, {"num_threads": 0}, {"num_threads": "2"}, {"num_threads": True}, b"not json"):
            status, out = _post(server + "/set_num_threads", body)
            assert status == 400 and out["error"]["field"] == "num_threads", (body, out)
        assert RemoteInferenceEngine(InferenceEngineConfig(backend="sglang"), [addr]).set_server_threads(1) is False
        assert _get(server + "/get_server_info")["num_threads"] == 2  # SGLang has no such endpoint: nothing sent
        assert RemoteInferenceEngine(InferenceEngineConfig(backend="local"), [addr]).set_server_threads(1) is True
        assert _get(server + "/get_server_info")["num_threads"] == 1
    finally:
        _post(server + "/set_num_threads", {"num_threads": 1})
