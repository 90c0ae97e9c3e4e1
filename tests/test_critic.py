"""FSDPCriticEngine: token-aligned values, zero-initialised head, MSE training, HF save, and
1 vs 2 ranks / micro-batches / packed vs padded agreement."""

import pytest
import torch

from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from arealite.train_engine.fsdp import FSDPCriticEngine
from test_fsdp import assert_same_training, run_train_steps

LENGTHS = [11, 4, 8, 2]


def make_batch(T=11):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (len(LENGTHS), T), generator=g)
    am = torch.zeros(len(LENGTHS), T, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        am[i, :n] = True
    lm = am.int()
    lm[:, :2] = 0
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm}


@pytest.fixture(scope="module")
def critic(tiny_model_dir):
    engine = FSDPCriticEngine(TrainEngineConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=12)))
    engine.initialize(tiny_model_dir)
    return engine


def test_zero_initialised_head_gives_zero_values(critic):
    assert torch.equal(critic.forward(make_batch()), torch.zeros(len(LENGTHS), 11))


@pytest.mark.parametrize("packing", [True, False])
def test_value_at_t_is_head_of_hidden_state_at_t_minus_1(tiny_model_dir, packing):
    from transformers import AutoModel

    engine = FSDPCriticEngine(TrainEngineConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=12, packing=packing)))
    engine.initialize(tiny_model_dir)
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(1, 64, generator=g), torch.randn(1, generator=g)
    with torch.no_grad():  # 1 rank: the local shard is the whole head
        engine.model.score.weight.to_local().copy_(w)
        engine.model.score.bias.to_local().copy_(b)
    batch = make_batch()
    values = engine.forward(batch)
    backbone = AutoModel.from_pretrained(tiny_model_dir).eval()
    expected = torch.zeros(len(LENGTHS), 11)
    for i, n in enumerate(LENGTHS):  # each sequence alone, no padding
        with torch.no_grad():
            h = backbone(input_ids=batch["input_ids"][i:i + 1, :n]).last_hidden_state[0]  # [n, H]
        expected[i, 1:n] = (h[:-1] @ w.T + b).squeeze(-1)  # V(input_ids[:t]) at index t
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)
    assert values[:, 0].abs().sum() == 0 and values[~batch["attention_mask"]].abs().sum() == 0


def test_mse_steps_on_a_fixed_target_reduce_the_loss_and_save_loads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    engine = FSDPCriticEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-3),
                                                mb_spec=MicroBatchSpec(max_tokens_per_mb=12)))
    engine.initialize(tiny_model_dir)
    batch = make_batch()
    batch["returns"] = torch.full((len(LENGTHS), 11), 0.5) * batch["loss_mask"]

    def mse(values, mb):
        mask = mb["loss_mask"].float()
        return (((values - mb["returns"]) ** 2) * mask).sum() / mask.sum()

    losses = [engine.train_batch(batch, mse, lambda mb: float(mb["loss_mask"].sum()))["loss"] for _ in range(6)]
    assert losses[0] == pytest.approx(0.25, rel=1e-6)  # zero head: mean (0 - 0.5)²
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.5 * losses[0], losses
    values = engine.forward(batch)
    engine.save(str(tmp_path / "critic"))
    hf = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic")).eval()
    assert hf.config.num_labels == 1
    for i, n in enumerate(LENGTHS):
        with torch.no_grad():
            logits = hf(input_ids=batch["input_ids"][i:i + 1, :n]).logits[0, :, 0]  # [n]
        torch.testing.assert_close(values[i, 1:n], logits[:-1], rtol=1e-5, atol=1e-5)


def test_critic_one_vs_two_ranks_microbatches_packed_vs_padded_agree(tmp_path):
    from conftest import save_tiny_model

    model_dir = save_tiny_model(str(tmp_path / "model"), initializer_range=0.2)
    one = run_train_steps(model_dir, tmp_path, 1, "critic")
    two = run_train_steps(model_dir, tmp_path, 2, "critic")
    ref = one["10000_True"]
    assert ref["loss"][1] < ref["loss"][0] and any("score" in n for n in ref["params"])
    for ranks, results in ((1, one), (2, two)):
        for setting, got in results.items():
            assert_same_training(got, ref, f"critic, {ranks} ranks, {setting}")
