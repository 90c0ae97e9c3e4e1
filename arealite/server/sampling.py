"""Token sampling for the server's decode step: one token per row from the next-token logits,
with temperature, top-k and top-p (nucleus) per row, and the logprob the trainer recomputes.
"""

from __future__ import annotations

import torch


def sample_next_tokens(logits, temperature, top_p, top_k, generator):
    """Pick one token per row; return ``(tokens [B] long, logprobs [B] float32)``.

    ``logits`` is ``[B, V]``; ``temperature``/``top_p`` are float ``[B]``, ``top_k`` long ``[B]``.
    Rows with temperature 0 are greedy (argmax, logprob from ``log_softmax(logits)``).  Other
    rows sample from ``softmax(logits / T)`` filtered by top-k then top-p (nucleus: smallest
    set with cumulative probability >= top_p, top token always kept).  As in SGLang, the
    returned logprob is ``log_softmax(logits / T)[token]``: after temperature, before the
    top-k/top-p filtering, which is what the trainer recomputes.
    """
    greedy = temperature == 0
    # one pass from the model's dtype to fp32 logits / T (float32 temperatures promote)
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).float()[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    vocab = logits.shape[-1]
    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    plain_mask = ~greedy & ~filtered
    if bool(plain_mask.all()):  # the usual RL batch: every row samples the tempered softmax
        tokens = _sample_rows(torch.exp(logprobs_all, out=scaled), generator)  # scaled's memory again
        return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    tokens = logits.argmax(dim=-1)
    plain = plain_mask.nonzero().squeeze(1)
    if plain.numel():  # no top-k/top-p: sample the tempered softmax directly (no sort)
        tokens[plain] = _sample_rows(logprobs_all[plain].exp(), generator)
    rows = (~greedy & filtered).nonzero().squeeze(1)
    if rows.numel():
        probs = logprobs_all[rows].exp()
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        k = top_k[rows]
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        drop = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop |= mass_before >= top_p[rows][:, None]
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        choice = _sample_rows(sorted_p, generator)
        tokens[rows] = sorted_idx.gather(1, choice[:, None]).squeeze(1)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _last_with_weight(w):
    """Per row of ``w`` ``[B, n]``, the last index whose weight is positive."""
    return w.shape[1] - 1 - (w.flip(-1) > 0).int().argmax(dim=-1)


def _sample_rows(weights, generator):
    """One index per row of ``weights`` ``[B, V]`` (non-negative, unnormalised, float), drawn with
    probability proportional to the weight by inverse-CDF sampling in two levels: ``u ~ U[0, 1)``
    times the row's total picks a block of ``BLOCK`` entries on the cumulative block sums
    (``searchsorted(right=True)``: the first block whose cumulative sum exceeds it), then the
    remainder picks the entry on that block's own cumulative sum. The same distribution as
    ``torch.multinomial(weights, 1)`` (~3x slower on CPU for a 49k vocabulary) and as one
    ``searchsorted(cumsum(w), u * sum(w))``, without the [B, V] cumulative sum (a 49k
    vocabulary, 32 rows: 0.75 ms per decode step for the full cumsum, 0.1 ms here). A
    zero-weight entry or block is never the first whose cumulative sum exceeds ``u``, so it is
    never picked; only rounding can put ``u`` past the end of the row or of the chosen block, and
    then the last index with weight (of the row, or of the block) is taken."""
    b, v = weights.shape
    full = v - v % BLOCK
    sums = weights[:, :full].reshape(b, -1, BLOCK).sum(-1)  # [B, V // BLOCK]
    if full < v:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=1)
    block_cdf = sums.cumsum(dim=-1)  # [B, nb]
    nb = block_cdf.shape[1]
    u = torch.rand(b, 1, generator=generator, device=weights.device,
                   dtype=block_cdf.dtype) * block_cdf[:, -1:]
    blk = torch.searchsorted(block_cdf, u, right=True).squeeze(1)  # [B]
    over = blk >= nb  # u rounded up to the row's total
    blk = blk.clamp_max(nb - 1)
    before = torch.where(blk > 0, block_cdf.gather(1, (blk - 1).clamp_min(0)[:, None]).squeeze(1), 0.0)
    cols = blk[:, None] * BLOCK + torch.arange(BLOCK, device=weights.device)  # [B, BLOCK]
    inside = weights.gather(1, cols.clamp_max(v - 1)).masked_fill(cols >= v, 0.0)
    j = torch.searchsorted(inside.cumsum(dim=-1), (u.squeeze(1) - before)[:, None], right=True).squeeze(1)
    past = j >= BLOCK  # the remainder rounded past the block's own total
    if bool(past.any()):
        j[past] = _last_with_weight(inside[past])
    idx = blk * BLOCK + j
    if bool(over.any()):
        idx[over] = _last_with_weight(weights[over])
    return idx
