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
- :class:`Int8Packed`: an :class:`Int8Weight` laid out for VNNI (16 channels x 4 features per
  64 bytes) beside its row-major values, made at compile for plans that multiply int8 weights
  by int8 activations (``kernels.activation_choice.pack_weights``).
- :class:`Int4Packed`: a 4-bit weight in groups of 32 (int4, Q4_0, Q4_1) laid out the same way
  (16 channels x 8 features per 64 bytes of nibbles), each record followed by its scales and
  offsets (fp16 where they are exactly fp16, as a GGUF's; else fp32), made at compile for plans
  whose 4-bit weights multiply int8 activations.
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


class Int8Packed(NamedTuple):
    """:class:`Int8Weight`'s values laid out for VNNI's ``vpdpbusd``: data uint8 (N / 16, K / 4, 64),
    block b, quad q holding ``w[16 b + c, 4 q + i] + 128`` at byte ``4 c + i`` (16 output channels
    of 4 input features per 64 bytes, the weight read unsigned as the instruction takes it);
    scale float32 or bfloat16 (N,); rows: the same values row-major, int8 (N, K), for products of
    many rows (a prefill's: torch's integer GEMM is faster there, see ``kernels.bundles``). Made
    by :func:`pack_int8` for plans whose int8 weights always multiply int8 activations
    (``kernels.activation_choice``), read by ``library.w8a8_packed``."""

    data: Tensor
    scale: Tensor
    rows: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (N, K) of the weight."""
        return (self.data.shape[0] * PACK_CHANNELS, self.data.shape[1] * PACK_FEATURES)


class Int4Packed(NamedTuple):
    """A 4-bit weight in groups of 32 (:class:`Int4Weight` with ``group_size=32``, GGUF's
    :class:`Q4_0Blocks` / :class:`Q4_1Blocks`) laid out for VNNI's ``vpdpbusd`` against int8
    activations: data uint8 (N / 16, G, R), one record of R bytes per block b of 16 output
    channels and group g of 32 input features. Bytes [0, 256) are 4 lines of 64, line l holding
    at byte ``4 c + i`` the nibbles of ``q[16 b + c, 32 g + 8 l + i]`` (low) and ``q[16 b + c,
    32 g + 8 l + 4 + i]`` (high), q in [0, 15]; then the 16 channels' scales, then their offsets:
    float16 (R = 320, where every scale and offset is exactly an fp16, as a GGUF's d and m) or
    float32 (R = 384: int4's, or a Q4_0 whose -8 d overflows fp16); ``w = q * scale + offset``
    (Q4_0's offset is -8 d). One record per (block, group) keeps a block one memory stream.
    Made by :func:`pack_int4` for plans whose 4-bit weights multiply int8 activations
    (``kernels.activation_choice``), read by ``library.w4a8_packed``; :func:`w4a8_linear`
    computes its bits."""

    data: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (N, K) of the weight."""
        return (self.data.shape[0] * PACK_CHANNELS, self.data.shape[1] * GGUF_BLOCK)


NIBBLE_BYTES = 256
"""Bytes of nibbles in an :class:`Int4Packed` record (16 channels x 32 features / 2)."""


PACK_CHANNELS = 16
"""Output channels per block of :class:`Int8Packed` (int32 lanes of a 512-bit register)."""
PACK_FEATURES = 4
"""Input features per lane of :class:`Int8Packed` (bytes ``vpdpbusd`` sums into one int32)."""

QuantizedWeight = Int8Weight | Int4Weight | Q4_0Blocks | Q4_1Blocks | Q8_0Blocks | Int8Packed | Int4Packed
FORMAT_NAMES = {Int8Weight: "int8", Int4Weight: "int4", Q4_0Blocks: "q4_0", Q4_1Blocks: "q4_1", Q8_0Blocks: "q8_0"}
"""Format name of each class (the kernel's ``format`` argument)."""


# ---- quantizers (load time; pure torch, any float input) -----------------------------------


def quantize_int8(w: Tensor) -> Int8Weight:
    """w float (N, K) -> :class:`Int8Weight`: symmetric per output channel (gpt-fast's
    ``dynamically_quantize_per_channel``): scale fp32 (N,) = absmax / 127, data int8 (N, K) =
    round(w / scale), so ``|w - data * scale| <= scale / 2``. An all-zero row gets scale 0 and
    data 0 (dequantizes exactly; no division by zero)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = torch.round(w / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(data, scale)


def quantize_int4(w: Tensor, group_size: int) -> Int4Weight:
    """w float (N, K) -> :class:`Int4Weight`, asymmetric per group of ``group_size`` (even) along K,
    as GGUF's Q4_1 (ggml-quants.c ``quantize_row_q4_1_ref``) but with fp32 scale / offset and
    round-to-nearest: offset = group min, scale = (max - min) / 15, q = round((w - min) / scale)
    in [0, 15], so ``|w - (q * scale + offset)| <= scale / 2``. K is padded with zeros to a multiple
    of the group (the padding takes part in the last group's min / max); a constant group gets
    scale 0 and q 0 (dequantizes exactly)."""
    n, k = w.shape
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"int4 group_size must be a positive even number, got {group_size}")
    groups = -(-k // group_size)
    w = torch.nn.functional.pad(w.float(), (0, groups * group_size - k)).view(n, groups, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - lo[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    half = group_size // 2
    data = q[..., :half] | (q[..., half:] << 4)  # byte j: element j (low nibble), j + g/2 (high)
    return Int4Weight(data.reshape(n, groups * half), scale, lo)


# ---- graph-side functions (torch ops only: traced by torch.export and inductor) ------------


def _nibbles(packed: Tensor) -> Tensor:
    """uint8 (..., h) -> uint8 (..., 2h): low nibbles then high nibbles (Q4 order in a group)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _fp16(blocks: Tensor, start: int) -> Tensor:
    """The little-endian fp16 at bytes [start, start + 2) of each block (..., B, bytes) -> fp32 (..., B, 1)."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _blocks(data: Tensor, fmt: str) -> Tensor:
    """uint8 (..., B * bytes) -> (..., B, bytes)."""
    size = GGUF_BLOCK_BYTES[fmt]
    return data.view(*data.shape[:-1], data.shape[-1] // size, size)


def packable(q: QuantizedWeight) -> bool:
    """Whether ``q`` is an int8 (N, K) weight :func:`pack_int8` takes: N a multiple of
    :data:`PACK_CHANNELS` and K of :data:`PACK_FEATURES`."""
    return (isinstance(q, Int8Weight) and q.data.dim() == 2 and q.data.shape[0] % PACK_CHANNELS == 0
            and q.data.shape[1] % PACK_FEATURES == 0)


def pack_int8(q: Int8Weight) -> Int8Packed:
    """:class:`Int8Weight` -> :class:`Int8Packed`, the same values (``q.data`` kept as its rows);
    ValueError when not :func:`packable` (N not a multiple of 16 or K of 4)."""
    if not packable(q):
        raise ValueError(f"an int8 weight packs when it is (N, K) with N % {PACK_CHANNELS} == 0 and K % {PACK_FEATURES} == 0, "
                         f"got {tuple(q.data.shape)}")
    n, k = q.data.shape
    blocks = q.data.view(n // PACK_CHANNELS, PACK_CHANNELS, k // PACK_FEATURES, PACK_FEATURES).transpose(1, 2)
    data = (blocks.to(torch.int16) + 128).to(torch.uint8).reshape(n // PACK_CHANNELS, k // PACK_FEATURES, -1)
    return Int8Packed(data.contiguous(), q.scale, q.data)


def four_bit_groups(q: QuantizedWeight) -> tuple[Tensor, Tensor, Tensor] | None:
    """A 4-bit weight in groups of 32 as (q uint8 (N, G, 32) in [0, 15], scale float32 (N, G),
    offset float32 (N, G)), ``w = q * scale + offset``: an :class:`Int4Weight` of groups of 32,
    :class:`Q4_0Blocks` (offset -8 * d) or :class:`Q4_1Blocks`; None for anything else."""
    if isinstance(q, Int4Weight) and q.data.dim() == 2 and 2 * q.data.shape[1] == GGUF_BLOCK * q.scale.shape[1]:
        n, groups = q.scale.shape
        return _nibbles(q.data.view(n, groups, GGUF_BLOCK // 2)), q.scale.float(), q.offset.float()
    if isinstance(q, (Q4_0Blocks, Q4_1Blocks)) and q.data.dim() == 2:
        fmt = "q4_1" if isinstance(q, Q4_1Blocks) else "q4_0"
        b = _blocks(q.data, fmt)
        d = _fp16(b, 0)[..., 0]
        return _nibbles(b[..., 4 if fmt == "q4_1" else 2:]), d, _fp16(b, 2)[..., 0] if fmt == "q4_1" else -8 * d
    return None


def packable_int4(q: QuantizedWeight) -> bool:
    """Whether :func:`pack_int4` takes ``q``: a 4-bit weight in groups of 32
    (:func:`four_bit_groups`) with N a multiple of :data:`PACK_CHANNELS`."""
    return isinstance(q, (Int4Weight, Q4_0Blocks, Q4_1Blocks)) and q.data.dim() == 2 and q.data.shape[0] % PACK_CHANNELS == 0 \
        and four_bit_groups(q) is not None


def pack_int4(q: Int4Weight | Q4_0Blocks | Q4_1Blocks) -> Int4Packed:
    """A 4-bit weight in groups of 32 -> :class:`Int4Packed`, the same values (scales and
    offsets stored fp16 when each is exactly an fp16, as a GGUF's, else fp32); ValueError when
    not :func:`packable_int4` (other group sizes, N not a multiple of 16)."""
    if not packable_int4(q):
        raise ValueError(f"a 4-bit weight packs when its groups are 32 wide and N % {PACK_CHANNELS} == 0; got "
                         f"{type(q).__name__} {tuple(q.data.shape)}")
    values, scale, offset = four_bit_groups(q)
    n, groups, _ = values.shape
    nb = n // PACK_CHANNELS
    v = values.view(nb, PACK_CHANNELS, groups, 4, 2, 4)  # (b, c, g, l, half, i): feature 8 l + 4 half + i
    nibbles = (v[..., 0, :] | (v[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(nb, groups, NIBBLE_BYTES)
    exact16 = all(torch.equal(t.half().float(), t) for t in (scale, offset))  # Q4_0's -8 d can overflow fp16
    dtype = torch.float16 if exact16 else torch.float32

    def per_block(t: Tensor) -> Tensor:  # (N, G) -> the bytes of (NB, G, 16) in dtype
        return t.to(dtype).reshape(nb, PACK_CHANNELS, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return Int4Packed(torch.cat([nibbles, per_block(scale), per_block(offset)], dim=-1).contiguous())


def unpack_int4(p: Int4Packed) -> tuple[Tensor, Tensor, Tensor]:
    """:class:`Int4Packed` -> (q uint8 (N, G, 32), scale float32 (N, G), offset float32 (N, G)),
    the inverse of :func:`pack_int4` (:func:`four_bit_groups`' form)."""
    nb, groups, record = p.data.shape
    dtype = torch.float16 if record == NIBBLE_BYTES + 2 * PACK_CHANNELS * 2 else torch.float32
    b = p.data[..., :NIBBLE_BYTES].reshape(nb, groups, 4, PACK_CHANNELS, 4)  # (b, g, l, c, i)
    v = torch.stack([b & 0x0F, b >> 4], dim=-2)  # (b, g, l, c, half, i)
    q = v.permute(0, 3, 1, 2, 4, 5).reshape(nb * PACK_CHANNELS, groups, GGUF_BLOCK)
    tail = p.data[..., NIBBLE_BYTES:].contiguous().view(dtype).float()  # (NB, G, 32): scales, offsets

    def per_channel(t: Tensor) -> Tensor:
        return t.transpose(1, 2).reshape(nb * PACK_CHANNELS, groups)

    return q, per_channel(tail[..., :PACK_CHANNELS]), per_channel(tail[..., PACK_CHANNELS:])


def unpack_int8(p: Int8Packed) -> Int8Weight:
    """:class:`Int8Packed` -> :class:`Int8Weight`, the inverse of :func:`pack_int8` (its rows)."""
    return Int8Weight(p.rows, p.scale)


def packed_values(p: Int8Packed) -> Tensor:
    """int8 (N, K): the values ``p.data`` holds, read back from the packed layout (what
    ``p.rows`` must equal)."""
    nb, k4, _ = p.data.shape
    blocks = (p.data.to(torch.int16) - 128).to(torch.int8).view(nb, k4, PACK_CHANNELS, PACK_FEATURES).transpose(1, 2)
    return blocks.reshape(nb * PACK_CHANNELS, k4 * PACK_FEATURES)


def dequantize(q: QuantizedWeight, k: int) -> Tensor:
    """Any quantized weight (leading dims ``...``: (N,) for a weight, the ids' shape after
    :func:`gather_rows`) -> float32 (..., k), the first k input features (drops int4's padding).
    The GGUF formats follow ggml's ``dequantize_row_q4_0 / q4_1 / q8_0`` (ggml-quants.c)."""
    if isinstance(q, Int8Packed):
        q = unpack_int8(q)
    if isinstance(q, Int4Packed):
        values, scale, offset = unpack_int4(q)
        w = values.float() * scale[..., None] + offset[..., None]
        return w.reshape(w.shape[0], -1)[..., :k]
    if isinstance(q, Int8Weight):
        return (q.data.float() * q.scale.float()[..., None])[..., :k]
    if isinstance(q, Int4Weight):
        groups = q.scale.shape[-1]
        packed = q.data.view(*q.data.shape[:-1], groups, q.data.shape[-1] // groups)
        w = _nibbles(packed).float() * q.scale.float()[..., None] + q.offset.float()[..., None]
    elif isinstance(q, Q4_0Blocks):
        b = _blocks(q.data, "q4_0")
        w = (_nibbles(b[..., 2:]).float() - 8) * _fp16(b, 0)
    elif isinstance(q, Q4_1Blocks):
        b = _blocks(q.data, "q4_1")
        w = _nibbles(b[..., 4:]).float() * _fp16(b, 0) + _fp16(b, 2)
    elif isinstance(q, Q8_0Blocks):
        b = _blocks(q.data, "q8_0")
        w = b[..., 2:].contiguous().view(torch.int8).float() * _fp16(b, 0)
    else:
        raise TypeError(f"not a quantized weight: {type(q).__name__}")
    return w.reshape(*w.shape[:-2], -1)[..., :k]  # (..., groups, g) -> (..., groups * g)


def gather_rows(q: QuantizedWeight, ids: Tensor) -> QuantizedWeight:
    """The same format holding rows ``ids`` (any integer shape S) of every tensor: leading dims S.
    A tied embedding lookup is ``dequantize(gather_rows(lm_head, ids), hidden)`` -> (*S, hidden)."""
    return type(q)(*(t[ids] for t in q))


def reference_linear(x: Tensor, q: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """x (..., K) @ dequantize(q).T (+ bias) in fp32, cast to x.dtype: the reference op of the
    quantized product kernel (``kernels.quant_gemm``) and its fallback without kernels."""
    w = dequantize(q, x.shape[-1])
    out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


def weight_bytes(q: QuantizedWeight) -> int:
    """Bytes a product reads from the weight (data, scales and offsets; a packed int8 weight's
    packed data and scales: its row-major copy serves only prefill)."""
    return sum(t.numel() * t.element_size() for t in read_tensors(q))


def read_tensors(q: QuantizedWeight) -> tuple[Tensor, ...]:
    """The tensors a decode product of ``q`` reads: all its fields, but an :class:`Int8Packed`'s
    ``rows`` (the row-major copy prefill reads)."""
    return (q.data, q.scale) if isinstance(q, Int8Packed) else tuple(q)


BLOCK_TYPES = (Q4_0Blocks, Q4_1Blocks, Q8_0Blocks)
"""The GGUF block records (kept from a file, never made by neuronfx's quantizer)."""
QUANTIZED_TYPES = (Int8Weight, Int4Weight, *BLOCK_TYPES, Int8Packed, Int4Packed)
"""Every quantized weight record: what ``isinstance`` tells from a float tensor."""

for _cls in QUANTIZED_TYPES:
    # torch.export saves a program's input tree only for namedtuples registered with a stable name.
    _pytree._register_namedtuple(_cls, serialized_type_name=f"neuronfx.graphs.models.quant.{_cls.__name__}")


def int8_x_group_size(q: QuantizedWeight) -> int | None:
    """The group size the ``int8_x`` kernel path serves for weight ``q`` (Q4_0 / Q4_1: 32;
    int4 with groups of 32 or a multiple of 64), or None where it keeps x in float."""
    if isinstance(q, (Q4_0Blocks, Q4_1Blocks)):
        return GGUF_BLOCK
    if isinstance(q, Int4Weight):
        g = 2 * q.data.shape[1] // q.scale.shape[1]
        return g if g == 32 or g % 64 == 0 else None
    return None
