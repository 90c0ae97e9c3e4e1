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
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    vocab = logits.shape[-1]
    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    plain_mask = ~greedy & ~filtered
    if bool(plain_mask.all()):  # the usual RL batch: every row samples the tempered softmax
        tokens = _sample_rows(logprobs_all.exp(), generator)
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


def _sample_rows(weights, generator):
    """One index per row of ``weights`` ``[B, V]`` (non-negative, unnormalised), drawn with
    probability proportional to the weight by inverse-CDF sampling: ``searchsorted(cumsum(w),
    u * sum(w))``, ``u ~ U[0, 1)``. Same distribution as ``torch.multinomial(weights, 1)``, which
    takes ~3x as long on CPU for a 49k vocabulary (16 rows: 17 ms vs 6 ms). Zero-weight entries are never picked."""
    cdf = weights.cumsum(dim=-1)
    u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device,
                   dtype=cdf.dtype) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    # searchsorted(right=True) returns the first i with cdf[i] > u, and a zero-weight i has
    # cdf[i] = cdf[i-1], so it is never that first index. Only u * total rounding up to total
    # gives i = V (past the end): then take the row's last index with weight.
    over = idx >= weights.shape[1]
    if bool(over.any()):
        w = weights[over]
        idx[over] = w.shape[1] - 1 - (w.flip(-1) > 0).int().argmax(dim=-1)
    return idx

