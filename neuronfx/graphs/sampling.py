"""In-graph sampling from per-row (top_k, top_p, temperature) and explicit uniform random numbers.

No host sync and no data-dependent shapes: top-k uses a static width (``max_topk`` capped at the
vocab, as NxD's on-device sampler does), top-p and the draw are masks and cumulative sums.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, params: torch.Tensor, rand: torch.Tensor, topk_width: int) -> torch.Tensor:
    """Sample one token per row.

    logits: (B, V) float32. params: (B, 3) float32 rows of (top_k, top_p, temperature); greedy
    rows are (1, 1, 1). rand: (B,) float32 uniform in [0, 1). Returns token ids (B,) int32.

    Order: top-k, temperature, top-p (keep tokens whose preceding cumulative probability is below
    top_p, i.e. the token crossing p is kept: the transformers ``TopPLogitsWarper`` / vLLM rule),
    then inverse-CDF draw with ``rand``. A row with top_k = 1 is exactly argmax.
    """
    vals, idx = torch.topk(logits, topk_width, dim=-1)  # (B, K) sorted descending
    top_k, top_p, temperature = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    ranks = torch.arange(topk_width, device=logits.device)[None, :]  # (1, K)
    vals = vals.masked_fill(ranks >= top_k, float("-inf"))
    probs = torch.softmax(vals / temperature, dim=-1)  # (B, K)
    before = probs.cumsum(-1) - probs  # probability mass ranked strictly above each token
    probs = probs * (before < top_p)
    cdf = probs.cumsum(-1)  # (B, K), unnormalised
    target = rand[:, None] * cdf[:, -1:]
    choice = (cdf <= target).sum(-1).clamp(max=topk_width - 1)  # (B,)
    return idx.gather(1, choice[:, None]).squeeze(1).to(torch.int32)
