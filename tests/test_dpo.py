"""DPO / cDPO / IPO: hand-computed losses and gradients, the per-row surrogate against autograd of
the direct pair loss under arbitrary micro-batch splits, preference data and pair selection."""

import json
import math

import pytest
import torch

from arealite.algorithms.dpo import DPO, dpo_loss, sequence_logprobs
from arealite.algorithms.functional import gather_logprobs
from arealite.api.config import DPOAlgoConfig
from arealite.api.engine import TrainEngine
from arealite.dataset.preference_data import PreferenceCollator, load_preference_jsonl, make_arithmetic_pairs
from arealite.workflow.preference import pick_pair

# Written-out pair, prompts of different lengths: chosen = 3 prompt + 2 response tokens,
# rejected = 2 prompt + 3 response tokens (prompt logprobs are junk and must be ignored).
LOSS_MASK = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
POLICY = torch.tensor([[0.0, -9.0, -9.0, -1.0, -0.5], [0.0, -7.0, -0.5, -1.0, -1.5]])  # s_w = -1.5, s_l = -3.0
REF = torch.tensor([[0.0, -4.0, -4.0, -1.2, -0.8], [0.0, -3.0, -0.5, -0.5, -1.0]])  # ref_w = -2.0, ref_l = -2.0
# Δ = (-1.5 + 2.0) - (-3.0 + 2.0) = 1.5


def _pair_loss(beta, loss_type="sigmoid", eps=0.0, policy=POLICY):
    s = sequence_logprobs(policy, LOSS_MASK)
    r = sequence_logprobs(REF, LOSS_MASK)
    return dpo_loss(s[0:1], s[1:2], r[0:1], r[1:2], beta, loss_type, eps)


def test_sequence_logprobs_exclude_prompt_tokens_on_both_sides():
    bad = POLICY.clone()
    bad[0, :3] = float("nan")  # prompt positions of the chosen row
    bad[1, :2] = -float("inf")
    assert sequence_logprobs(bad, LOSS_MASK).tolist() == [-1.5, -3.0]


def test_dpo_loss_hand_computed():
    # β Δ = 0.15; -log σ(0.15) = log(1 + e^-0.15) = log(1.8607080) = 0.6209570
    assert _pair_loss(0.1).item() == pytest.approx(0.6209570, abs=1e-6)


def test_conservative_dpo_loss_hand_computed():
    # -(0.9) log σ(0.15) - 0.1 log σ(-0.15) = 0.9·0.6209570 + 0.1·0.7709570 = 0.6359570
    assert _pair_loss(0.1, eps=0.1).item() == pytest.approx(0.6359570, abs=1e-6)


def test_ipo_loss_hand_computed():
    # (Δ - 1/(2β))² = (1.5 - 5)² = 12.25
    assert _pair_loss(0.1, "ipo").item() == pytest.approx(12.25)


@pytest.mark.parametrize("loss_type,eps,d_delta", [
    ("sigmoid", 0.0, -0.1 * 0.4625702),  # dℓ/dΔ = -β σ(-βΔ), σ(-0.15) = 0.4625702
    ("sigmoid", 0.1, -0.1 * (0.9 * 0.4625702 - 0.1 * 0.5374298)),  # -β((1-ε)σ(-z) - ε σ(z))
    ("ipo", 0.0, 2 * (1.5 - 5.0)),  # 2(Δ - 1/(2β)) = -7
])
def test_token_gradients_hand_computed(loss_type, eps, d_delta):
    """∂ℓ/∂logprob_t = +dℓ/dΔ on chosen response tokens, -dℓ/dΔ on rejected ones, 0 on prompts."""
    policy = POLICY.clone().requires_grad_(True)
    _pair_loss(0.1, loss_type, eps, policy).sum().backward()
    expected = torch.tensor([[0, 0, 0, d_delta, d_delta], [0, 0, -d_delta, -d_delta, -d_delta]], dtype=torch.float32)
    torch.testing.assert_close(policy.grad, expected, rtol=1e-5, atol=1e-7)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="algo.loss_type"):
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.1, "hinge")
    with pytest.raises(ValueError, match="algo.beta"):
        DPO(DPOAlgoConfig(beta=0.0), None, None)
    with pytest.raises(ValueError, match="algo.label_smoothing"):
        DPO(DPOAlgoConfig(label_smoothing=0.5), None, None)
    with pytest.raises(ValueError, match="algo.label_smoothing"):
        DPO(DPOAlgoConfig(loss_type="ipo", label_smoothing=0.1), None, None)


# ---------------------------------------------------------------------------------------------
# The surrogate through the engine contract equals autograd of the direct DPO loss
# ---------------------------------------------------------------------------------------------
class BigramEngine(TrainEngine):
    """logits[b, t] = W[input_ids[b, t]]; train_batch splits rows into ``self.groups`` and
    combines micro-batches exactly as the contract says; a plain SGD step with ``lr``."""

    def __init__(self, vocab=7, seed=0, groups=None, lr=0.0):
        torch.manual_seed(seed)
        self.W = torch.randn(vocab, vocab, requires_grad=True)
        self.groups, self.lr = groups, lr

    def _logprobs(self, mb):
        return gather_logprobs(self.W[mb["input_ids"]], mb["input_ids"]) * mb["attention_mask"]

    def forward(self, batch):
        with torch.no_grad():
            return self._logprobs(batch)

    def train_batch(self, batch, loss_fn, loss_weight_fn):
        groups = self.groups or [list(range(batch["input_ids"].shape[0]))]
        mbs = [{k: v[torch.tensor(g)] for k, v in batch.items()} for g in groups]
        weights = [loss_weight_fn(mb) for mb in mbs]
        self.W.grad = None
        for mb, w in zip(mbs, weights):
            (loss_fn(self._logprobs(mb), mb) * (w / sum(weights))).backward()
        self.last_grad = self.W.grad.clone()
        with torch.no_grad():
            self.W -= self.lr * self.W.grad
        return {"loss": 0.0, "grad_norm": float(self.W.grad.norm()), "lr": self.lr}

    def save(self, path): ...


def _pair_batch():
    """3 pairs, prompts of different lengths on the chosen and rejected side, right padding."""
    rows = [([1, 2, 3], [4, 5]), ([1, 2], [6, 6, 0]),  # pair 0
            ([2], [3, 3, 3, 3]), ([2, 5, 5, 1], [0]),  # pair 1
            ([6, 1], [2]), ([6], [1, 4])]  # pair 2
    T = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    att = torch.zeros(len(rows), T, dtype=torch.bool)
    lm = torch.zeros(len(rows), T, dtype=torch.int32)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p + r)] = torch.tensor(p + r)
        att[i, : len(p + r)] = True
        lm[i, len(p): len(p + r)] = 1
    return {"input_ids": ids, "attention_mask": att, "loss_mask": lm}


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
@pytest.mark.parametrize("groups", [None, [[0], [1, 2], [3, 4, 5]], [[5, 0], [3], [1, 2, 4]]])
def test_surrogate_gradient_equals_direct_dpo_gradient(loss_type, eps, groups):
    """Pairs split across micro-batches (rows 0|1, 3|2...) still get exactly ∇ mean_i ℓ_i."""
    batch = _pair_batch()
    ref = BigramEngine(seed=1)
    actor = BigramEngine(seed=2, groups=groups)
    cfg = DPOAlgoConfig(beta=0.5, loss_type=loss_type, label_smoothing=eps)
    stats = DPO(cfg, actor, ref).update(dict(batch))
    # Direct: differentiate the mean pair loss through the model.
    W = actor.W.detach().clone().requires_grad_(True)
    lp = gather_logprobs(W[batch["input_ids"]], batch["input_ids"]) * batch["attention_mask"]
    s = sequence_logprobs(lp, batch["loss_mask"])
    r = sequence_logprobs(ref.forward(batch), batch["loss_mask"])
    direct = dpo_loss(s[0::2], s[1::2], r[0::2], r[1::2], cfg.beta, loss_type, eps).mean()
    direct.backward()
    torch.testing.assert_close(actor.last_grad, W.grad, rtol=1e-5, atol=1e-6)
    assert stats["loss"] == pytest.approx(direct.item(), rel=1e-5)
    # Metrics of the same forward: implicit rewards β(s - s_ref), margin, accuracy, logps.
    rw, rl = cfg.beta * (s[0::2] - r[0::2]), cfg.beta * (s[1::2] - r[1::2])
    assert stats["rewards/margin"] == pytest.approx((rw - rl).mean().item(), rel=1e-5)
    assert stats["rewards/accuracy"] == pytest.approx((rw > rl).float().mean().item())
    assert stats["logps/chosen"] == pytest.approx(s[0::2].mean().item(), rel=1e-5)
    assert stats["logps/rejected"] == pytest.approx(s[1::2].mean().item(), rel=1e-5)
    assert stats["n_pairs"] == 3


def test_policy_equal_to_reference_gives_log2_then_sgd_lowers_the_loss():
    batch = _pair_batch()
    ref, actor = BigramEngine(seed=3), BigramEngine(seed=3, lr=1.0)
    algo = DPO(DPOAlgoConfig(beta=0.5), actor, ref)
    first = algo.update(dict(batch))
    assert first["loss"] == pytest.approx(math.log(2.0), abs=1e-6)  # Δ = 0: -log σ(0)
    assert first["rewards/margin"] == 0.0 and first["rewards/accuracy"] == 0.0
    second = algo.update(dict(batch))
    assert second["loss"] < first["loss"] - 1e-3
    assert second["rewards/margin"] > 0 and second["rewards/accuracy"] > 0


def test_bad_batch_layouts_are_rejected():
    batch = _pair_batch()
    algo = DPO(DPOAlgoConfig(), BigramEngine(), BigramEngine())
    with pytest.raises(ValueError, match="even"):
        algo.update({k: v[:5] for k, v in batch.items()})
    empty = dict(batch, loss_mask=batch["loss_mask"].clone())
    empty["loss_mask"][3] = 0
    with pytest.raises(ValueError, match=r"rows \[3\] have no response tokens"):
        algo.update(empty)


# ---------------------------------------------------------------------------------------------
# Data and online pair selection
# ---------------------------------------------------------------------------------------------
def test_pick_pair_first_best_and_first_worst():
    assert pick_pair(torch.tensor([0.0, 1.0, 0.0, 1.0])) == (1, 0)
    assert pick_pair(torch.tensor([1.0, 1.0, 0.5])) == (0, 2)
    assert pick_pair(torch.tensor([1.0, 1.0])) is None
    assert pick_pair(torch.tensor([0.0, 0.0, 0.0])) is None


def _write(tmp_path, rows):
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def test_preference_jsonl_formats(tmp_path):
    path = _write(tmp_path, [
        {"prompt": "1+1?", "chosen": "2", "rejected": "3"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
         "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]},
    ])
    rows = load_preference_jsonl(path)
    assert rows[0] == {"messages": [{"role": "user", "content": "1+1?"}], "chosen": "2", "rejected": "3"}
    assert rows[1]["messages"][0]["role"] == "system" and (rows[1]["chosen"], rows[1]["rejected"]) == ("4", "5")


@pytest.mark.parametrize("row,match", [
    ({"chosen": "2", "rejected": "3"}, "row 2 is missing field 'prompt'"),
    ({"prompt": "q", "rejected": "3"}, "row 2 is missing field 'chosen'"),
    ({"prompt": "q", "chosen": "2"}, "row 2 is missing field 'rejected'"),
    ({"prompt": "q", "chosen": "", "rejected": "3"}, "row 2 field 'chosen' must be a non-empty string"),
    ({"messages": [{"role": "user"}], "chosen": "2", "rejected": "3"}, "row 2 field 'messages' message 0"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "2"}], "rejected": "3"},
     "row 2 field 'chosen' must end with an 'assistant' message"),
])
def test_malformed_preference_rows_name_row_and_field(tmp_path, row, match):
    path = _write(tmp_path, [{"prompt": "ok", "chosen": "1", "rejected": "2"}, row])
    with pytest.raises(ValueError, match=match):
        load_preference_jsonl(path)


def test_arithmetic_pairs_are_correct_vs_wrong_and_seeded():
    rows = make_arithmetic_pairs("train", 50, seed=3)
    assert rows == make_arithmetic_pairs("train", 50, seed=3)
    for r in rows:
        q = r["messages"][0]["content"]
        a, b = (int(x) for x in q.split("What is ")[1].split("?")[0].split(" + "))
        assert r["chosen"] == str(a + b)
        assert int(r["rejected"]) - (a + b) in (-10, -1, 1, 10)


def test_preference_collator_interleaves_pairs_and_masks_prompts(tiny_model_dir):
    from arealite.utils.hf import load_tokenizer
    from arealite.utils.hf import tokenize_chat

    tok = load_tokenizer(tiny_model_dir)
    rows = [{"messages": [{"role": "user", "content": "What is 1 + 1?"}], "chosen": "2", "rejected": "three"},
            {"messages": [{"role": "user", "content": "Hi"}], "chosen": "Hello there", "rejected": "x"}]
    batch = PreferenceCollator(tok, max_length=64)(rows)
    assert batch["input_ids"].shape[0] == 4
    for i, (r, key) in enumerate([(rows[0], "chosen"), (rows[0], "rejected"), (rows[1], "chosen"), (rows[1], "rejected")]):
        prompt = tokenize_chat(tok, r["messages"])
        resp = tok.encode(r[key], add_special_tokens=False) + [tok.eos_token_id]
        n = len(prompt) + len(resp)
        assert batch["input_ids"][i, :n].tolist() == prompt + resp
        assert batch["loss_mask"][i].tolist() == [0] * len(prompt) + [1] * len(resp) + [0] * (batch["input_ids"].shape[1] - n)
        assert int(batch["attention_mask"][i].sum()) == n
