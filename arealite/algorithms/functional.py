"""Shared RL math. Every tensor is token-aligned (see :mod:`arealite.api.io_struct`):
index t of a [B, T] tensor describes token ``input_ids[:, t]``; ``loss_mask`` [B, T] is 1 on
generated tokens. Nothing here touches an engine: inputs are plain tensors.

Masking rule, everywhere: a masked position contributes exactly 0 to every value AND to every
gradient, whatever its logprobs hold (-inf, 1e30, NaN from an unused LM-head slot). Inputs are
replaced by 0 with ``torch.where`` *before* any exp/product, never multiplied by a 0 mask
(``0 · inf = nan``, and the backward of ``x · 0`` is ``0 · dx``, which is also nan).

Formulas and sources:
* PPO clipped surrogate: Schulman et al. 2017, arXiv 1707.06347, Eq. 7; asymmetric bounds
  (clip-higher): DAPO, arXiv 2503.14476, Eq. 10; dual clip: Ye et al. 2020, arXiv 1912.09729, Eq. 5.
* Decoupled PPO objective (behaviour vs proximal policy): AReaL, arXiv 2505.24298, Eq. 5.
* GRPO group-normalised advantage: DeepSeekMath, arXiv 2402.03300, §4.1.2 (outcome supervision);
  mean-only variant: Dr.GRPO, arXiv 2503.20783, §3.2.
* Leave-one-out baseline: RLOO, Ahmadian et al. 2024, arXiv 2402.14740, Eq. 7 (§3.2).
* REINFORCE++ global advantage normalisation: Hu 2025, arXiv 2501.03262, §3.
* GSPO sequence-level ratio: arXiv 2507.18071, Eq. 7 and the GSPO-token form, Eq. 13.
* Loss aggregation: DAPO token-level loss, arXiv 2503.14476, Eq. 12 (``token-mean``);
  GRPO per-sequence mean, arXiv 2402.03300, Eq. 3 (``seq-mean-token-mean``);
  Dr.GRPO constant normaliser, arXiv 2503.20783, Eq. 3 (``seq-mean-token-sum-norm``).
* KL estimators k1, k2, k3: J. Schulman, "Approximating KL divergence" (2020).
* Soft overlong punishment: DAPO, arXiv 2503.14476, Eq. 13.
* GAE: Schulman et al. 2016, arXiv 1506.02438, Eq. 16; clipped value loss: PPO2 (OpenAI
  baselines), Andrychowicz et al. 2020, arXiv 2006.05990, §3.5.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from arealite.api.config import KL_ESTIMATORS, LOSS_AGG_MODES  # noqa: F401 (defined with the config fields)


def _zero_where_masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` where ``keep`` is true, exactly 0 elsewhere (value and gradient)."""
    return torch.where(keep, x, torch.zeros_like(x))


# --------------------------------------------------------------------------------------------
# Log-probabilities and masked reductions
# --------------------------------------------------------------------------------------------
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

    Shapes: ``x`` and ``mask`` broadcastable; returns a scalar tensor. Masked entries of ``x``
    may be inf/nan: they are never read.
    """
    keep = mask > 0
    return _zero_where_masked(x, keep).sum() / keep.sum().clamp(min=1).to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, all_ranks: bool = True) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with mean and (biased) std over every masked token of the
    batch — of all data-parallel ranks when ``torch.distributed`` is initialised and
    ``all_ranks`` (REINFORCE++ global batch normalisation, arXiv 2501.03262, §3).

    Args:
        x: [B, T] float (e.g. per-token returns); mask: [B, T] 0/1.

    Returns:
        [B, T] float32, 0 at masked positions. If every masked value is equal (std = 0) the
        result is exactly 0 there (never NaN, never a blown-up rounding residue).
    """
    keep = mask > 0
    x = _zero_where_masked(x.float(), keep)
    total = torch.stack([x.sum(), keep.sum().float()])  # [Σx, n]
    hi = torch.where(keep, x, torch.full_like(x, -float("inf"))).amax()
    lo = torch.where(keep, x, torch.full_like(x, float("inf"))).amin()
    distributed = all_ranks and dist.is_available() and dist.is_initialized()
    if distributed:
        dist.all_reduce(total)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    n = total[1].clamp(min=1.0)
    centred = _zero_where_masked(x - total[0] / n, keep)
    sq = (centred**2).sum()
    if distributed:
        dist.all_reduce(sq)
    if not bool(hi > lo):  # all equal (or empty): x - mean is a rounding residue, eps would blow it up
        return torch.zeros_like(x)
    return centred / ((sq / n).sqrt() + eps)


# --------------------------------------------------------------------------------------------
# Loss aggregation (the engine combines micro-batches as Σ loss_mb · w_mb / Σ_global w_mb)
# --------------------------------------------------------------------------------------------
def agg_loss(
    loss: torch.Tensor, loss_mask: torch.Tensor, mode: str = "token-mean", max_len: int | None = None
) -> torch.Tensor:
    """Aggregate a per-token loss ℓ [B, T] into the scalar mean over its own weight
    :func:`agg_weight` (the :meth:`TrainEngine.train_batch` contract).

    Modes (m = loss_mask, L_i = Σ_t m_{i,t}, B = rows):

    * ``token-mean`` (DAPO Eq. 12): ``Σ_{i,t} ℓ m / Σ_{i,t} m``; weight = Σ m (loss tokens).
    * ``seq-mean-token-mean`` (GRPO Eq. 3): ``mean over rows with L_i > 0 of Σ_t ℓ m / L_i``;
      weight = number of rows with L_i > 0.
    * ``seq-mean-token-sum-norm`` (Dr.GRPO Eq. 3): ``Σ_{i,t} ℓ m / (B · max_len)`` with a
      constant ``max_len`` = L_max = gconfig.max_new_tokens; weight = B. Every token has the
      same weight 1/(B·L_max), whatever the length of its response.

    With these weights, ``Σ_mb agg_loss(mb) · agg_weight(mb) / Σ_mb agg_weight(mb)`` equals
    ``agg_loss`` of the concatenated batch exactly, for every mode and every row split.

    Args:
        loss: [B, T] float per-token loss (masked entries may be anything, even inf/nan).
        loss_mask: [B, T] 0/1.
        mode: one of :data:`LOSS_AGG_MODES`.
        max_len: L_max for ``seq-mean-token-sum-norm`` (required there).

    Returns: scalar tensor (0 for an empty mask).
    """
    keep = loss_mask > 0
    total = _zero_where_masked(loss, keep)
    if mode == "token-mean":
        return total.sum() / keep.sum().clamp(min=1).to(total.dtype)
    if mode == "seq-mean-token-mean":
        n_tok = keep.sum(-1)  # [B]
        per_seq = total.sum(-1) / n_tok.clamp(min=1).to(total.dtype)  # [B]
        return per_seq.sum() / (n_tok > 0).sum().clamp(min=1).to(total.dtype)
    if mode == "seq-mean-token-sum-norm":
        if not max_len or max_len <= 0:
            raise ValueError("loss_agg_mode=seq-mean-token-sum-norm needs max_len = L_max > 0 "
                             "(pass max_new_tokens=config.gconfig.max_new_tokens to the algorithm)")
        return total.sum() / (loss_mask.shape[0] * float(max_len))
    raise ValueError(f"algo.loss_agg_mode: unknown mode {mode!r}; choose one of {LOSS_AGG_MODES}")


def agg_weight(loss_mask: torch.Tensor, mode: str = "token-mean") -> float:
    """The engine weight of one micro-batch matching :func:`agg_loss` (see there).

    Args: loss_mask [b, T] 0/1. Returns: float ≥ 0.
    """
    keep = loss_mask > 0
    if mode == "token-mean":
        return float(keep.sum())
    if mode == "seq-mean-token-mean":
        return float(keep.any(-1).sum())
    if mode == "seq-mean-token-sum-norm":
        return float(loss_mask.shape[0])
    raise ValueError(f"algo.loss_agg_mode: unknown mode {mode!r}; choose one of {LOSS_AGG_MODES}")


# --------------------------------------------------------------------------------------------
# Rewards → advantages
# --------------------------------------------------------------------------------------------
def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] rewards → [N / G, G] float32, checking that N is a multiple of G."""
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size: {rewards.numel()} rewards cannot be split into groups of {group_size}; "
            "batch rows must be whole groups of gconfig.n_samples"
        )
    return rewards.float().view(-1, group_size)


# Groups whose population std of rewards is at most this are treated as zero-variance: every
# advantage of the group is exactly 0. Rewards that differ only by float noise (e.g. 1e-7 after
# reward shaping or a float32 round trip) otherwise get multiplied by 1/std ≈ 1e6 and their noise
# becomes a full-size advantage. 1e-4 is far below any meaningful reward gap on the usual 0/1 or
# [0, 1] scales; pass ``std_floor`` (``algo.adv_std_floor``) for rewards on other scales.
STD_FLOOR = 1e-4


def _zero_flat_groups(adv: torch.Tensor, r: torch.Tensor, std_floor: float = STD_FLOOR) -> torch.Tensor:
    """Exact 0 for every group without a learning signal: population std of its rewards (in
    float64) ``<= std_floor`` — all-equal groups included — or any non-finite reward (such a group
    is dropped from learning; the other groups of the batch are unaffected). Without it,
    ``0.7 - mean(0.7 × 8)`` is a float32 residue of 6e-8 that the std division turns into 0.06."""
    finite = torch.isfinite(r).all(dim=1, keepdim=True)  # [N/G, 1]
    r64 = torch.where(finite, r.double(), torch.zeros_like(r, dtype=torch.float64))
    flat = (r64 == r64[:, :1]).all(dim=1, keepdim=True) | (r64.std(dim=1, unbiased=False, keepdim=True) <= std_floor)
    return torch.where(flat | ~finite, torch.zeros_like(adv), adv)


def group_normalize(rewards: torch.Tensor, group_size: int, use_std: bool = True, eps: float = 1e-6,
                    std_floor: float = STD_FLOOR) -> torch.Tensor:
    """GRPO advantages: ``(r - mean_group(r)) / (std_group(r) + eps)`` (std: unbiased=False).

    Args:
        rewards: [N] float, consecutive rows of ``group_size`` are one group (one prompt).
        group_size: G, must divide N. G = 1 gives 0 advantages.
        use_std: False gives Dr.GRPO's mean-only centring (arXiv 2503.20783, §3.2).
        eps: added to the std before dividing.
        std_floor: groups with std ``<= std_floor`` count as zero-variance (see :data:`STD_FLOOR`).

    Returns:
        [N] float32, always finite. A group whose rewards have std ``<= std_floor`` (all equal,
        or equal up to float noise) gets exactly 0, and so does a group containing a NaN/inf
        reward (the reward worker already turns those into 0; this guards custom workflows).

    Raises:
        ValueError: N is not a multiple of ``group_size``, or ``std_floor < 0``.
    """
    if not std_floor >= 0:
        raise ValueError(f"algo.adv_std_floor must be >= 0, got {std_floor!r}")
    r = _groups(rewards, group_size)
    safe = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    adv = safe - safe.mean(dim=1, keepdim=True)
    if use_std:
        adv = adv / (safe.std(dim=1, unbiased=False, keepdim=True) + eps)
    return _zero_flat_groups(adv, r, std_floor).view(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO leave-one-out advantages (Ahmadian et al. 2024, arXiv 2402.14740, Eq. 7)::

        A_i = r_i - 1/(G-1) Σ_{j≠i} r_j  =  G/(G-1) · (r_i - mean_j r_j)

    Args: rewards [N] float (consecutive groups of G); group_size G ≥ 2.
    Returns: [N] float32; exactly 0 for all-equal groups.
    Raises: ValueError when G < 2 (no other sample to form the baseline) or G ∤ N.
    """
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: RLOO's leave-one-out baseline needs at least 2 samples "
                         "per prompt; set gconfig.n_samples >= 2")
    r = _groups(rewards, group_size)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return _zero_flat_groups(r - baseline, r).view(-1)


def last_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence reward on its last generated token (outcome reward as a token
    reward, REINFORCE++ Eq. 2). rewards [B] float, loss_mask [B, T] → [B, T] float32 (rows
    without loss tokens are all 0)."""
    keep = loss_mask > 0
    T = keep.shape[1]
    last = (T - 1) - keep.flip(-1).int().argmax(-1)  # [B] index of the last loss token
    out = torch.zeros(keep.shape, dtype=torch.float32, device=rewards.device)
    out[torch.arange(keep.shape[0]), last] = rewards.float()
    return _zero_where_masked(out, keep)


def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go over generated tokens: ``G_t = r_t + γ G_{t'}`` where t' is the next
    generated token (non-generated tokens in between, e.g. tool outputs, are skipped and not
    discounted).

    Args: token_rewards [B, T] float; loss_mask [B, T] 0/1; gamma γ ∈ [0, 1].
    Returns: [B, T] float32, 0 at masked positions.
    """
    keep = loss_mask > 0
    r = _zero_where_masked(token_rewards.float(), keep)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(keep[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return _zero_where_masked(out, keep)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor,
        gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438, Eqs. 11–16)
    over the generated tokens of each row::

        δ_t = r_t + γ V_{t'} - V_t          t' = the next generated token (V = 0 after the last)
        A_t = δ_t + γ λ A_{t'}
        R_t = A_t + V_t                     (value targets, "returns")

    Values are token-aligned like logprobs: ``values[:, t]`` is V of the state *before* token t
    is generated. Non-generated tokens between two generated ones (tool or environment output)
    are skipped, not discounted: the state before the next generated token already contains them.

    Args:
        token_rewards: [B, T] float (e.g. :func:`last_token_rewards` minus a KL penalty).
        values: [B, T] float, critic values V_t (no grad).
        loss_mask: [B, T] 0/1, generated tokens.
        gamma: discount γ ∈ [0, 1]; lam: GAE λ ∈ [0, 1] (λ = 1: Monte-Carlo return minus V).

    Returns:
        (advantages [B, T] float32, returns [B, T] float32), both exactly 0 at masked positions.

    Raises:
        ValueError: γ or λ outside [0, 1].
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"algo.gamma={gamma} and algo.lam={lam} must be in [0, 1]")
    keep = loss_mask > 0
    r = _zero_where_masked(token_rewards.float(), keep)
    v = _zero_where_masked(values.float(), keep)
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        k = keep[:, t]
        a_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        adv[:, t] = torch.where(k, a_t, torch.zeros_like(a_t))
        next_adv = torch.where(k, a_t, next_adv)
        next_value = torch.where(k, v[:, t], next_value)
    return adv, _zero_where_masked(adv + v, keep)


def value_loss_per_token(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                         loss_mask: torch.Tensor, value_eps_clip: float | None = 0.2
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 as in OpenAI baselines and Ouyang et al. 2022; the value
    clipping of Andrychowicz et al. 2020, arXiv 2006.05990, §3.5)::

        V^clip_t = V_old,t + clip(V_t - V_old,t, -ε_v, ε_v)
        ℓ_t      = ½ max((V_t - R_t)², (V^clip_t - R_t)²)        (ε_v = None: ½ (V_t - R_t)²)

    Args:
        values: [B, T] float32 current critic values, with grad.
        old_values: [B, T] values before this update (no grad); returns: [B, T] targets R_t.
        loss_mask: [B, T] 0/1. value_eps_clip: ε_v > 0 or None.

    Returns:
        (ℓ [B, T] float32, exactly 0 at masked positions, value and gradient; stats dict of
        detached scalars ``value_clip_frac`` (share of tokens where the clipped term is the
        larger one) and ``value_mean``).
    """
    keep = loss_mask > 0
    v = _zero_where_masked(values, keep)
    old = _zero_where_masked(old_values.float(), keep)
    ret = _zero_where_masked(returns.float(), keep)
    err = (v - ret) ** 2
    if value_eps_clip is None:
        loss, clipped_frac = 0.5 * err, torch.zeros(())
    else:
        if value_eps_clip <= 0:
            raise ValueError(f"algo.value_eps_clip must be > 0 (or None to disable), got {value_eps_clip}")
        v_clip = old + (v - old).clamp(-value_eps_clip, value_eps_clip)
        err_clip = (v_clip - ret) ** 2
        loss = 0.5 * torch.maximum(err, err_clip)
        clipped_frac = masked_mean((err_clip > err).float(), keep)
    with torch.no_grad():
        stats = {"value_clip_frac": clipped_frac, "value_mean": masked_mean(v.detach(), keep)}
    return _zero_where_masked(loss, keep), stats


def turn_lengths(loss_mask: torch.Tensor) -> torch.Tensor:
    """The longest run of consecutive generated tokens of each row: the length of its longest
    model turn (each turn of a multi-turn episode has its own ``max_new_tokens`` budget; tool
    output and the next prompt between turns are masked out). For a single-turn row it is the
    response length ``loss_mask.sum(-1)``, correct even when the pad id equals the EOS id and the
    response was truncated (no EOS), where scanning ids cannot tell.

    Args: loss_mask [B, T] 0/1 (any dtype). Returns: [B] int64.
    """
    m = loss_mask > 0
    count = m.long().cumsum(-1)  # [B, T] generated tokens up to t
    # Count at the last masked-out position before t: a run's length is count - that.
    before = torch.where(m, torch.zeros_like(count), count).cummax(-1).values
    run = count - before
    return run.max(-1).values if run.shape[-1] else torch.zeros(run.shape[0], dtype=torch.long)


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, Eq. 13), times ``factor``::

        R(|y|) = 0                               if |y| ≤ L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| ≤ L_max
               = -1                              if |y| > L_max

    Take ``lengths = turn_lengths(loss_mask)``: the response length of a single-turn row (even
    when the pad id equals the EOS id and the response was truncated), the longest turn's of a
    multi-turn episode, whose budget L_max is per turn.

    Args: lengths [B] int/float; max_len L_max (gconfig.max_new_tokens); cache_len L_cache in
    (0, L_max]. Returns: [B] float32 ≤ 0, added to the reward.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"algo.overlong_penalty: L_cache={cache_len} must be in (0, L_max={max_len}]")
    n = lengths.float()
    start = float(max_len - cache_len)
    pen = torch.where(n <= start, torch.zeros_like(n), (start - n) / cache_len)
    return torch.where(n > max_len, torch.full_like(n, -1.0), pen) * factor


# --------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------
def kl_estimate(
    logprobs: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3",
    loss_mask: torch.Tensor | None = None, clamp: float = 20.0,
) -> torch.Tensor:
    """Per-token estimators of KL(π_θ || π_ref) from samples of π_θ (Schulman 2020), with
    ``x = clamp(log π_θ - log π_ref, -clamp, clamp)``::

        k1 = x              (unbiased, can be negative; the usual reward penalty)
        k2 = x² / 2          (biased, low variance; its gradient is the KL gradient)
        k3 = exp(-x) - 1 + x (unbiased, ≥ 0; GRPO Eq. 4 loss term)

    The clamp keeps value and gradient finite at any log-ratio (the gradient is 0 beyond it).
    Use it as a loss term (with grad) or, detached, as a per-token reward penalty.

    Args:
        logprobs, ref_logp: [B, T] float32. loss_mask: optional [B, T]; masked positions are
        exactly 0 (value and gradient). Returns: [B, T] float32.
    """
    x = logprobs - ref_logp
    if loss_mask is not None:
        x = _zero_where_masked(x, loss_mask > 0)
    x = x.clamp(-clamp, clamp)
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        y = -x  # log π_ref/π_θ; written as exp(y) - y - 1 (same rounding as before)
        return torch.exp(y) - y - 1.0
    raise ValueError(f"algo.kl_estimator: unknown {kind!r}; choose one of {KL_ESTIMATORS}")


# --------------------------------------------------------------------------------------------
# Policy losses
# --------------------------------------------------------------------------------------------
def sequence_log_ratio(logprobs: torch.Tensor, prox_logp: torch.Tensor, loss_mask: torch.Tensor,
                       max_log_ratio: float = 10.0) -> torch.Tensor:
    """GSPO-token log-ratio (arXiv 2507.18071, Eqs. 7 and 13), per token::

        log s_i     = 1/|y_i| Σ_t (log π_θ(y_{i,t}) - log π_old(y_{i,t}))     # sequence ratio
        log s_{i,t} = sg[log s_i] + log π_θ(y_{i,t}) - sg[log π_θ(y_{i,t})]

    The value of ``exp(log s_{i,t})`` is s_i for every token of row i, and its gradient with
    respect to ``log π_θ(y_{i,t})`` is s_i (per token). ``sg[log s_i]`` is capped at
    ``max_log_ratio`` (verl) so one bad sequence cannot overflow exp.

    Args: logprobs [B, T] float32 with grad; prox_logp [B, T] (π_old); loss_mask [B, T].
    Returns: [B, T] float32, 0 at masked positions.
    """
    keep = loss_mask > 0
    lp = _zero_where_masked(logprobs, keep)
    per_tok = lp.detach() - _zero_where_masked(prox_logp, keep)
    seq = per_tok.sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    return _zero_where_masked(seq.clamp(max=max_log_ratio) + lp - lp.detach(), keep)


def ppo_loss_per_token(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    behav_weight: torch.Tensor | None = None,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    c_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token decoupled PPO clipped surrogate (AReaL arXiv 2505.24298 Eq. 5, DAPO clip-higher,
    dual clip).

    With ``r = exp(log_ratio)`` (π_θ/π_prox; GSPO passes :func:`sequence_log_ratio`) and the
    behaviour-correction weight ``w`` (:func:`arealite.algorithms.corrections.behaviour_correction`,
    e.g. ρ = π_prox/π_behav, 0 where the correction masks a token)::

        ℓ_t = w · max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))
        ℓ_t = w · min(ℓ_t / w, -A · c_clip)      if c_clip and A < 0   (dual clip, Ye et al.
                                                   2020, arXiv 1912.09729, Eq. 5; c_clip > 1)

    Args:
        log_ratio: [B, T] float32 log π_θ - log π_prox, with grad.
        advantages: [B, T] float32, no grad.
        loss_mask: [B, T] 0/1: the tokens that carry a loss (generated and kept by the correction).
        behav_weight: [B, T] float32 detached, or None (= 1).

    Returns:
        (ℓ [B, T] float32, exactly 0 where ``loss_mask`` is 0 (value and gradient); stats dict of
        detached scalars over the loss tokens: ``clip_frac``, ``dual_clip_frac``, ``approx_kl``
        (mean -log_ratio: k1 of KL(π_prox‖π_θ))). Aggregate ℓ over the *pre-mask* loss mask
        (:func:`agg_loss`): masked tokens then count as zero-loss tokens.

    Raises:
        ValueError: ``c_clip`` ≤ 1.
    """
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"algo.c_clip must be > 1 (dual-clip bound), got {c_clip}; None disables it")
    kept = loss_mask > 0
    high = eps_clip if eps_clip_high is None else eps_clip_high
    # Sanitise every input first: nothing from a dropped position reaches exp or a product.
    log_ratio = _zero_where_masked(log_ratio, kept)
    adv = _zero_where_masked(advantages, kept)
    w = torch.ones_like(adv) if behav_weight is None else torch.where(kept, behav_weight, torch.ones_like(adv))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    dual = torch.zeros_like(kept)
    if c_clip is not None:
        dual = (adv < 0) & (pg > -adv * c_clip)
        pg = torch.where(dual, -adv * c_clip, pg)  # constant: zero gradient
    loss = _zero_where_masked(pg * w, kept)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean(((-adv * clipped) > (-adv * ratio)).float(), kept),
            "dual_clip_frac": masked_mean(dual.float(), kept),
            "approx_kl": masked_mean(-log_ratio, kept),
        }
    return loss, stats
