"""KV-cache layout and the slice/update spec of each graph: which positions it reads and writes."""

from __future__ import annotations

import attrs

from neuronfx.config.dtypes import dtype_bytes
from neuronfx.errors import BucketOverflowError


@attrs.frozen(kw_only=True)
class KVLayout:
    """Static KV-cache layout: per layer one K and one V of shape
    [num_slots, num_kv_heads, sequence_length, head_dim].

    ``num_slots = batch_size + 1``: the last slot (``scratch_slot``) absorbs the writes of padding
    rows, so a padded batch never writes into a live or free request slot.
    """

    num_layers: int
    num_slots: int
    num_kv_heads: int
    sequence_length: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of each K or V tensor: (num_slots, num_kv_heads, sequence_length, head_dim)."""
        return (self.num_slots, self.num_kv_heads, self.sequence_length, self.head_dim)

    @property
    def scratch_slot(self) -> int:
        """Index of the slot padding rows write to; never holds a request."""
        return self.num_slots - 1

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache (all layers, K and V)."""
        n = self.num_slots * self.num_kv_heads * self.sequence_length * self.head_dim
        return 2 * self.num_layers * n * dtype_bytes(self.dtype)


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
