"""Chunked LM head (arealite/train_engine/lm_head.py) and the engine's packed forward: equal to the
naive full-logits computation in values and gradients, with the largest float buffer bounded by
chunk × vocab."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from arealite.algorithms.functional import gather_logprobs
from arealite.api.config import MicroBatchSpec, TrainEngineConfig
from arealite.train_engine.fsdp import FSDPEngine
from arealite.train_engine.lm_head import chunked_logprobs_entropy


def naive(hidden, weight, bias, labels, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def inputs(N=300, H=16, V=50, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g, dtype=torch.float64) * 2).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_() if bias else None
    return hidden, weight, b, torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize("temperature,chunk,bias", [(1.0, 64, True), (0.7, 7, False), (0.0, 1000, True)])
def test_chunked_equals_naive_values_and_gradients(temperature, chunk, bias):
    hidden, weight, b, labels = inputs(bias=bias)
    lp, ent = chunked_logprobs_entropy(hidden, weight, labels, temperature, chunk, bias=b)
    lp_ref, ent_ref = naive(hidden, weight, b, labels, temperature)
    torch.testing.assert_close(lp, lp_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref.float(), rtol=1e-5, atol=1e-5)
    assert lp.dtype == ent.dtype == torch.float32 and not ent.requires_grad
    g_out = torch.randn(lp.shape[0], generator=torch.Generator().manual_seed(3))
    params = [hidden, weight] + ([b] if bias else [])
    grads = torch.autograd.grad((lp * g_out).sum(), params)
    grads_ref = torch.autograd.grad((lp_ref * g_out.double()).sum(), params)
    for got, ref in zip(grads, grads_ref):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


class LargestFloatTensor(TorchDispatchMode):
    """Records the element count of the largest floating-point tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


def test_largest_logits_buffer_is_one_chunk():
    N, H, V, chunk = 2000, 8, 500, 64  # full logits: 1M elements; one chunk: 32k
    hidden, weight, b, labels = inputs(N=N, H=H, V=V)
    hidden, weight = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    with LargestFloatTensor() as probe:
        lp, _ = chunked_logprobs_entropy(hidden, weight, labels, 0.7, chunk)
        lp.sum().backward()
    assert probe.largest <= chunk * V, probe.largest
    with LargestFloatTensor() as probe_naive:  # the probe does see full logits when they exist
        naive(hidden, weight, None, labels, 0.7)[0].sum().backward()
    assert probe_naive.largest == N * V


def test_bad_chunk_size_names_the_config_field():
    hidden, weight, b, labels = inputs()
    with pytest.raises(ValueError, match="mb_spec.logits_chunk_size"):
        chunked_logprobs_entropy(hidden, weight, labels, 1.0, 0)


@pytest.mark.parametrize("packing", [True, False])
def test_engine_packed_and_padded_logprobs_equal_each_sequence_alone(tiny_model_dir, packing):
    from transformers import AutoModelForCausalLM

    lengths, T = [13, 5, 9, 2, 1], 13
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (len(lengths), T), generator=g)
    am = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        am[i, :n] = True
    batch = {"input_ids": ids * am, "attention_mask": am}
    engine = FSDPEngine(TrainEngineConfig(mb_spec=MicroBatchSpec(packing=packing, logits_chunk_size=3)),
                        temperature=0.7)
    engine.initialize(tiny_model_dir)
    got = engine.forward(batch)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    expected, expected_entropy = torch.zeros(len(lengths), T), torch.zeros(len(lengths), T)
    for i, n in enumerate(lengths):  # every sequence alone: no packing, no padding
        with torch.no_grad():
            logits = hf(input_ids=ids[i:i + 1, :n]).logits
        expected[i, :n] = gather_logprobs(logits, ids[i:i + 1, :n], 0.7)[0]
        logp = (logits[0, :-1] / 0.7).log_softmax(-1)
        expected_entropy[i, 1:n] = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got[:, 0].abs().sum() == 0 and got[~am].abs().sum() == 0

    seen = {}  # the training forward: same logprobs (with grad), entropy handed to loss_fn

    def loss_fn(logprobs, mb):
        seen["logprobs"], seen["entropy"] = logprobs.detach().clone(), mb["entropy"]
        return -(logprobs * mb["loss_mask"]).sum() / mb["loss_mask"].sum()

    engine.train_batch({**batch, "loss_mask": am.int()}, loss_fn, lambda mb: float(mb["loss_mask"].sum()))
    torch.testing.assert_close(seen["logprobs"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["entropy"], expected_entropy, rtol=1e-5, atol=1e-5)
    assert not seen["entropy"].requires_grad
