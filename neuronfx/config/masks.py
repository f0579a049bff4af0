"""Attention-mask builders: tiny pure tensor functions (True = attend).

They run inside traced graphs (no ``.item()``, no data-dependent shapes) and in tests, where
they are checked against a naive Python reference.
"""

from __future__ import annotations

import torch


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, kind: str, size: int | None) -> torch.Tensor:
    """The part of a layer's mask beyond causality, for query positions ``query_pos`` (..., Tq, 1)
    and key positions ``key_pos`` (Tk,), broadcast to (..., Tq, Tk): "full" attends every key;
    "sliding" the last ``size`` positions, the query's own included (``j > i - size``,
    transformers' ``sliding_window_overlay``); "chunked" the keys of the query's chunk of
    ``size`` positions (``j // size == i // size``, transformers' ``chunked_overlay`` with no
    left padding: neuronfx pads on the right)."""
    if kind == "full":
        return torch.ones_like(query_pos - key_pos, dtype=torch.bool)
    if kind == "sliding":
        return key_pos > query_pos - size
    return torch.div(key_pos, size, rounding_mode="floor") == torch.div(query_pos, size, rounding_mode="floor")


def prefill_mask(prompt_lens: torch.Tensor, bucket: int, kind: str = "full", size: int | None = None) -> torch.Tensor:
    """Causal mask for right-padded prompts starting at position 0.

    ``prompt_lens``: [B] int32, real tokens per row (>= 1). Returns bool [B, 1, bucket, bucket] with
    ``M[b, 0, i, j] = (j <= i) and (j < prompt_lens[b]) and window(i, j)`` (:func:`window_mask`
    of ``kind`` and ``size``). Pad query rows (i >= len) still attend the real keys (a windowed
    pad row with none in reach attends itself), so no row is fully masked (no NaN from softmax).
    """
    idx = torch.arange(bucket, device=prompt_lens.device)
    causal = idx[None, :] <= idx[:, None]  # (T, T)
    real_key = idx[None, :] < prompt_lens[:, None]  # (B, T)
    mask = causal[None] & real_key[:, None, :]  # (B, T, T)
    if kind != "full":
        mask = mask & window_mask(idx[:, None], idx, kind, size)[None]
        empty = ~mask.any(-1, keepdim=True)  # pad rows past every real key's window: attend themselves
        mask = mask | (empty & torch.eye(bucket, dtype=torch.bool, device=idx.device)[None])
    return mask[:, None]  # (B, 1, T, T)


def decode_mask(position_ids: torch.Tensor, bucket: int, kind: str = "full", size: int | None = None) -> torch.Tensor:
    """Mask for T new tokens per row at ``position_ids`` over a KV window of ``bucket`` positions
    (decode: T = 1; speculate: T = k consecutive positions).

    ``position_ids``: [B, T] int32, each new token's position (the first is the slot's cache_len
    before the step). The step writes all T K/V first, so ``M[b, 0, t, j] = (j <= position_ids[b, t])
    and window(position_ids[b, t], j)`` (:func:`window_mask` of ``kind`` and ``size``): the cached
    prefix plus causal attention among the T new tokens. Returns bool [B, 1, T, bucket].
    """
    idx = torch.arange(bucket, device=position_ids.device)
    pos = position_ids[:, :, None]  # (B, T, 1)
    mask = idx[None, None, :] <= pos
    if kind != "full":
        mask = mask & window_mask(pos, idx, kind, size)
    return mask[:, None]  # (B, 1, T, S)


def chunk_mask(position_ids: torch.Tensor, bucket: int, kind: str = "full", size: int | None = None) -> torch.Tensor:
    """Mask of a chunk (prefill at an offset): T new tokens per row at ``position_ids`` [B, T]
    int32 over a KV window of ``bucket`` positions, returns bool [B, 1, T, bucket].

    Real token t of a row whose chunk starts at p (the slot's cache_len) sits at p + t and sees
    the cached prefix [0, p) plus the chunk's tokens up to itself: ``j <= p + t`` (and its
    window), which is :func:`decode_mask`'s rule, since the chunk's K/V are written before
    attending. Pad tokens (t >= the row's chunk length) repeat the last real position
    (``config.kv.chunk_positions``), so they see exactly what the last real token sees: no pad
    query row is empty, and no pad key is visible (pads write to the scratch block,
    ``config.kv.pad_writes``)."""
    return decode_mask(position_ids, bucket, kind, size)
