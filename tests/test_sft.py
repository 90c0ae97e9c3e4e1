"""SFT: token-mean loss over the global batch (hand-computed, any micro-batch split), the held-out
NLL, SFT jsonl loading (row/field errors) and tokenization (loss on response + EOS only)."""

import json
import os

import pytest
import torch

from arealite.algorithms.functional import gather_logprobs
from arealite.algorithms.sft import SFT, evaluate_nll
from arealite.api.engine import TrainEngine
from arealite.dataset.math_data import GSM8K_INSTRUCTION
from arealite.dataset.sft_data import SFTCollator, load_sft_dataset, load_sft_jsonl, tokenize_example
TEST_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


class FixedEngine(TrainEngine):
    """Logprobs = ``lp`` (a leaf tensor) for the rows of each micro-batch (row index in
    ``mb["row"]``); micro-batches are combined exactly as the engine contract says."""

    def __init__(self, lp, groups):
        self.lp, self.groups = lp.clone().requires_grad_(True), groups

    def forward(self, batch):
        return self.lp.detach()[batch["row"]]

    def train_batch(self, batch, loss_fn, loss_weight_fn):
        mbs = [{k: v[torch.tensor(g)] for k, v in batch.items()} for g in self.groups]
        w = [loss_weight_fn(mb) for mb in mbs]
        self.lp.grad = None
        total = sum(loss_fn(self.lp[mb["row"]], mb) * (wi / sum(w)) for mb, wi in zip(mbs, w))
        total.backward()
        return {"loss": float(total.detach()), "grad_norm": 0.0, "lr": 0.0}

    def save(self, path): ...


LP = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -5.0]])
MASK = torch.tensor([[0, 1, 1], [0, 1, 0]])  # 3 loss tokens: NLL 1, 2, 3


@pytest.mark.parametrize("groups", [[[0, 1]], [[0], [1]], [[1], [0]]])
def test_token_mean_over_the_global_batch_for_any_split(groups):
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.bool),
             "loss_mask": MASK, "row": torch.arange(2)}
    engine = FixedEngine(LP, groups)
    stats = SFT(engine).update(batch)
    # (1 + 2 + 3) / 3 = 2 (a per-sequence mean would give (1.5 + 3) / 2 = 2.25)
    assert stats["loss"] == pytest.approx(2.0)
    assert stats["n_tokens"] == 3
    # every loss token weighs -1/3, prompt and masked-out positions 0
    torch.testing.assert_close(engine.lp.grad, torch.tensor([[0, -1 / 3, -1 / 3], [0, -1 / 3, 0]]))


def test_evaluate_nll_is_the_token_mean_over_batches():
    engine = FixedEngine(LP, None)
    batches = [{"loss_mask": MASK[:1], "row": torch.tensor([0])}, {"loss_mask": MASK[1:], "row": torch.tensor([1])}]
    assert evaluate_nll(engine, batches) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no response tokens"):
        evaluate_nll(engine, [{"loss_mask": torch.zeros(1, 3), "row": torch.tensor([0])}])


def test_missing_key_is_named():
    with pytest.raises(ValueError, match="'loss_mask'"):
        SFT(None).update({"input_ids": torch.zeros(1, 2), "attention_mask": torch.ones(1, 2)})


def test_sft_training_lowers_the_loss_of_a_real_tiny_model(tiny_model_dir):
    """Plain (non-distributed) check that the SFT gradient points downhill on a real LM."""
    from transformers import AutoModelForCausalLM

    from arealite.utils.hf import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + 1?"}], "response": str(a + 1)} for a in range(4)]
    batch = SFTCollator(tok, 64)(rows)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    losses = []
    for _ in range(3):
        lp = gather_logprobs(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                             batch["input_ids"])
        loss = SFT(None).loss_fn(lp, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[0] - 0.1, losses


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def _write(tmp_path, rows):
    p = tmp_path / "sft.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def test_messages_and_gsm8k_rows(tmp_path):
    path = _write(tmp_path, [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"question": "Q?", "answer": "48/2 = <<48/2=24>>24 clips.\n#### 24"},
    ])
    rows = load_sft_jsonl(path)
    assert rows[0] == {"messages": [{"role": "user", "content": "hi"}], "response": "hello"}
    assert rows[1] == {"messages": [{"role": "user", "content": "Q?" + GSM8K_INSTRUCTION}], "response": "48/2 = 24 clips.\n#### 24"}


@pytest.mark.parametrize("row,match", [
    ({"text": "x"}, "row 2 is missing field 'messages'"),
    ({"question": "Q?"}, "row 2 is missing field 'answer'"),
    ({"answer": "#### 1"}, "row 2 is missing field 'question'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "row 2 field 'messages' must end with an 'assistant'"),
    ({"messages": "hi"}, "row 2 field 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}, "row 2 field 'messages' message 0"),
])
def test_malformed_sft_rows_name_row_and_field(tmp_path, row, match):
    path = _write(tmp_path, [{"question": "ok", "answer": "#### 1"}, row])
    with pytest.raises(ValueError, match=match):
        load_sft_jsonl(path)


def test_gsm8k_train_file_loads_without_calculator_annotations():
    path = os.path.join(TEST_DATA, "gsm8k", "train.jsonl")  # a 64-row slice committed with the tests
    rows = load_sft_dataset(path, "train", size=50, seed=0)
    assert len(rows) == 50
    assert all("<<" not in r["response"] and "\n#### " in r["response"] for r in rows)


def test_tokenize_masks_prompt_and_keeps_eos_then_truncates(tiny_model_dir):
    from arealite.utils.hf import load_tokenizer
    from arealite.utils.hf import tokenize_chat

    tok = load_tokenizer(tiny_model_dir)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tokenize_chat(tok, msgs)
    resp = tok.encode("It is 4.", add_special_tokens=False) + [tok.eos_token_id]
    ids, mask = tokenize_example(tok, msgs, "It is 4.", 1000)
    assert ids == prompt + resp and mask == [0] * len(prompt) + [1] * len(resp)
    ids, mask = tokenize_example(tok, msgs, "It is 4.", len(prompt) + 2)  # keeps 2 response tokens
    assert ids == prompt + resp[:2] and sum(mask) == 2
    with pytest.raises(ValueError, match="train_dataset.max_length"):
        SFTCollator(tok, 0)
