"""The algorithm family (GRPO options, GSPO, RLOO, REINFORCE++) and the shared math in
arealite/algorithms/functional.py, on small written-out tensors with hand-computed values."""

import asyncio
import math

import pytest
import torch

from arealite.algorithms import functional as F
from arealite.algorithms.grpo import GRPO, should_accept
from arealite.algorithms.gspo import GSPO
from arealite.algorithms.reinforce_pp import ReinforcePP
from arealite.algorithms.rloo import RLOO
from arealite.api.config import GRPOAlgoConfig, GSPOAlgoConfig, ReinforcePPAlgoConfig

from conftest import ppo_token_mean

MODES = F.LOSS_AGG_MODES




class _FakeActor:
    """Engine stand-in: current logprobs = behaviour logprobs (on-policy first update); splits the
    batch into micro-batches of ``mb_rows`` rows and combines them as the engine contract says:
    Σ loss_mb · w_mb / Σ w_mb."""

    def __init__(self, mb_rows=None):
        self.mb_rows, self.losses = mb_rows, []

    def forward(self, batch):
        return batch["logprobs"].clone()

    def train_batch(self, batch, loss_fn, loss_weight_fn, skipped_weight=0.0):
        n = batch["loss_mask"].shape[0]
        step = self.mb_rows or n
        mbs = [{k: v[i:i + step] for k, v in batch.items()} for i in range(0, n, step)]
        ws = [loss_weight_fn(mb) for mb in mbs]
        total = sum(loss_fn(mb["logprobs"].clone().requires_grad_(), mb) * w for mb, w in zip(mbs, ws)) / (sum(ws) + skipped_weight)
        self.losses.append(total.item())
        return {"loss": total.item()}


def _batch(lengths, rewards, prompt=2, logp=-0.5):
    """Rows of ``prompt`` prompt tokens + ``lengths[i]`` generated tokens, right-padded."""
    T = prompt + max(lengths)
    mask = torch.zeros(len(lengths), T, dtype=torch.int32)
    for i, n in enumerate(lengths):
        mask[i, prompt:prompt + n] = 1
    return {
        "input_ids": torch.ones(len(lengths), T, dtype=torch.long),
        "attention_mask": mask.bool() | (torch.arange(T) < prompt),
        "loss_mask": mask,
        "logprobs": torch.where(mask > 0, torch.tensor(logp), torch.tensor(0.0)),
        "rewards": torch.tensor(rewards, dtype=torch.float32),
    }


# ---------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------
def test_agg_modes_hand_computed_and_masked_entries_ignored():
    loss = torch.tensor([[1.0, 2.0, 3.0, float("inf")], [4.0, float("nan"), -float("inf"), 1e30]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # token-mean: (1+2+3+4)/4 = 2.5; weight 4 tokens
    assert F.agg_loss(loss, mask, "token-mean").item() == 2.5 and F.agg_weight(mask, "token-mean") == 4
    # seq-mean-token-mean: mean(6/3, 4/1) = 3; weight 2 sequences
    assert F.agg_loss(loss, mask, "seq-mean-token-mean").item() == 3.0
    assert F.agg_weight(mask, "seq-mean-token-mean") == 2
    # Dr.GRPO: 10 / (2 seqs · L_max 4) = 1.25; weight 2 sequences
    assert F.agg_loss(loss, mask, "seq-mean-token-sum-norm", max_len=4).item() == 1.25
    assert F.agg_weight(mask, "seq-mean-token-sum-norm") == 2
    with pytest.raises(ValueError, match="loss_agg_mode"):
        F.agg_loss(loss, mask, "seq-sum")
    with pytest.raises(ValueError, match="max_len"):
        F.agg_loss(loss, mask, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [[2, 2], [1, 3], [3, 1]])
def test_each_agg_mode_is_exact_when_split_into_microbatches(mode, split):
    # 4 rows of lengths 3, 1, 0 (empty response) and 2: the engine contract
    # Σ agg_loss(mb)·agg_weight(mb) / Σ agg_weight(mb) must equal agg_loss(whole), value and grad.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    base = torch.tensor([[0.5, -1.0, 2.0], [3.0, 9.0, 9.0], [7.0, 7.0, 7.0], [-2.0, 0.25, 9.0]])
    x1 = base.clone().requires_grad_()
    whole = F.agg_loss(x1 * 1.0, mask, mode, max_len=3)
    whole.backward()
    x2 = base.clone().requires_grad_()
    parts, ws, i = [], [], 0
    for n in split:
        m = mask[i:i + n]
        w = F.agg_weight(m, mode)
        parts.append(F.agg_loss(x2[i:i + n], m, mode, max_len=3) * w)
        ws.append(w)
        i += n
    combined = sum(parts) / sum(ws)
    combined.backward()
    torch.testing.assert_close(combined, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=1e-7)


def test_dr_grpo_normaliser_gives_every_token_the_same_gradient():
    # Two responses of lengths 2 and 5, ℓ_t = -A·logp_t with A = 1. Dr.GRPO: ∂L/∂logp_t = -1/(2·8)
    # for every token (L_max = 8), whatever the length; seq-mean-token-mean would give -1/(2·2)
    # to the short response and -1/(2·5) to the long one.
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    logp = torch.full((2, 5), -1.0, requires_grad=True)
    F.agg_loss(-logp, mask, "seq-mean-token-sum-norm", max_len=8).backward()
    torch.testing.assert_close(logp.grad, -mask.float() / 16)
    logp.grad = None
    F.agg_loss(-logp, mask, "seq-mean-token-mean").backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25, 0, 0, 0], [-0.1] * 5]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [GRPO, GSPO, RLOO, ReinforcePP])
def test_algorithm_loss_is_exact_under_microbatch_split(mode, cls):
    # Off-policy data (current ≠ behaviour) with one token above the behaviour-weight cap; rows
    # of different lengths. Whole batch at once == two micro-batches recombined by the weights.
    cfg_cls = {GSPO: GSPOAlgoConfig, ReinforcePP: ReinforcePPAlgoConfig}.get(cls, GRPOAlgoConfig)
    cap = 3.0 if mode != "token-mean" else None  # token-mean keeps GRPO's historical cap normaliser
    cfg = cfg_cls(loss_agg_mode=mode, n_minibatches=2, eps_clip=0.2, eps_clip_high=0.28, behav_imp_weight_cap=cap)
    b = _batch([3, 1, 2, 4], [1.0, 0.0, 0.0, 0.6], logp=-1.0)
    b["prox_logp"] = b["logprobs"] + 0.1 * (b["loss_mask"] > 0)
    cur = b["logprobs"] + torch.tensor([0.3, -0.2, 0.1, 0.4, -0.3, 0.05])[None, :b["logprobs"].shape[1]]
    if cap is not None:
        b["logprobs"][3, 2] = -3.0  # π_prox/π_behav = e^(-0.9+3) = 8.2 > cap 3: token dropped
    algo = cls(cfg, _FakeActor(), group_size=2, max_new_tokens=4)
    b["advantages"] = algo.compute_advantages(b, algo.shaped_rewards(b))
    algo._mb_stats = []
    x1 = cur.clone().requires_grad_()
    whole = algo.loss_fn(x1, b)
    whole.backward()
    x2 = cur.clone().requires_grad_()
    mbs = [{k: v[:1] for k, v in b.items()}, {k: v[1:] for k, v in b.items()}]
    ws = [algo.loss_weight_fn(mb) for mb in mbs]
    combined = (algo.loss_fn(x2[:1], mbs[0]) * ws[0] + algo.loss_fn(x2[1:], mbs[1]) * ws[1]) / sum(ws)
    combined.backward()
    torch.testing.assert_close(combined, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=1e-7)
    assert algo._mb_stats[0]["masked_by_cap"] == (1.0 if cap is not None else 0.0)
    assert (x1.grad[3, 2] == 0.0) == (cap is not None)  # the dropped token, and only it, has no gradient


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------
def test_all_equal_groups_have_exactly_zero_advantage_for_every_estimator():
    # 0.7 × 8 in float32: r - mean(r) is a 6e-8 residue that /(std + 1e-6) used to turn into 0.056.
    r = torch.tensor([0.7] * 8 + [0.0] * 8)
    for adv in (F.group_normalize(r, 8), F.group_normalize(r, 8, use_std=False), F.rloo_advantages(r, 8)):
        assert torch.equal(adv, torch.zeros(16))
    mask = torch.ones(16, 3)
    ret = F.discounted_returns(F.last_token_rewards(F.group_normalize(r, 8, use_std=False), mask), mask)
    assert torch.equal(F.masked_whiten(ret, mask), torch.zeros(16, 3))
    # whitening of all-equal non-zero returns (std 0) is 0, not a residue/eps blow-up or NaN
    assert torch.equal(F.masked_whiten(torch.full((2, 3), 0.7), mask[:2]), torch.zeros(2, 3))


def test_group_of_size_one_grpo_zero_advantage_rloo_raises():
    r = torch.tensor([1.0, 0.0, 0.5])
    assert torch.equal(F.group_normalize(r, 1), torch.zeros(3))
    with pytest.raises(ValueError, match="group_size=1"):
        F.rloo_advantages(r, 1)
    with pytest.raises(ValueError, match="group_size=1"):
        RLOO(GRPOAlgoConfig(), _FakeActor(), group_size=1)


def test_rloo_leave_one_out_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    # group 1: A_0 = 1 - (0+0+1)/3 = 2/3, A_1 = 0 - (1+0+1)/3 = -2/3, A_2 = -2/3, A_3 = 2/3
    # group 2: A_0 = 3 - (1+2+2)/3 = 4/3, A_1 = 1 - (3+2+2)/3 = -4/3, A_2 = 2 - (3+1+2)/3 = 0, A_3 = 0
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0.0, 0.0])
    torch.testing.assert_close(F.rloo_advantages(r, 4), expected)


def test_last_token_rewards_and_discounted_returns_hand_computed():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = F.last_token_rewards(torch.tensor([3.0, 7.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 3, 0], [0, 0, 0, 0], [0, 0, 0, 5]]
    # γ = 0.5, rewards [_, 1, 0, 2] on tokens 1..3: G_3 = 2, G_2 = 0 + 0.5·2 = 1, G_1 = 1 + 0.5·1 = 1.5
    g = F.discounted_returns(torch.tensor([[9.0, 1.0, 0.0, 2.0]]), torch.tensor([[0, 1, 1, 1]]), gamma=0.5)
    assert g.tolist() == [[0.0, 1.5, 1.0, 2.0]]
    # a non-generated token in between (tool output) is skipped, not discounted:
    # G_2 = 4, G_0 = 0 + 0.5·4 = 2 (its reward 5 is ignored)
    g = F.discounted_returns(torch.tensor([[0.0, 5.0, 4.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    assert g.tolist() == [[2.0, 0.0, 4.0]]


def test_masked_whiten_hand_computed_ignores_masked_garbage():
    x = torch.tensor([[1.0, float("inf")], [3.0, float("nan")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    # mean 2, biased std 1 -> [-1, 1]; masked positions exactly 0
    out = F.masked_whiten(x, mask, eps=0.0)
    assert out.tolist() == [[-1.0, 0.0], [1.0, 0.0]]


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_advantages_hand_computed(baseline):
    # groups (r=1 len 1, r=0 len 2), (r=1 len 1, r=1 len 1); γ = 1, no KL: return = r' on every token
    b = _batch([1, 2, 1, 1], [1.0, 0.0, 1.0, 1.0])
    algo = ReinforcePP(ReinforcePPAlgoConfig(group_baseline=baseline), _FakeActor(), group_size=2)
    adv = algo.compute_advantages(b, b["rewards"])
    if not baseline:
        # tokens [1, 0, 0, 1, 1]: mean 0.6, var (3·0.16 + 2·0.36)/5 = 0.24
        s = math.sqrt(0.24)
        vals = [0.4 / s, -0.6 / s, -0.6 / s, 0.4 / s, 0.4 / s]
    else:
        # r' = [0.5, -0.5, 0, 0]; tokens [0.5, -0.5, -0.5, 0, 0]: mean -0.1,
        # var (0.36 + 0.16 + 0.16 + 0.01 + 0.01)/5 = 0.14
        s = math.sqrt(0.14)
        vals = [0.6 / s, -0.4 / s, -0.4 / s, 0.1 / s, 0.1 / s]
    torch.testing.assert_close(adv[b["loss_mask"] > 0], torch.tensor(vals), rtol=0, atol=1e-5)
    assert torch.equal(adv[b["loss_mask"] == 0], torch.zeros(int((b["loss_mask"] == 0).sum())))


def test_reinforce_pp_kl_penalty_in_reward_hand_computed():
    # one response of 2 tokens, reward 1, β = 0.1, k1 = log π_behav - log π_ref = [0.5, -0.5]
    # token rewards: [-0.05, 1 + 0.05] -> returns (γ=1): [1.0, 1.05] -> whitened [-1, 1]
    class Ref:
        def forward(self, batch):
            return torch.tensor([[0.0, -1.5, -1.5], [0.0, -1.5, -1.5]])

    b = {"loss_mask": torch.tensor([[0, 1, 1], [0, 1, 1]]), "logprobs": torch.tensor([[0.0, -1.0, -2.0]] * 2),
         "rewards": torch.tensor([1.0, 1.0])}
    cfg = ReinforcePPAlgoConfig(kl_coef=0.1, n_minibatches=2)
    algo = ReinforcePP(cfg, _FakeActor(), group_size=2, ref=Ref())
    assert not algo.kl_in_loss
    b = algo.prepare(b)
    kl = F.kl_estimate(b["logprobs"], b["ref_logp"], "k1", b["loss_mask"])
    torch.testing.assert_close(kl[0], torch.tensor([0.0, 0.5, -0.5]))
    torch.testing.assert_close(b["advantages"], torch.tensor([[0.0, -1.0, 1.0]] * 2), rtol=0, atol=1e-5)
    assert ReinforcePP(ReinforcePPAlgoConfig(kl_coef=0.1, kl_in_reward=False), _FakeActor(), 2, ref=Ref()).kl_in_loss


# ---------------------------------------------------------------------------------------------
# Overlong penalty and dynamic sampling
# ---------------------------------------------------------------------------------------------
def test_overlong_penalty_hand_computed():
    # L_max 10, L_cache 4: window starts after 6 tokens
    # 5 -> 0, 6 -> 0, 7 -> (6-7)/4 = -0.25, 10 -> (6-10)/4 = -1, 11 -> -1
    pen = F.overlong_penalty(torch.tensor([5, 6, 7, 10, 11]), max_len=10, cache_len=4)
    assert pen.tolist() == [0.0, 0.0, -0.25, -1.0, -1.0]
    assert F.overlong_penalty(torch.tensor([7]), 10, 4, factor=0.5).tolist() == [-0.125]
    with pytest.raises(ValueError, match="L_cache"):
        F.overlong_penalty(torch.tensor([7]), 10, 11)


def test_truncated_response_with_pad_equal_eos_is_penalised_from_loss_mask_length():
    # EOS id = pad id = 2. Row 0: truncated at L_max = 4 (no EOS); row 1: "7 2" (EOS at length 2)
    # then padding 2 2. Scanning ids for EOS would give length 1 for both; loss_mask knows 4 and 2.
    eos = 2
    b = {"input_ids": torch.tensor([[1, 5, 6, 7, 8], [1, 7, eos, eos, eos]]),
         "loss_mask": torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]),
         "logprobs": torch.zeros(2, 5), "rewards": torch.tensor([1.0, 1.0])}
    algo = GRPO(GRPOAlgoConfig(overlong_penalty=2), _FakeActor(), group_size=2, max_new_tokens=4)
    # window starts at 4 - 2 = 2: length 4 -> (2 - 4)/2 = -1, length 2 -> 0; rewards [0, 1]
    assert algo.shaped_rewards(b).tolist() == [0.0, 1.0]
    b = algo.prepare(b)
    torch.testing.assert_close(b["advantages"], torch.tensor([[0, -1.0, -1, -1, -1], [0, 1, 1, 0, 0]]),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GRPO(GRPOAlgoConfig(overlong_penalty=2), _FakeActor(), group_size=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GRPO(GRPOAlgoConfig(loss_agg_mode="seq-mean-token-sum-norm"), _FakeActor(), group_size=2)


def test_turn_lengths_are_the_longest_run_of_generated_tokens():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0],   # turns of 3 and 2 -> 3
                         [0, 0, 1, 1, 0, 1, 1, 1, 1],   # 2 and 4 (running to the end) -> 4
                         [0, 0, 0, 0, 0, 0, 0, 0, 0],   # nothing generated -> 0
                         [1, 1, 1, 1, 1, 1, 1, 1, 1]])  # one turn of 9 -> 9 (= the sum)
    assert F.turn_lengths(mask).tolist() == [3, 4, 0, 9]
    assert F.turn_lengths(mask.float()).tolist() == [3, 4, 0, 9]
    assert F.turn_lengths(torch.zeros(2, 0)).tolist() == [0, 0]


def test_overlong_penalty_of_a_multi_turn_episode_is_per_turn():
    """L_max = gconfig.max_new_tokens is a per-turn budget: two 14-token turns under L_max 24
    are not overlong (their sum, 28, would get -1); a 22-token turn is in the window."""
    from arealite.workflow.multi_turn import Episode, episodes_to_batch

    def episode(turns: list[int], reward: float) -> Episode:
        ep = Episode()
        for k, n in enumerate(turns):
            ep.append([1, 2, 3 + k], False)  # the prompt / the tool's reply: masked out
            ep.append(list(range(100, 100 + n)), True, [-0.1] * n, [0] * n)
        ep.reward, ep.turns = reward, len(turns)
        return ep

    batch = episodes_to_batch([episode([14, 14], 0.9), episode([14], 1.0), episode([5, 22], 1.0), episode([25], 0.0)])
    assert F.turn_lengths(batch["loss_mask"]).tolist() == [14, 14, 22, 25]
    algo = GRPO(GRPOAlgoConfig(overlong_penalty=8), _FakeActor(), group_size=2, max_new_tokens=24)
    # window starts at 24 - 8 = 16: 14 -> 0; 22 -> (16 - 22)/8 = -0.75; 25 > 24 -> -1
    torch.testing.assert_close(algo.shaped_rewards(batch), torch.tensor([0.9, 1.0, 0.25, -1.0]), rtol=0, atol=1e-6)


def test_dynamic_sampling_rejects_all_equal_groups_through_a_workflow_wrapper():
    assert not should_accept({"rewards": torch.tensor([1.0, 1.0, 1.0])})
    assert not should_accept({"rewards": torch.tensor([1.0])})
    assert should_accept({"rewards": torch.tensor([1.0, 0.0, 1.0])})

    class Inner:
        def __init__(self, rewards):
            self.rewards = rewards

        async def arun_episode(self, engine, data):
            return {"rewards": torch.tensor(self.rewards)}

    class DynamicSampling:  # the wrapper documented in grpo.py: None = the executor drops it
        def __init__(self, inner):
            self.inner = inner

        async def arun_episode(self, engine, data):
            traj = await self.inner.arun_episode(engine, data)
            return traj if traj is not None and should_accept(traj) else None

    assert asyncio.run(DynamicSampling(Inner([0.0, 0.0])).arun_episode(None, {})) is None
    assert asyncio.run(DynamicSampling(Inner([0.0, 1.0])).arun_episode(None, {})) is not None


# ---------------------------------------------------------------------------------------------
# Clipped surrogate, dual clip, decoupled weight cap, masking
# ---------------------------------------------------------------------------------------------
def test_asymmetric_clip_both_sides_with_gradient():
    prox = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    # ratios 1.3, 1.3, 0.7, 0.7 with A = +1, -1, -1, +1; ε_low 0.2, ε_high 0.28
    logp = (prox + torch.log(torch.tensor([[1.3, 1.3, 0.7, 0.7]]))).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, stats = ppo_token_mean(logp, prox, prox, adv, torch.ones(1, 4), eps_clip=0.2, eps_clip_high=0.28)
    # t0: max(-1.3, -1.28) = -1.28 (clipped high, no grad); t1: max(1.3, 1.28) = 1.3 (grad +1.3)
    # t2: max(0.7, 0.8) = 0.8 (clipped low, no grad);      t3: max(-0.7, -0.8) = -0.7 (grad -0.7)
    assert loss.item() == pytest.approx((-1.28 + 1.3 + 0.8 - 0.7) / 4, abs=1e-6)
    assert stats["clip_frac"].item() == 0.5
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.3 / 4, 0.0, -0.7 / 4]]))


def test_dual_clip_caps_negative_advantage_loss():
    prox = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]])).requires_grad_()  # ratios 5, 2, 5
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, stats = ppo_token_mean(logp, prox, prox, adv, torch.ones(1, 3), eps_clip=0.2, c_clip=3.0)
    # t0: A<0, max(5, 1.2) = 5 > c·|A| = 3 -> 3 (dual clipped, no grad)
    # t1: A<0, max(2, 1.2) = 2 < 3 -> 2 (grad -A·r = 2)
    # t2: A>0, max(-5, -1.2) = -1.2 (ordinary clip, dual clip does not apply to A > 0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-6)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    with pytest.raises(ValueError, match="c_clip"):
        ppo_token_mean(logp, prox, prox, adv, torch.ones(1, 3), c_clip=1.0)
    with pytest.raises(ValueError, match="c_clip"):
        GRPO(GRPOAlgoConfig(c_clip=0.5), _FakeActor(), group_size=2)


def test_decoupled_weight_cap_drops_token_even_with_infinite_weight():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5]])).requires_grad_()
    prox = logp.detach().clone()
    behav = torch.tensor([[math.log(0.25), -float("inf"), math.log(0.5)]])  # w = 2, inf, 1
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, stats = ppo_token_mean(logp, prox, behav, adv, torch.ones(1, 3), behav_imp_weight_cap=5.0)
    # t1 dropped (w = inf > 5) and counted as a zero-loss token; t0: -1·2·1 = -2; t2: +1·1·1 = 1;
    # token-mean over the 3 loss tokens -> -1/3
    assert loss.item() == pytest.approx(-1.0 / 3.0)
    assert stats["masked_by_cap"].item() == 1.0 and stats["importance_weight"].item() == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 / 3.0, 0.0, 1.0 / 3.0]]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls", [GRPO, GSPO, RLOO, ReinforcePP])
def test_masked_tokens_contribute_exactly_zero_value_and_gradient(mode, cls):
    # Same batch twice: masked positions hold 0 in one, -inf / 1e30 / nan garbage in the other
    # (current logprobs, prox, behaviour, reference, advantages). Loss must be identical, every
    # gradient finite, and the gradient at masked positions exactly 0.
    cfg_cls = {GSPO: GSPOAlgoConfig, ReinforcePP: ReinforcePPAlgoConfig}.get(cls, GRPOAlgoConfig)
    extra = {"kl_in_reward": False} if cls is ReinforcePP else {}
    cfg = cfg_cls(loss_agg_mode=mode, kl_coef=0.1, c_clip=3.0, **extra)
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
    clean = {"loss_mask": mask, "logprobs": torch.tensor([[0, -1.0, -2.0, 0], [0, -0.5, 0, 0]]),
             "advantages": torch.tensor([[0, 1.0, 1.0, 0], [0, -1.0, 0, 0]]),
             "ref_logp": torch.full((2, 4), -1.0) * mask,
             "prox_logp": torch.tensor([[0, -1.1, -1.9, 0], [0, -0.6, 0, 0]])}
    cur_clean = torch.tensor([[0, -0.9, -2.1, 0], [0, -0.4, 0, 0]])
    junk = torch.tensor([[-float("inf"), 0, 0, 1e30], [float("nan"), 0, -float("inf"), 1e30]])
    dirty = {k: (v if k == "loss_mask" else torch.where(mask > 0, v.float(), junk)) for k, v in clean.items()}
    out = []
    for b, cur in ((clean, cur_clean), (dirty, torch.where(mask > 0, cur_clean, junk))):
        algo = cls(cfg, _FakeActor(), group_size=2, ref=_FakeActor(), max_new_tokens=4)
        algo._mb_stats = []
        x = cur.clone().requires_grad_()
        loss = algo.loss_fn(x, b)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        assert torch.equal(x.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
        assert all(math.isfinite(v) for v in algo._mb_stats[0].values())
        out.append((loss.detach(), x.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------
def test_kl_estimators_hand_computed_at_log_two():
    # x = log π_θ - log π_ref = log 2: k1 = 0.693147, k2 = x²/2 = 0.240227, k3 = 1/2 - 1 + log 2 = 0.193147
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    x = math.log(2)
    for kind, val, grad in (("k1", x, 1.0), ("k2", x * x / 2, x), ("k3", 0.5 - 1 + x, 1 - 0.5)):
        logp.grad = None
        k = F.kl_estimate(logp, ref, kind)
        k.sum().backward()
        assert k.item() == pytest.approx(val, abs=1e-6) and logp.grad.item() == pytest.approx(grad, abs=1e-6)
    with pytest.raises(ValueError, match="kl_estimator"):
        F.kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("kind", F.KL_ESTIMATORS)
def test_kl_estimators_finite_value_and_gradient_at_extreme_log_ratios(kind):
    logp = torch.tensor([-50.0, 50.0, -float("inf")], requires_grad=True)  # log-ratios -50, +50, masked
    ref = torch.zeros(3)
    k = F.kl_estimate(logp, ref, kind, loss_mask=torch.tensor([1, 1, 0]))
    # clamped to ±20: k1 = ±20, k2 = 200, k3 = e^20 - 1 - 20 and e^-20 - 1 + 20
    expected = {"k1": [-20.0, 20.0], "k2": [200.0, 200.0], "k3": [math.exp(20) - 21, math.exp(-20) + 19]}[kind]
    torch.testing.assert_close(k[:2], torch.tensor(expected))
    assert k[2].item() == 0.0
    k.sum().backward()
    assert torch.isfinite(logp.grad).all() and torch.equal(logp.grad, torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# On-policy first update and GSPO's sequence ratio
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_minibatches", [1, 2])
@pytest.mark.parametrize("cls", [GRPO, GSPO, RLOO, ReinforcePP])
def test_on_policy_first_update_has_ratio_one_and_no_clipping(cls, n_minibatches):
    cfg_cls = {GSPO: GSPOAlgoConfig, ReinforcePP: ReinforcePPAlgoConfig}.get(cls, GRPOAlgoConfig)
    actor = _FakeActor(mb_rows=1)
    algo = cls(cfg_cls(n_minibatches=n_minibatches, c_clip=3.0), actor, group_size=2)
    b = _batch([3, 1, 2, 2], [1.0, 0.0, 0.3, 0.9], logp=-0.7)
    stats = algo.update(b)
    # ratio = exp(0) = 1 exactly: log-ratio mean 0, nothing clipped, behaviour weight 1
    assert stats["actor/approx_kl"] == 0.0 and stats["actor/clip_frac"] == 0.0
    assert stats["actor/dual_clip_frac"] == 0.0 and stats["actor/importance_weight"] == 1.0
    assert stats["actor/advantage_abs_mean"] > 0 and all(math.isfinite(v) for v in actor.losses)
    lr = algo.log_ratio(b["logprobs"].clone().requires_grad_(), b["logprobs"], b["loss_mask"])
    assert torch.equal(torch.exp(lr), torch.ones_like(lr))


def test_gspo_sequence_ratio_value_and_per_token_gradient():
    # row 0: log π_θ - log π_old = [0.3, -0.1, 0.1] -> mean 0.1 -> s_0 = e^0.1 = 1.105171 (inside [0.8, 1.2])
    # row 1: [0.5, 0.5] -> s_1 = e^0.5 = 1.648721 > 1.2 with A = +1 -> clipped branch -1.2, no gradient
    prox = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, -2.0, -2.0, 0.0]])
    delta = torch.tensor([[0.0, 0.3, -0.1, 0.1], [0.0, 0.5, 0.5, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    logp = (prox + delta).requires_grad_()
    s = F.sequence_log_ratio(logp, prox, mask).exp()
    e1, e5 = math.exp(0.1), math.exp(0.5)
    torch.testing.assert_close(s, torch.tensor([[1.0, e1, e1, e1], [1.0, e5, e5, 1.0]]))
    algo = GSPO(GSPOAlgoConfig(eps_clip=0.2, eps_clip_high=0.2), _FakeActor(), group_size=2)
    mb = {"loss_mask": mask, "logprobs": prox, "prox_logp": prox, "advantages": mask.float()}
    algo._mb_stats = []
    loss = algo.loss_fn(logp, mb)
    # seq-mean-token-mean: mean(-s_0, -1.2) = (-1.105171 - 1.2)/2
    assert loss.item() == pytest.approx((-math.exp(0.1) - 1.2) / 2, abs=1e-6)
    loss.backward()
    # ∂/∂logp_t = -A·s_0 / (|y_0| = 3) / (2 seqs) on row 0 — the gradient of -s_0·A of the
    # sequence objective spread over its tokens —, 0 on the clipped row and masked tokens
    g = -math.exp(0.1) / 6
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, g, g, g], [0.0, 0.0, 0.0, 0.0]]))
    assert algo._mb_stats[0]["clip_frac"] == pytest.approx(2 / 5)
