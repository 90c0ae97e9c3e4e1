"""Run by tests/test_skip_equivalence.py (plain python, a 1-rank gloo group): one GRPO/GSPO
update of a real FSDPEngine on a fixed batch, with the computations the algorithm skips and with
them done explicitly, each from the same saved weights.

Cases (name -> what is computed):
* ``<algo>_skip``: one minibatch, decoupled loss: π_prox = the training forward's detached
  logprobs (GRPO.prepare adds no ``prox_logp``);
* ``<algo>_full``: the same, but ``prox_logp`` from a separate no-grad ``actor.forward``;
* ``<algo>_wrong``: ``prox_logp`` = that forward + 0.5 on loss tokens (a negative control: a
  different proximal policy must give a visibly different update; π_prox cancels out of
  w·u = π_θ/π_behav, so only a shift beyond the clip range ε = 0.2 changes the update);
* ``grpo_kl_full``: ``kl_coef`` 0 but a frozen reference engine (other weights: ref_model_dir)
  run and the β·KL term (β = 0) in the loss, as with ``kl_coef > 0``;
* ``grpo_kl_wrong``: the same with β = 0.1 (negative control: the KL term does move the update);
* ``inert_<loss>_skip`` / ``_full`` / ``_unweighted``: two updates, the first on a batch whose
  second group has all-equal rewards (4 rows with all-zero advantages), the second on a batch
  of such groups only. ``skip``: GRPO leaves those rows out and passes their weight as the
  engine's ``skipped_weight`` (one row kept when all are inert); ``full``: every row trained;
  ``unweighted``: left out without their weight (a negative control: the step grows).
  ``<loss>``: ppo (token-mean), cispo (seq-mean-token-mean), gmpo, GSPO, and ppo_2mb (two
  minibatches, so π_prox comes from a forward pass of the rows trained).

The optimizer is AdamW with eps = lr = 1 and no clipping, so the step is
g / (|g| + 1) ≈ g per parameter: sensitive to the gradient's magnitude (with the usual tiny eps,
Adam's first step is ≈ lr·sign(g) and would hide a rescaled gradient).

argv: model_dir ref_model_dir out_path. Writes {case: {"stats": {...}, "params": {name: [first 256 values]}}}.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from arealite.algorithms.grpo import GRPO, with_surrogate
from arealite.algorithms.gspo import GSPO
from arealite.api.config import GRPOAlgoConfig, GSPOAlgoConfig, OptimizerConfig, TrainEngineConfig
from arealite.train_engine.fsdp import FSDPEngine, init_distributed
from arealite.utils.proc import exit_without_teardown

TEMPERATURE = 0.7
GROUP = 4


def make_batch(engine: FSDPEngine, rewards=(1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0)) -> dict:
    """8 rows (2 groups of 4), prompt 3 tokens, responses of 2..9 tokens; behaviour logprobs =
    the model's own + noise (so the behaviour weight π_prox/π_behav ≠ 1), ``rewards``."""
    g = torch.Generator().manual_seed(0)
    B, T, P = 8, 12, 3
    lengths = [12, 5, 9, 7, 11, 6, 10, 8]
    ids = torch.randint(0, 1000, (B, T), generator=g)
    am = torch.zeros(B, T, dtype=torch.bool)
    lm = torch.zeros(B, T, dtype=torch.int32)
    for i, n in enumerate(lengths):
        am[i, :n] = True
        lm[i, P:n] = 1
    batch = {"input_ids": ids * am, "attention_mask": am, "loss_mask": lm,
             "rewards": torch.tensor(rewards),
             "versions": torch.where(lm.bool(), 0, -1)}
    own = engine.forward(batch)
    batch["logprobs"] = (own + 0.3 * torch.randn(B, T, generator=g)) * lm
    return batch


class ExplicitProx:
    """Mixin: ``prepare`` also computes ``prox_logp`` by a separate forward (+ ``shift``)."""

    shift = 0.0

    def prepare(self, batch):
        batch = super().prepare(batch)
        assert "prox_logp" not in batch  # the algorithm itself skipped it (one minibatch)
        batch["prox_logp"] = self.actor.forward(batch) + self.shift * batch["loss_mask"]
        return batch


class TrainInertRows:
    """Mixin: no row is inert, every row gets its forward and backward pass."""

    def inert_rows(self, mb):
        return torch.zeros(mb["loss_mask"].shape[0], dtype=torch.bool)


class DropInertRowsUnweighted:
    """Mixin (negative control): the inert rows left out without passing their weight."""

    def train_minibatch(self, mb):
        keep = ~GRPO.inert_rows(self, mb)
        keep[0] = True
        return self.actor.train_batch({k: v[keep] for k, v in mb.items()}, self.loss_fn, self.loss_weight_fn)


def run_inert_case(model_dir: str, cls, cfg, mixin=None) -> dict:
    actor = new_engine(model_dir)
    if mixin is not None:
        cls = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    algo = cls(cfg, actor, group_size=GROUP)
    first = algo.update(make_batch(actor, (1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0)))
    second = algo.update(make_batch(actor, (0.0,) * 4 + (1.0,) * 4))
    state = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"stats": [first, second], "params": {n: state[n].flatten()[:256].tolist() for n in sorted(state)}}


def new_engine(model_dir: str, trainable: bool = True) -> FSDPEngine:
    cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1.0, eps=1.0, gradient_clipping=0.0))
    engine = FSDPEngine(cfg, temperature=TEMPERATURE, trainable=trainable)
    engine.initialize(model_dir)
    return engine


def run_case(model_dir: str, cls, cfg, shift: float | None = None, ref_dir: str | None = None) -> dict:
    actor = new_engine(model_dir)
    batch = make_batch(actor)
    if shift is not None:
        cls = type(f"Explicit{cls.__name__}", (ExplicitProx, cls), {"shift": shift})
    ref = new_engine(ref_dir, trainable=False) if ref_dir else None
    algo = cls(cfg, actor, group_size=GROUP, ref=ref)
    if ref_dir:
        algo.kl_in_loss = True  # β · KL in the loss (also at β = 0), ref_logp from the reference forward
    stats = algo.update(batch)
    state = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"stats": stats,
            "params": {n: state[n].flatten()[:256].tolist() for n in sorted(state)}}


def main():
    model_dir, ref_dir, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    init_distributed()
    results = {}
    for name, cls, cfg_cls in (("grpo", GRPO, GRPOAlgoConfig), ("gspo", GSPO, GSPOAlgoConfig)):
        cfg = cfg_cls(n_minibatches=1, use_decoupled_loss=True, behav_imp_weight_cap=5.0)
        results[f"{name}_skip"] = run_case(model_dir, cls, cfg)
        results[f"{name}_full"] = run_case(model_dir, cls, cfg, shift=0.0)
        results[f"{name}_wrong"] = run_case(model_dir, cls, cfg, shift=0.5)
    results["grpo_kl_full"] = run_case(model_dir, GRPO, GRPOAlgoConfig(n_minibatches=1, kl_coef=0.0), ref_dir=ref_dir)
    results["grpo_kl_wrong"] = run_case(model_dir, GRPO, GRPOAlgoConfig(n_minibatches=1, kl_coef=0.1), ref_dir=ref_dir)
    for name, cls, cfg in (("ppo", GRPO, GRPOAlgoConfig()),
                           ("cispo", with_surrogate(GRPO, "cispo"), GRPOAlgoConfig(loss="cispo", loss_agg_mode="seq-mean-token-mean")),
                           ("gmpo", with_surrogate(GRPO, "gmpo"), GRPOAlgoConfig(loss="gmpo", loss_agg_mode="seq-mean-token-mean")),
                           ("gspo", GSPO, GSPOAlgoConfig()), ("ppo_2mb", GRPO, GRPOAlgoConfig(n_minibatches=2))):
        for mode, mixin in (("skip", None), ("full", TrainInertRows), ("unweighted", DropInertRowsUnweighted)):
            results[f"inert_{name}_{mode}"] = run_inert_case(model_dir, cls, cfg, mixin)
    # the untrained weights, to show the update is not ~0
    init = get_model_state_dict(new_engine(model_dir, trainable=False).model,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    results["init"] = {"params": {n: init[n].flatten()[:256].tolist() for n in sorted(init)}}
    with open(out_path, "w") as f:
        json.dump(results, f)
    dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()  # results written, group destroyed: skip finalisation (see its docstring)
