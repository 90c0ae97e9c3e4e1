"""Behaviour corrections (arealite/algorithms/corrections.py) and the surrogates (cispo.py, sapo.py,
gmpo.py, dppo.py) against hand-computed values on small tensors: every preset, masked tokens,
all-masked sequences, non-finite logprobs, the pre-mask denominator, and the default (``cap``)
reproducing the pre-refactor decoupled PPO loss exactly."""

import math

import pytest
import torch

from arealite.algorithms import corrections as C
from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO, SURROGATE_MIXINS, with_surrogate
from arealite.api.cli import ConfigError, validate_config
from arealite.api.config import CORRECTIONS, SURROGATES, GRPOAlgoConfig, GRPOConfig

# ρ = π_prox/μ per token; rows 1 and 2 have two loss tokens (the rest masked, with garbage ρ).
RHO = torch.tensor([[2.0, 0.25, 1.0, 8.0], [1.0, 3.0, 50.0, 50.0], [2.0, 0.5, 50.0, 50.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]])
PROX = torch.full((3, 4), math.log(0.5))
BEHAV = PROX - RHO.log()


def _w(preset, **kw):
    return C.behaviour_correction(PROX, BEHAV, MASK, preset, **kw)


def test_preset_names_match_the_config_choices():
    assert tuple(C.PRESETS) == CORRECTIONS == C.CORRECTIONS
    assert set(SURROGATES) == {"ppo", *SURROGATE_MIXINS}


@pytest.mark.parametrize("preset,kw,expected", [
    ("cap", {"upper": 5.0}, [[2, .25, 1, 0], [1, 3, 0, 0], [2, .5, 0, 0]]),  # 8 > 5 masked
    ("cap", {}, [[2, .25, 1, 8], [1, 3, 0, 0], [2, .5, 0, 0]]),  # no cap: w = ρ
    ("none", {}, [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]),
    ("token_tis", {}, [[2, .25, 1, 2], [1, 2, 0, 0], [2, .5, 0, 0]]),  # min(ρ, 2)
    ("seq_tis", {}, [[2, 2, 2, 2], [2, 2, 0, 0], [1, 1, 0, 0]]),  # ∏ρ = 4, 3, 1 → min(·, 2)
    ("token_mis", {}, [[2, 0, 1, 0], [1, 0, 0, 0], [2, .5, 0, 0]]),  # ρ in [0.5, 2]
    ("seq_mis", {}, [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]),  # ∏ρ ≤ 2: row 2 only
    ("seq_mis", {"upper": 5.0}, [[4, 4, 4, 4], [3, 3, 0, 0], [1, 1, 0, 0]]),
    ("icepop", {}, [[2, 0, 1, 0], [1, 3, 0, 0], [2, .5, 0, 0]]),  # ρ in [0.5, 5]
    ("geo_rs", {}, [[0, 0, 0, 0], [0, 0, 0, 0], [2, .5, 0, 0]]),  # geometric means 4^¼, √3, 1; then min(ρ, 2)
    ("k2_rs", {}, [[2, .25, 1, 0], [1, 3, 0, 0], [2, .5, 0, 0]]),  # ½ ln²8 = 2.16 > 2
    ("k3_rs", {}, [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]),  # mean k3 1.47, 0.45, 0.25 > 0.01
    ("k3_rs", {"upper": 0.3}, [[0, 0, 0, 0], [0, 0, 0, 0], [2, .5, 0, 0]]),
    ("m2po", {}, [[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]),  # only ln²ρ = 0 left: mean 0 < 0.04
    ("m2po", {"upper": 1.0}, [[2, .25, 1, 0], [1, 3, 0, 0], [2, .5, 0, 0]]),  # dropping ln²8 leaves mean .65
])
def test_preset_weights_hand_computed(preset, kw, expected):
    corr = _w(preset, **kw)
    torch.testing.assert_close(corr.weight, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert torch.equal(corr.keep, (MASK > 0) & (corr.weight > 0))
    assert corr.weight.requires_grad is False
    kept = int(corr.keep.sum())
    assert corr.stats["behav/masked_frac"].item() == pytest.approx((8 - kept) / 8)  # pre-mask count: 8 loss tokens


def test_truncation_fraction_ess_and_batch_norm():
    tis = _w("token_tis")
    assert tis.stats["behav/truncated_frac"].item() == pytest.approx(2 / 8)  # 8 and 3 cut to 2
    cap = _w("cap", upper=5.0)  # w over the loss tokens: 2 .25 1 0 1 3 2 .5
    s, s2 = 9.75, 4 + .0625 + 1 + 0 + 1 + 9 + 4 + .25
    assert cap.stats["behav/ess"].item() == pytest.approx(s * s / (8 * s2), rel=1e-5)
    norm = _w("icepop", batch_norm=True)  # kept weights 2 1 1 3 2 .5, mean 9.5 / 6
    torch.testing.assert_close(norm.weight[norm.keep], torch.tensor([2, 1, 1, 3, 2, .5]) / (9.5 / 6))


def test_kpop_binary_kl_hand_computed():
    p, q = torch.tensor([[0.5]]), torch.tensor([[0.25]])
    kl_pq = 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)  # 0.1438
    kl_qp = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)  # 0.1308
    assert C.binary_kl(p, q).item() == pytest.approx(kl_pq, rel=1e-5)
    assert C.binary_kl(q, p).item() == pytest.approx(kl_qp, rel=1e-5)
    one = torch.ones(1, 1)
    assert C.behaviour_correction(p.log(), q.log(), one, "kpop").weight.item() == pytest.approx(2.0)  # 0.1438 ≤ 2
    assert C.behaviour_correction(p.log(), q.log(), one, "kpop", upper=0.14).weight.item() == 0.0  # > 0.14


def test_non_finite_and_all_masked_rows():
    prox = torch.tensor([[math.log(0.5), math.log(0.5)], [0.0, 0.0]])
    behav = torch.tensor([[float("nan"), -float("inf")], [float("nan"), 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])  # row 1: nothing to train
    for preset in CORRECTIONS:
        corr = C.behaviour_correction(prox, behav, mask, preset)
        assert torch.isfinite(corr.weight).all() and (corr.weight[1] == 0).all(), preset
        assert all(torch.isfinite(v) for v in corr.stats.values()), preset
    lr = C.log_rho(prox, behav, mask)
    assert lr[0, 0] == 0 and lr[0, 1] == C.LOG_RATIO_CLAMP  # NaN → 0; μ = 0 → the clamp
    assert C.behaviour_correction(prox, behav, mask, "cap", upper=5.0).weight[0].tolist() == [1.0, 0.0]


def test_mismatch_stats_hand_computed():
    st = C.mismatch_stats(PROX, BEHAV, MASK)
    lr = RHO.log()[MASK > 0]
    assert st["mismatch/kl_k1"].item() == pytest.approx(float((-lr).mean()), rel=1e-5)
    assert st["mismatch/kl_k3"].item() == pytest.approx(float((lr.exp() - 1 - lr).mean()), rel=1e-5)
    assert st["mismatch/abs_log_rho_max"].item() == pytest.approx(math.log(8), rel=1e-5)
    assert C.mismatch_stats(PROX, PROX, MASK)["mismatch/kl_k3"].item() == 0.0


def _old_ppo_loss_per_token(log_ratio, prox_logp, behav_logp, advantages, loss_mask, eps_clip=0.2,
                            eps_clip_high=None, behav_imp_weight_cap=None):
    """The decoupled PPO loss as it was before the corrections existed (reference)."""
    mask = loss_mask > 0
    zero = lambda x, k: torch.where(k, x, torch.zeros_like(x))  # noqa: E731
    high = eps_clip if eps_clip_high is None else eps_clip_high
    behav_w = torch.exp(zero(prox_logp - behav_logp, mask))
    capped = mask & (behav_w > behav_imp_weight_cap) if behav_imp_weight_cap is not None else mask & False
    kept = mask & ~capped
    log_ratio, adv = zero(log_ratio, kept), zero(advantages, kept)
    w = torch.where(kept, behav_w, torch.ones_like(behav_w))
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high))
    return zero(pg * w, kept)


@pytest.mark.parametrize("cap", [5.0, None])
def test_the_default_reproduces_the_old_decoupled_loss_and_gradient(cap):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    mask = (torch.rand(B, T, generator=g) > 0.3).int()
    behav = -torch.rand(B, T, generator=g) * 3
    prox = behav + torch.randn(B, T, generator=g) * 2.0  # ρ up to e^4: some above the cap
    cur = (prox + torch.randn(B, T, generator=g) * 0.3).requires_grad_()
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    ref = F.agg_loss(_old_ppo_loss_per_token(cur - prox, prox, behav, adv, mask, 0.2, 0.28, cap), mask)
    (g_ref,) = torch.autograd.grad(ref, cur)
    corr = C.behaviour_correction(prox, behav, mask, "cap", upper=cap)
    new = F.agg_loss(F.ppo_loss_per_token(cur - prox, adv, corr.keep, corr.weight, 0.2, 0.28)[0], mask)
    (g_new,) = torch.autograd.grad(new, cur)
    assert (mask.bool() & ~corr.keep).any() == (cap is not None)
    assert abs(new.item() - ref.item()) <= 1e-6
    assert (g_new - g_ref).abs().max().item() <= 1e-6


class _NoActor:
    pass


def _loss(cfg: GRPOAlgoConfig, cur, prox, behav, adv, mask):
    algo = with_surrogate(GRPO, cfg.loss)(cfg, _NoActor(), group_size=2)
    algo._mb_stats = []
    mb = {"loss_mask": mask, "prox_logp": prox, "logprobs": behav, "advantages": adv}
    loss = algo.loss_fn(cur, mb)
    return loss, algo._mb_stats[0]


def test_masking_keeps_the_pre_mask_denominator():
    """icepop masks two of four loss tokens: the kept tokens' gradient is −A·w/4, not −A·w/2."""
    cur = torch.full((1, 4), math.log(0.5)).requires_grad_()
    prox = cur.detach().clone()
    behav = prox - torch.tensor([[1.0, 8.0, 2.0, 0.25]]).log()
    adv = torch.ones(1, 4)
    loss, stats = _loss(GRPOAlgoConfig(correction="icepop"), cur, prox, behav, adv, torch.ones(1, 4, dtype=torch.int))
    loss.backward()
    torch.testing.assert_close(cur.grad, torch.tensor([[-1 / 4, 0.0, -2 / 4, 0.0]]))
    assert stats["behav/masked_frac"] == 0.5 and stats["masked_by_cap"] == 2.0
    assert loss.item() == pytest.approx(-(1 + 2) / 4)


def test_surrogates_hand_computed():
    lp = torch.log(torch.tensor([[0.5, 0.5]]))
    one = torch.ones(1, 2, dtype=torch.int)
    # CISPO: r = 1.5 (A = 1) clipped to 1.28, r = 0.5 (A = −1) clipped to 0.8; both keep a gradient
    cur = lp.clone().requires_grad_()
    prox = lp - torch.tensor([[1.5, 0.5]]).log()
    cfg = GRPOAlgoConfig(loss="cispo", eps_clip=0.2, eps_clip_high=0.28)
    loss, st = _loss(cfg, cur, prox, prox, torch.tensor([[1.0, -1.0]]), one)
    loss.backward()
    torch.testing.assert_close(cur.grad, torch.tensor([[-1.28 / 2, 0.8 / 2]]))
    assert st["clip_frac"] == 1.0
    # SAPO: at r = 1 the gradient is vanilla PG (−A); at r = 2 (A = 1, τ = 1) it is −4σ(1)(1−σ(1))·2
    cur = lp.clone().requires_grad_()
    prox = lp - torch.tensor([[1.0, 2.0]]).log()
    loss, _ = _loss(GRPOAlgoConfig(loss="sapo"), cur, prox, prox, torch.tensor([[1.0, 1.0]]), one)
    loss.backward()
    s1 = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(cur.grad, torch.tensor([[-1.0 / 2, -4 * s1 * (1 - s1) * 2 / 2]]))
    assert loss.item() == pytest.approx((-2.0 - 4 * s1) / 2)
    # GMPO: log ratios 0.1, 0.5 with ε = 0.4: A = 1 → R = exp((0.1 + 0.4)/2); A = −1 → exp((0.1 + 0.5)/2)
    for a, expected in ((1.0, -math.exp(0.25)), (-1.0, math.exp(0.3))):
        cur = (lp + torch.tensor([[0.1, 0.5]])).requires_grad_()
        cfg = GRPOAlgoConfig(loss="gmpo", eps_clip=0.4, loss_agg_mode="seq-mean-token-mean")
        loss, _ = _loss(cfg, cur, lp, lp, torch.full((1, 2), a), one)
        assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_dppo_trust_region_hand_computed():
    p_prox = torch.full((1, 4), 0.5)
    p = torch.tensor([[0.8, 0.6, 0.2, 0.7]])  # Δp = .3, .1, −.3, .2
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    cur = p.log().requires_grad_()
    loss, st = _loss(GRPOAlgoConfig(loss="dppo_tv"), cur, p_prox.log(), p_prox.log(), adv,
                     torch.ones(1, 4, dtype=torch.int))
    loss.backward()
    # kept: t1 (A > 0, Δp ≤ .2) and t3 (A < 0, Δp ≥ −.2): grad −A·min(r, 20)/4 with r = p/p_prox
    torch.testing.assert_close(cur.grad, torch.tensor([[0.0, -1.2 / 4, 0.0, 1.4 / 4]]))
    assert st["trust_region_masked_frac"] == 0.5
    kl = lambda a, b: a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))  # noqa: E731
    assert kl(0.5, 0.8) > 0.05 > kl(0.5, 0.55)
    cur = torch.tensor([[0.8, 0.55]]).log().requires_grad_()
    loss, _ = _loss(GRPOAlgoConfig(loss="dppo_kl"), cur, p_prox[:, :2].log(), p_prox[:, :2].log(),
                    torch.ones(1, 2), torch.ones(1, 2, dtype=torch.int))
    loss.backward()
    torch.testing.assert_close(cur.grad, torch.tensor([[0.0, -1.1 / 2]]))


def test_incompatible_pairs_are_refused_before_launch():
    with pytest.raises(ConfigError, match=r"^algo\.correction: 'icepop' with algo\.use_decoupled_loss false"):
        validate_config(GRPOConfig(algo=GRPOAlgoConfig(correction="icepop", use_decoupled_loss=False)))
    with pytest.raises(ConfigError, match=r"^algo\.loss_agg_mode: .*algo\.loss gmpo"):
        validate_config(GRPOConfig(algo=GRPOAlgoConfig(loss="gmpo")))
    with pytest.raises(ConfigError, match=r"^algo\.correction: unknown 'tis'"):
        validate_config(GRPOConfig(algo=GRPOAlgoConfig(correction="tis")))
    with pytest.raises(ConfigError, match=r"^algo\.correction_upper: .*behav_imp_weight_cap"):
        validate_config(GRPOConfig(algo=GRPOAlgoConfig(correction_upper=3.0)))
    for preset in CORRECTIONS:
        validate_config(GRPOConfig(algo=GRPOAlgoConfig(correction=preset)))


def test_every_method_is_selectable_from_the_command_line():
    from arealite.api.cli import load_config

    cfg = load_config(GRPOConfig, ["--algo.correction", "icepop", "--algo.loss", "cispo"])
    assert (cfg.algo.correction, cfg.algo.loss) == ("icepop", "cispo")
    algo = GRPO.from_config(cfg, _NoActor())
    assert type(algo).__name__ == "GRPO[cispo]" and isinstance(algo, SURROGATE_MIXINS["cispo"])
