"""Behaviour-policy corrections: one composable weight/mask from log ρ = log π_prox − log μ.

In asynchronous RL every token was sampled by a behaviour policy μ (the inference engine's
logprobs, possibly several weight versions) that is not π_prox (the trainer's recomputation
with the weights before the update). A correction turns ρ_t = π_prox(y_t)/μ(y_t) into a
detached per-token weight ``w`` [B, T] that multiplies the surrogate, and a ``keep`` mask; the
published methods are presets of one piece (``algo.correction``), specified in the project's
off-policy spec (formulas and defaults from the papers named per preset):

=============  ====================  ==========================================  ==============
preset         level                 weight w / mask                             defaults
=============  ====================  ==========================================  ==============
``cap``        token                 w = ρ_t, masked where ρ_t > C (AReaL-lite    C = algo.
               (today's default)     decoupled PPO, arXiv 2505.24298)             behav_imp_
                                                                                 weight_cap
``none``       —                     w = 1 (no correction)                        —
``token_tis``  token                 w = min(ρ_t, C) (Yao et al. 2025, "off-      C = 2
                                     policy RL" note)
``seq_tis``    sequence, product     w = min(∏ρ_t, C) on every token              C = 2
``token_mis``  token                 w = ρ_t if lo ≤ ρ_t ≤ C else 0               lo 0.5, C 2
``seq_mis``    sequence, product     w = ρ_seq if ρ_seq ≤ C else 0 (Liu, Li et    C = 2
                                     al. 2025, arXiv 2512.23075)
``icepop``     token                 w = ρ_t if lo ≤ ρ_t ≤ C else 0 (Ring-1T,     lo 0.5, C 5
                                     arXiv 2510.18855)
``kpop``       token                 w = ρ_t, masked where max(KL_b(p‖q),          C = 2
                                     KL_b(q‖p)) > C, p = π_prox, q = μ
``geo_rs``     sequence, geometric   w = min(ρ_t, 2) if lo ≤ exp(mean log ρ) ≤ C  lo .999, C
                                     else 0 (verl seq_mean_k1 + token TIS)        1.001
``k2_rs``      token                 w = ρ_t, masked where ½(log ρ_t)² > C        C = 2
``k3_rs``      sequence              w = ρ_t, the sequence rejected where          C = 0.01
                                     mean_t(ρ_t − log ρ_t − 1) > C
``m2po``       token                 w = ρ_t, the tokens of largest (log ρ_t)²     τ = 0.04
                                     masked until the mean of the rest < τ
                                     (arXiv 2510.01161)
=============  ====================  ==========================================  ==============

Rules (the spec's): log ρ is computed in fp32, NaN becomes 0, and log ratios are clamped to
[−20, 20] before ``exp`` (±inf included: see :func:`log_rho`); every weight is detached (a change of measure: no gradient
through it); masking never changes the loss denominator (the surrogate is aggregated over the
original ``loss_mask``, so a masked token is a zero-loss token and the kept ones are not
up-weighted); masked fractions are counted against the pre-mask token count. Optional batch
normalisation (``algo.correction_batch_norm``, verl ``rollout_is_batch_normalize``) divides the
kept weights by their mean after truncation. In bypass mode (``algo.use_decoupled_loss false``)
π_prox ≡ μ, ρ ≡ 1, and only ``cap`` / ``none`` are allowed (``cli.check_algorithm``): a
correction there would be a no-op that looks like one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0

# name: (level, weight rule, mask metric, default lower, default upper)
#   level: "token" | "seq_prod" | "seq_geo" | "seq_k3"; weight rule: "is" (w = ρ), "tis" (w = min(ρ, C)),
#   "tis2" (w = min(ρ_t, 2), Geo-RS's token TIS), "one" (w = 1); mask metric: None | "ratio_band" |
#   "ratio_upper" | "binary_kl" | "k2" | "k3" | "m2" (the bounds apply to it).
PRESETS: dict[str, tuple[str, str, str | None, float | None, float | None]] = {
    "cap": ("token", "is", "ratio_upper", None, 5.0),
    "none": ("token", "one", None, None, None),
    "token_tis": ("token", "tis", None, None, 2.0),
    "seq_tis": ("seq_prod", "tis", None, None, 2.0),
    "token_mis": ("token", "is", "ratio_band", 0.5, 2.0),
    "seq_mis": ("seq_prod", "is", "ratio_upper", None, 2.0),
    "icepop": ("token", "is", "ratio_band", 0.5, 5.0),
    "kpop": ("token", "is", "binary_kl", None, 2.0),
    "geo_rs": ("seq_geo", "tis2", "ratio_band", 0.999, 1.001),
    "k2_rs": ("token", "is", "k2", None, 2.0),
    "k3_rs": ("seq_k3", "is", "k3", None, 0.01),
    "m2po": ("token", "is", "m2", None, 0.04),
}
CORRECTIONS = tuple(PRESETS)


@dataclass
class Correction:
    """The result of :func:`behaviour_correction`.

    Attributes:
        weight: [B, T] float32, detached; 0 at masked and non-loss positions.
        keep: [B, T] bool: loss tokens not masked by the correction.
        stats: detached scalars: ``behav/masked_frac`` (masked loss tokens / loss tokens),
            ``behav/truncated_frac`` (weights cut to C / loss tokens), ``behav/weight_mean``,
            ``behav/weight_max``, ``behav/ess`` ((Σw)² / (N Σw²) over the loss tokens).
    """

    weight: torch.Tensor
    keep: torch.Tensor
    stats: dict[str, torch.Tensor]


def log_rho(prox_logp: torch.Tensor, behav_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log ρ = log π_prox − log μ [B, T] in fp32, detached: 0 at non-loss positions and where it
    is NaN (no information), clamped to ±:data:`LOG_RATIO_CLAMP` (so ±inf — a token μ gave
    probability 0 — becomes ±20: the most off-policy token, which bounded presets mask or
    truncate, as the ``cap`` default always did)."""
    x = prox_logp.detach().float() - behav_logp.detach().float()
    x = torch.where((loss_mask > 0) & ~torch.isnan(x), x, torch.zeros_like(x))
    return x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def binary_kl(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KL_b(p‖q) = p log(p/q) + (1−p) log((1−p)/(1−q)) of Bernoulli parameters (token
    probabilities) p, q [B, T], clamped to [eps, 1 − eps]. KPop (ringtech.notion.site/kpop)."""
    p, q = p.clamp(eps, 1 - eps), q.clamp(eps, 1 - eps)
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of ``x`` over ``mask`` [B, T] → [B, 1] (0 for an empty row)."""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def m2po_mask(m2: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """M2PO (arXiv 2510.01161): sort the loss tokens by M2 = (log ρ)² descending and mask the
    largest until the mean M2 of the rest is < ``tau``. Returns keep [B, T] bool (over the whole
    tensor: a micro-batch when called from a loss)."""
    flat = m2[mask]
    keep_flat = torch.ones_like(flat, dtype=torch.bool)
    if flat.numel() and float(flat.mean()) >= tau:
        order = torch.argsort(flat, descending=True)
        sorted_m2 = flat[order]
        # mean of the tokens after dropping the first k largest, for k = 0 .. n-1
        rest_sum = sorted_m2.sum() - torch.cumsum(sorted_m2, 0)
        rest_n = torch.arange(flat.numel() - 1, -1, -1, dtype=torch.float32)
        rest_mean = torch.where(rest_n > 0, rest_sum / rest_n.clamp(min=1), torch.zeros_like(rest_sum))
        k = int(torch.nonzero(rest_mean < tau)[0]) + 1 if bool((rest_mean < tau).any()) else flat.numel()
        keep_flat[order[:k]] = False
    keep = torch.zeros_like(mask)
    keep[mask] = keep_flat
    return keep


def behaviour_correction(prox_logp: torch.Tensor, behav_logp: torch.Tensor, loss_mask: torch.Tensor,
                         preset: str = "cap", lower: float | None = None, upper: float | None = None,
                         batch_norm: bool = False) -> Correction:
    """The correction weight and mask of ``preset`` (see the module table).

    Args:
        prox_logp: [B, T] log π_prox (the trainer's recomputation), any float dtype.
        behav_logp: [B, T] log μ (the inference engine's logprobs).
        loss_mask: [B, T] 0/1 (generated tokens).
        preset: one of :data:`CORRECTIONS`.
        lower, upper: bounds overriding the preset's (None = the preset's default; ``cap``
            with ``upper`` None has no cap: w = ρ).
        batch_norm: divide the kept weights by their mean (after truncation).

    Returns: a :class:`Correction`.

    Raises:
        ValueError: unknown ``preset`` (names ``algo.correction``).
    """
    if preset not in PRESETS:
        raise ValueError(f"algo.correction: unknown {preset!r}; choose one of {list(CORRECTIONS)}")
    level, rule, metric, lo_default, hi_default = PRESETS[preset]
    lo = lo_default if lower is None else lower
    hi = upper if upper is not None or preset == "cap" else hi_default
    mask = loss_mask > 0
    fmask = mask.float()
    lr = log_rho(prox_logp, behav_logp, loss_mask)
    rho = torch.exp(lr)  # 1 at non-loss positions
    if level in ("seq_prod", "seq_geo"):
        seq_log = (lr * fmask).sum(-1, keepdim=True)
        if level == "seq_geo":
            seq_log = seq_log / fmask.sum(-1, keepdim=True).clamp(min=1)
        seq = torch.exp(seq_log.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(rho)  # [B, T]
    else:
        seq = rho
    # The weight rule.
    truncated = torch.zeros_like(mask)
    if rule == "one":
        w = torch.ones_like(rho)
    elif rule == "is":
        w = seq if level in ("seq_prod",) else rho
    else:  # truncated IS
        cap = 2.0 if rule == "tis2" else hi
        base = seq if level == "seq_prod" else rho
        truncated = mask & (base > cap)
        w = base.clamp(max=cap)
    # The mask.
    keep = mask.clone()
    if metric == "ratio_upper" and hi is not None:
        keep &= ~(seq > hi)
    elif metric == "ratio_band":
        keep &= (seq >= lo) & (seq <= hi)
    elif metric == "binary_kl":
        p, q = torch.exp(prox_logp.detach().float().clamp(max=0)), torch.exp(behav_logp.detach().float().clamp(max=0))
        keep &= ~(torch.maximum(binary_kl(p, q), binary_kl(q, p)) > hi)
    elif metric == "k2":
        keep &= ~(0.5 * lr * lr > hi)
    elif metric == "k3":
        keep &= ~(_seq_mean(rho - lr - 1.0, fmask) > hi).expand_as(mask)
    elif metric == "m2":
        keep &= m2po_mask(lr * lr, mask, hi)
    w = torch.where(keep, w, torch.zeros_like(w))
    if batch_norm and bool(keep.any()):
        w = w / w[keep].mean()
    n = fmask.sum().clamp(min=1)
    wk = w[mask]
    stats = {
        "behav/masked_frac": (mask & ~keep).float().sum() / n,
        "behav/truncated_frac": (truncated & keep).float().sum() / n,
        "behav/weight_mean": wk.mean() if wk.numel() else torch.ones(()),
        "behav/weight_max": wk.max() if wk.numel() else torch.ones(()),
        "behav/ess": (wk.sum() ** 2 / (wk.numel() * (wk * wk).sum())) if wk.numel() and bool((wk > 0).any())
        else torch.zeros(()),
    }
    return Correction(w, keep, stats)


def mismatch_stats(prox_logp: torch.Tensor, behav_logp: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far μ is from π_prox over the loss tokens (detached scalars):

    * ``mismatch/kl_k1`` = mean(−log ρ), ``mismatch/kl_k2`` = mean(½ (log ρ)²),
      ``mismatch/kl_k3`` = mean(ρ − 1 − log ρ): estimates of KL(μ‖π_prox) from μ's samples
      (Schulman 2020; k3 ≥ 0, unbiased; computed in fp64 as expm1(log ρ) − log ρ, since at the
      numeric mismatch of one policy (|log ρ| ~ 1e-6) fp32 rounds it to 0);
    * ``mismatch/abs_log_rho_mean`` / ``mismatch/abs_log_rho_max``;
    * ``mismatch/binary_kl_mean``: mean max(KL_b(π_prox‖μ), KL_b(μ‖π_prox)) of the token
      probabilities (KPop's metric).
    """
    mask = loss_mask > 0
    lr = log_rho(prox_logp, behav_logp, loss_mask)[mask]
    if not lr.numel():
        return {}
    p = torch.exp(prox_logp.detach().float().clamp(max=0))[mask]
    q = torch.exp(behav_logp.detach().float().clamp(max=0))[mask]
    return {
        "mismatch/kl_k1": (-lr).mean(), "mismatch/kl_k2": (0.5 * lr * lr).mean(),
        "mismatch/kl_k3": (torch.expm1(lr.double()) - lr.double()).mean().float(),  # fp64: no cancellation at tiny log ρ
        "mismatch/abs_log_rho_mean": lr.abs().mean(), "mismatch/abs_log_rho_max": lr.abs().max(),
        "mismatch/binary_kl_mean": torch.maximum(binary_kl(p, q), binary_kl(q, p)).mean(),
    }
