"""Issue 33's machinery: oneDNN packed linears of the server (equal to the plain computation),
sampling's past-the-end guard, model FLOP counting (hand-computed),
the precision choice, and bf16 compute on CPU with fp32 logprobs and master weights."""

import pytest
import torch

from arealite.server import packed_linear
from arealite.server.sampling import _sample_rows
from arealite.utils import perf

pytestmark = pytest.mark.skipif(not packed_linear.available("cpu", torch.float32),
                                reason="this torch has no oneDNN packed linear")


def _tiny(tiny_model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()


def test_packed_linears_equal_plain_and_follow_weight_changes(tiny_model_dir):
    model, ref = _tiny(tiny_model_dir), _tiny(tiny_model_dir)
    assert packed_linear.pack_linears(model) == 2 * 7 + 1  # q k v o gate up down per layer + head
    ids = torch.tensor([[5, 17, 900, 3, 44, 2]])
    with torch.inference_mode():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        # a weight written in place (as the server's loaders do) is repacked before use
        for m in (model, ref):
            m.model.layers[0].mlp.up_proj.weight.mul_(3.0)
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    # a write the version counter does not see (.data) needs invalidate(), which the scheduler
    # calls after every weight load
    for m in (model, ref):
        m.model.layers[1].self_attn.q_proj.weight.data.mul_(-1.0)
    with torch.inference_mode():
        assert (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max() > 1e-2  # stale
    packed_linear.invalidate(model)
    with torch.inference_mode():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    out = model(input_ids=ids).logits  # grad mode: plain F.linear, gradients flow
    assert out.requires_grad and (out - b).abs().max() <= 1e-5 * b.abs().max()


def test_every_weight_loader_is_seen_by_the_packed_copies_without_invalidate(tiny_model_dir, tmp_path):
    """The scheduler calls no invalidate() after a weight load: a distributed bucket, a folder of
    full weights and an fp32 LoRA merge each bump the changed weights' version counters, so the
    packed model equals a plain model given the same load."""
    from arealite.server.weights import load_named_tensors, load_weights_from_disk

    model, ref = _tiny(tiny_model_dir), _tiny(tiny_model_dir)
    packed_linear.pack_linears(model)
    ids = torch.tensor([[5, 17, 900, 3, 44, 2]])

    def assert_same():
        with torch.inference_mode():
            a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()

    assert_same()
    g = torch.Generator().manual_seed(0)
    up, q = "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    bucket = {k: torch.randn(ref.state_dict()[k].shape, generator=g) for k in (up, q)}
    for m in (model, ref):
        load_named_tensors(m, bucket)
    assert_same()
    other = _tiny(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    other.save_pretrained(str(tmp_path / "full"))
    for m in (model, ref):
        load_weights_from_disk(m, str(tmp_path / "full"))
    assert_same()
    name = "model.layers.0.self_attn.v_proj"
    out_f, in_f = ref.get_submodule(name).weight.shape
    lora = {name + ".lora_A.weight": torch.randn(4, in_f, generator=g),
            name + ".lora_B.weight": torch.randn(out_f, 4, generator=g)}
    for m in (model, ref):
        load_named_tensors(m, lora)  # fp32: merged into the weight
    assert_same()


@pytest.mark.skipif(not packed_linear.available("cpu", torch.bfloat16), reason="no oneDNN bf16 packing here")
def test_bf16_lora_load_repacks_nothing(tiny_model_dir, monkeypatch):
    """A bf16 server serves LoRA unmerged: its weights do not change, so no packed copy is
    rebuilt (the scheduler no longer marks all of them stale per version); the adapter still
    changes the output."""
    from arealite.server.weights import load_named_tensors

    model = _tiny(tiny_model_dir, torch.bfloat16)
    packed_linear.pack_linears(model)
    ids = torch.tensor([[5, 17, 900, 3, 44, 2]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    packs = []
    real_pack, real_group_pack = packed_linear._pack, packed_linear._FusedGroup.pack
    monkeypatch.setattr(packed_linear, "_pack", lambda m: packs.append(m) or real_pack(m))
    monkeypatch.setattr(packed_linear._FusedGroup, "pack", lambda self: packs.append(self) or real_group_pack(self))
    name = "model.layers.0.mlp.down_proj"
    out_f, in_f = model.get_submodule(name).weight.shape
    g = torch.Generator().manual_seed(1)
    load_named_tensors(model, {name + ".lora_A.weight": torch.randn(4, in_f, generator=g),
                               name + ".lora_B.weight": torch.randn(out_f, 4, generator=g)})
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    assert packs == [] and (after.float() - before.float()).abs().max() > 1e-2


def test_fused_siblings_run_one_gemm_per_group_and_equal_plain(tiny_model_dir, monkeypatch):
    """q/k/v and gate/up of each layer share one packed GEMM (4 calls per layer instead of 7,
    plus the head), with the same logits as the unpacked model; a grad-mode call is plain."""
    model, ref = _tiny(tiny_model_dir), _tiny(tiny_model_dir)
    assert packed_linear.pack_linears(model) == 2 * 7 + 1
    attn = model.model.layers[0].self_attn
    assert attn.q_proj._arealite_group is attn.v_proj._arealite_group
    calls, real = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    ids = torch.tensor([[5, 17, 900, 3, 44, 2], [7, 7, 7, 8, 9, 10]])
    with torch.inference_mode():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert len(calls) == 2 * 4 + 1
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert all(layer.self_attn.q_proj._arealite_group.input is None and layer.mlp.up_proj._arealite_group.outputs
               is None for layer in model.model.layers)  # no activations held between forwards
    with torch.inference_mode():  # the same input twice to one member: computed again, same values
        x = torch.randn(5, attn.q_proj.in_features)
        first, again, v = attn.q_proj(x), attn.q_proj(x), attn.v_proj(x)
        ref_attn = ref.model.layers[0].self_attn
        assert torch.allclose(first, again) and torch.allclose(first, ref_attn.q_proj(x), atol=1e-5)
        assert torch.allclose(v, ref_attn.v_proj(x), atol=1e-5)
    calls.clear()
    x = torch.randn(3, attn.q_proj.in_features, requires_grad=True)
    assert attn.k_proj(x).requires_grad and not calls  # autograd: F.linear, no oneDNN call


def test_row_bucket_pads_at_most_one_eighth_and_bounds_the_row_counts():
    assert [packed_linear.row_bucket(m) for m in (1, 7, 16, 17, 18, 19, 33, 100, 1000, 1024, 1025)] == \
        [1, 7, 16, 18, 18, 20, 36, 104, 1024, 1024, 1152]
    buckets = {packed_linear.row_bucket(m) for m in range(1, 1025)}
    assert len(buckets) == 16 + 6 * 8  # exact up to 16, then 8 per octave
    assert all(m <= packed_linear.row_bucket(m) <= m * 1.125 for m in range(1, 5000))


def test_packed_forward_pads_rows_to_buckets_and_slices_them_off(monkeypatch):
    """The server's memory fix: oneDNN sees only bucketed row counts (a primitive per count is
    kept in its caches, 0.6-1 MiB each), and the padded rows never reach the output."""
    torch.manual_seed(0)
    lin, ref = torch.nn.Linear(64, 96), torch.nn.Linear(64, 96)
    ref.load_state_dict(lin.state_dict())
    packed_linear.pack_linears(lin)
    seen, real = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    with torch.inference_mode():
        for shape in [(17, 64), (1, 33, 64), (100, 1, 64), (3, 5, 64), (1, 1000, 64)]:
            x = torch.randn(shape)
            got, want = lin(x), ref(x)
            assert got.shape == want.shape == (*shape[:-1], 96)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert seen == [18, 36, 104, 15, 1024]
    with torch.inference_mode():
        for m in range(1, 300):
            lin(torch.randn(m, 64))
    assert len(set(seen)) <= 16 + 5 * 8  # 299 row counts ran as at most 56 primitives


def test_server_greedy_tokens_and_logprobs_match_unpacked():
    from test_server_kv import _greedy, _model, _run

    from arealite.server.scheduler import Scheduler

    prompts = ([1, 2, 3, 4, 5], [9, 8, 7], list(range(1, 12)))
    replies = {}
    for packed in (True, False):
        s = Scheduler(_model(), max_batch_size=4, use_packed_linear=packed)
        assert bool(s.packed_linears) == packed
        replies[packed] = _run(s, [(p, _greedy(12)) for p in prompts])
    for a, b in zip(replies[True], replies[False]):
        assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 12
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-4


def test_bf16_server_runs_with_or_without_packed_bf16_support():
    from test_server_kv import _greedy, _model, _run

    from arealite.server.scheduler import Scheduler

    assert packed_linear.available("cpu", torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    s = Scheduler(_model().to(torch.bfloat16), max_batch_size=2)  # packs only where oneDNN can
    assert bool(s.packed_linears) == packed_linear.available("cpu", torch.bfloat16)
    reply = _run(s, [([1, 2, 3], _greedy(4))])[0]
    assert len(reply["output_ids"]) == 4


def _fp32_head_here() -> bool:
    from arealite import native

    return native.pack_bf16(torch.zeros(32, 4, dtype=torch.bfloat16)) is not None


@pytest.mark.skipif(not _fp32_head_here(), reason="no native bf16 GEMM here (compiler, libgomp, AVX-512 BF16)")
def test_fp32_lm_head_gives_fp32_logits_of_the_bf16_numbers_and_follows_weight_changes(tiny_model_dir):
    """A bf16 model's head returns float32 logits equal to the fp32 product of its bf16 hidden
    states and weight (no bf16 rounding of the logits), packed once and repacked after in-place
    writes or invalidate(); grad mode and fp32 models keep the plain head."""
    model = _tiny(tiny_model_dir, torch.bfloat16)
    assert packed_linear.fp32_lm_head(model)
    n_packed = packed_linear.pack_linears(model) if packed_linear.available("cpu", torch.bfloat16) else None
    assert n_packed in (None, 2 * 7)  # the head gets no oneDNN copy
    ids = torch.tensor([[5, 17, 900, 3, 44, 2]])

    def check():
        with torch.inference_mode():
            hidden = model.model(input_ids=ids).last_hidden_state  # [1, 6, 64] bf16
            logits = model(input_ids=ids).logits
            ref = hidden.double() @ model.lm_head.weight.double().t()
            bf16 = (hidden @ model.lm_head.weight.t()).double()  # what the bf16 head gave
        assert logits.dtype == torch.float32 and logits.shape == ref.shape
        assert (logits.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert (bf16 - ref).abs().max() > 100 * (logits.double() - ref).abs().max()
        return logits

    first = check()
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place, version counter seen (tied: embeddings too)
    assert not torch.allclose(check(), first)
    model.lm_head.weight.data.mul_(-1.0)  # unseen by the version counter: needs invalidate()
    packed_linear.invalidate(model)
    torch.testing.assert_close(check(), first)
    out = model(input_ids=ids).logits  # grad mode: the plain bf16 head, gradients flow
    assert out.dtype == torch.bfloat16 and out.requires_grad
    assert not packed_linear.fp32_lm_head(_tiny(tiny_model_dir, torch.float32))


def test_embedded_model_serves_in_bf16_with_fp32_logprobs_near_the_fp32_model():
    """SmolLM2-135M in bf16 passes the server's start-up self-check (on token ids 1, 2, 3 its
    bf16 rounding reached 7.5 of 31 in the logits and refused every bf16 server) and its sampled
    logprobs are fp32 numbers close to the fp32 model's on the same tokens."""
    from test_server_kv import _greedy, _reference_logprobs, _run
    from transformers import AutoModelForCausalLM

    from arealite.server.scheduler import Scheduler
    from arealite.utils.hf import default_model_path

    path = default_model_path()
    s = Scheduler(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), max_batch_size=2)
    assert s.fp32_head == _fp32_head_here()
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2]
    reply = _run(s, [(prompt, _greedy(12))])[0]
    out = reply["output_ids"]
    lp = [x[0] for x in reply["meta_info"]["output_token_logprobs"]]
    ref = _reference_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), prompt, out)
    diff = [abs(a - b) for a, b in zip(lp, ref)]
    assert len(out) == 12 and all(x <= 0 for x in lp)
    assert sum(diff) / len(diff) < 0.1 and max(diff) < 0.5  # bf16 rounding (fp32 vs bf16: 1.8e-5 vs ~3e-2 mean)


def test_sample_rows_past_the_end_takes_the_last_index_with_weight(monkeypatch):
    weights = torch.tensor([[1.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 5.0, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda n, _, **kw: torch.ones(n, 1, dtype=kw["dtype"]))
    assert _sample_rows(weights, None).tolist() == [1, 3, 1]  # u = total: past the end
    monkeypatch.setattr(torch, "rand", lambda n, _, **kw: torch.full((n, 1), 0.5, dtype=kw["dtype"]))
    # u = total / 2: first index whose cdf exceeds it (cdf 1,3 -> 1.5 -> index 1; 2 -> index 2)
    assert _sample_rows(weights, None).tolist() == [1, 2, 1]


def test_two_level_sampling_equals_one_inverse_cdf_over_the_whole_row():
    """Integer weights (exact sums in fp32): for the same u, the block-then-entry pick equals
    searchsorted(cumsum(w), u * total) over the whole row, on a vocabulary that is not a multiple
    of the block (a short last block), with zero-weight entries and whole zero-weight blocks."""
    from arealite.server.sampling import BLOCK

    g = torch.Generator().manual_seed(0)
    v = 3 * BLOCK + 37
    weights = torch.randint(0, 4, (512, v), generator=g).float()
    weights[:, BLOCK:2 * BLOCK] = 0  # a zero block in every row
    weights[::3, 3 * BLOCK:] = 0  # and a zero short block in some
    weights[5] = 0
    weights[5, 7] = 2.0  # a single entry with weight
    state = g.get_state()
    got = _sample_rows(weights, g)
    g.set_state(state)
    cdf = weights.cumsum(-1)
    u = torch.rand(512, 1, generator=g, dtype=cdf.dtype) * cdf[:, -1:]
    want = torch.searchsorted(cdf, u, right=True).squeeze(1)
    assert torch.equal(got, want)
    assert bool((weights.gather(1, got[:, None]) > 0).all()) and got[5] == 7
    assert not bool(((got >= BLOCK) & (got < 2 * BLOCK)).any())


def test_forward_flops_by_hand():
    # 2·10·3 + 4·2·4·6 + 2·5·7·2
    assert perf.forward_flops(10, 3, 6, 2, 4, head_positions=2, hidden=5, vocab=7) == 60 + 192 + 140
    assert perf.causal_pairs(3) == 6 and perf.causal_pairs(2, prefix=4) == 2 * 4 + 3


def test_engine_counts_model_flops_of_forward_and_train_batch(tiny_model_dir):
    from test_prefix_sharing import _group_batch, _n_loss_tokens, _pg_loss

    from arealite.api.config import OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine

    engine = FSDPEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-4)), temperature=0.7)
    engine.initialize(tiny_model_dir)
    # tiny Llama: per layer q 64·64, k and v 64·32, o 64·64, gate/up/down 64·128, 2 norms of 64;
    # 2 layers + the final norm; the tied embedding/LM head is not a per-token matmul
    n_params = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128) + 64
    assert engine._flop_shape == {"n_params": n_params, "n_layers": 2, "d_attn": 64, "hidden": 64,
                                  "vocab": 49152}
    # _group_batch, prompts shared: prompt 6 + suffixes 5,1,9,3 (24 tokens, 21 + 45+7+99+24 pairs),
    # prompt 11 + 4,4,7 (26 tokens, 66 + 54+54+105 pairs), one row of 3+8 (11 tokens, 66 pairs);
    # 40 positions predict a loss token (41 loss tokens, one masked out in the middle)
    fwd = 2 * n_params * 61 + 4 * 2 * 64 * 541 + 2 * 64 * 49152 * 40
    batch = _group_batch()
    before = perf.FLOPS.total
    engine.forward(batch)
    assert perf.FLOPS.total - before == fwd
    engine.train_batch(batch, _pg_loss, _n_loss_tokens)
    assert perf.FLOPS.total - before == fwd + 3 * fwd  # forward, activation and weight gradients


def test_precision_auto_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(perf, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert perf.resolve_precision("auto", "cpu", "actor.mixed_precision") == "bf16"
    monkeypatch.setattr(perf, "cpu_flags", lambda: {"avx2", "fma"})
    assert perf.fast_bf16("cpu")[0] is False
    assert perf.resolve_precision("auto", "cpu", "actor.mixed_precision") == "none"
    assert perf.resolve_precision("bf16", "cpu", "actor.mixed_precision") == "bf16"  # explicit: kept
    assert perf.resolve_dtype("auto", "cpu") == ("float32", perf.fast_bf16("cpu")[1])  # the server's --dtype auto
    assert perf.resolve_dtype("bfloat16", "cpu") == ("bfloat16", "asked for")
    monkeypatch.setattr(perf, "cpu_flags", lambda: {"amx_bf16"})
    assert perf.resolve_dtype("auto", "cpu")[0] == "bfloat16"
    assert perf.fast_bf16("cpu") == (True, "CPU has amx_bf16")


def test_gemm_peak_is_measured_and_cached():
    first = perf.gemm_peak(torch.float32, "cpu", size=256)
    assert first > 0.1  # GFLOP/s; any CPU of this century
    assert perf.gemm_peak(torch.float32, "cpu", size=256) == first


def test_bf16_compute_on_cpu_keeps_fp32_logprobs_and_master_weights(tiny_model_dir):
    from test_prefix_sharing import _group_batch, _n_loss_tokens, _pg_loss

    from arealite.api.config import OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine

    outs, params = {}, {}
    for mp in ("none", "bf16"):
        engine = FSDPEngine(TrainEngineConfig(mixed_precision=mp, optimizer=OptimizerConfig(lr=1e-3)),
                            temperature=0.7)
        engine.initialize(tiny_model_dir)
        assert engine.precision == mp
        batch = _group_batch()
        outs[mp] = engine.forward(batch)
        stats = engine.train_batch(batch, _pg_loss, _n_loss_tokens)
        assert stats["skipped"] == 0 and stats["grad_norm"] > 0
        params[mp] = {n: p.detach().full_tensor() for n, p in engine.model.named_parameters()}
        assert all(p.dtype == torch.float32 for p in params[mp].values())  # fp32 master weights
    assert outs["bf16"].dtype == torch.float32
    mask = outs["none"] != 0
    assert torch.equal(mask, outs["bf16"] != 0)
    diff = (outs["bf16"] - outs["none"])[mask].abs()
    assert 0 < diff.max() < 0.05  # bf16 rounding of a tiny model's activations, not garbage
    moved = [(params["bf16"][n] - params["none"][n]).abs().max() for n in params["none"]]
    assert max(moved) < 1e-3 * 5  # both took one AdamW step of lr 1e-3 in the same direction


def test_lm_head_multiplies_bf16_inputs_in_fp32():
    from arealite.train_engine.lm_head import chunked_logprobs_entropy

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 32, generator=g).bfloat16(), torch.randn(100, 32, generator=g).bfloat16()
    labels = torch.tensor([1, 5, 99, 0, 42, 7])
    lp, _ = chunked_logprobs_entropy(h, w, labels, 1.0, chunk_size=4)
    ref = torch.log_softmax(h.float() @ w.float().T, -1).gather(1, labels[:, None])[:, 0]
    assert lp.dtype == torch.float32 and torch.allclose(lp, ref, atol=1e-5)
