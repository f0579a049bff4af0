"""Attention-mask builders: tiny pure tensor functions (True = attend).

They run inside traced graphs (no ``.item()``, no data-dependent shapes) and in tests, where
they are checked against a naive Python reference.
"""

from __future__ import annotations

import torch


def prefill_mask(prompt_lens: torch.Tensor, bucket: int) -> torch.Tensor:
    """Causal mask for right-padded prompts starting at position 0.

    ``prompt_lens``: [B] int32, real tokens per row (>= 1). Returns bool [B, 1, bucket, bucket] with
    ``M[b, 0, i, j] = (j <= i) and (j < prompt_lens[b])``. Pad query rows (i >= len) still attend the
    real keys, so no row is fully masked (no NaN from softmax).
    """
    idx = torch.arange(bucket, device=prompt_lens.device)
    causal = idx[None, :] <= idx[:, None]  # (T, T)
    real_key = idx[None, :] < prompt_lens[:, None]  # (B, T)
    return (causal[None] & real_key[:, None, :])[:, None]  # (B, 1, T, T)


def decode_mask(position_ids: torch.Tensor, bucket: int) -> torch.Tensor:
    """Mask for T new tokens per row at ``position_ids`` over a KV window of ``bucket`` positions
    (decode: T = 1; speculate: T = k consecutive positions).

    ``position_ids``: [B, T] int32, each new token's position (the first is the slot's cache_len
    before the step). The step writes all T K/V first, so ``M[b, 0, t, j] = (j <= position_ids[b, t])``:
    the cached prefix plus causal attention among the T new tokens. Returns bool [B, 1, T, bucket].
    """
    idx = torch.arange(bucket, device=position_ids.device)
    return (idx[None, None, :] <= position_ids[:, :, None])[:, None]  # (B, 1, T, S)
