"""int8 activations: x rounded to int8 and multiplied in integers, the references of the kernels
that do it (``csrc/w8a8_gemm.cpp``, ``csrc/quant_gemm.cpp``'s ``int8_x``).

- :func:`int8_rows` / :func:`int8_groups`: x rounded per row (torchao's dynamic per-token
  quantization) or per group of 32 (ggml's ``q8_1``, OpenVINO's dynamic quantization).
- :func:`w8a8_linear`: int8 weights, x per row, ``torch._int_mm`` (the bits of ``w8a8_gemm`` /
  ``w8a8_packed``); :func:`reference_w8a8_linear` the same in float64.
- :func:`w4a8_linear`: packed 4-bit weights, x per 32 (the bits of ``w4a8_packed``).
- :func:`reference_int8_x_linear`: ``quant_gemm``'s int8-activation path in float64.
"""

from __future__ import annotations

import torch

from neuronfx.graphs.models.quant import (
    GGUF_BLOCK,
    Int4Packed,
    Int4Weight,
    Int8Packed,
    Int8Weight,
    QuantizedWeight,
    dequantize,
    four_bit_groups,
    int8_x_group_size,
    unpack_int4,
    unpack_int8,
)

Tensor = torch.Tensor


def _int8_rounded_x(x: Tensor, group_size: int) -> Tensor:
    """x (..., K) -> float64 (..., K), each value rounded to a multiple of its lane block's
    scale ``absmax / 127`` (round half to even; an all-zero block stays zero). A lane block is
    the 32 values one half of a 64-weight chunk meets (``csrc/quant_gemm.cpp``): with groups of
    32, elements 0-15 of two neighbouring groups (then 16-31 of both); with groups of 64 or
    more, 32 consecutive values of one half of a group."""
    k = x.shape[-1]
    g = group_size
    span = 64 if g == 32 else g
    kp = -(-k // span) * span
    xp = torch.nn.functional.pad(x.float(), (0, kp - k)).reshape(-1, kp)
    if g == 32:  # (rows, pairs, group a/b, half, 16) -> lane blocks (rows, pairs, half, a/b, 16)
        blocks = xp.view(-1, kp // 64, 2, 2, 16).transpose(2, 3)
    else:  # (rows, groups, half, chunk, 32)
        blocks = xp.view(-1, kp // g, 2, g // 64, 32)
    flat = (blocks.reshape(*blocks.shape[:-2], -1) if g == 32 else blocks).float()  # x was fp32 (or exactly widened bf16)
    d = flat.abs().amax(dim=-1, keepdim=True) / 127  # fp32, then x * (1 / d) in fp32: the kernel's arithmetic
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1.0), 0.0)
    rounded = (torch.round(flat * inv).double() * d.double()).reshape(blocks.shape)
    if g == 32:
        rounded = rounded.transpose(2, 3)
    return rounded.reshape(*x.shape[:-1], kp)[..., :k]


def _offsets(q: QuantizedWeight, k: int) -> Tensor:
    """float32 (N, k): each weight's offset term (int4: offset, Q4_1: m, Q4_0: -8 d)."""
    if isinstance(q, Int4Weight):
        g = 2 * q.data.shape[1] // q.scale.shape[1]
        return q.offset.float().repeat_interleave(g, dim=-1)[..., :k]
    return four_bit_groups(q)[2].repeat_interleave(GGUF_BLOCK, dim=-1)[..., :k]


def reference_int8_x_linear(x: Tensor, q: QuantizedWeight) -> Tensor:
    """What the kernel's int8-activation path (``quant_gemm(..., int8_x=True)``) computes,
    in float64: x (..., K) @ the weight's scaled values with x rounded per lane block (as ggml's
    ``quantize_row_q8_1``, absmax / 127 per 32 values; lane blocks in ``_int8_rounded_x``), plus
    the offsets against the exact x (the kernel uses x's exact group sums there). Formats the
    path does not serve (:func:`int8_x_group_size` None): the plain float64 product."""
    k = x.shape[-1]
    w = dequantize(q, k).double()
    g = int8_x_group_size(q)
    if g is None:
        return x.double() @ w.T
    o = _offsets(q, k).double()
    return _int8_rounded_x(x, g) @ (w - o).T + x.double() @ o.T


def int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., K) float -> (int8 (M, K), float32 (M, 1)) with M the rows of x: each row rounded
    (half to even) to a multiple of its scale ``absmax / 127`` (torchao's dynamic per-token
    activation quantization, ``int8_dynamic_activation_int8_weight``); an all-zero row gets
    scale 0 and zeros. One group per row of :func:`int8_groups`."""
    q, scale = int8_groups(x, x.shape[-1])  # (M, 1, K), (M, 1)
    return q.view(q.shape[0], -1), scale


def w8a8_linear(x: Tensor, q: Int8Weight | Int8Packed, bias: Tensor | None = None) -> Tensor:
    """x (..., K) float @ dequantize(q).T (+ bias (N,)) -> (..., N) in x.dtype, multiplied in
    integers: x rounded per row (:func:`int8_rows`), int8 x int8 products summed exactly in int32
    by ``torch._int_mm`` (oneDNN: VNNI or AMX where the CPU has them), then scaled by x's and the
    weight's scales in fp32. The error added is x's rounding, at most ``absmax / 254`` per value
    of a row. Reference: :func:`reference_w8a8_linear`."""
    if isinstance(q, Int8Packed):
        q = unpack_int8(q)
    xq, xs = int8_rows(x)
    out = torch._int_mm(xq, q.data.t()).float() * xs * q.scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], q.data.shape[0])


def int8_groups(x: Tensor, group: int = GGUF_BLOCK) -> tuple[Tensor, Tensor]:
    """x (..., K) float, K a multiple of ``group`` -> (int8 (M, G, group), float32 (M, G)): each
    group of ``group`` values of a row rounded as :func:`int8_rows` rounds a row (absmax / 127,
    half to even; an all-zero group gets scale 0): ggml's ``quantize_row_q8_1`` grouping and
    OpenVINO's dynamic quantization in groups of 32."""
    rows = x.reshape(-1, x.shape[-1] // group, group).float()
    scale = rows.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(rows / safe[..., None]).clamp(-127, 127).to(torch.int8), scale


def w4a8_linear(x: Tensor, q: Int4Packed, bias: Tensor | None = None) -> Tensor:
    """x (..., K) float @ dequantize(q).T (+ bias (N,)) -> (..., N) in x.dtype, multiplied in
    integers with the bits of ``library.w4a8_packed``: x rounded per group of 32
    (:func:`int8_groups`), per group the nibble x int8 sums S and x's own sums X exact, then in
    fp32, each step rounded once and the groups in order: ``acc += (S * scale + X * offset) * x
    scale``, then + bias. The error added is x's rounding, at most ``absmax / 254`` of each 32
    values. Slow (a loop over the groups): the kernel's reference, not a fallback."""
    values, scale, offset = unpack_int4(q)
    n, groups, _ = values.shape
    xq, xs = int8_groups(x)
    xg = xq.int()
    sums = (xg[:, None] * values.int()[None]).sum(-1)  # (M, N, G) exact
    xsum = xg.sum(-1).float()  # (M, G)
    acc = torch.zeros(xq.shape[0], n)
    for g in range(groups):
        acc = acc + (sums[:, :, g].float() * scale[:, g] + xsum[:, g:g + 1] * offset[:, g]) * xs[:, g:g + 1]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], n)


def reference_w8a8_linear(x: Tensor, q: Int8Weight | Int8Packed) -> Tensor:
    """What :func:`w8a8_linear` computes, in float64: x rounded per row as :func:`int8_rows`,
    times the weight's exact values."""
    xq, xs = int8_rows(x)
    out = (xq.double() * xs.double()) @ dequantize(q, x.shape[-1]).double().T
    return out.reshape(*x.shape[:-1], q.data.shape[0])
