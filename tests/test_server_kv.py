"""The server's scheduler and KV cache, driven in-process step by step (no HTTP).

Reference: the same random tiny Llama (its own instance, default sdpa attention) run by HF:
greedy tokens from ``generate`` and logprobs from one full forward of prompt + output.
"""

import asyncio

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from arealite.server.messages import Generate, LoadFromDisk, LoadTensors
from arealite.server.protocol import SamplingParams
from arealite.server.scheduler import Scheduler

VOCAB = 128


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=0, initializer_range=0.5)
    return LlamaForCausalLM(cfg).eval()


def _run(sched, requests):
    """Submit ``[(input_ids, SamplingParams)]`` at once and step the scheduler until all finish;
    returns the replies in order."""
    async def main():
        futures = [sched.submit(Generate(f"r{i}", ids, params, True))
                   for i, (ids, params) in enumerate(requests)]
        while not all(f.done() for f in futures):
            sched.step()
            await asyncio.sleep(0)  # run the futures' call_soon_threadsafe callbacks
        return [f.result() for f in futures]
    return asyncio.run(main())


def _greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _reference_logprobs(model, prompt, output, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None]).squeeze(1).tolist()


def _logprobs(reply):
    return [x[0] for x in reply["meta_info"]["output_token_logprobs"]]


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def test_chunked_prefill_matches_hf():
    """A 23-token prompt prefilled in chunks of 4 tokens (6 forwards, positions continuing
    across chunks) decodes exactly like HF."""
    ref = _model()
    sched = Scheduler(_model(), max_batch_size=4, max_prefill_tokens=4)
    prompt = _prompt(23, 1)
    reply = _run(sched, [(prompt, _greedy(12))])[0]
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                          min_new_tokens=12, pad_token_id=0)[0, 23:].tolist()
    assert reply["output_ids"] == hf
    assert _logprobs(reply) == pytest.approx(_reference_logprobs(ref, prompt, hf), abs=1e-5)
    assert sched.stats["prefill_tokens"] == 22  # the last prompt token is the first decode input
    assert sched.stats["decode_steps"] == 12


def test_group_shares_one_prefill_and_logprobs_match():
    """4 samples of one prompt (a GRPO group) + 1 other prompt: the group's prompt KV is computed
    once and copied 3 times; every sampled token's logprob equals HF's recomputation."""
    ref = _model()
    sched = Scheduler(_model(), max_batch_size=8, seed=5)
    group, other = _prompt(15, 2), _prompt(9, 3)
    params = SamplingParams(temperature=0.8, max_new_tokens=10, ignore_eos=True)
    replies = _run(sched, [(group, params)] * 4 + [(other, params)])
    assert sched.stats["prefill_tokens"] == 14 + 8
    assert sched.stats["shared_prefix_tokens"] == 3 * 14
    outputs = [r["output_ids"] for r in replies]
    assert len({tuple(o) for o in outputs[:4]}) > 1  # the samples differ
    for prompt, reply in zip([group] * 4 + [other], replies):
        assert _logprobs(reply) == pytest.approx(
            _reference_logprobs(ref, prompt, reply["output_ids"], 0.8), abs=1e-4)


def test_rows_leave_and_join_through_a_small_batch():
    """9 requests of mixed prompt/output lengths through 3 rows and 7-token prefill chunks:
    requests wait, join between steps, finished rows are replaced by the last row (KV copy),
    buffers grow; every output equals its solo greedy run."""
    sched = Scheduler(_model(), max_batch_size=3, max_prefill_tokens=7)
    requests = [(_prompt(n, 10 + i), _greedy(m))
                for i, (n, m) in enumerate([(3, 20), (30, 5), (1, 9), (18, 14), (12, 2), (25, 17),
                                            (7, 11), (9, 30), (15, 6)])]
    together = _run(sched, requests)
    solo = [_run(Scheduler(_model(), max_batch_size=1), [r])[0] for r in requests]
    for s, t in zip(solo, together):
        assert t["output_ids"] == s["output_ids"]
        assert _logprobs(t) == pytest.approx(_logprobs(s), abs=1e-5)
        assert t["meta_info"]["finish_reason"]["type"] == "length"


def test_no_prefix_sharing_across_a_weight_update():
    """KV computed before a weight load is not reused after it: the same prompt is prefilled
    again, and its logprobs are those of the new weights."""
    sched = Scheduler(_model(0), max_batch_size=4)
    new = _model(1)
    prompt = _prompt(11, 4)

    async def main():
        first = sched.submit(Generate("a", prompt, _greedy(40), True))
        sched.step()
        sched.step()
        load = sched.submit(LoadTensors(dict(new.state_dict()), 7))
        second = sched.submit(Generate("b", prompt, _greedy(5), True))
        while not (first.done() and second.done() and load.done()):
            sched.step()
            await asyncio.sleep(0)
        return first.result(), second.result(), load.result()

    _, second, (status, _) = asyncio.run(main())
    assert status == 200
    assert sched.stats["prefill_tokens"] == 2 * 10 and sched.stats["shared_prefix_tokens"] == 0
    assert second["meta_info"]["weight_version"] == 7
    assert _logprobs(second) == pytest.approx(
        _reference_logprobs(new, prompt, second["output_ids"]), abs=1e-5)


def test_models_outside_the_attention_interface_are_refused():
    class Legacy(LlamaForCausalLM):
        def set_attn_implementation(self, *args, **kwargs):  # keeps its own attention
            return None

    torch.manual_seed(0)
    legacy = Legacy(_model().config).eval()
    with pytest.raises(RuntimeError, match="AttentionInterface"):
        Scheduler(legacy)


def test_sliding_window_models_are_refused():
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                      sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        Scheduler(Qwen2ForCausalLM(cfg).eval())


def test_inverse_cdf_sampling_frequencies():
    """20000 draws per row match the tempered / nucleus-filtered distribution to 0.01, and a
    zero-probability token (after filtering) is never drawn."""
    from arealite.server.sampling import sample_next_tokens

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = torch.log(probs).repeat(n, 1)
    g = torch.Generator().manual_seed(0)
    plain, _ = sample_next_tokens(logits, torch.ones(n), torch.ones(n), torch.full((n,), -1), g)
    freq = torch.bincount(plain, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.01)
    hot, _ = sample_next_tokens(logits, torch.full((n,), 0.5), torch.ones(n), torch.full((n,), -1), g)
    tempered = probs ** 2 / (probs ** 2).sum()  # softmax(log p / 0.5)
    assert torch.allclose(torch.bincount(hot, minlength=4).float() / n, tempered, atol=0.01)
    nucleus, _ = sample_next_tokens(logits, torch.ones(n), torch.full((n,), 0.7), torch.full((n,), -1), g)
    freq = torch.bincount(nucleus, minlength=4).float() / n  # keeps {0, 1}: 0.5 + 0.3 >= 0.7
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.01)


def test_next_turn_reuses_the_finished_turns_kv():
    """Turn 2 = turn 1's prompt + output + 5 new tokens: the whole blocks (16 tokens) of turn 1's
    KV come from the prefix store, only the rest is prefilled, and the result equals HF. After
    a weight load the store is empty and everything is prefilled again."""
    ref = _model()
    sched = Scheduler(_model(), max_batch_size=4)
    turn1 = _prompt(40, 7)
    out1 = _run(sched, [(turn1, _greedy(12))])[0]["output_ids"]
    assert len(sched.prefix_store) == 1  # 51 cached tokens -> 48 kept (3 blocks)
    turn2 = turn1 + out1 + _prompt(5, 8)  # 57 tokens
    before = dict(sched.stats)
    reply = _run(sched, [(turn2, _greedy(8))])[0]
    assert sched.stats["cached_prefix_tokens"] - before["cached_prefix_tokens"] == 48
    assert sched.stats["prefill_tokens"] - before["prefill_tokens"] == 56 - 48
    with torch.no_grad():
        hf = ref.generate(torch.tensor([turn2]), do_sample=False, max_new_tokens=8,
                          min_new_tokens=8, pad_token_id=0)[0, 57:].tolist()
    assert reply["output_ids"] == hf
    assert _logprobs(reply) == pytest.approx(_reference_logprobs(ref, turn2, hf), abs=1e-5)

    async def load():
        future = sched.submit(LoadTensors(dict(_model(1).state_dict()), 1))
        while not future.done():
            sched.step()
            await asyncio.sleep(0)
    asyncio.run(load())
    assert len(sched.prefix_store) == 0
    before = dict(sched.stats)
    reply = _run(sched, [(turn2, _greedy(8))])[0]
    assert sched.stats["cached_prefix_tokens"] == before["cached_prefix_tokens"]
    assert sched.stats["prefill_tokens"] - before["prefill_tokens"] == 56
    assert _logprobs(reply) == pytest.approx(
        _reference_logprobs(_model(1), turn2, reply["output_ids"]), abs=1e-5)


def test_prefix_store_longest_match_and_lru_eviction():
    from arealite.server.kv_cache import PrefixStore

    store = PrefixStore(max_tokens=64, block=4)
    kv = lambda n, fill: [torch.full((2, n, 3), float(fill))]  # noqa: E731 - one layer [H, n, D]
    a = list(range(100, 120))  # 20 tokens
    store.insert(a, kv(20, 1), kv(20, -1))
    b = a[:8] + list(range(200, 210))  # shares 2 blocks with a, 18 tokens -> 16 kept
    store.insert(b, kv(18, 2), kv(18, -2))
    n, k, v = store.lookup(a[:13] + [999], limit=14)  # 3 whole blocks of a match
    assert n == 12 and k[0].shape == (2, 12, 3) and k[0].eq(1).all() and v[0].eq(-1).all()
    n, k, _ = store.lookup(b + [5], limit=19)
    assert n == 16 and k[0].eq(2).all()
    assert store.lookup(a, limit=3)[0] == 0  # less than one block allowed
    assert store.lookup([7] * 20, limit=20)[0] == 0
    store.lookup(a, limit=20)  # a is now the most recently used
    store.insert(list(range(300, 332)), kv(32, 3), kv(32, -3))  # 20 + 16 + 32 > 64: evict b
    assert len(store) == 2 and store.lookup(b, limit=18)[0] == 8  # only a's shared blocks left
    assert store.lookup(a, limit=20)[0] == 20


def test_cache_shrinks_after_long_rows_leave_and_the_survivor_is_unchanged():
    """8 rows sized for a 250-token prompt; once only one short row is left, the buffers are
    reallocated to 1 row x 128 tokens, and that row decodes exactly as it does alone."""
    sched = Scheduler(_model(), max_batch_size=8)
    survivor = (_prompt(2, 20), _greedy(40))
    requests = [(_prompt(250, 21), _greedy(2)), survivor] + [(_prompt(2, 22 + i), _greedy(3)) for i in range(6)]

    async def main():
        futures = [sched.submit(Generate(f"r{i}", ids, p, True)) for i, (ids, p) in enumerate(requests)]
        sched.step()
        assert (sched.cache.rows, sched.cache.capacity) == (8, 256)
        for _ in range(5):
            sched.step()
        assert len(sched._rows) == 1 and (sched.cache.rows, sched.cache.capacity) == (1, 128)
        while not futures[1].done():
            sched.step()
            await asyncio.sleep(0)
        return futures[1].result()

    reply = asyncio.run(main())
    solo = _run(Scheduler(_model(), max_batch_size=1), [survivor])[0]
    assert reply["output_ids"] == solo["output_ids"]
    assert _logprobs(reply) == pytest.approx(_logprobs(solo), abs=1e-5)


def test_disk_update_with_abort_all_requests_returns_partial_outputs(tmp_path):
    """SGLang's ``abort_all_requests``: the running request ends with ``abort`` and the tokens
    made by the old weights, stamped with the old version; the update then applies."""
    sched = Scheduler(_model(0), max_batch_size=2, weight_version=3)
    _model(1).save_pretrained(tmp_path)

    async def main():
        running = sched.submit(Generate("a", _prompt(6, 30), _greedy(50), True))
        for _ in range(4):
            sched.step()
        update = sched.submit(LoadFromDisk(str(tmp_path), 4, True))
        sched.step()
        await asyncio.sleep(0)
        return running.result(), update.result()

    reply, (status, _) = asyncio.run(main())
    assert status == 200 and sched.weight_version == 4
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(reply["output_ids"]) == 4 and reply["meta_info"]["weight_version"] == 3


def test_generate_request_validation_of_numbers():
    from arealite.server.protocol import RequestError, parse_generate_request

    def params(**sp):
        return parse_generate_request({"input_ids": [1, 2], "sampling_params": sp}, VOCAB, 256)[1]

    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(RequestError, match="temperature"):
            params(temperature=bad)
    with pytest.raises(RequestError, match="top_p"):
        params(top_p=float("nan"))
    assert params(top_k=10**20).top_k == -1 and params(top_k=VOCAB).top_k == -1  # disabled
    assert params(top_k=5).top_k == 5


def test_long_prompt_is_staged_while_running_rows_keep_decoding():
    """A 60-token prompt with an 8-token budget is prefilled one chunk per iteration in its own
    cache (8 iterations) while a running request decodes one token per iteration; then it joins
    and both outputs equal HF."""
    ref = _model()
    sched = Scheduler(_model(), max_batch_size=4, max_prefill_tokens=8)
    short, long_ = _prompt(5, 40), _prompt(60, 41)

    async def main():
        first = sched.submit(Generate("a", short, _greedy(30), True))
        sched.step()
        second = sched.submit(Generate("b", long_, _greedy(6), True))
        lengths = []
        for _ in range(8):
            sched.step()
            lengths.append(len(sched._rows[0].output_ids))
            assert len(sched._rows) == 1 and sched._staged is not None
        sched.step()  # the last chunk (3 tokens), then the copy into a row
        assert len(sched._rows) == 2 and sched._staged is None
        while not (first.done() and second.done()):
            sched.step()
            await asyncio.sleep(0)
        return lengths, first.result(), second.result()

    lengths, a, b = asyncio.run(main())
    assert lengths == list(range(2, 10))  # decoding never stalled
    assert sched.stats["prefill_tokens"] == 4 + 59
    for prompt, reply, n in ((short, a, 30), (long_, b, 6)):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=0)[0, len(prompt):].tolist()
        assert reply["output_ids"] == hf
        assert _logprobs(reply) == pytest.approx(_reference_logprobs(ref, prompt, hf), abs=1e-4)
