"""KV-cache layout and the slice/update spec of each graph: which positions it reads and writes."""

from __future__ import annotations

import attrs
import torch

from neuronfx.config.dtypes import dtype_bytes
from neuronfx.errors import BucketOverflowError, ConfigError

KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "int8", "fp8", "fp8_e4m3")
"""Values of ``InferenceConfig.kv_cache_dtype`` (vLLM's ``--kv-cache-dtype`` names): "auto" keeps
the plan's dtype; "bf16" / "bfloat16" stores bfloat16; "int8" stores int8 with one fp32 scale per
(token, head) (:data:`INT8_SCALE_BYTES`); "fp8" / "fp8_e4m3" stores torch's float8_e4m3fn, saturated
at +-448 (vLLM's fp8 cache with its default scale of 1)."""
INT8_SCALE_BYTES = 4
"""An int8 KV row ends in its fp32 scale's 4 bytes: a (token, head) row is head_dim int8 values
then the scale, so every copy of cache rows (prefix blocks, forks) moves the scales with them."""
INT8_MAX_HEAD_DIM = 512
"""The largest head_dim of an int8 KV cache: the attention kernel sums q . k over a head in int32
(q rounded to int16), exact while head_dim x 32767 x 128 < 2^31 (``csrc/small_gemm.cpp``)."""
_STORAGE = {"bf16": "bfloat16", "bfloat16": "bfloat16", "int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
_ALIASES = {"bfloat16": "bf16", "fp8": "fp8_e4m3"}


def canonical_kv_cache_dtype(value: object) -> object:
    """``value`` with vLLM's aliases spelled one way ("bfloat16" -> "bf16", "fp8" ->
    "fp8_e4m3"), so that a plan, its cache key and a saved runtime's check see one name per
    stored dtype; anything else unchanged (the validator names what is wrong)."""
    return _ALIASES.get(value, value) if isinstance(value, str) else value


def kv_storage_dtype(kv_cache_dtype: str, dtype: str, head_dim: int) -> str:
    """The dtype name the KV cache stores (a key of ``config.dtypes.DTYPES``) for
    ``kv_cache_dtype`` (one of :data:`KV_CACHE_DTYPES`, as ``InferenceConfig`` validated it) in a
    plan of ``dtype``. Raises ConfigError for int8 with a head_dim not a multiple of 4 (its fp32
    scale must sit 4-byte aligned after the values) or above :data:`INT8_MAX_HEAD_DIM`."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "int8" and head_dim % INT8_SCALE_BYTES:
        raise ConfigError(f"kv_cache_dtype='int8' needs head_dim divisible by {INT8_SCALE_BYTES} (got {head_dim}): each "
                          "row's fp32 scale follows its values; use kv_cache_dtype='bf16' or 'fp8_e4m3' for this model.")
    if kv_cache_dtype == "int8" and head_dim > INT8_MAX_HEAD_DIM:
        raise ConfigError(f"kv_cache_dtype='int8' supports head_dim up to {INT8_MAX_HEAD_DIM} (got {head_dim}): the attention "
                          "kernel sums q . k in int32; use kv_cache_dtype='bf16' or 'fp8_e4m3' for this model.")
    return _STORAGE[kv_cache_dtype]


KV_LAYOUTS = ("slots", "blocks")
"""Values of ``InferenceConfig.kv_layout``: "slots" (NxD's: one contiguous ``sequence_length``
row per request slot) or "blocks" (paged, vLLM's and NxDI's block layout: fixed-size blocks
handed to requests as they grow, addressed through a block table per row)."""


@attrs.frozen(kw_only=True)
class KVLayout:
    """Static KV-cache layout: per layer one K and one V of shape
    [num_blocks, num_kv_heads, block_size, row_width] in ``dtype``, the stored dtype
    (:func:`kv_storage_dtype`): ``row_width`` is head_dim, or head_dim + 4 for int8 rows, whose
    last 4 bytes hold the row's fp32 scale. Position j of a request lives in block
    ``table[j // block_size]`` at offset ``j % block_size``, its table being a graph input.

    - slots layout (the default: ``block_size`` and ``num_blocks`` left None): one block per
      slot of ``sequence_length`` positions, ``num_blocks = num_slots`` and a request's table is
      ``[slot]``. ``num_slots = batch_size + 1``: the last slot (``scratch_slot``) absorbs the
      writes of padding rows, so a padded batch never writes into a live or free request slot.
    - blocks layout: ``num_blocks`` blocks of ``block_size`` positions, the last one
      (``scratch_block``) written by padding rows and tokens and pointed at by every table entry
      a request does not own; ``num_slots`` still counts the request rows of the state.
    - window ring (blocks layout only, ``ring_blocks`` set): the layers flagged in
      ``ring_layers`` (sliding-window and chunked-attention layers, which never attend further
      back than their window) keep their K and V in a ring of ``ring_blocks`` blocks per slot
      instead, shape [(num_slots - 1) * ring_blocks + 1, num_kv_heads, block_size, row_width]:
      position j of the request in slot s lives in ring block ``s * ring_blocks + (j //
      block_size) % ring_blocks``, a table the graphs derive from ``seq_ids``
      (:func:`ring_table`); padding rows (the scratch slot) write the last block. A slot's window
      memory is then fixed by the window, not the context (vLLM's sliding-window blocks freed
      past the window, without a second block manager).
    """

    num_layers: int
    num_slots: int
    num_kv_heads: int
    sequence_length: int
    head_dim: int
    dtype: str
    block_size: int | None = None
    num_blocks: int | None = None
    ring_layers: tuple[bool, ...] = ()
    ring_blocks: int | None = None

    @property
    def paged(self) -> bool:
        """Whether this is the blocks layout (a table of blocks per request, not one slot)."""
        return self.block_size is not None

    @property
    def positions_per_block(self) -> int:
        """Positions of one block: ``block_size``, or ``sequence_length`` for the slots layout."""
        return self.sequence_length if self.block_size is None else self.block_size

    @property
    def total_blocks(self) -> int:
        """Blocks of each K or V tensor, the scratch one included (slots: ``num_slots``)."""
        return self.num_slots if self.num_blocks is None else self.num_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        """N, the columns of a block table: blocks covering ``sequence_length`` positions (1 for slots)."""
        return -(-self.sequence_length // self.positions_per_block)

    @property
    def row_width(self) -> int:
        """Elements of one stored (token, head) row: head_dim, plus the scale's bytes for int8."""
        return self.head_dim + (INT8_SCALE_BYTES if self.dtype == "int8" else 0)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of each K or V tensor: (total_blocks, num_kv_heads, positions_per_block, row_width)."""
        return (self.total_blocks, self.num_kv_heads, self.positions_per_block, self.row_width)

    @property
    def scratch_slot(self) -> int:
        """Index of the request row padding rows use; never holds a request."""
        return self.num_slots - 1

    @property
    def scratch_block(self) -> int:
        """Index of the block padding rows and pad tokens write to (the slots layout's scratch slot)."""
        return self.total_blocks - 1

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over the layers the block table addresses (all but the ring's), K and V."""
        return 2 * (self.num_layers - sum(self.ring_layers)) * self._layer_block_bytes

    @property
    def _layer_block_bytes(self) -> int:
        return self.num_kv_heads * self.positions_per_block * self.row_width * dtype_bytes(self.dtype)

    @property
    def ring_shape(self) -> tuple[int, int, int, int]:
        """Shape of each ring layer's K or V: ((num_slots - 1) * ring_blocks + 1, num_kv_heads,
        block_size, row_width)."""
        return (self.scratch_ring_block + 1, self.num_kv_heads, self.positions_per_block, self.row_width)

    def layer_shape(self, layer: int) -> tuple[int, int, int, int]:
        """Shape of ``layer``'s K or V: :attr:`ring_shape` for a ring layer, else :attr:`shape`."""
        return self.ring_shape if self.in_ring(layer) else self.shape

    def in_ring(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` keeps its K/V in the window ring."""
        return bool(self.ring_layers) and self.ring_layers[layer]

    @property
    def scratch_ring_block(self) -> int:
        """The ring's last block, which no request reads: padding rows and pad tokens of ring layers write it."""
        return self.scratch_slot * (self.ring_blocks or 0)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache (all layers, K and V; the ring's included)."""
        ring = 2 * sum(self.ring_layers) * (self.scratch_ring_block + 1) * self._layer_block_bytes if self.ring_blocks else 0
        return self.total_blocks * self.block_nbytes + ring


@attrs.frozen
class KVAccess:
    """Positions (tokens) of one slot a graph touches in one step.

    ``read``: positions sliced out of the cache; ``attend``: positions the mask lets the last
    query see; ``write``: positions overwritten. ``cache_len_after`` is the slot's new cache_len.
    """

    read: range
    attend: range
    write: range
    cache_len_after: int


def prefill_access(prompt_len: int, bucket: int) -> KVAccess:
    """Prefill of a prompt of ``prompt_len`` tokens in a graph of ``bucket`` tokens.

    Prefill reads nothing from the cache (the prompt attends itself) and writes the whole bucket:
    positions ``[prompt_len, bucket)`` get pad garbage, which is never attended because every
    later read is masked at ``j <= cache_len`` and decode overwrites position cache_len first.
    Raises BucketOverflowError if the prompt does not fit the bucket.
    """
    if not 0 < prompt_len <= bucket:
        raise BucketOverflowError(f"prompt_len={prompt_len} does not fit prefill bucket {bucket}.")
    return KVAccess(read=range(0), attend=range(prompt_len), write=range(bucket), cache_len_after=prompt_len)


def decode_access(cache_len: int, bucket: int) -> KVAccess:
    """Decode of one token at position ``cache_len`` in a graph attending ``bucket`` positions.

    Writes position ``cache_len``, reads ``[0, bucket)`` and attends ``[0, cache_len]``.
    Raises BucketOverflowError if ``cache_len + 1 > bucket``.
    """
    if not 0 <= cache_len < bucket:
        raise BucketOverflowError(f"cache_len={cache_len} + 1 does not fit decode bucket {bucket}.")
    return KVAccess(
        read=range(bucket),
        attend=range(cache_len + 1),
        write=range(cache_len, cache_len + 1),
        cache_len_after=cache_len + 1,
    )


def speculate_access(cache_len: int, k: int, bucket: int) -> KVAccess:
    """Verification of ``k`` tokens at positions ``[cache_len, cache_len + k)`` in a graph
    attending ``bucket`` positions: writes those k positions, reads ``[0, bucket)``, and the last
    query attends ``[0, cache_len + k)``. ``cache_len_after`` counts all k; the caller then
    rewinds it to the accepted length, and positions past it are never attended again (every
    read is masked at ``j <= position``, and the next write starts at the new cache_len).
    Raises BucketOverflowError if ``cache_len + k > bucket``.
    """
    if k < 1 or cache_len < 0 or cache_len + k > bucket:
        raise BucketOverflowError(f"cache_len={cache_len} + k={k} does not fit speculate bucket {bucket}.")
    return KVAccess(
        read=range(bucket),
        attend=range(cache_len + k),
        write=range(cache_len, cache_len + k),
        cache_len_after=cache_len + k,
    )


def chunk_access(cache_len: int, chunk_len: int, chunk_size: int, bucket: int) -> KVAccess:
    """A chunk (prefill at an offset) of ``chunk_len`` real tokens in a graph of ``chunk_size``
    tokens per row attending ``bucket`` positions, written from the slot's ``cache_len``.

    Writes the row's slot at ``[cache_len, cache_len + chunk_len)`` and nothing else of it: the
    ``chunk_size - chunk_len`` pad tokens write to the scratch block (:func:`pad_writes`)
    at the last real position (:func:`chunk_positions`), which is < ``bucket`` <=
    sequence_length, so no write lands past the cache or in a slot a request can see. Reads
    ``[0, bucket)``; the last real token attends ``[0, cache_len + chunk_len)``. Raises
    BucketOverflowError when ``chunk_len`` is not in [1, chunk_size], ``cache_len`` < 0 or
    ``cache_len + chunk_len > bucket``.
    """
    if not 0 < chunk_len <= chunk_size or cache_len < 0 or cache_len + chunk_len > bucket:
        raise BucketOverflowError(
            f"cache_len={cache_len} + chunk_len={chunk_len} does not fit a chunk graph of {chunk_size} tokens attending {bucket}."
        )
    end = cache_len + chunk_len
    return KVAccess(read=range(bucket), attend=range(end), write=range(cache_len, end), cache_len_after=end)


def chunk_positions(starts: torch.Tensor, chunk_lens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Positions (B, T = ``chunk_size``) int32 of a chunk graph's tokens: ``starts[b] + t`` for
    the real tokens (t < ``chunk_lens[b]``), the last real position ``starts[b] + chunk_lens[b]
    - 1`` for the pads, so a pad's RoPE, mask row and write position stay inside the row's real
    range (never >= sequence_length). ``starts`` and ``chunk_lens``: (B,) int, lengths >= 1."""
    t = torch.arange(chunk_size, dtype=torch.int32)
    return (starts.to(torch.int32)[:, None] + torch.minimum(t[None, :], chunk_lens.to(torch.int32)[:, None] - 1)).contiguous()


def ring_table(seq_ids: torch.Tensor, num_columns: int, ring_blocks: int, scratch_slot: int) -> torch.Tensor:
    """The window ring's block table (B, ``num_columns``) int64 of rows in slots ``seq_ids`` (B,)
    int: column j -> ``seq_ids * ring_blocks + j % ring_blocks``, every column of the scratch
    slot's rows -> the ring's scratch block ``scratch_slot * ring_blocks`` (``KVLayout``).
    Columns whose ring block now holds a later position are never read unmasked: the ring is
    sized so that a step's window and writes fit it (``config.kv_blocks.ring_size``). A traced
    tensor function."""
    cols = torch.arange(num_columns, device=seq_ids.device) % ring_blocks
    return (seq_ids.long()[:, None] * ring_blocks + cols[None, :]).clamp(max=scratch_slot * ring_blocks)


def pad_writes(blocks: torch.Tensor, chunk_lens: torch.Tensor, scratch_block: int) -> torch.Tensor:
    """The block each token of a chunk graph writes its K/V to, (B, T) int64: ``blocks[b, t]``
    (the row's block at the token's position) for the real tokens (t < ``chunk_lens[b]``), the
    scratch block for pads, which no request reads. A traced tensor function (no host reads)."""
    t = torch.arange(blocks.shape[1], device=blocks.device)
    real = t[None, :] < chunk_lens[:, None]  # (B, T)
    return torch.where(real, blocks.long(), torch.full_like(blocks, scratch_block, dtype=torch.long))
