"""The blocks KV layout (``InferenceConfig.kv_layout="blocks"``): its options, the cache it
builds, and the pure arithmetic of block tables.

A request's position j lives in block ``table[j // block_size]`` at offset ``j % block_size``;
a table holds the blocks a request owns in order, then the scratch block in every column it does
not own (``config.kv.KVLayout``). Blocks are handed out as a request grows (``runtime/blocks.py``,
the block manager); this module holds what can be derived without a cache.

vLLM's paged attention (``vllm/v1/core/kv_cache_manager.py``, block size 16 by default) and NxDI's
block KV layout (``is_block_kv_layout``, ``pa_block_size``, ``pa_num_blocks``) are the models.
"""

from __future__ import annotations

from collections.abc import Sequence

from neuronfx.config.dtypes import dtype_bytes
from neuronfx.config.kv import INT8_SCALE_BYTES, KVLayout
from neuronfx.errors import ConfigError

DEFAULT_KV_BLOCK_SIZE = 16
"""Positions per block when ``kv_block_size`` is None (vLLM's default ``block_size``)."""
KEYS_PER_STEP = 4
"""The attention kernel reads keys 4 at a time within one block (``csrc/small_gemm.cpp``), so a
block size must be a multiple of it."""


def block_size_field(inst: object, attribute: object, value: object) -> None:
    """attrs validator of ``kv_block_size``: None, or a positive int multiple of :data:`KEYS_PER_STEP`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % KEYS_PER_STEP):
        raise ConfigError(f"kv_block_size={value!r} must be a positive multiple of {KEYS_PER_STEP} (positions per KV block; "
                          f"the attention kernel reads {KEYS_PER_STEP} keys at a time within a block); pass e.g. 16.")


def check_block_options(kv_layout: str, kv_block_size: int | None, num_kv_blocks: int | None, kv_cache_memory: int | None,
                        ) -> None:
    """Raise ConfigError for block options that mean nothing for ``kv_layout`` ("slots" takes
    none of them) or both budgets at once. Types and the block size's multiple of
    :data:`KEYS_PER_STEP` are checked by the config's validators (:func:`block_size_field`)."""
    given = [f"{name}={value!r}" for name, value in (("kv_block_size", kv_block_size), ("num_kv_blocks", num_kv_blocks),
                                                     ("kv_cache_memory", kv_cache_memory)) if value is not None]
    if kv_layout == "slots" and given:
        raise ConfigError(f"{', '.join(given)} with kv_layout='slots': block options size the paged KV cache; "
                          "pass kv_layout='blocks' or drop them.")
    if num_kv_blocks is not None and kv_cache_memory is not None:
        raise ConfigError(f"num_kv_blocks={num_kv_blocks} and kv_cache_memory={kv_cache_memory}: both size the KV cache; "
                          "pass one of them.")


def blocks_covering(positions: int, block_size: int) -> int:
    """Blocks holding positions [0, ``positions``): ceil(positions / block_size)."""
    return -(-positions // block_size)


def ring_size(reach: int, step_tokens: int, block_size: int) -> int:
    """Ring blocks per slot for layers attending at most ``reach`` positions back (the query's
    own included: a sliding window, or an attention chunk) when one step writes at most
    ``step_tokens`` positions per row. Position j lives at ring position j mod (ring_blocks *
    block_size) (``config.kv.ring_table``), and a step reads and writes positions [s - reach +
    1, s + step_tokens): ceil((reach + step_tokens - 1) / block_size) blocks keep them distinct,
    so no write lands on a position a read of the same or a later step still needs (a verify
    pass that rewinds rereads from s + 1 at the earliest)."""
    return blocks_covering(reach + step_tokens - 1, block_size)


def window_ring(ring_layers: Sequence[bool], reach: int, step_tokens: int, block_size: int,
                sequence_length: int) -> tuple[tuple[bool, ...], int | None]:
    """(ring_layers, ring_blocks) of ``KVLayout``: the window ring, :func:`ring_size` plus one
    block, when some layers but not all are windowed (``ring_layers``) and the ring holds fewer
    positions than ``sequence_length``, else ((), None): every layer through the block table."""
    # One block past the steps' need: a draft model (planned for decode steps) writes up to k - 1
    # drafts a verify pass may reject, which then fit for k <= block_size + 2 (runtime.check_draft_ring)
    ring = ring_size(reach, step_tokens, block_size) + 1
    if not any(ring_layers) or all(ring_layers) or ring * block_size >= sequence_length:
        return (), None
    return tuple(ring_layers), ring


def block_layout(num_layers: int, num_slots: int, num_kv_heads: int, sequence_length: int, head_dim: int, dtype: str,
                 block_size: int | None, num_kv_blocks: int | None, kv_cache_memory: int | None,
                 buckets: Sequence[tuple[str, Sequence[int]]], ring_layers: Sequence[bool] = (), reach: int = 0,
                 step_tokens: int = 1) -> KVLayout:
    """The blocks layout's KVLayout: ``block_size`` (None: :data:`DEFAULT_KV_BLOCK_SIZE`)
    positions per block and the request blocks ``num_kv_blocks``, or as many as
    ``kv_cache_memory`` bytes hold beside the window ring, or by default what the slots layout
    would hold ((num_slots - 1) requests of ``sequence_length``), plus one scratch block.
    ``buckets``: (name, ladder) of every token ladder a graph reads or writes through the table.
    ``ring_layers`` (per layer: windowed, attending at most ``reach`` positions back) and
    ``step_tokens`` (positions a step writes per row at most) size the window ring
    (:func:`window_ring`).

    Raises ConfigError when the block size does not divide ``sequence_length`` or a bucket (a
    graph reads whole blocks), or when the budget holds fewer blocks than one request of
    ``sequence_length`` needs (it could never finish alone)."""
    bs = DEFAULT_KV_BLOCK_SIZE if block_size is None else block_size
    for name, ladder in (("sequence_length", (sequence_length,)), *buckets):
        bad = [k for k in ladder if k % bs]
        if bad:
            raise ConfigError(f"kv_block_size={bs} does not divide {name} {bad}: a graph reads and writes whole blocks; "
                              f"pick a block size dividing every bucket (e.g. {_common_divisor(bs, bad)}) or buckets that are "
                              f"multiples of {bs}.")
    per_seq = blocks_covering(sequence_length, bs)
    ring_layers, ring = window_ring(ring_layers, reach, step_tokens, bs, sequence_length)
    width = head_dim + (INT8_SCALE_BYTES if dtype == "int8" else 0)
    layer_block = 2 * num_kv_heads * bs * width * dtype_bytes(dtype)  # one block of one layer, K and V
    block_bytes = (num_layers - sum(ring_layers)) * layer_block
    ring_bytes = sum(ring_layers) * ((num_slots - 1) * ring + 1) * layer_block if ring else 0
    if num_kv_blocks is not None:
        count, source = num_kv_blocks, f"num_kv_blocks={num_kv_blocks}"
    elif kv_cache_memory is not None:
        count = max(kv_cache_memory - ring_bytes, 0) // block_bytes
        source = f"kv_cache_memory={kv_cache_memory} bytes ({ring_bytes} for the window ring, {block_bytes} a block)"
    else:
        count, source = (num_slots - 1) * per_seq, "the default"
    if count < per_seq:
        raise ConfigError(f"{source} gives {count} KV blocks, fewer than the {per_seq} one request of sequence_length="
                          f"{sequence_length} needs at kv_block_size={bs}: raise the budget to at least {per_seq} blocks "
                          f"({per_seq * block_bytes + ring_bytes} bytes) or lower sequence_length.")
    return KVLayout(num_layers=num_layers, num_slots=num_slots, num_kv_heads=num_kv_heads, sequence_length=sequence_length,
                    head_dim=head_dim, dtype=dtype, block_size=bs, num_blocks=count + 1, ring_layers=ring_layers,
                    ring_blocks=ring)


def _common_divisor(bs: int, ladder: Sequence[int]) -> int:
    """The largest multiple of :data:`KEYS_PER_STEP` dividing ``bs`` and every value of ``ladder``
    (KEYS_PER_STEP when none does)."""
    for d in range(bs, KEYS_PER_STEP - 1, -KEYS_PER_STEP):
        if d % KEYS_PER_STEP == 0 and all(k % d == 0 for k in (bs, *ladder)):
            return d
    return KEYS_PER_STEP


def request_blocks(prompt_len: int, max_tokens: int | None, sequence_length: int, speculation_length: int,
                   block_size: int) -> int:
    """Blocks a request may hold at most: its prompt, ``max_tokens`` (None: up to
    ``sequence_length``) and the ``speculation_length`` positions a last verify pass may write
    past them, capped at ``sequence_length``. What a scheduler without preemption reserves."""
    end = sequence_length if max_tokens is None else prompt_len + max_tokens + speculation_length
    return blocks_covering(min(end, sequence_length), block_size)


def admissible(free: int, outstanding: int, wanted: Sequence[int]) -> int:
    """How many of the requests ``wanted`` (blocks each may hold, oldest first) can be admitted,
    in order, when ``free`` blocks are free and the running requests may still take
    ``outstanding`` of them: the longest prefix whose total fits ``free - outstanding``."""
    room, count = free - outstanding, 0
    for want in wanted:
        if want > room:
            break
        room, count = room - want, count + 1
    return count
