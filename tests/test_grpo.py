"""GRPO math: advantages, the clipped/decoupled loss and token alignment, with hand-computed values."""

import math

import pytest
import torch

from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO
from arealite.api.config import GRPOAlgoConfig
from arealite.api.io_struct import ModelResponse
from arealite.workflow.rlvr import build_trajectories

from conftest import ppo_token_mean




def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    adv = F.group_normalize(rewards, group_size=4, use_std=True, eps=0.0)
    # group 1: mean 0.25, std sqrt(0.1875)=0.4330127; group 2: mean 0.75, same std
    s = math.sqrt(0.1875)
    expected = torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0.25 / s, 0.25 / s, -0.75 / s, 0.25 / s])
    torch.testing.assert_close(adv, expected)


def test_group_normalisation_is_per_group_not_global():
    # A helper that normalised the wrong rows after the first group would mix these.
    rewards = torch.tensor([0.0, 1.0, 10.0, 12.0])
    adv = F.group_normalize(rewards, group_size=2, use_std=False)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -1.0, 1.0]))


def test_all_equal_group_has_zero_advantage_and_no_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    adv = F.group_normalize(rewards, group_size=3)
    assert torch.equal(adv, torch.zeros(6))
    assert not torch.isnan(adv).any()


def test_near_zero_variance_group_gets_zero_advantage_others_unchanged():
    # Group 1 differs only by float noise (std 5e-8): without the floor its advantages would be
    # ±(5e-8 / (5e-8 + 1e-6)) ≈ ±0.048, or ±1 with eps=0. Group 2 is ordinary: (±0.5)/0.5 = ±1.
    noise = torch.tensor([0.7, 0.7 + 1e-7, 0.7, 0.7 + 1e-7], dtype=torch.float64)
    rewards = torch.cat([noise, torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)])
    for eps in (0.0, 1e-6):
        adv = F.group_normalize(rewards, group_size=4, eps=eps)
        assert torch.equal(adv[:4], torch.zeros(4))
        torch.testing.assert_close(adv[4:], torch.tensor([-1.0, 1.0, -1.0, 1.0]) / (1 + 2 * eps))
    assert torch.equal(F.rloo_advantages(rewards, 4)[:4], torch.zeros(4))
    # std exactly at / just above the floor: 0.5·d is the population std of [0, d, 0, d]
    at = torch.tensor([0.0, 2e-4, 0.0, 2e-4])  # std 1e-4 == floor -> 0
    above = torch.tensor([0.0, 4e-4, 0.0, 4e-4])  # std 2e-4 > floor -> ±1
    assert torch.equal(F.group_normalize(at, 4, eps=0.0), torch.zeros(4))
    torch.testing.assert_close(F.group_normalize(above, 4, eps=0.0), torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    # a configurable floor: std_floor=0 keeps the float-noise group (exactly-equal still 0)
    assert F.group_normalize(noise, 4, eps=0.0, std_floor=0.0).abs().min() > 0.99
    with pytest.raises(ValueError, match="adv_std_floor"):
        F.group_normalize(rewards, 4, std_floor=-1.0)


def test_non_finite_reward_zeroes_only_its_group():
    rewards = torch.tensor([float("nan"), 1.0, 0.0, 1.0, 0.0, 1.0, float("inf"), 0.0, 1.0, 0.0, 1.0, 0.0])
    adv = F.group_normalize(rewards, group_size=4, eps=0.0)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:4], torch.zeros(4)) and torch.equal(adv[4:8], torch.zeros(4))
    torch.testing.assert_close(adv[8:], torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert torch.isfinite(F.rloo_advantages(rewards, 4)).all()


def test_dynamic_sampling_filter_uses_the_same_floor():
    from arealite.algorithms.grpo import should_accept

    assert not should_accept({"rewards": torch.tensor([0.7, 0.7 + 1e-7, 0.7, 0.7], dtype=torch.float64)})
    assert not should_accept({"rewards": torch.tensor([1.0, float("nan"), 0.0])})
    assert should_accept({"rewards": torch.tensor([0.0, 4e-4])})
    with pytest.raises(ValueError, match="algo.adv_std_floor"):
        GRPO(GRPOAlgoConfig(adv_std_floor=-0.1), actor=None, group_size=2)


def test_group_size_must_divide_batch():
    with pytest.raises(ValueError, match="group_size"):
        F.group_normalize(torch.zeros(5), group_size=2)


def test_ppo_loss_hand_computed_with_clipping():
    # 1 row, 3 tokens; token 0 is a prompt token (masked).
    logp = torch.tensor([[0.0, math.log(0.6), math.log(0.2)]], requires_grad=True)
    prox = torch.tensor([[0.0, math.log(0.4), math.log(0.4)]])
    adv = torch.tensor([[0.0, 1.0, -1.0]])
    mask = torch.tensor([[0, 1, 1]])
    loss, stats = ppo_token_mean(logp, prox, prox, adv, mask, eps_clip=0.2)
    # token1: r=1.5, A=1 -> max(-1.5, -1.2) = -1.2 (clipped); token2: r=0.5, A=-1 -> max(0.5, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(1.0)
    loss.backward()
    # both tokens clipped -> zero gradient; masked prompt token -> zero gradient
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_on_policy_ratio_is_one_and_clip_frac_zero():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.9]])).requires_grad_()
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    loss, stats = ppo_token_mean(logp, logp.detach(), logp.detach(), adv, torch.ones(1, 3))
    assert loss.item() == pytest.approx(-2.0)
    assert stats["clip_frac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -2.0 / 3))


def test_decoupled_weight_and_cap():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    prox = torch.log(torch.tensor([[0.5, 0.5]]))
    behav = torch.log(torch.tensor([[0.25, 0.05]]))  # weights 2 and 10
    adv = torch.tensor([[1.0, 1.0]])
    loss, stats = ppo_token_mean(logp, prox, behav, adv, torch.ones(1, 2), behav_imp_weight_cap=5.0)
    # token 2 dropped by the cap (a zero-loss token); token 1: w=2, r=1 -> -2; mean over 2 loss tokens
    assert loss.item() == pytest.approx(-1.0)
    assert stats["masked_by_cap"].item() == 1.0


def test_asymmetric_clip_higher():
    logp = torch.log(torch.tensor([[0.65]]))
    prox = torch.log(torch.tensor([[0.5]]))  # r = 1.3
    loss, _ = ppo_token_mean(logp, prox, prox, torch.ones(1, 1), torch.ones(1, 1), eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28, abs=1e-6)


def test_k3_kl_is_finite_at_extreme_log_ratios():
    logp = torch.tensor([-100.0, 0.0, -1e-3], requires_grad=True)
    ref = torch.tensor([0.0, -100.0, -1e-3])
    kl = F.kl_estimate(logp, ref, "k3")
    assert torch.isfinite(kl).all() and kl[2].item() == pytest.approx(0.0, abs=1e-9)
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_gather_logprobs_alignment_and_temperature():
    # logits[:, t] scores token t+1; output index t+1 holds it, index 0 is 0.
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 5)
    ids = torch.tensor([[3, 1, 4, 2]])
    out = F.gather_logprobs(logits, ids, temperature=0.5)
    ref = torch.log_softmax(logits / 0.5, -1)
    assert out[0, 0] == 0
    for t in range(1, 4):
        assert out[0, t].item() == pytest.approx(ref[0, t - 1, ids[0, t]].item(), abs=1e-6)


def test_trajectory_layout_aligns_loss_mask_logprobs_versions():
    r1 = ModelResponse(input_tokens=[10, 11, 12], output_tokens=[5, 6], output_logprobs=[-0.1, -0.2],
                       output_versions=[3, 4], stop_reason="stop")
    r2 = ModelResponse(input_tokens=[10, 11, 12], output_tokens=[7], output_logprobs=[-0.3],
                       output_versions=[4], stop_reason="length")
    t = build_trajectories([r1, r2], [1.0, 0.0])
    assert t["input_ids"].tolist() == [[10, 11, 12, 5, 6], [10, 11, 12, 7, 0]]
    assert t["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    torch.testing.assert_close(t["logprobs"], torch.tensor([[0, 0, 0, -0.1, -0.2], [0, 0, 0, -0.3, 0]]))
    assert t["versions"].tolist() == [[-1, -1, -1, 3, 4], [-1, -1, -1, 4, -1]]
    assert t["no_eos"].tolist() == [False, True]


class _FakeActor:
    """Records what GRPO sends to the engine; logprobs = stored behaviour logprobs (on-policy)."""

    def __init__(self):
        self.calls = []

    def forward(self, batch):
        return batch["logprobs"].clone()

    def train_batch(self, batch, loss_fn, loss_weight_fn, skipped_weight=0.0):
        loss = loss_fn(batch["logprobs"].clone().requires_grad_(), batch)
        self.calls.append((batch, loss.item(), loss_weight_fn(batch)))
        return {"loss": loss.item()}


def test_grpo_update_uses_group_advantages_on_generated_tokens_only():
    actor = _FakeActor()
    algo = GRPO(GRPOAlgoConfig(n_minibatches=2), actor, group_size=2)
    batch = build_trajectories(
        [ModelResponse([1, 2], [3], [-0.5], [0], "stop"), ModelResponse([1, 2], [4, 5], [-0.1, -0.2], [0, 0], "stop"),
         ModelResponse([1], [6], [-0.3], [0], "stop"), ModelResponse([1], [7], [-0.4], [0], "stop")],
        [1.0, 0.0, 1.0, 1.0],
    )
    stats = algo.update(batch)
    assert len(actor.calls) == 2  # two minibatches of one group each
    mb0, loss0, w0 = actor.calls[0]
    # group 1: advantages +1/-1 (std-normalised, eps tiny), only on generated tokens
    torch.testing.assert_close(mb0["advantages"], torch.tensor([[0, 0, 1.0, 0], [0, 0, -1.0, -1.0]]), atol=1e-5, rtol=0)
    assert w0 == 3.0
    # on-policy: loss = -(1 - 1 - 1)/3 = 1/3
    assert loss0 == pytest.approx(1.0 / 3.0, abs=1e-5)
    _, loss1, _ = actor.calls[1]
    assert loss1 == 0.0  # all-equal group
    assert stats["actor/clip_frac"] == 0.0


def test_single_minibatch_decoupled_loss_uses_the_training_forward_as_proximal_policy():
    # One minibatch: π_prox = the weights being updated, so prox_logp = logprobs.detach():
    # ratio u = 1 and the behaviour weight w = π_θ/π_behav multiplies the advantage.
    algo = GRPO(GRPOAlgoConfig(n_minibatches=1, use_decoupled_loss=True, behav_imp_weight_cap=None),
                _FakeActor(), group_size=2)
    batch = build_trajectories(
        [ModelResponse([1], [3], [math.log(0.25)], [0], "stop"), ModelResponse([1], [4], [math.log(0.5)], [0], "stop")],
        [1.0, 0.0],
    )
    batch = algo.prepare(batch)
    assert "prox_logp" not in batch  # no extra forward pass
    algo._mb_stats = []
    current = torch.log(torch.tensor([[1.0, 0.5], [1.0, 0.5]])).requires_grad_()
    loss = algo.loss_fn(current, batch)
    # advantages ±1; w = 0.5/0.25 = 2 for row 0 and 0.5/0.5 = 1 for row 1; u = 1
    # loss = (-(+1)·2 + -(-1)·1) / 2 tokens = -0.5
    assert loss.item() == pytest.approx(-0.5, abs=1e-5)
    loss.backward()
    # d/dlogp of -A·w·exp(logp - sg(logp)) = -A·w
    torch.testing.assert_close(current.grad, torch.tensor([[0.0, -1.0], [0.0, 0.5]]), atol=1e-5, rtol=0)


def test_new_grpo_options_default_to_the_original_objective():
    c = GRPOAlgoConfig()
    assert (c.loss_agg_mode, c.c_clip, c.kl_estimator, c.overlong_penalty) == ("token-mean", None, "k3", 0)
    # default loss_fn == token-mean decoupled PPO (cap-dropped tokens excluded) + β·mean k3, bit for bit
    class Ref:
        def forward(self, batch):
            return batch["logprobs"] - 0.3

    algo = GRPO(GRPOAlgoConfig(kl_coef=0.1, n_minibatches=2), _FakeActor(), group_size=2, ref=Ref())
    batch = algo.prepare(build_trajectories(
        [ModelResponse([1], [3, 4], [-0.2, -3.0], [0, 0], "stop"), ModelResponse([1], [5], [-0.5], [0], "stop")],
        [1.0, 0.0]))
    algo._mb_stats = []
    cur = batch["logprobs"] + torch.tensor([[0.0, 0.1, 2.0], [0.0, -0.2, 0.0]])
    expected, _ = ppo_token_mean(cur, batch["prox_logp"], batch["logprobs"], batch["advantages"],
                                  batch["loss_mask"], eps_clip=0.2, behav_imp_weight_cap=5.0)
    expected = expected + 0.1 * F.masked_mean(F.kl_estimate(cur, batch["ref_logp"], "k3"), batch["loss_mask"])
    assert torch.equal(algo.loss_fn(cur, batch), expected)
    assert algo.loss_weight_fn(batch) == 3.0
