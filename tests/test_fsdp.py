"""FSDP2 engine: the loss and the update do not depend on how the global batch is split
(ranks, micro-batches, packed or padded rows), with sequences of very different lengths."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, save_tiny_model

SCRIPT = os.path.join(REPO_ROOT, "tests", "dist", "train_step.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("fsdp_model")), initializer_range=0.2)


def run_train_steps(model_dir, tmp_path, nproc, kind):
    """Results of tests/dist/train_step.py under torchrun: {setting: {loss, grad_norm, ...}}."""
    out = tmp_path / f"{kind}_n{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           SCRIPT, model_dir, str(out), kind]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.load(open(out))


def assert_same_training(got, ref, what):
    for key in ("loss", "grad_norm"):
        for g, r in zip(got[key], ref[key]):
            assert g == pytest.approx(r, rel=1e-5), (what, key)
    assert got["params"].keys() == ref["params"].keys()
    for name in ref["params"]:
        torch.testing.assert_close(torch.tensor(got["params"][name]), torch.tensor(ref["params"][name]),
                                   rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def test_one_vs_two_ranks_one_vs_four_microbatches_packed_vs_padded_skipped_rows_agree(model_dir, tmp_path):
    one = run_train_steps(model_dir, tmp_path, 1, "actor")
    two = run_train_steps(model_dir, tmp_path, 2, "actor")
    ref = one["10000_True"]  # 1 rank, 1 packed micro-batch
    assert ref["n_microbatches"] == 1 and one["41_True"]["n_microbatches"] == 4
    assert two["41_False"]["n_microbatches"] == 2  # per rank
    # rows 1, 2, 6 (zero advantages, 48 of 162 tokens) left out, their weight passed as
    # skipped_weight: the same step with 3 micro-batches instead of 4
    assert one["41_True_skip"]["n_microbatches"] == 3 and two["41_True_skip"]["n_microbatches"] == 2
    for ranks, results in ((1, one), (2, two)):
        for setting, got in results.items():
            assert_same_training(got, ref, f"{ranks} ranks, {setting}")


def test_lr_schedules_hand_computed():
    from arealite.api.config import OptimizerConfig
    from arealite.train_engine.fsdp import lr_multiplier

    def lrs(**kw):
        oc = OptimizerConfig(warmup_steps=2, min_lr_ratio=0.1, **kw)
        return [lr_multiplier(oc, s, total_steps=6) for s in range(7)]

    # warmup (s+1)/3 for s < 2; then p = (s-2)/4
    assert lrs(lr_scheduler="constant") == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 1])
    assert lrs(lr_scheduler="linear") == pytest.approx([1 / 3, 2 / 3, 1.0, 0.775, 0.55, 0.325, 0.1])
    c = 0.1 + 0.9 * 0.5 * (1 + 0.5 ** 0.5)  # cos(π/4) = √½
    assert lrs(lr_scheduler="cosine") == pytest.approx([1 / 3, 2 / 3, 1.0, c, 0.55, 1.0 - c + 0.1, 0.1])


def test_bad_engine_config_names_the_field():
    from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine

    with pytest.raises(ValueError, match="optimizer.lr_scheduler"):
        FSDPEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr_scheduler="step")))
    with pytest.raises(ValueError, match="mb_spec.logits_chunk_size"):
        FSDPEngine(TrainEngineConfig(mb_spec=MicroBatchSpec(logits_chunk_size=0)))
    with pytest.raises(ValueError, match="optimizer.min_lr_ratio"):
        FSDPEngine(TrainEngineConfig(optimizer=OptimizerConfig(min_lr_ratio=2.0)))


def _batch(lengths=(9, 4, 6), T=9):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (len(lengths), T), generator=g)
    am = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        am[i, :n] = True
    lm = am.int()
    lm[:, :2] = 0
    return {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm}


def _token_mean_nll(logprobs, mb):
    return -(logprobs * mb["loss_mask"]).sum() / mb["loss_mask"].sum()


def _n_tokens(mb):
    return float(mb["loss_mask"].sum())


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tiny_model_dir):
    from arealite.api.config import OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine

    engine = FSDPEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-2, max_consecutive_skips=3)))
    engine.initialize(tiny_model_dir)
    before = {n: p.detach().full_tensor().clone() for n, p in engine.model.named_parameters()}
    nan_loss = lambda lp, mb: _token_mean_nll(lp, mb) * float("nan")  # noqa: E731
    for i in range(2):
        stats = engine.train_batch(_batch(), nan_loss, _n_tokens)
        assert stats["skipped"] == 1.0 and stats["skipped_total"] == i + 1
    for n, p in engine.model.named_parameters():  # untouched
        assert torch.equal(p.detach().full_tensor(), before[n]), n
    assert engine.train_batch(_batch(), _token_mean_nll, _n_tokens)["skipped"] == 0.0  # resets the streak
    assert any(not torch.equal(p.detach().full_tensor(), before[n]) for n, p in engine.model.named_parameters())
    assert engine.lr_scheduler.last_epoch == 1  # skipped steps do not advance the LR schedule
    for _ in range(2):
        engine.train_batch(_batch(), nan_loss, _n_tokens)
    with pytest.raises(RuntimeError, match="optimizer.max_consecutive_skips=3"):
        engine.train_batch(_batch(), nan_loss, _n_tokens)
    assert engine.n_skipped_steps == 5


@pytest.mark.filterwarnings("ignore:Seems like .optimizer.step")
def test_the_fused_optimizer_step_equals_torchs_reference_adamw(tiny_model_dir):
    """The engine's AdamW (fused) takes the step of torch's single-tensor AdamW on the same
    clipped gradients: two steps (moments carried over), weight decay on matrices only."""
    from arealite.api.config import OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine

    engine = FSDPEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1, gradient_clipping=0.5)))
    engine.initialize(tiny_model_dir)
    assert engine.optimizer.defaults["fused"]
    names = {p: n for n, p in engine.model.named_parameters()}
    params = {n: p.detach().full_tensor().clone() for n, p in engine.model.named_parameters()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    groups = [{"params": [ref[names[p]] for p in g["params"]], "weight_decay": g["weight_decay"]}
              for g in engine.optimizer.param_groups]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and all(ref[n].dim() < 2 for n in
                                                                      (names[p] for p in engine.optimizer.param_groups[1]["params"]))
    reference = torch.optim.AdamW(groups, lr=1e-2, foreach=False, fused=False)
    step = engine.optimizer.step

    def step_and_check(*args, **kwargs):  # the engine's gradients, after clipping, into the reference
        for p, n in names.items():
            ref[n].grad = p.grad.full_tensor().clone()
        out = step(*args, **kwargs)
        reference.step()
        for p, n in names.items():
            torch.testing.assert_close(p.detach().full_tensor(), ref[n].detach(), rtol=1e-6, atol=1e-7, msg=n)
        return out

    engine.optimizer.step = step_and_check
    for _ in range(2):
        engine.train_batch(_batch(), _token_mean_nll, _n_tokens)
    assert any(not torch.equal(ref[n].detach(), params[n]) for n in params)


def test_saved_hf_checkpoint_generates_the_engines_greedy_tokens(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from arealite.api.config import OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine

    engine = FSDPEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-2)))
    engine.initialize(tiny_model_dir)
    for _ in range(2):  # move the weights away from the initial folder
        engine.train_batch(_batch(), _token_mean_nll, _n_tokens)
    engine.save(str(tmp_path / "hf"))
    prompt = torch.tensor([[1, 17, 305, 42, 9]])
    ids = prompt
    engine.model.eval()
    with torch.no_grad():
        for _ in range(12):  # the engine's own greedy decoding: argmax of its forward's logits
            ids = torch.cat([ids, engine.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.tie_word_embeddings and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(hf.model.embed_tokens.weight, initial.model.embed_tokens.weight)  # the trained weights
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                      min_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert out.tolist() == ids.tolist()


def test_first_fit_decreasing_packing_and_layout_by_hand():
    from arealite.train_engine.packing import pack_sequences, packed_layout

    lengths = [13, 5, 9, 2, 1, 0]
    bins = pack_sequences(lengths, capacity=13)
    assert bins == [[0], [2, 3, 4], [1]]  # 13 | 9+2+1 | 5 (5 no longer fits after 9)
    assert pack_sequences(lengths, capacity=30) == [[0, 1, 2, 3, 4]]
    ids = torch.arange(1, 31)  # sequences back to back: [1..13], [14..18], [19..27], [28, 29], [30]
    input_ids, position_ids, where = packed_layout(ids, lengths, bins)
    assert input_ids.tolist() == [list(range(1, 14)), list(range(19, 28)) + [28, 29, 30, 0],
                                  list(range(14, 19)) + [0] * 8]
    assert position_ids.tolist() == [list(range(13)), list(range(9)) + [0, 1, 0, 0], list(range(5)) + [0] * 8]
    assert torch.equal(input_ids.flatten()[where], ids)  # every real token found where it went


def test_gradient_checkpointing_gives_the_same_step(tiny_model_dir):
    from arealite.api.config import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine

    stats = []
    for ckpt in (False, True):
        engine = FSDPEngine(TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-3), gradient_checkpointing=ckpt,
                                              mb_spec=MicroBatchSpec(max_tokens_per_mb=8, logits_chunk_size=5)),
                            temperature=0.7)
        engine.initialize(tiny_model_dir)
        stats.append(engine.train_batch(_batch(), _token_mean_nll, _n_tokens))
    assert stats[0]["n_microbatches"] == 3
    assert stats[1]["loss"] == pytest.approx(stats[0]["loss"], rel=1e-6)
    assert stats[1]["grad_norm"] == pytest.approx(stats[0]["grad_norm"], rel=1e-5)


def test_micro_batch_without_loss_tokens_contributes_exactly_zero(tiny_model_dir):
    from arealite.api.config import MicroBatchSpec, TrainEngineConfig
    from arealite.train_engine.fsdp import FSDPEngine

    batch = _batch()
    batch["loss_mask"][0] = 0  # the 9-token row ends up alone in a micro-batch: its mean would be 0/0
    without_row = {k: v[1:] for k, v in batch.items()}
    stats = []
    for b, budget in ((batch, 9), (without_row, 10_000)):
        engine = FSDPEngine(TrainEngineConfig(mb_spec=MicroBatchSpec(max_tokens_per_mb=budget)))
        engine.initialize(tiny_model_dir)
        stats.append(engine.train_batch(b, _token_mean_nll, _n_tokens))
    assert stats[0]["n_microbatches"] == 3 and stats[1]["n_microbatches"] == 1 and stats[0]["skipped"] == 0
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-6)
    assert stats[0]["grad_norm"] == pytest.approx(stats[1]["grad_norm"], rel=1e-5)
