"""DPO: direct preference optimisation (Rafailov et al. 2023, arXiv 2305.18290), with the
conservative-DPO label smoothing (Mitchell 2023, "A note on DPO with noisy preferences") and
the IPO loss (Azar et al. 2023, arXiv 2310.12036), in one file.

Batch layout: rows come in pairs, row ``2i`` is the chosen and row ``2i+1`` the rejected
response to prompt i (the two prompts may differ in length, e.g. other chat turns); ``loss_mask``
is 1 on response tokens only, so prompt tokens never enter a sequence log-probability::

    s_θ(y)   = Σ_t log π_θ(y_t | x, y_<t) · loss_mask_t      # [B] per-row response logprob
    Δ_i      = (s_θ(y_w) - s_ref(y_w)) - (s_θ(y_l) - s_ref(y_l))   # w = chosen, l = rejected
    sigmoid: ℓ_i = -(1-ε) log σ(β Δ_i) - ε log σ(-β Δ_i)     # DPO Eq. 7; ε > 0: conservative DPO
    ipo:     ℓ_i = (Δ_i - 1/(2β))²                           # IPO Eq. 17 (sums of logprobs, as
                                                             # in the paper; TRL averages per token)
    L        = mean_i ℓ_i                                     # over all pairs of the global batch
    implicit reward r(y) = β (s_θ(y) - s_ref(y));  accuracy = mean_i [r(y_w) > r(y_l)]

**How the pair coupling meets the engine contract.** ``TrainEngine.train_batch`` splits rows
into micro-batches (and ranks) freely, but ℓ_i couples the two rows of a pair. Instead of
forcing pairs into one micro-batch, :meth:`DPO.prepare` runs one no-grad forward of the policy
(and of the frozen reference), computes Δ_i and the per-row coefficient
``c_row = ∂(Σ_i ℓ_i)/∂s_θ(row)`` (autograd through the closed form above: ``+ℓ'(Δ_i)`` for
the chosen row, ``-ℓ'(Δ_i)`` for the rejected one), and the training loss of a row is the
surrogate ``c_row · s_θ(row)`` with ``c_row`` a constant. Its gradient at the current weights
is exactly ``∇_θ L`` for any row split (tests/test_dpo.py checks it against autograd of the
direct loss); the cost is one extra no-grad forward per step. The reported ``loss`` is L
itself, from the prepare forward (the weights the gradient is taken at). One optimizer step per
batch, like TRL's default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as Fn

from arealite.api.algorithm import Algorithm
from arealite.api.cli import check_algorithm
from arealite.api.config import DPOAlgoConfig
from arealite.api.engine import Batch, TrainEngine



def sequence_logprobs(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Σ_t logprobs · loss_mask per row: the response log-likelihood [B] float32 from token-aligned
    ``logprobs`` [B, T] and ``loss_mask`` [B, T] 0/1 (prompt and padding excluded; masked
    entries may hold anything, even inf/nan — they are never read)."""
    keep = loss_mask > 0
    return torch.where(keep, logprobs.float(), torch.zeros_like(logprobs, dtype=torch.float32)).sum(-1)


def dpo_loss(
    chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-pair preference loss ℓ_i [P] (formulas in the module doc), differentiable.

    Args:
        chosen_logp, rejected_logp: [P] response logprob sums under the policy.
        ref_chosen_logp, ref_rejected_logp: [P] the same under the reference model.
        beta: β > 0. loss_type: ``sigmoid`` (DPO) or ``ipo``.
        label_smoothing: ε in [0, 0.5) (conservative DPO; sigmoid only).

    Raises:
        ValueError: unknown ``loss_type``, β ≤ 0, ε outside [0, 0.5), or ε > 0 with ``ipo``.
    """
    check_config(beta, loss_type, label_smoothing)
    delta = (chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp)  # [P]
    if loss_type == "ipo":
        return (delta - 1.0 / (2.0 * beta)) ** 2
    z = beta * delta
    return -(1.0 - label_smoothing) * Fn.logsigmoid(z) - label_smoothing * Fn.logsigmoid(-z)


def check_config(beta: float, loss_type: str, label_smoothing: float) -> None:
    """Raises ValueError (``ConfigError``) naming the ``algo.*`` field when the DPO
    hyper-parameters are invalid (the rules of :func:`arealite.api.cli.check_algorithm`)."""
    check_algorithm(DPOAlgoConfig(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing))


def check_pairs(batch: Batch) -> None:
    """Raises ValueError when ``batch`` is not [chosen, rejected] row pairs with response tokens."""
    for key in ("input_ids", "attention_mask", "loss_mask"):
        if key not in batch:
            raise ValueError(f"DPO batch has no {key!r}; build it with arealite.dataset.preference_data "
                             "or arealite.workflow.preference")
    n = batch["input_ids"].shape[0]
    if n == 0 or n % 2:
        raise ValueError(f"DPO batch has {n} rows; it needs an even, non-zero number (row 2i chosen, 2i+1 rejected)")
    empty = ((batch["loss_mask"] > 0).sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"DPO batch rows {empty} have no response tokens (loss_mask all 0); "
                         "raise train_dataset.max_length or drop those pairs")


class DPO(Algorithm):
    """DPO / cDPO / IPO update: one optimizer step of ``actor`` per batch of pairs.

    Args:
        config: :class:`DPOAlgoConfig` (β, loss_type, label_smoothing).
        actor: the trainable policy engine (temperature 1: DPO likelihoods are the model's own).
        ref: a frozen engine (``trainable=False``) holding the reference weights.

    Raises:
        ValueError: invalid config (see :func:`check_config`), at construction.
    """

    def __init__(self, config: DPOAlgoConfig, actor: TrainEngine, ref: TrainEngine):
        check_config(config.beta, config.loss_type, config.label_smoothing)
        self.config, self.actor, self.ref = config, actor, ref

    def pair_terms(self, seq_logp: torch.Tensor, ref_seq_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair losses ℓ [P] and per-row surrogate coefficients ∂Σℓ/∂s [B] from row sums [B]."""
        s = seq_logp.detach().double().requires_grad_(True)
        ref = ref_seq_logp.double()
        c = self.config
        losses = dpo_loss(s[0::2], s[1::2], ref[0::2], ref[1::2], c.beta, c.loss_type, c.label_smoothing)
        (coef,) = torch.autograd.grad(losses.sum(), s)
        return losses.detach().float(), coef.float()

    def prepare(self, batch: Batch) -> Batch:
        """Adds ``ref_logp`` [B, T] (frozen reference), ``dpo_coef`` [B] (surrogate coefficient)
        and records the pair metrics of the current weights. Raises ValueError on a bad layout."""
        check_pairs(batch)
        batch["ref_logp"] = self.ref.forward(batch)
        policy_logp = self.actor.forward(batch)  # no grad: Δ at the weights of this update
        mask = batch["loss_mask"]
        seq, ref_seq = sequence_logprobs(policy_logp, mask), sequence_logprobs(batch["ref_logp"], mask)
        losses, batch["dpo_coef"] = self.pair_terms(seq, ref_seq)
        beta = self.config.beta
        r_w, r_l = beta * (seq[0::2] - ref_seq[0::2]), beta * (seq[1::2] - ref_seq[1::2])  # [P] implicit rewards
        sums = torch.stack([
            losses.sum(), r_w.sum(), r_l.sum(), (r_w - r_l).sum(), (r_w > r_l).float().sum(),
            seq[0::2].sum(), seq[1::2].sum(), torch.tensor(float(losses.numel())),
        ]).double()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        n = float(sums[-1])
        names = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
                 "logps/chosen", "logps/rejected"]
        self._stats = {k: float(v) / n for k, v in zip(names, sums[:-1])}
        self._stats["n_pairs"] = n
        return batch

    def loss_fn(self, logprobs: torch.Tensor, mb: Batch) -> torch.Tensor:
        """Surrogate of one micro-batch: Σ_rows c_row · s_θ(row) / (rows/2), the mean over its
        :meth:`loss_weight_fn` (engine contract); its gradient is the DPO gradient."""
        seq = sequence_logprobs(logprobs, mb["loss_mask"])  # [b]
        return (mb["dpo_coef"] * seq).sum() / (mb["input_ids"].shape[0] / 2.0)

    def loss_weight_fn(self, mb: Batch) -> float:
        """Pairs in the micro-batch (rows / 2; may be fractional when a pair is split)."""
        return mb["input_ids"].shape[0] / 2.0

    def update(self, batch: Batch) -> dict[str, float]:
        """Prepare, then one optimizer step. Returns the engine stats (grad_norm, lr, …) with
        ``loss`` replaced by the DPO loss L and the pair metrics added."""
        batch = self.prepare(batch)
        stats = self.actor.train_batch(batch, self.loss_fn, self.loss_weight_fn)
        stats["surrogate_loss"] = stats.pop("loss")
        stats.update(self._stats)
        return stats
