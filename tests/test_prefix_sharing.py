"""Prefix sharing (issue 15, "skip work that cannot change the result"): rows that start with
the same prompt run it once per micro-batch, their completions attending to the one copy through
a 4D mask (arealite/train_engine/packing.py ``prompt_units`` / ``shared_prompt_layout``). Proven here on a
real FSDPEngine (tiny Llama): the same logprobs, the same gradients and the same AdamW update
(≤ 1e-6) as running every row on its own, for sdpa and eager attention, the actor and the critic."""

import pytest
import torch

from arealite.train_engine.packing import prompt_units, shared_prompt_layout, unit_length


def test_units_and_layout_by_hand():
    # rows 0, 1, 3 share the prompt (7, 8); row 2 has its own; row 4 has no loss token
    keys = [(7, 8), (7, 8), (5,), (7, 8), ()]
    lengths = [4, 3, 2, 5, 2]
    assert prompt_units(keys, lengths, cap=100) == [(2, [0, 1, 3]), (0, [2]), (0, [4])]
    # a cap of 7 packed tokens: prompt 2 + suffixes 2 + 1 fit, + 3 more do not
    assert prompt_units(keys, lengths, cap=7) == [(2, [0, 1]), (0, [2]), (0, [3]), (0, [4])]
    units = prompt_units(keys, lengths, cap=100)
    assert [unit_length(u, lengths) for u in units] == [2 + 2 + 1 + 3, 2, 2]
    ids = torch.tensor([7, 8, 1, 2, 7, 8, 3, 5, 4, 7, 8, 6, 6, 6, 9, 9])  # rows back to back
    bins = [[0], [1, 2]]
    input_ids, pos, where, allowed, spans = shared_prompt_layout(ids, lengths, units, bins)
    # (prefix start, prefix length, start, length): the prompt, 3 suffixes reading it; 2 rows
    assert spans == [(0, 0, 0, 2), (0, 2, 2, 2), (0, 2, 4, 1), (0, 2, 5, 3), (8, 0, 8, 2), (10, 0, 10, 2)]
    assert input_ids.tolist() == [[7, 8, 1, 2, 3, 6, 6, 6], [5, 4, 9, 9, 0, 0, 0, 0]]
    assert pos.tolist() == [[0, 1, 2, 3, 2, 2, 3, 4], [0, 1, 0, 1, 0, 0, 0, 0]]
    assert torch.equal(input_ids.flatten()[where], ids)  # every token of every row is found
    assert where[[0, 1, 4, 5, 9, 10]].tolist() == [0, 1, 0, 1, 0, 1]  # the prompt's one copy
    a = allowed[0, 0].int().tolist()
    assert a[4] == [1, 1, 0, 0, 1, 0, 0, 0]  # row 1's suffix: the prompt and itself
    assert a[7] == [1, 1, 0, 0, 0, 1, 1, 1]  # row 3's last token: the prompt and its own suffix
    assert a[1] == [1, 1, 0, 0, 0, 0, 0, 0]  # a prompt token: causal within the prompt
    b = allowed[1, 0].int()
    assert b[:4, :4].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert torch.equal(b[4:, 4:], torch.eye(4, dtype=torch.int))  # filler: only itself


def _group_batch():
    """3 prompts (groups of 4, 3 and 1 rows), completions of 1-9 tokens, and a multi-turn row
    (loss_mask 0 in the middle: a tool's tokens)."""
    g = torch.Generator().manual_seed(0)
    rows, masks = [], []
    for plen, comp in ((6, (5, 1, 9, 3)), (11, (4, 4, 7)), (3, (8,))):
        prompt = torch.randint(1, 1000, (plen,), generator=g).tolist()
        for n in comp:
            rows.append(prompt + torch.randint(1, 1000, (n,), generator=g).tolist())
            masks.append([0] * plen + [1] * n)
    masks[5][11 + 1] = 0  # a middle token of a row of the 2nd group is not trained on
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    am = torch.zeros(len(rows), T, dtype=torch.bool)
    lm = torch.zeros(len(rows), T, dtype=torch.int)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)], am[i, :len(r)], lm[i, :len(r)] = torch.tensor(r), True, torch.tensor(m)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm,
            "advantages": torch.randn(len(rows), generator=g)[:, None] * lm}


def _pg_loss(out, mb):  # a policy-gradient-like loss with per-token weights
    return -(out * mb["advantages"] * mb["loss_mask"]).sum() / mb["loss_mask"].sum()


def _n_loss_tokens(mb):
    return float(mb["loss_mask"].sum())


def _run(model_dir, sharing, attn, critic=False, budget=2048):
    from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPCriticEngine, FSDPEngine

    cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-4, gradient_clipping=0.0), attn_implementation=attn,
                            mb_spec=MicroBatchSpec(max_tokens_per_mb=budget, prefix_sharing=sharing))
    engine = FSDPCriticEngine(cfg) if critic else FSDPEngine(cfg, temperature=0.7)
    engine.initialize(model_dir)
    # sdpa runs as its segment-aware variant: shared layouts are attended by segments, not the mask
    assert engine.model.config._attn_implementation == ("arealite_sdpa" if attn == "sdpa" else attn)
    if critic:  # the critic's zero head would give zero gradients to the backbone
        with torch.no_grad():
            w = engine.model.score.weight
            w.to_local().copy_(torch.randn(w.to_local().shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    batch = _group_batch()
    out = engine.forward(batch)
    stats = engine.train_batch(batch, _pg_loss, _n_loss_tokens)
    params = {n: p.detach().full_tensor().clone() for n, p in engine.model.named_parameters()}
    params.update({f"grad/{n}": p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()})
    packed = sum(unit_length(u, batch["attention_mask"].sum(1).tolist())
                 for u in engine._units(batch, batch["attention_mask"].sum(1).tolist()))
    return out, stats, params, packed


@pytest.fixture(params=["mask", "segments"])
def sdpa_layout(request, monkeypatch):
    """The prefix-shared sdpa layout attended through its dense mask (these completions are
    short) or by segments (forced: ``MIN_PAIR_RATIO = 0``)."""
    from arealite.train_engine import segment_attention

    if request.param == "segments":
        monkeypatch.setattr(segment_attention, "MIN_PAIR_RATIO", 0)
    return request.param


@pytest.mark.parametrize("attn,min_ratio", [("sdpa", 10 ** 6), ("sdpa", 0), ("eager", 0)])
def test_shared_prompts_give_the_same_logprobs_and_update(tiny_model_dir, attn, min_ratio, monkeypatch):
    """sdpa through the dense mask (short completions), sdpa by segments (forced), eager."""
    from arealite.train_engine import segment_attention

    monkeypatch.setattr(segment_attention, "MIN_PAIR_RATIO", min_ratio)
    batch = _group_batch()
    out_s, st_s, p_s, packed_s = _run(tiny_model_dir, True, attn)
    out_f, st_f, p_f, packed_f = _run(tiny_model_dir, False, attn)
    n_real = int(batch["attention_mask"].sum())
    # rows (6+5, 6+1, 6+9, 6+3), (11+4, 11+4, 11+7), (3+8): 101 tokens; shared, the 6-token prompt
    # runs 3 times fewer and the 11-token one 2 times fewer
    assert packed_f == n_real == 101 and packed_s == 101 - 3 * 6 - 2 * 11
    assert (out_f != 0).sum() > 30 and torch.equal((out_s != 0), (out_f != 0))
    _assert_within_ulps(out_s, out_f)
    assert st_s["loss"] == pytest.approx(st_f["loss"], rel=1e-6, abs=1e-7)
    assert st_s["grad_norm"] == pytest.approx(st_f["grad_norm"], rel=1e-5)
    _assert_same_update(p_s, p_f)


def _assert_within_ulps(a, b, ulps: int = 4):
    """Logprobs (size ~10) equal to a few fp32 units in the last place: the shared and the full
    layouts sum in another order, which moves a value by 1–2 ulp (2 ulp at 10.8 is 1.9e-6)."""
    tol = ulps * torch.finfo(torch.float32).eps * b.abs() + 1e-7
    assert bool(((a - b).abs() <= tol).all()), (a - b).abs().max()


def _assert_same_update(p_s, p_f):
    """Every weight after AdamW's first step (lr 1e-4) equal to ≤ 1e-6; every gradient element
    to ≤ 1e-5 of the largest (fp32 sums in another order: a few 1e-7 relative per element)."""
    grads = [n for n in p_f if n.startswith("grad/")]
    scale = max(p_f[n].abs().max().item() for n in grads)
    assert scale > 1e-2 and max((p_s[n] - p_f[n]).abs().max().item() for n in grads) <= 1e-5 * scale
    assert max((p_s[n] - p_f[n]).abs().max().item() for n in p_f if n not in grads) <= 1e-6


def test_shared_prompts_in_several_micro_batches_and_the_critic(tiny_model_dir, sdpa_layout):
    # a 30-token budget: several micro-batches, each group kept whole in one of them (a
    # group of 4 rows with its prompt once is 24 tokens, of 3 rows 37: split into 2 + 1 rows)
    out_s, st_s, p_s, _ = _run(tiny_model_dir, True, "sdpa", budget=30)
    out_f, st_f, p_f, _ = _run(tiny_model_dir, False, "sdpa", budget=30)
    assert st_f["n_microbatches"] == 4  # ceil(101 / 30)
    assert st_s["n_microbatches"] == 3  # ceil((24 + 26 + 18 + 11) / 30)
    _assert_within_ulps(out_s, out_f)
    _assert_same_update(p_s, p_f)
    v_s, _, c_s, _ = _run(tiny_model_dir, True, "sdpa", critic=True)
    v_f, _, c_f, _ = _run(tiny_model_dir, False, "sdpa", critic=True)
    assert (v_f != 0).sum() > 60  # values at every position, of size ~4: fp32 rounding is relative
    assert torch.allclose(v_s, v_f, rtol=1e-6, atol=1e-6)
    _assert_same_update(c_s, c_f)


def test_negative_control_completions_that_see_each_other_change_the_logprobs(tiny_model_dir, monkeypatch):
    import arealite.train_engine.fsdp as fsdp

    real = fsdp.shared_prompt_layout

    def leaky(ids, lengths, units, bins):  # plain causal rows: a suffix also sees the suffixes before it
        input_ids, pos, where, allowed, spans = real(ids, lengths, units, bins)
        # segments: each suffix's prefix runs from the prompt's start to its own start
        spans = [(ps, st - ps if pl else 0, st, n) for ps, pl, st, n in spans]
        return input_ids, pos, where, torch.ones_like(allowed).tril(), spans

    out_f = _run(tiny_model_dir, False, "sdpa")[0]
    monkeypatch.setattr(fsdp, "shared_prompt_layout", leaky)
    for attn, min_ratio in (("sdpa", 0), ("sdpa", 10 ** 6), ("eager", 0)):  # segments; the mask
        monkeypatch.setattr(fsdp.segment_attention, "MIN_PAIR_RATIO", min_ratio)
        out_leaky = _run(tiny_model_dir, True, attn)[0]
        assert (out_leaky - out_f).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_attention_equals_sdpa_with_the_layout_mask(dtype):
    """Attention by segments (arealite/train_engine/segment_attention.py) = SDPA with
    ``shared_prompt_layout``'s dense mask, forward and gradients of q, k, v, on a layout with
    shared prompts of different lengths, an unshared row, filler and GQA (6 query heads on 2 KV
    heads); filler outputs are zeros."""
    from types import SimpleNamespace

    from arealite.train_engine.segment_attention import build_segments, segment_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    keys = [(1, 2, 3)] * 4 + [(4,) * 9] * 3 + [(5, 6)]  # 2 groups and a row of its own
    lengths = [3 + n for n in (5, 1, 9, 3)] + [9 + n for n in (4, 17, 7)] + [2 + 8]
    units = prompt_units(keys, lengths, cap=1000)
    sizes = [unit_length(u, lengths) for u in units]
    assert sizes == [21, 37, 10]
    bins = [[0], [1, 2]]  # rows of 21 + filler and 37 + 10 tokens
    ids = torch.randint(1, 100, (sum(lengths),), generator=g)
    _, _, _, allowed, spans = shared_prompt_layout(ids, lengths, units, bins)
    r, c = allowed.shape[0], allowed.shape[-1]
    segs = build_segments(spans, r * c, torch.device("cpu"))
    assert {g.mask is None for g in segs.groups} == {True, False}  # both kinds ran
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q = torch.randn(r, 6, c, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(r, 2, c, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(r, 2, c, 16, generator=g).to(dtype).requires_grad_()
    filler = torch.ones(r, c, dtype=torch.bool)
    for ps, pl, st, n in spans:
        filler.view(-1)[st:st + n] = False
    out_seg, _ = segment_attention(module, q, k, v, None, scaling=0.25, arealite_segments=segs)
    ref, _ = sdpa_attention_forward(module, q, k, v, allowed, scaling=0.25)  # [R, C, H, d]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out_seg[~filler], ref[~filler], rtol=tol, atol=tol)
    assert filler.sum() == 47 - 21 and (out_seg[filler] == 0).all()
    w = torch.randn(ref.shape, generator=g).to(dtype) * (~filler)[..., None, None]
    grads_seg = torch.autograd.grad((out_seg * w).float().sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).float().sum(), (q, k, v))
    for a, b in zip(grads_seg, grads_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * 10)


def test_segments_are_used_from_64_token_completions_or_on_the_cpu_at_2_5x_fewer_pairs():
    from arealite.train_engine.segment_attention import worthwhile

    def row(prompt, completions):  # one packed row: its spans and its dense pairs C²
        spans, start = [(0, 0, 0, prompt)], prompt
        for n in completions:
            spans.append((0, prompt, start, n))
            start += n
        return spans, start ** 2

    # README command 1: 232² = 53,824 dense pairs, 40² + 8·24·64 = 13,888 by segments (3.9x)
    assert worthwhile(*row(40, [24] * 8))
    assert worthwhile(*row(40, [64] * 8))
    assert not worthwhile(*row(40, [100, 20]))  # 25,600 vs 16,800: 1.5x
    assert not worthwhile(*row(110, [16] * 4))  # 30,276 vs 20,164: 1.5x (measured 0.86x)
    assert not worthwhile([(0, 0, 0, 500)], 500 ** 2)  # nothing shared
    # off the CPU (no short attention) only completions of 64 tokens or more on average
    assert not worthwhile(*row(40, [24] * 8), "cuda") and worthwhile(*row(40, [64] * 8), "cuda")
    assert worthwhile(*row(200, [100, 30]))  # mean 65 (ratio 1.9)
