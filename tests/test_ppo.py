"""PPO with a critic (arealite/algorithms/ppo.py) and its math (GAE, clipped value loss) on
small written-out tensors with hand-computed values; metrics of the GRPO family."""

import math

import pytest
import torch

from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO
from arealite.algorithms.ppo import PPO, normalize_rewards
from arealite.api.config import GRPOAlgoConfig, PPOAlgoConfig

from test_algorithms import _FakeActor, _batch


class _FakeCritic:
    """Value engine stand-in: fixed V_old from ``forward``; ``train_batch`` evaluates the loss at
    V = V_old + ``shift`` (with grad) and records loss and gradient."""

    def __init__(self, values, shift=0.0):
        self.values, self.shift, self.losses, self.grads = values, shift, [], []

    def forward(self, batch):
        return self.values.clone()

    def train_batch(self, batch, loss_fn, loss_weight_fn, skipped_weight=0.0):
        v = (batch["values"] + self.shift).clone().requires_grad_()
        loss = loss_fn(v, batch)
        loss.backward()
        self.losses.append(loss.item())
        self.grads.append(v.grad)
        return {"loss": loss.item(), "grad_norm": float(v.grad.norm())}


def test_gae_hand_computed():
    # prompt 2 tokens, 3 generated tokens with V = [0.5, 0.2, -0.1], R = 1 on the last token
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    values = torch.tensor([[7.0, 7.0, 0.5, 0.2, -0.1]])  # prompt values are garbage: never read
    rewards = F.last_token_rewards(torch.tensor([1.0]), mask)
    adv, ret = F.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # δ2 = 1 + 0 - (-0.1) = 1.1 ; A2 = 1.1
    # δ1 = 0 + 0.9·(-0.1) - 0.2 = -0.29 ; A1 = -0.29 + 0.72·1.1 = 0.502
    # δ0 = 0 + 0.9·0.2 - 0.5 = -0.32 ;    A0 = -0.32 + 0.72·0.502 = 0.04144
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.04144, 0.502, 1.1]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.0, 0.54144, 0.702, 1.0]]))


def test_gae_lambda_one_is_return_minus_value_and_skips_tool_tokens():
    # generated, tool output (masked, garbage value), generated; then padding
    mask = torch.tensor([[1, 0, 1, 0]])
    values = torch.tensor([[0.5, 9.0, 0.3, float("nan")]])
    adv, ret = F.gae(F.last_token_rewards(torch.tensor([1.0]), mask), values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.7, 0.0]]))  # 1 - V_t
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="algo.gamma"):
        F.gae(values, values, mask, 1.5, 1.0)


def test_clipped_value_loss_hand_computed_value_and_gradient():
    v = torch.tensor([[0.5, 1.0, 3.0]], requires_grad=True)
    old = torch.tensor([[0.2, 0.2, 0.0]])
    ret = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss_tok, stats = F.value_loss_per_token(v, old, ret, mask, value_eps_clip=0.2)
    # token 0: (0.5-0)² = 0.25 vs (0.4-0)² = 0.16 → ½·0.25; gradient v - ret = 0.5
    # token 1: (1-1)² = 0 vs (0.4-1)² = 0.36 → ½·0.36 (clipped branch: constant, gradient 0)
    torch.testing.assert_close(loss_tok, torch.tensor([[0.125, 0.18, 0.0]]))
    assert stats["value_clip_frac"].item() == 0.5
    loss_tok.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.5, 0.0, 0.0]]))
    unclipped, _ = F.value_loss_per_token(v.detach(), old, ret, mask, value_eps_clip=None)
    torch.testing.assert_close(unclipped, torch.tensor([[0.125, 0.0, 0.0]]))


def test_normalize_rewards_modes():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(normalize_rewards(r, "none", 2), r)
    torch.testing.assert_close(normalize_rewards(r, "group", 2), torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    # batch: mean 0.25, std sqrt(0.1875)
    s = math.sqrt(0.1875)
    torch.testing.assert_close(normalize_rewards(r, "batch", 2), torch.tensor([0.75, -0.25, -0.25, -0.25]) / s)
    with pytest.raises(ValueError, match="algo.reward_norm"):
        normalize_rewards(r, "zscore", 2)


def test_ppo_update_hand_computed_advantages_critic_loss_and_on_policy_ratio():
    # two rows: 2 and 1 generated tokens after a 2-token prompt; rewards 1 and 0
    b = _batch([2, 1], [1.0, 0.0], logp=-0.4)
    values = torch.tensor([[0.0, 0.0, 0.25, 0.5], [0.0, 0.0, 0.5, 0.0]])
    actor, critic = _FakeActor(), _FakeCritic(values)
    algo = PPO(PPOAlgoConfig(adv_whiten=False, value_eps_clip=None), actor, critic, group_size=1)
    stats = algo.update(b)
    # γ = λ = 1: A_t = R - V_t ; returns = R on every generated token
    torch.testing.assert_close(b["advantages"], torch.tensor([[0.0, 0.0, 0.75, 0.5], [0.0, 0.0, -0.5, 0.0]]))
    torch.testing.assert_close(b["returns"], torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    # critic loss at V = V_old: token-mean of ½ A² = ½ (0.5625 + 0.25 + 0.25) / 3
    assert critic.losses[0] == pytest.approx(0.5 * (0.5625 + 0.25 + 0.25) / 3)
    # its gradient: (V - G)/3 per loss token, 0 elsewhere
    torch.testing.assert_close(critic.grads[0], torch.tensor([[0.0, 0.0, -0.75, -0.5], [0.0, 0.0, 0.5, 0.0]]) / 3)
    # actor: on-policy first update (ratio 1); loss = -mean(A) over tokens = -(0.75 + 0.5 - 0.5) / 3
    assert actor.losses[0] == pytest.approx(-0.75 / 3)
    assert stats["actor/approx_kl"] == 0.0 and stats["actor/clip_frac"] == 0.0
    assert stats["actor/importance_weight_max"] == 1.0 and stats["actor/importance_weight_min"] == 1.0
    assert stats["actor/advantage_max"] == 0.75 and stats["actor/advantage_min"] == -0.5
    assert stats["critic/loss"] == pytest.approx(critic.losses[0])
    # explained variance of V_old for G: Var(G - V) / Var(G) over 3 tokens
    g, v = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.25, 0.5, 0.5])
    assert stats["critic/explained_var"] == pytest.approx(1 - float((g - v).var(unbiased=False) / g.var(unbiased=False)))


def test_ppo_kl_penalty_in_reward_and_whitening():
    b = _batch([2], [1.0], logp=-0.4)
    b["ref_logp"] = torch.where(b["loss_mask"] > 0, torch.tensor(-0.9), torch.tensor(0.0))
    algo = PPO(PPOAlgoConfig(kl_coef=0.1, adv_whiten=False), _FakeActor(), _FakeCritic(torch.zeros(1, 4)),
               ref=_FakeCritic(b["ref_logp"]))  # ref.forward returns ref_logp
    algo.prepare(b)
    # k1 = -0.4 - (-0.9) = 0.5 per token, β = 0.1: rewards [-0.05, 1 - 0.05]; returns-to-go
    torch.testing.assert_close(b["advantages"], torch.tensor([[0.0, 0.0, 0.9, 0.95]]))
    whitened = PPO(PPOAlgoConfig(kl_coef=0.1), _FakeActor(), _FakeCritic(torch.zeros(1, 4)),
                   ref=_FakeCritic(b["ref_logp"])).prepare(dict(b))["advantages"]
    torch.testing.assert_close(whitened, torch.tensor([[0.0, 0.0, -1.0, 1.0]]))


def test_ppo_config_errors_name_the_field():
    with pytest.raises(ValueError, match="algo.lam"):
        PPO(PPOAlgoConfig(lam=2.0), _FakeActor(), _FakeCritic(None))
    with pytest.raises(ValueError, match="algo.value_eps_clip"):
        PPO(PPOAlgoConfig(value_eps_clip=0.0), _FakeActor(), _FakeCritic(None))
    with pytest.raises(ValueError, match="algo.reward_norm"):
        PPO(PPOAlgoConfig(reward_norm="x"), _FakeActor(), _FakeCritic(None))


def test_stale_batch_metrics_behaviour_kl_weights_and_entropy():
    # the batch was sampled by an older policy: behaviour logp -1.0, proximal (recomputed) -0.5
    b = _batch([2, 2], [1.0, 0.0], logp=-1.0)
    b["entropy"] = torch.where(b["loss_mask"] > 0, torch.tensor(2.0), torch.tensor(0.0))

    class _Prox(_FakeActor):
        def forward(self, batch):
            return torch.where(batch["loss_mask"] > 0, torch.tensor(-0.5), torch.tensor(0.0))

        def train_batch(self, batch, loss_fn, loss_weight_fn, skipped_weight=0.0):
            loss = loss_fn(self.forward(batch).requires_grad_(), batch)
            return {"loss": loss.item()}

    algo = GRPO(GRPOAlgoConfig(n_minibatches=2, behav_imp_weight_cap=None), _Prox(), group_size=2)
    stats = algo.update(b)
    w = math.exp(0.5)
    assert stats["actor/importance_weight"] == pytest.approx(w)
    assert stats["actor/importance_weight_max"] == pytest.approx(w)
    assert stats["actor/approx_kl"] == 0.0  # π_θ = π_prox at the first step
    assert stats["actor/approx_kl_behav"] == pytest.approx(-0.5)  # log π_behav - log π_θ = -1 + 0.5
    assert stats["actor/entropy"] == pytest.approx(2.0)


def test_update_reports_mean_loss_and_grad_norm_over_minibatches():
    class _Counting(_FakeActor):
        def train_batch(self, batch, loss_fn, loss_weight_fn, skipped_weight=0.0):
            out = super().train_batch(batch, loss_fn, loss_weight_fn)
            self.calls = getattr(self, "calls", 0) + 1
            return {**out, "grad_norm": float(self.calls * 2 - 1), "lr": 1e-5 * self.calls}  # 1, 3

    actor = _Counting()
    stats = GRPO(GRPOAlgoConfig(n_minibatches=2), actor, group_size=2).update(_batch([1, 2, 1, 1], [1.0, 0.0, 0.0, 1.0]))
    assert stats["grad_norm"] == 2.0 and stats["lr"] == 2e-5  # mean of 1 and 3; the last lr
    assert stats["loss"] == pytest.approx(sum(actor.losses) / 2)
