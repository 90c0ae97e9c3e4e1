"""Shared RL math. Every tensor is token-aligned (see :mod:`arealite.api.io_struct`):
index t of a [B, T] tensor describes token ``input_ids[:, t]``.

Formulas and sources:
* PPO clipped surrogate: Schulman et al. 2017, arXiv 1707.06347, Eq. 7; asymmetric bounds
  (clip-higher): DAPO, arXiv 2503.14476, Eq. 10.
* Decoupled PPO objective (behaviour vs proximal policy): AReaL, arXiv 2505.24298, Eq. 5.
* GRPO group-normalised advantage: DeepSeekMath, arXiv 2402.03300, §4.1.2 (outcome supervision);
  mean-only variant: Dr.GRPO, arXiv 2503.20783, §3.2.
* k3 KL estimator: J. Schulman, "Approximating KL divergence" (2020); as a loss term: GRPO Eq. 4.
"""

from __future__ import annotations

import torch


def gather_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Token-aligned log-probabilities of ``input_ids`` under ``softmax(logits / temperature)``.

    Args:
        logits: [B, K, V] logits of the LAST K positions (K ≤ T; K = T for a full forward,
            smaller with HF ``logits_to_keep=K``), any float dtype (computed in float32).
            ``logits[:, j]`` is at position ``T - K + j`` and predicts the token after it.
        input_ids: [B, T] int64.
        temperature: the sampling temperature (0 or 1 means no scaling, matching the greedy
            convention of SGLang and our server).

    Returns:
        [B, T] float32 where ``out[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` for
        ``t ≥ T - K + 1`` and 0 for earlier positions (always ``out[:, 0] = 0``).
    """
    T, K = input_ids.shape[1], logits.shape[1]
    logits = logits[:, :-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    labels = input_ids[:, T - K + 1 :]
    # log p(label) = logit[label] - logsumexp(logits): never materialises a second [B, K, V].
    lp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return torch.nn.functional.pad(lp, (T - K + 1, 0), value=0.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is non-zero (0 when the mask is empty).

    Shapes: ``x`` and ``mask`` broadcastable; returns a scalar tensor.
    """
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def group_normalize(rewards: torch.Tensor, group_size: int, use_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: ``(r - mean_group(r)) / (std_group(r) + eps)`` (std: unbiased=False).

    Args:
        rewards: [N] float, consecutive rows of ``group_size`` are one group (one prompt).
        group_size: G, must divide N.
        use_std: False gives Dr.GRPO's mean-only centring.

    Returns:
        [N] float32. A group whose rewards are all equal gets exactly 0 (never NaN).

    Raises:
        ValueError: N is not a multiple of ``group_size``.
    """
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size: {rewards.numel()} rewards cannot be split into groups of {group_size}; "
            "batch rows must be whole groups of gconfig.n_samples"
        )
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if use_std:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.view(-1)


def ppo_actor_loss(
    logprobs: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_imp_weight_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO clipped surrogate, token-mean over ``loss_mask`` (AReaL Eq. 5).

    Per token, with ``r = exp(logprobs - prox_logp)`` and ``w = exp(prox_logp - behav_logp)``::

        ℓ_t = w · max(-A_t · r, -A_t · clip(r, 1 - eps_clip, 1 + eps_clip_high))

    Tokens with ``w > behav_imp_weight_cap`` are masked out (AReaL-lite). When
    ``prox_logp is behav_logp`` (on-policy / no recompute) ``w = 1`` and this is standard PPO.

    Args:
        logprobs: [B, T] float32 current policy, with grad.
        prox_logp, behav_logp, advantages: [B, T] float32, no grad.
        loss_mask: [B, T] 0/1.

    Returns:
        (scalar loss = Σ ℓ_t · mask / Σ mask, stats dict of detached scalars: ``clip_frac``,
        ``importance_weight`` (mean w), ``approx_kl`` (mean prox - logprobs), ``masked_by_cap``).
    """
    mask = loss_mask.float()
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logprobs - prox_logp)
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg_loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    behav_w = torch.exp(prox_logp - behav_logp)
    masked_by_cap = torch.zeros_like(mask)
    if behav_imp_weight_cap is not None:
        masked_by_cap = (behav_w > behav_imp_weight_cap).float() * mask
        mask = mask * (1.0 - masked_by_cap)
    # Masked positions must contribute exactly zero (and zero gradient), even if w is inf there.
    pg_loss = torch.where(mask > 0, pg_loss * behav_w, torch.zeros_like(pg_loss))
    loss = pg_loss.sum() / mask.sum().clamp(min=1.0)
    with torch.no_grad():
        clip_frac = masked_mean(((-advantages * clipped) > (-advantages * ratio)).float(), mask)
        stats = {
            "clip_frac": clip_frac,
            "importance_weight": masked_mean(behav_w, mask),
            "approx_kl": masked_mean(prox_logp - logprobs, mask),
            "masked_by_cap": masked_by_cap.sum(),
        }
    return loss, stats


def kl_k3(logprobs: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π_θ || π_ref): ``exp(ref - logp) - (ref - logp) - 1`` ≥ 0.

    The log-ratio is clamped to [-20, 20] so extreme values stay finite. Shapes: [B, T] → [B, T].
    """
    log_ratio = (ref_logp - logprobs).clamp(-20.0, 20.0)
    return torch.exp(log_ratio) - log_ratio - 1.0
