"""GRPO: group-relative policy optimisation (DeepSeekMath, arXiv 2402.03300), in one file.

Objective per token of response i in a group of G responses to one prompt (token-level
aggregation as in DAPO, arXiv 2503.14476, Eq. 12; decoupled for stale data as in AReaL,
arXiv 2505.24298, Eq. 5)::

    r_i   = reward_i + overlong_penalty(|y_i|)              # DAPO Eq. 13; off by default (|y_i|: longest turn)
    A_i   = (r_i - mean_j r_j) / (std_j r_j + 1e-6)          # adv_norm_std=False: no division
            (A_i = 0 for the whole group when std_j r_j <= algo.adv_std_floor, default 1e-4)
    u_t   = π_θ(a_t|s_t) / π_prox(a_t|s_t)                  # π_prox: weights before this update
    w_t   = π_prox(a_t|s_t) / π_behav(a_t|s_t)              # π_behav: the sampling weights
    ℓ_t   = w_t · max(-A_i u_t, -A_i clip(u_t, 1-ε, 1+ε_high)) + β · k3(π_θ, π_ref)_t
            (with c_clip and A_i < 0: the PPO term is capped at -A_i · c_clip, dual clip)
    L     = Σ_{i,t} ℓ_t · mask_t / Σ_{i,t} mask_t              # loss_agg_mode="token-mean"

``loss_agg_mode`` picks the aggregation (see :func:`functional.agg_loss`):
``seq-mean-token-mean`` (original GRPO: mean over responses of per-response token means) or
``seq-mean-token-sum-norm`` (Dr.GRPO: Σ ℓ / (#responses · L_max), with ``adv_norm_std=False``
for the full Dr.GRPO recipe). Each mode has its matching engine weight, so micro-batching and
data parallelism never change the loss.

With ``use_decoupled_loss``, ``π_prox`` is the policy before this update: with one minibatch
it is the training forward's own detached logprobs (same weights, no extra pass); with several
minibatches it is recomputed by a forward pass before the first one. Without it,
``π_prox = π_behav`` and w = 1 (standard PPO/GRPO, clipping around the possibly stale
behaviour policy).

Dynamic sampling (DAPO §3.2, ``algo.dynamic_sampling``): :func:`should_accept` says whether
a group carries a learning signal; :class:`DynamicSampling` wraps a workflow so that the
executor drops the other groups (a workflow returning ``None`` rejects its episode), and
``prepare_batch`` keeps sampling until the batch is full of accepted groups (rejected ones are
counted in ``RolloutStat.rejected``).

Config: :class:`arealite.api.config.GRPOAlgoConfig`. RLOO, REINFORCE++ and GSPO subclass this
class and override :meth:`GRPO.compute_advantages` or :meth:`GRPO.log_ratio`.
"""

from __future__ import annotations

import torch

from arealite.algorithms import corrections as C
from arealite.algorithms import functional as F
from arealite.algorithms.cispo import CISPOSurrogate
from arealite.algorithms.dppo import DPPOKLSurrogate, DPPOTVSurrogate
from arealite.algorithms.gmpo import GMPOSurrogate
from arealite.algorithms.sapo import SAPOSurrogate
from arealite.api.algorithm import Algorithm
from arealite.api.cli import check_algorithm
from arealite.api.config import GRPOAlgoConfig
from arealite.api.engine import Batch, TrainEngine
from arealite.api.workflow import RolloutWorkflow


def should_accept(trajectory: dict[str, torch.Tensor], std_floor: float = F.STD_FLOOR) -> bool:
    """DAPO dynamic sampling filter (arXiv 2503.14476, Eq. 11): keep a group only if its
    ``rewards`` [G] are not all equal (0 < #correct < G). All-equal groups — including groups
    of size 1, groups equal up to float noise (std <= ``std_floor``, see
    :data:`functional.STD_FLOOR`) and groups with a non-finite reward — give zero advantage
    and only dilute the batch."""
    r = trajectory["rewards"].reshape(-1).double()
    if r.numel() < 2 or not bool(torch.isfinite(r).all()):
        return False
    return bool((r != r[0]).any() and r.std(unbiased=False) > std_floor)


class DynamicSampling(RolloutWorkflow):
    """Wrap ``inner`` so that episodes failing :func:`should_accept` are rejected (DAPO §3.2).

    The executor then keeps sampling prompts until ``prepare_batch`` has a full batch of
    accepted groups; the number of rejected groups is ``RolloutStat.rejected``.

    Raises (from :meth:`arun_episode`, counted as a failed episode by the executor, which stops
    the run after repeated failures instead of sampling forever): RuntimeError after
    ``max_consecutive_rejections`` rejected groups in a row — every group has all-equal
    rewards, i.e. the task is far too hard or too easy for the current policy.
    """

    def __init__(self, inner: RolloutWorkflow, max_consecutive_rejections: int = 256):
        self.inner, self.max_rejections, self.rejected_in_a_row = inner, max_consecutive_rejections, 0

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def arun_episode(self, engine, data):
        traj = await self.inner.arun_episode(engine, data)
        if traj is not None and should_accept(traj):
            self.rejected_in_a_row = 0
            return traj
        self.rejected_in_a_row += 1
        if self.rejected_in_a_row > self.max_rejections:
            raise RuntimeError(
                f"algo.dynamic_sampling: {self.rejected_in_a_row} groups in a row had all-equal rewards "
                "(no learning signal); the task is too hard or too easy for this model. "
                "Set --algo.dynamic_sampling False or change the data.")
        return None


class GRPO(Algorithm):
    """GRPO on a policy engine ``actor`` and an optional frozen reference ``ref`` (for KL).

    Batch layout (rows of one prompt consecutive): ``input_ids``, ``attention_mask``,
    ``loss_mask``, ``logprobs`` (behaviour), ``versions`` [B, T]; ``rewards`` [B], with
    B a multiple of ``group_size``.

    ``max_new_tokens`` (= gconfig.max_new_tokens, L_max) is needed only by
    ``loss_agg_mode="seq-mean-token-sum-norm"`` and by ``overlong_penalty``.
    """

    def __init__(self, config: GRPOAlgoConfig, actor: TrainEngine, group_size: int,
                 ref: TrainEngine | None = None, max_new_tokens: int | None = None):
        # The config's own rules (ranges, choices, group size, overlong window vs L_max) live in
        # arealite.api.cli (validate_config runs them before launch); only the engines are checked here.
        check_algorithm(config, group_size, max_new_tokens)
        if config.kl_coef > 0 and ref is None:
            raise ValueError("algo.kl_coef > 0 needs a reference model; pass ref= or set algo.kl_coef 0")
        self.config, self.actor, self.ref, self.group_size = config, actor, ref, group_size
        self.max_new_tokens = max_new_tokens
        self.kl_in_loss = config.kl_coef > 0  # REINFORCE++ may move the KL into the reward

    @classmethod
    def from_config(cls, config, actor: TrainEngine, ref: TrainEngine | None = None):
        """The builder the RL loop takes (:func:`arealite.trainer.rl_loop.run_rl`): ``cls`` (with
        the surrogate of ``config.algo.loss``, :func:`with_surrogate`) on ``config.algo`` with
        group size ``config.gconfig.n_samples`` and L_max ``config.gconfig.max_new_tokens``
        (GRPO, GSPO, RLOO, REINFORCE++)."""
        return with_surrogate(cls, config.algo.loss)(config.algo, actor, group_size=config.gconfig.n_samples, ref=ref,
                                                     max_new_tokens=config.gconfig.max_new_tokens)

    # -- the two places where the algorithms of this family differ -------------------------------
    def compute_advantages(self, batch: Batch, rewards: torch.Tensor) -> torch.Tensor:
        """Token advantages [B, T] float32 (0 on non-generated tokens) from the shaped
        ``rewards`` [B]. GRPO: the group-normalised reward on every generated token."""
        adv = F.group_normalize(rewards, self.group_size, self.config.adv_norm_std,
                                std_floor=self.config.adv_std_floor)  # [B]
        return adv[:, None] * batch["loss_mask"].float()  # [B, T]

    def log_ratio(self, logprobs: torch.Tensor, prox_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Per-token log(π_θ / π_prox) [B, T] fed to the clipped surrogate (token level)."""
        return logprobs - prox_logp

    # -- Algorithm -------------------------------------------------------------------------------
    def shaped_rewards(self, batch: Batch) -> torch.Tensor:
        """``rewards`` [B] plus the DAPO overlong penalty of the response length: the longest
        run of generated tokens of ``loss_mask`` (:func:`~arealite.algorithms.functional.turn_lengths`;
        correct even when pad == EOS and there is no EOS; a multi-turn episode's longest turn,
        since ``max_new_tokens`` is a per-turn budget)."""
        rewards = batch["rewards"].float()
        if self.config.overlong_penalty > 0:
            lengths = F.turn_lengths(batch["loss_mask"])  # [B]
            rewards = rewards + F.overlong_penalty(lengths, self.max_new_tokens, self.config.overlong_penalty,
                                                   self.config.overlong_penalty_factor)
        return rewards

    def prepare(self, batch: Batch) -> Batch:
        """Adds ``advantages`` [B, T], ``prox_logp`` [B, T] (unless the training forward provides
        it, see the module doc; the :meth:`inert_rows`, never trained, get the behaviour
        logprobs instead of a forward pass) and, with a reference model, ``ref_logp`` [B, T]."""
        if self.ref is not None:
            batch["ref_logp"] = self.ref.forward(batch)
        batch["advantages"] = self.compute_advantages(batch, self.shaped_rewards(batch))
        if self.config.n_minibatches > 1:
            rows = ~self.inert_rows(batch)
            batch["prox_logp"] = batch["logprobs"].float().clone()
            if bool(rows.any()):
                batch["prox_logp"][rows] = self.actor.forward({k: v[rows] for k, v in batch.items()})
        elif not self.config.use_decoupled_loss:
            batch["prox_logp"] = batch["logprobs"]
        # else: one minibatch — π_prox are the weights of this very update, so the training
        # forward's own (detached) logprobs are exactly π_prox: no extra forward pass needed.
        return batch

    def correction(self, prox_logp: torch.Tensor, mb: Batch) -> C.Correction:
        """The behaviour-policy correction of one micro-batch (``algo.correction``, default
        ``cap``: w = π_prox/π_behav, masked above ``behav_imp_weight_cap``), from
        :func:`arealite.algorithms.corrections.behaviour_correction`."""
        c = self.config
        upper = c.behav_imp_weight_cap if c.correction == "cap" else c.correction_upper
        return C.behaviour_correction(prox_logp, mb["logprobs"], mb["loss_mask"], c.correction,
                                      c.correction_lower, upper, c.correction_batch_norm)

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mb: Batch, corr: C.Correction,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss ℓ [B, T] (0 off ``corr.keep``) and its stats: the decoupled PPO
        clipped surrogate (:func:`~arealite.algorithms.functional.ppo_loss_per_token`). The
        surrogates of ``algo.loss`` (CISPO, SAPO, GMPO, DPPO: one file each) override it."""
        c = self.config
        return F.ppo_loss_per_token(log_ratio, mb["advantages"], corr.keep, corr.weight, c.eps_clip,
                                    c.eps_clip_high, c.c_clip)

    def loss_fn(self, logprobs: torch.Tensor, mb: Batch) -> torch.Tensor:
        """Policy loss of one micro-batch, the mean over :meth:`loss_weight_fn` (engine contract):
        correction weights (:meth:`correction`) → surrogate (:meth:`surrogate`) → aggregated
        over the *pre-mask* ``loss_mask`` (masked tokens count as zero-loss tokens, so the
        engine's combination over micro-batches and ranks stays exact and masking never
        up-weights the kept tokens) → + the KL term."""
        c = self.config
        mask = mb["loss_mask"]
        prox_logp = mb["prox_logp"] if "prox_logp" in mb else logprobs.detach()
        corr = self.correction(prox_logp, mb)
        loss_tok, stats = self.surrogate(logprobs, self.log_ratio(logprobs, prox_logp, mask), mb, corr)
        loss = F.agg_loss(loss_tok, mask, c.loss_agg_mode, self.max_new_tokens)
        if self.kl_in_loss:
            kl_tok = F.kl_estimate(logprobs, mb["ref_logp"], c.kl_estimator, mask)
            kl = F.agg_loss(kl_tok, mask, c.loss_agg_mode, self.max_new_tokens)
            loss = loss + c.kl_coef * kl
            stats["kl_ref"] = kl.detach()
        stats.update(self._behaviour_stats(logprobs, prox_logp, mb, corr))
        if "entropy" in mb:  # detached per-token entropy from the engine, when it provides one
            stats["entropy"] = F.masked_mean(mb["entropy"], mask)
        self._mb_stats.append({k: float(v) for k, v in stats.items()})
        return loss

    @staticmethod
    def _behaviour_stats(logprobs: torch.Tensor, prox_logp: torch.Tensor, mb: Batch,
                         corr: C.Correction) -> dict[str, torch.Tensor]:
        """The correction's and the mismatch's stats, plus ``importance_weight`` (mean w over the
        kept tokens) with ``_max``/``_min``, ``masked_by_cap`` (masked loss tokens, count) and
        ``approx_kl_behav`` (k1 of KL(π_behav‖π_θ) over the kept tokens)."""
        mask, keep, w = mb["loss_mask"] > 0, corr.keep, corr.weight
        with torch.no_grad():
            out = {**corr.stats, **C.mismatch_stats(prox_logp, mb["logprobs"], mb["loss_mask"]),
                   "masked_by_cap": (mask & ~keep).float().sum(),
                   "importance_weight": F.masked_mean(w, keep),
                   "importance_weight_max": w[keep].max() if keep.any() else torch.ones(()),
                   "importance_weight_min": w[keep].min() if keep.any() else torch.ones(()),
                   "approx_kl_behav": F.masked_mean(mb["logprobs"].float() - logprobs.detach().float(), keep)}
        return out

    def loss_weight_fn(self, mb: Batch) -> float:
        """The engine weight matching ``loss_agg_mode`` (token-mean: number of loss tokens)."""
        return F.agg_weight(mb["loss_mask"], self.config.loss_agg_mode)

    def inert_rows(self, mb: Batch) -> torch.Tensor:
        """[b] bool: the rows of ``mb`` whose policy loss is exactly 0 with a 0 gradient: every
        advantage on the row's loss tokens is 0 (all of a GRPO group with all-equal rewards),
        and each token's term of every surrogate of ``algo.loss`` is its advantage times a
        finite factor. None is inert with a KL term in the loss (``kl_coef > 0``) or with
        ``correction_batch_norm`` (its batch mean couples the rows)."""
        if self.kl_in_loss or self.config.correction_batch_norm:
            return torch.zeros(mb["loss_mask"].shape[0], dtype=torch.bool)
        return ((mb["advantages"] == 0) | (mb["loss_mask"] == 0)).all(1)

    def train_minibatch(self, mb: Batch) -> dict[str, float]:
        """One optimizer step of the policy on minibatch ``mb`` (PPO adds its critic here).

        The :meth:`inert_rows` get no forward or backward pass: their loss weight goes to the
        engine as ``skipped_weight``, so the step equals the step on all of ``mb`` (one row is
        kept when all are inert, so the optimizer still steps, as it would on zero gradients).
        The loss stats (``actor/*`` from :meth:`loss_fn`) are over the rows trained;
        ``rows_skipped`` counts the others."""
        inert = self.inert_rows(mb)
        if bool(inert.all()):
            inert[0] = False
        kept = {k: v[~inert] for k, v in mb.items()}
        skipped = float(self.loss_weight_fn({k: v[inert] for k, v in mb.items()})) if inert.any() else 0.0
        stats = self.actor.train_batch(kept, self.loss_fn, self.loss_weight_fn, skipped_weight=skipped)
        return {**stats, "rows_skipped": float(inert.sum())}

    def update(self, batch: Batch) -> dict[str, float]:
        """Prepare, then ``n_minibatches`` optimizer steps over whole groups of the batch.

        Returns the engine stats (``loss`` and ``grad_norm``: mean over the minibatches; ``lr``
        and counters: the last one's) plus ``actor/<stat>`` from the loss, combined over every
        micro-batch of every minibatch on this rank (``*_max``: max, ``*_min``: min, others:
        mean), and advantage statistics over the loss tokens."""
        batch = self.prepare(batch)
        n_groups = batch["rewards"].shape[0] // self.group_size
        splits = torch.arange(n_groups).chunk(self.config.n_minibatches)
        per_minibatch: list[dict[str, float]] = []
        self._mb_stats: list[dict[str, float]] = []
        for groups in splits:
            rows = (groups[:, None] * self.group_size + torch.arange(self.group_size)).view(-1)
            per_minibatch.append(self.train_minibatch({k: v[rows] for k, v in batch.items()}))
        stats = dict(per_minibatch[-1])
        for key in stats:
            if key.rsplit("/", 1)[-1] in ("loss", "grad_norm"):
                stats[key] = sum(s[key] for s in per_minibatch) / len(per_minibatch)
            elif key == "rows_skipped":
                stats[key] = sum(s[key] for s in per_minibatch)
        stats.update(combine_stats(self._mb_stats))
        adv = batch["advantages"][batch["loss_mask"].bool()]
        if adv.numel():
            stats.update({"actor/advantage_mean": float(adv.mean()), "actor/advantage_std": float(adv.std(unbiased=False)),
                          "actor/advantage_max": float(adv.max()), "actor/advantage_min": float(adv.min()),
                          "actor/advantage_abs_mean": float(adv.abs().mean())})
        return stats


SURROGATE_MIXINS = {"cispo": CISPOSurrogate, "sapo": SAPOSurrogate, "gmpo": GMPOSurrogate,
                    "dppo_tv": DPPOTVSurrogate, "dppo_kl": DPPOKLSurrogate}


def with_surrogate(cls: type, loss: str) -> type:
    """``cls`` (GRPO or a subclass: GSPO, RLOO, REINFORCE++, PPO) with its :meth:`GRPO.surrogate`
    replaced by ``algo.loss``'s (one file each: cispo.py, sapo.py, gmpo.py, dppo.py); ``cls``
    itself for ``ppo``.

    Raises: ValueError: unknown ``loss`` (names ``algo.loss``)."""
    if loss == "ppo":
        return cls
    if loss not in SURROGATE_MIXINS:
        raise ValueError(f"algo.loss: unknown {loss!r}; choose one of {['ppo', *SURROGATE_MIXINS]}")
    mixin = SURROGATE_MIXINS[loss]
    return type(f"{cls.__name__}[{loss}]", (mixin, cls), {"__doc__": f"{cls.__name__} with the {loss} surrogate."})


def combine_stats(per_mb: list[dict[str, float]], prefix: str = "actor/") -> dict[str, float]:
    """Combine per-micro-batch loss stats: keys ending in ``_max`` by max, ``_min`` by min,
    the rest by their mean; each key is prefixed with ``prefix``."""
    out = {}
    for key in per_mb[0] if per_mb else []:
        vals = [s[key] for s in per_mb if key in s]
        fn = max if key.endswith("_max") else min if key.endswith("_min") else (lambda v: sum(v) / len(v))
        out[prefix + key] = float(fn(vals))
    return out
