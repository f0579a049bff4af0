"""Quantized weight formats: what a quantized linear weight is inside the graphs.

A quantized weight replaces a float (N, K) linear weight (HF layout: out, in) in the nested
weights. Each format is its own NamedTuple of tensors, so its format is known statically (the
class) and every backend sees a pytree of plain tensors (torch.export and inductor flatten
NamedTuples). Shapes give everything else: N = ``data.shape[0]``, K = the input's last dim.

- :class:`Int8Weight`: symmetric per output channel, ``w[n, k] = data[n, k] * scale[n]``.
- :class:`Int4Weight`: group-wise asymmetric, group size g = 2 * data.shape[1] / G,
  ``w[n, k] = q[n, k] * scale[n, k // g] + offset[n, k // g]``, q in [0, 15]. Within a
  group, byte j holds element j in its low nibble and element j + g/2 in its high nibble
  (GGUF's Q4_1 order, so one unpack serves both). K is padded with zeros up to a multiple of g.
- :class:`Q4_0Blocks`, :class:`Q4_1Blocks`, :class:`Q8_0Blocks`: GGUF blocks of 32 weights
  kept as the file stores them (ggml's ``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``,
  ggml-common.h), one row of blocks per output channel: uint8 (N, K / 32 * block bytes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils import _pytree

Tensor = torch.Tensor

GGUF_BLOCK = 32
"""Weights per GGUF block of the kept types (ggml's QK4_0 = QK4_1 = QK8_0 = 32)."""
GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
"""Bytes per block: fp16 d (+ fp16 m for q4_1), then 16 bytes of nibbles or 32 int8."""


def _block_shape(data: Tensor, fmt: str) -> tuple[int, int]:
    return (data.shape[0], data.shape[1] // GGUF_BLOCK_BYTES[fmt] * GGUF_BLOCK)


class Int8Weight(NamedTuple):
    """data int8 (N, K); scale float32 or bfloat16 (N,)."""

    data: Tensor
    scale: Tensor


class Int4Weight(NamedTuple):
    """data uint8 (N, G * g / 2); scale and offset float32 or bfloat16 (N, G)."""

    data: Tensor
    scale: Tensor
    offset: Tensor


class Q4_0Blocks(NamedTuple):
    """uint8 (N, K / 32 * 18): per block fp16 d, 16 bytes of nibbles; w = (q - 8) * d."""

    data: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (N, K) of the weight the blocks hold (what a checkpoint check compares)."""
        return _block_shape(self.data, "q4_0")


class Q4_1Blocks(NamedTuple):
    """uint8 (N, K / 32 * 20): per block fp16 d, fp16 m, 16 bytes of nibbles; w = q * d + m."""

    data: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (N, K) of the weight the blocks hold (what a checkpoint check compares)."""
        return _block_shape(self.data, "q4_1")


class Q8_0Blocks(NamedTuple):
    """uint8 (N, K / 32 * 34): per block fp16 d, 32 int8; w = q * d."""

    data: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (N, K) of the weight the blocks hold (what a checkpoint check compares)."""
        return _block_shape(self.data, "q8_0")


QuantizedWeight = Int8Weight | Int4Weight | Q4_0Blocks | Q4_1Blocks | Q8_0Blocks
FORMAT_NAMES = {Int8Weight: "int8", Int4Weight: "int4", Q4_0Blocks: "q4_0", Q4_1Blocks: "q4_1", Q8_0Blocks: "q8_0"}
"""Format name of each class (the kernel's ``format`` argument)."""
BLOCK_TYPES = (Q4_0Blocks, Q4_1Blocks, Q8_0Blocks)
"""The GGUF block records (kept from a file, never made by neuronfx's quantizer)."""
QUANTIZED_TYPES = (Int8Weight, Int4Weight, *BLOCK_TYPES)
"""Every quantized weight record: what ``isinstance`` tells from a float tensor."""

for _cls in QUANTIZED_TYPES:
    # torch.export saves a program's input tree only for namedtuples registered with a stable name.
    _pytree._register_namedtuple(_cls, serialized_type_name=f"neuronfx.graphs.quant.{_cls.__name__}")
