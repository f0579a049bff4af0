"""A GGUF file read fast: metadata as Python values, tensors as zero-copy views of one mmap.

The format is ggml's ``docs/gguf.md`` (v2 and v3, little-endian): magic ``GGUF``, version,
tensor count, metadata count, the metadata key/value pairs, the tensor table (name, dims
innermost first, ggml type, offset), then the tensor data from the next ``general.alignment``
boundary. ``gguf.GGUFReader`` parses the same thing but builds numpy views per array element
(3.6 s for SmolLM2's 49152-token vocabulary and merges); here a string array is one tight loop
over ``mmap`` slices (under 0.1 s). The type codes and block sizes come from the ``gguf``
package (``GGUFValueType``, ``GGMLQuantizationType``, ``GGML_QUANT_SIZES``), and so does
dequantization of the types decoded here by :func:`dequantize` with ``gguf.quants``.

Metadata values are what transformers' legacy reader (``integrations/ggml.py``
``_gguf_parse_value``) makes of them: ints, floats (float32 values as Python floats), bools,
UTF-8 strings, and arrays as lists. Nothing here knows about transformers or HF names
(``neuronfx.io.checkpoints`` maps them). Errors: :class:`GGUFFormatError` (a ValueError) for a
truncated or corrupt file, naming what is wrong.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import attrs
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize

T = GGMLQuantizationType
V = GGUFValueType
_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has not written it since 2023
_SCALARS = {
    V.UINT8: struct.Struct("<B"), V.INT8: struct.Struct("<b"), V.UINT16: struct.Struct("<H"), V.INT16: struct.Struct("<h"),
    V.UINT32: struct.Struct("<I"), V.INT32: struct.Struct("<i"), V.FLOAT32: struct.Struct("<f"), V.BOOL: struct.Struct("<?"),
    V.UINT64: struct.Struct("<Q"), V.INT64: struct.Struct("<q"), V.FLOAT64: struct.Struct("<d"),
}
_NUMPY = {
    V.UINT8: np.uint8, V.INT8: np.int8, V.UINT16: np.uint16, V.INT16: np.int16, V.UINT32: np.uint32, V.INT32: np.int32,
    V.FLOAT32: np.float32, V.BOOL: np.bool_, V.UINT64: np.uint64, V.INT64: np.int64, V.FLOAT64: np.float64,
}
_U32, _U64, _HEADER = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<IIQQ")
# Types whose data GGUFReader hands out as typed values (not bytes): gguf.quants.dequantize
# takes F32 and F16 that way; the rest are block bytes, (..., row bytes) uint8.
_VALUE_DTYPES = {T.F32: np.float32, T.F16: np.float16}
DEQUANT_CHUNK = 1 << 13
"""Blocks dequantized at a time (256K weights: 1 MB of fp32 output, in cache; measured best of 2K-64K)."""


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader can parse (bad magic or version), or is truncated or corrupt."""


@attrs.frozen(eq=False)
class GGUFTensor:
    """One tensor of the file. ``shape`` in torch order (outermost first); ``data`` a read-only
    view of the file's bytes, as GGUFReader gives it: F32 / F16 typed with ``shape``, every
    other type uint8 ``(*shape[:-1], shape[-1] / block * block bytes)`` (one row of blocks per
    row: blocks never cross rows, ggml requires the row length to be a multiple of the block)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    data: np.ndarray = attrs.field(repr=False)


@attrs.frozen(eq=False)
class GGUFFile:
    """A parsed GGUF file: ``metadata`` key -> value in file order, ``tensors`` name -> tensor
    in file order. The tensors' data stays mapped (copy-on-write, so a stray write changes no file)."""

    path: str
    metadata: dict[str, Any] = attrs.field(repr=False)
    tensors: dict[str, GGUFTensor] = attrs.field(repr=False)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse ``path``: header, metadata, tensor table; map the data. Reads only the metadata's
    pages (the tensors' pages are read when used). Raises GGUFFormatError for a file that is not
    GGUF, of another version, truncated, or with an unknown value or tensor type; OSError when
    it cannot be opened."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < _HEADER.size:
            raise GGUFFormatError(f"{os.fspath(path)!r} is {os.fstat(f.fileno()).st_size} bytes, shorter than a GGUF header")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    reader = _Cursor(buf, os.fspath(path))
    magic, version, tensor_count, kv_count = reader.unpack(_HEADER)
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"{reader.path!r} does not start with the GGUF magic bytes; it is not a GGUF file")
    if version not in _VERSIONS:
        raise GGUFFormatError(f"{reader.path!r} is GGUF version {version}; this reader reads versions {_VERSIONS}")
    metadata = {}
    for _ in range(reader.count(kv_count, 12, "metadata entries")):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack(_U32)[0])
    table = [_tensor_entry(reader) for _ in range(reader.count(tensor_count, 24, "tensors"))]
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"{reader.path!r} has general.alignment={alignment!r}, not a power of two")
    data_start = -(-reader.pos // alignment) * alignment
    blob = np.frombuffer(buf, dtype=np.uint8)
    tensors = {}
    for name, shape, ggml_type, offset in table:
        if name in tensors:
            raise GGUFFormatError(f"{reader.path!r} holds tensor {name!r} twice")
        tensors[name] = _tensor(blob, reader.path, name, shape, ggml_type, data_start + offset)
    return GGUFFile(path=reader.path, metadata=metadata, tensors=tensors)


def rows(tensor: GGUFTensor) -> np.ndarray:
    """A 2-D block tensor's bytes as uint8 (N, K / block * block bytes): one row of blocks per
    output channel, the layout of ``graphs.quant``'s ``Q4_0Blocks`` / ``Q4_1Blocks`` / ``Q8_0Blocks``."""
    return tensor.data.reshape(tensor.shape[0], -1)


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor as float32 numpy, bitwise what ``gguf.quants.dequantize(data, type)`` returns
    (the function transformers' loader calls): Q4_0, Q4_1 and Q8_0 decoded here over whole
    tensors (:data:`DEQUANT_CHUNK` blocks a pass) with gguf's arithmetic in its order (fp16
    scales widened to fp32, ``d * q`` then ``+ m``: one rounding per op, as numpy does), F32
    copied (never a view of the file), every other type by ``gguf.quants.dequantize``.
    Raises GGUFFormatError for a type gguf cannot dequantize (integer tensors)."""
    if tensor.ggml_type in _VALUE_DTYPES:
        return tensor.data.astype(np.float32)  # a copy, as gguf's F16 path; F32 not left a view of the file
    decode = _DECODERS.get(tensor.ggml_type)
    if decode is None:
        try:
            return gguf_dequantize(tensor.data, tensor.ggml_type)
        except NotImplementedError as exc:
            raise GGUFFormatError(f"tensor {tensor.name!r} is {tensor.ggml_type.name}, which cannot be dequantized: {exc}") from exc
    block, size = GGML_QUANT_SIZES[tensor.ggml_type]
    blocks = torch.from_numpy(tensor.data.reshape(-1, size))
    out = torch.empty(blocks.shape[0], block, dtype=torch.float32)
    for start in range(0, blocks.shape[0], DEQUANT_CHUNK):
        decode(blocks[start:start + DEQUANT_CHUNK], out[start:start + DEQUANT_CHUNK])
    return out.numpy().reshape(tensor.shape)


# --- block decoders: gguf/quants.py's dequantize_blocks, per type, in torch -----------------------


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block, as fp32 (n, 1)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) values: low nibbles are elements 0-15, high nibbles 16-31 (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """block_q4_0: fp16 d, 16 bytes of nibbles; w = d * (q - 8) (gguf: int8 q - 8, then fp32)."""
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    torch.mul(_scale(blocks, 0), q.float(), out=out)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m."""
    torch.mul(_scale(blocks, 0), _nibbles(blocks[:, 4:]).float(), out=out)
    out.add_(_scale(blocks, 2))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """block_q8_0: fp16 d, 32 int8; w = q * d."""
    torch.mul(blocks[:, 2:].contiguous().view(torch.int8).float(), _scale(blocks, 0), out=out)


_DECODERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q8_0: _q8_0}


# --- parsing ------------------------------------------------------------------------------------


class _Cursor:
    """Reads little-endian values from ``buf`` at ``pos``, checking every read against its end."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise GGUFFormatError(f"{self.path!r} is truncated: {what} at byte {self.pos} runs past its end ({self.size} bytes)")

    def unpack(self, fmt: struct.Struct) -> tuple:
        self._need(fmt.size, "a value")
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return values

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """``n``, checked to fit in what is left of the file at ``min_bytes`` each (a corrupt
        count would otherwise loop for ever)."""
        if n * min_bytes > self.size - self.pos:
            raise GGUFFormatError(f"{self.path!r} is corrupt or truncated: {n} {what} cannot fit in its {self.size} bytes")
        return n

    def string(self) -> str:
        (n,) = self.unpack(_U64)
        self._need(n, "a string")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return _decode(raw, self)

    def value(self, value_type: int) -> Any:
        if value_type == V.STRING:
            return self.string()
        if value_type == V.ARRAY:
            element_type, n = self.unpack(_ARRAY)
            return self.array(element_type, n)
        fmt = _SCALARS.get(value_type)  # type: ignore[call-overload]
        if fmt is None:
            raise GGUFFormatError(f"{self.path!r} holds a metadata value of unknown type {value_type} at byte {self.pos}")
        return self.unpack(fmt)[0]

    def array(self, element_type: int, n: int) -> list:
        if element_type == V.STRING:
            return self.strings(self.count(n, 8, "strings"))
        if element_type == V.ARRAY:  # GGUF allows nested arrays; llama.cpp writes none
            return [self.value(V.ARRAY) for _ in range(self.count(n, 12, "arrays"))]
        dtype = _NUMPY.get(element_type)  # type: ignore[call-overload]
        if dtype is None:
            raise GGUFFormatError(f"{self.path!r} holds an array of unknown type {element_type} at byte {self.pos}")
        nbytes = self.count(n, np.dtype(dtype).itemsize, "array elements") * np.dtype(dtype).itemsize
        values = np.frombuffer(self.buf, dtype=np.dtype(dtype).newbyteorder("<"), count=n, offset=self.pos).tolist()
        self.pos += nbytes
        return values

    def strings(self, n: int) -> list[str]:
        """``n`` strings (a vocabulary, merges): the hot loop of the whole parse."""
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        raw = []
        try:
            for _ in range(n):
                (length,) = unpack(buf, pos)
                pos += 8
                raw.append(buf[pos:pos + length])
                pos += length
        except struct.error as exc:
            raise GGUFFormatError(f"{self.path!r} is truncated in a string array at byte {pos}") from exc
        self.pos = pos
        self._need(0, "a string array")
        return [_decode(r, self) for r in raw]


_ARRAY = struct.Struct("<IQ")


def _decode(raw: bytes, cursor: _Cursor) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GGUFFormatError(f"{cursor.path!r} holds a string that is not UTF-8 near byte {cursor.pos}: {exc}") from exc


def _tensor_entry(reader: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = reader.string()
    (n_dims,) = reader.unpack(_U32)
    if n_dims > 8:  # GGML_MAX_DIMS is 4
        raise GGUFFormatError(f"{reader.path!r} gives tensor {name!r} {n_dims} dimensions; the file is corrupt")
    dims = reader.unpack(struct.Struct(f"<{n_dims}Q"))
    raw_type, offset = reader.unpack(_TYPE_OFFSET)
    try:
        ggml_type = GGMLQuantizationType(raw_type)
    except ValueError as exc:
        raise GGUFFormatError(f"{reader.path!r} gives tensor {name!r} the unknown ggml type {raw_type}") from exc
    return name, tuple(reversed(dims)), ggml_type, offset  # ggml lists dims innermost first


_TYPE_OFFSET = struct.Struct("<IQ")


def _tensor(blob: np.ndarray, path: str, name: str, shape: tuple[int, ...], ggml_type: GGMLQuantizationType, start: int) -> GGUFTensor:
    block, size = GGML_QUANT_SIZES[ggml_type]
    inner = shape[-1] if shape else 1
    if inner % block:
        raise GGUFFormatError(f"{path!r}: tensor {name!r} has rows of {inner}, not a multiple of {ggml_type.name}'s block of {block}")
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count // block * size
    if start + nbytes > blob.size:
        raise GGUFFormatError(f"{path!r} is truncated: tensor {name!r} needs bytes {start}..{start + nbytes}, the file has {blob.size}")
    data = blob[start:start + nbytes]
    if ggml_type in _VALUE_DTYPES:
        data = data.view(_VALUE_DTYPES[ggml_type]).reshape(shape)
    else:
        data = data.reshape(*shape[:-1], inner // block * size)
    return GGUFTensor(name=name, shape=shape, ggml_type=ggml_type, data=data)
