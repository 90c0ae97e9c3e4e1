"""Reward-model training: the Bradley–Terry pairwise loss (Bradley & Terry 1952; InstructGPT,
Ouyang et al. 2022, arXiv 2203.02155, Eq. 1), in one file.

A reward model r_φ(x, y) is a causal LM with a scalar head read at the last token of prompt x +
response y (transformers' ``AutoModelForSequenceClassification``, ``num_labels=1``). For a
preference pair (y_w preferred over y_l)::

    P(y_w ≻ y_l | x) = σ(r_φ(x, y_w) − r_φ(x, y_l))                 # Bradley–Terry
    ℓ_i = −log σ(r_w − r_l − m)  +  c · (r_w + r_l)²                  # m: margin (Llama 2, arXiv
                                                                     # 2307.09288, Eq. 2); c: centring
    L   = mean_i ℓ_i;   accuracy = mean_i ([r_w > r_l] + ½ [r_w = r_l])  # c: Eisenstein et al. 2023

**Batch layout.** Row ``2i`` is the chosen and row ``2i+1`` the rejected sequence of pair i
(prompt + response + EOS, as :func:`arealite.dataset.sft_data.tokenize_example` builds them),
followed by ONE extra token (the pad id) whose ``loss_mask`` is 1 and every other ``loss_mask``
0: the train engine's token-aligned output at index t comes from the hidden state at t − 1, so
the output at the extra index is the head applied to the sequence's own last token — exactly
what ``AutoModelForSequenceClassification`` reads (causal attention: the extra token changes no
earlier hidden state). :func:`reward_batch` builds that layout from token ids.

**Pair coupling vs. the engine contract** (the same device as :mod:`arealite.algorithms.dpo`):
:meth:`BradleyTerry.prepare` runs one no-grad forward, computes ℓ_i and the per-row coefficient
``c_row = ∂(Σ_i ℓ_i)/∂r(row)``; the training loss of a row is ``c_row · r(row)``, whose gradient
at the current weights is ∇L for any split of rows into micro-batches and ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as Fn

from arealite.api.algorithm import Algorithm
from arealite.api.engine import Batch, TrainEngine
from arealite.utils.data import pad_and_stack


def reward_batch(seqs: list[list[int]], pad_id: int) -> Batch:
    """The scoring layout of token sequences (see the module doc): each sequence + one ``pad_id``
    token, right-padded. Returns ``input_ids`` [B, T] int64, ``attention_mask`` [B, T] bool,
    ``loss_mask`` [B, T] int32 (1 only at each row's extra token, index ``len(seq)``).

    Raises:
        ValueError: an empty sequence (nothing to score).
    """
    if any(len(s) == 0 for s in seqs):
        raise ValueError("reward_batch: every sequence needs at least one token")
    rows = [list(s) + [pad_id] for s in seqs]
    return {
        "input_ids": pad_and_stack(rows, pad_id, torch.int64),
        "attention_mask": pad_and_stack([[1] * len(r) for r in rows], 0, torch.bool),
        "loss_mask": pad_and_stack([[0] * len(s) + [1] for s in seqs], 0, torch.int32),
    }


def sequence_scores(out: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-row reward [B] float32: the token-aligned head output ``out`` [B, T] at the row's one
    ``loss_mask`` = 1 index (the extra token of :func:`reward_batch`)."""
    keep = loss_mask > 0
    return torch.where(keep, out.float(), torch.zeros_like(out, dtype=torch.float32)).sum(-1)


def bt_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float = 0.0,
            center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair Bradley–Terry loss ℓ [P] (module doc), differentiable.

    Args:
        r_chosen, r_rejected: [P] rewards of the preferred and the other response.
        margin: m ≥ 0, required gap (Llama 2's margin loss; 0 = plain BT).
        center_coef: c ≥ 0 of the (r_w + r_l)² term that keeps rewards centred at 0.

    Raises:
        ValueError: a negative ``margin`` or ``center_coef``, or shapes that differ.
    """
    if margin < 0 or center_coef < 0:
        raise ValueError(f"algo.margin ({margin}) and algo.center_coef ({center_coef}) must be >= 0")
    if r_chosen.shape != r_rejected.shape:
        raise ValueError(f"bt_loss: chosen {tuple(r_chosen.shape)} and rejected {tuple(r_rejected.shape)} differ")
    loss = -Fn.logsigmoid(r_chosen - r_rejected - margin)
    if center_coef > 0:
        loss = loss + center_coef * (r_chosen + r_rejected) ** 2
    return loss


def check_pairs(batch: Batch) -> None:
    """Raises ValueError unless ``batch`` is [chosen, rejected] row pairs with exactly one
    ``loss_mask`` = 1 position per row (the layout of :func:`reward_batch`)."""
    for key in ("input_ids", "attention_mask", "loss_mask"):
        if key not in batch:
            raise ValueError(f"reward-model batch has no {key!r}; build it with "
                             "arealite.dataset.preference_data.RewardPairCollator or reward_batch")
    n = batch["input_ids"].shape[0]
    if n == 0 or n % 2:
        raise ValueError(f"reward-model batch has {n} rows; it needs an even, non-zero number (2i chosen, 2i+1 rejected)")
    per_row = (batch["loss_mask"] > 0).sum(-1)
    bad = (per_row != 1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"reward-model batch rows {bad} do not have exactly one loss_mask = 1 position "
                         "(the extra token after each sequence); build the batch with reward_batch")


class BradleyTerry(Algorithm):
    """One optimizer step of a reward-model engine per batch of pairs (BT loss, module doc).

    Args:
        rm: a trainable engine whose outputs are the head's scores
            (:class:`arealite.train_engine.fsdp.FSDPRewardEngine`).
        margin, center_coef: see :func:`bt_loss`.

    Raises:
        ValueError: negative ``margin`` / ``center_coef`` (at construction).
    """

    def __init__(self, rm: TrainEngine, margin: float = 0.0, center_coef: float = 0.0):
        bt_loss(torch.zeros(1), torch.zeros(1), margin, center_coef)  # validates the coefficients
        self.rm, self.margin, self.center_coef = rm, margin, center_coef

    def scores(self, batch: Batch) -> torch.Tensor:
        """Rewards [B] float32 of the rows of ``batch`` (no grad)."""
        return sequence_scores(self.rm.forward(batch), batch["loss_mask"])

    def pair_stats(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(per-pair losses [P], per-row coefficients ∂Σℓ/∂r [B], summed pair metrics) from row rewards [B]."""
        s = r.detach().double().requires_grad_(True)
        losses = bt_loss(s[0::2], s[1::2], self.margin, self.center_coef)
        (coef,) = torch.autograd.grad(losses.sum(), s)
        r_w, r_l = r[0::2].double(), r[1::2].double()
        sums = {"loss": losses.detach().sum(), "accuracy": ((r_w > r_l).double() + 0.5 * (r_w == r_l).double()).sum(),
                "margin": (r_w - r_l).sum(), "chosen": r_w.sum(), "rejected": r_l.sum(),
                "n_pairs": torch.tensor(float(r_w.numel()), dtype=torch.float64)}
        return losses.detach().float(), coef.float(), sums

    @staticmethod
    def reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """All-reduce the summed metrics over ranks; means per pair (``n_pairs`` the total)."""
        names = list(sums)
        t = torch.stack([sums[k] for k in names]).double()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t)
        n = float(t[names.index("n_pairs")])
        return {k: (float(v) if k == "n_pairs" else float(v) / max(n, 1.0)) for k, v in zip(names, t)}

    def prepare(self, batch: Batch) -> Batch:
        """Adds ``bt_coef`` [B] (the surrogate coefficients at the current weights) and keeps the
        pair metrics for :meth:`update`. Raises ValueError on a bad layout (:func:`check_pairs`)."""
        check_pairs(batch)
        _, batch["bt_coef"], self._sums = self.pair_stats(self.scores(batch))
        return batch

    def loss_fn(self, out: torch.Tensor, mb: Batch) -> torch.Tensor:
        """Surrogate of one micro-batch: Σ_rows c_row · r(row) / (rows/2); its gradient is ∇L."""
        return (mb["bt_coef"] * sequence_scores(out, mb["loss_mask"])).sum() / (mb["input_ids"].shape[0] / 2.0)

    def loss_weight_fn(self, mb: Batch) -> float:
        """Pairs in the micro-batch (rows / 2)."""
        return mb["input_ids"].shape[0] / 2.0

    def update(self, batch: Batch) -> dict[str, float]:
        """No-grad forward → coefficients → one optimizer step. Returns the engine stats with
        ``loss`` = the BT loss L at the weights of this step, ``accuracy`` (pairs with r_w > r_l; a tie
        counts ½),
        ``margin`` (mean r_w − r_l), ``chosen`` / ``rejected`` (mean rewards), ``n_pairs``.

        Raises: ValueError: a batch not in the layout of :func:`reward_batch` (see :func:`check_pairs`)."""
        batch = self.prepare(batch)
        stats = self.rm.train_batch(batch, self.loss_fn, self.loss_weight_fn)
        stats["surrogate_loss"] = stats.pop("loss")
        stats.update(self.reduce_sums(self._sums))
        return stats

    def evaluate(self, batch: Batch) -> dict[str, float]:
        """Held-out pair metrics (no update): ``loss``, ``accuracy``, ``margin``, ``chosen``,
        ``rejected``, ``n_pairs`` over all ranks' rows (collective)."""
        check_pairs(batch)
        return self.reduce_sums(self.pair_stats(self.scores(batch))[2])
