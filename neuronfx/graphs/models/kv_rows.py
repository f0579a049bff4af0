"""How K and V rows are stored in the KV cache (``InferenceConfig.kv_cache_dtype``,
``config.kv.KVLayout``): every graph writes through its ops bundle's ``store_kv`` (the reference
ops: :func:`store_rows`; the CPU kernels: ``neuronfx::store_int8_kv`` for int8, the same bits)
and every torch-op reader reads through :func:`load_rows`; the C++ ``cached_attention`` reads the
same layout directly.

The stored dtype is the cache tensor's own, so which encoding runs is fixed when a graph is
traced: a float cache holds the values cast to its dtype; an fp8 cache (float8_e4m3fn) holds them
saturated at +-448 (vLLM's fp8 cache with scale 1); an int8 cache holds each (token, head) row
as head_dim int8 values and then the 4 bytes of its fp32 scale, absmax / 127 (per-token
symmetric quantization, as llama.cpp's q8_0 per block and vLLM's per-token int8 KV).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuronfx.config.kv import INT8_SCALE_BYTES, KVLayout, ring_table

Tensor = torch.Tensor

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn: values past it are saturated, not turned into NaN."""


def quantize_rows(x: Tensor) -> Tensor:
    """x (..., D) float -> (..., D + 4) int8: round(x * 127 / absmax) in [-127, 127], then the
    fp32 scale absmax / 127 as 4 little-endian bytes. An all-zero row gets scale 0 and zeros."""
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, 0.0)
    q = (x32 * inv).round().clamp(-127, 127).to(torch.int8)
    # values then scale bytes as one pointwise sum of two padded parts: inductor fuses it into the
    # cache write, where a cat of the two was a separate ATen call
    return F.pad(q, (0, INT8_SCALE_BYTES)) + F.pad(_float_bytes(amax / 127.0), (q.shape[-1], 0))


def dequantize_rows(rows: Tensor) -> Tensor:
    """(..., D + 4) int8 rows of :func:`quantize_rows` -> (..., D) float32, values * scale."""
    d = rows.shape[-1] - INT8_SCALE_BYTES
    return rows[..., :d].float() * _bytes_float(rows[..., d:])


# The scale's bytes are taken with integer arithmetic on its int32 bits, not with a view of the
# fp32 tensor as int8: inductor lowers a bitcast between dtypes of one size inside its kernels,
# but calls out to ATen for one that changes the size: with that view and a cat, a decode layer
# group's two cache writes took 56 us against 22 for a float cache (a microbenchmark).
def _float_bytes(x: Tensor) -> Tensor:
    """(..., 1) float32 -> (..., 4) int8: its bytes, least significant first."""
    bits = x.view(torch.int32)
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=x.device)
    unsigned = (bits >> shifts) & 255  # (..., 4) in [0, 255]
    return ((unsigned ^ 128) - 128).to(torch.int8)  # two's complement: 255 -> -1


def _bytes_float(b: Tensor) -> Tensor:
    """(..., 4) int8 bytes of :func:`_float_bytes` -> (..., 1) float32."""
    unsigned = b.to(torch.int64) & 255
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=b.device)
    bits = (unsigned << shifts).sum(-1, keepdim=True)  # [0, 2**32)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def store_rows(x: Tensor, cache: Tensor) -> Tensor:
    """K or V rows x (..., D) in any float dtype -> what ``cache`` stores for them: (..., D) in
    its float dtype, saturated float8_e4m3fn, or (..., D + 4) int8 rows (:func:`quantize_rows`)."""
    if cache.dtype == torch.int8:
        return quantize_rows(x)
    if cache.dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
    return x.to(cache.dtype)


def load_rows(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """Stored rows (..., W) read back -> (..., D) values in ``dtype`` (int8 rows dequantized in
    fp32 first)."""
    if rows.dtype == torch.int8:
        return dequantize_rows(rows).to(dtype)
    return rows.to(dtype)


def window_rows(cache: Tensor, block_table: Tensor, n: int) -> Tensor:
    """The stored rows of each row's first ``n`` positions: cache (num_blocks, H_kv, block_size,
    W), block_table (B, N) int (position j of row b lives in block ``block_table[b, j //
    block_size]`` at offset ``j % block_size``; ``config.kv``) -> (B, H_kv, n, W), a gathered copy.
    The slots layout is the case N = 1, block_size = sequence_length (table = seq_ids): the
    positions are sliced to n before the gather, so it copies n positions per row, not the slot."""
    bs = cache.shape[2]
    width = min(n, bs)  # positions kept of each block: all of them past one block
    count = -(-n // bs)  # blocks holding [0, n)
    blocks = cache[:, :, :width][block_table[:, :count].long()]  # (B, count, H_kv, width, W)
    b, _, h, _, w = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(b, h, count * width, w)[:, :, :n]


def block_writes(block_table: Tensor, positions: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Where tokens at ``positions`` (B, T) int write through ``block_table`` (..., B, N) int:
    (the block (..., B, T) int64, the offset in it (B, T) int64); ``positions // block_size``
    must be < N."""
    pos = positions.long()
    col = (pos // block_size).expand(*block_table.shape[:-1], pos.shape[-1])
    return block_table.long().gather(-1, col), pos % block_size


def pool_tables(kv: KVLayout, masks: tuple[str, ...], block_table: Tensor, seq_ids: Tensor) -> Tensor:
    """The block tables of the cache's pools, (G, B, N) int32: ``block_table`` (B, N) alone
    (G = 1), or with a window ring one per mask kind of ``masks`` (the attention layout's, in
    its order: a layer picks its table by its ``mask_index``), "full" the block table, the
    windowed kinds the ring's table of the rows' slots ``seq_ids`` (B,) (``config.kv.ring_table``)."""
    if not kv.ring_blocks:
        return block_table[None]
    ring = ring_table(seq_ids, block_table.shape[1], kv.ring_blocks, kv.scratch_slot).to(block_table.dtype)
    return torch.stack([block_table if kind == "full" else ring for kind in masks])


def pool_scratch(kv: KVLayout, masks: tuple[str, ...]) -> list[int]:
    """The scratch block of each pool of :func:`pool_tables`: where pad tokens write."""
    if not kv.ring_blocks:
        return [kv.scratch_block]
    return [kv.scratch_block if kind == "full" else kv.scratch_ring_block for kind in masks]
