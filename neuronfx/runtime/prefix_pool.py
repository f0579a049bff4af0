"""The prefix cache's tensors: a pool of KV blocks, and exact copies between it and a slot.

Design (issue 18, option (a)): a pool separate from the slots. Per layer one K and one V of
shape [num_blocks, num_kv_heads, block_size, row_width] in the cache's dtype; pool block i holds
the K/V of one cached prompt block (``runtime/prefix_store.py`` says which). A hit is copied into
the request's slot (:func:`copy_to_slot`) and a prefilled prompt's new full blocks out of it
(:func:`copy_to_pool`). Slots, batch capacity and every graph stay as they are; the memory bound
is the pool's size, fixed when the state is made. The copies are plain tensor indexing on the
host, outside the graphs: bit-exact.

Like the KV cache, the pool is updated in place: a state whose prefix cache was used is consumed
(``State`` lease) and the new state shares the pool.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from neuronfx.config.dtypes import dtype_bytes, torch_dtype
from neuronfx.config.plan import Plan
from neuronfx.config.serialization import unstructure
from neuronfx.graphs.phases.inputs import KVCache, LayerKV
from neuronfx.runtime.prefix_store import PrefixStore, empty_store


@attrs.frozen(kw_only=True, eq=False)
class PrefixCache:
    """A state's prefix cache: the block ``pool`` (one LayerKV per layer, each
    [num_blocks, num_kv_heads, block_size, head_dim]; empty in the blocks KV layout, where
    store block i is the KV block ``BlockTables.cached[i]``) and the ``store`` saying what it
    holds."""

    pool: KVCache
    store: PrefixStore


def num_prefix_blocks(plan: Plan) -> int:
    """Blocks the cache may hold: ``max_prefix_blocks``, or by default enough for every slot's
    longest prompt (``batch_size * max_context_length // prefix_block_size``, at least 1); in
    the blocks KV layout, whose cached blocks are KV blocks, every KV block by default."""
    inference = plan.inference
    if inference.max_prefix_blocks is not None:
        return inference.max_prefix_blocks
    if plan.kv.paged:
        return plan.kv.total_blocks - 1
    return max(1, inference.batch_size * inference.max_context_length // inference.prefix_block_size)


def pool_nbytes(plan: Plan) -> int:
    """Bytes of the pool of ``plan`` (all layers, K and V); 0 without prefix caching or in the
    blocks KV layout (its cached blocks are KV blocks, no pool of their own)."""
    inf, kv = plan.inference, plan.kv
    if not inf.enable_prefix_caching or kv.paged:
        return 0
    per_block = kv.num_kv_heads * inf.prefix_block_size * kv.row_width * dtype_bytes(kv.dtype)
    return 2 * kv.num_layers * num_prefix_blocks(plan) * per_block


def empty_prefix_cache(plan: Plan) -> PrefixCache | None:
    """A zero pool and an empty store for ``plan`` (:func:`pool_nbytes` bytes), or None when the
    plan does not cache prefixes."""
    inf, kv = plan.inference, plan.kv
    if not inf.enable_prefix_caching:
        return None
    n = num_prefix_blocks(plan)
    shape = (n, kv.num_kv_heads, inf.prefix_block_size, kv.row_width)

    def zeros() -> torch.Tensor:
        return torch.zeros(shape, dtype=torch_dtype(kv.dtype))

    pool = () if kv.paged else tuple(LayerKV(zeros(), zeros()) for _ in range(kv.num_layers))
    return PrefixCache(pool=pool, store=empty_store(inf.prefix_block_size, n))


def copy_to_slot(kv: KVCache, pool: KVCache, slot: int, blocks: Sequence[int]) -> None:
    """Write pool blocks ``blocks`` (in prompt order) to positions [0, len(blocks) * block_size)
    of ``slot``, every layer, K and V (in place)."""
    if not blocks:
        return
    idx = torch.tensor(list(blocks), dtype=torch.long)
    for layer, cached in zip(kv, pool):
        for dst, src in ((layer.k, cached.k), (layer.v, cached.v)):
            n, heads, b, d = len(blocks), src.shape[1], src.shape[2], src.shape[3]
            x = src.index_select(0, idx)  # (n, n_kv_heads, B, head_dim)
            dst[slot, :, : n * b].view(heads, n, b, d).copy_(x.permute(1, 0, 2, 3))  # one gather, one strided copy


def copy_to_pool(kv: KVCache, pool: KVCache, slot: int, placements: Sequence[tuple[int, int]]) -> None:
    """For each ``(j, block)``: write positions [j * block_size, (j + 1) * block_size) of
    ``slot`` to pool block ``block``, every layer, K and V (in place)."""
    if not placements:
        return
    b, n = pool[0].k.shape[2], len(placements)
    blocks = torch.tensor([blk for _, blk in placements], dtype=torch.long)
    first = placements[0][0]
    contiguous = [j for j, _ in placements] == list(range(first, first + n))  # the usual case: a prompt's new blocks
    positions = torch.cat([torch.arange(j * b, (j + 1) * b) for j, _ in placements])  # [n*B]
    for layer, cached in zip(kv, pool):
        for src, dst in ((layer.k, cached.k), (layer.v, cached.v)):
            heads, d = src.shape[1], src.shape[3]
            # (n_kv_heads, n*B, head_dim): a view when contiguous, else a gather
            x = src[slot, :, first * b:(first + n) * b] if contiguous else src[slot].index_select(1, positions)
            dst.index_copy_(0, blocks, x.reshape(heads, n, b, d).permute(1, 0, 2, 3))


def _digest_into(h: Any, value: Any) -> None:
    """Feed ``value`` (weights: nested dicts / lists of tensors and plain values) to ``h``."""
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous()
        h.update(f"T{tuple(t.shape)}{t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(f"D{len(value)};".encode())
        for k in sorted(value, key=str):
            h.update(f"K{k!s};".encode())
            _digest_into(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)};".encode())
        for v in value:
            _digest_into(h, v)
    else:
        h.update(f"V{value!r};".encode())


def identity_key(plan: Plan, weights: Any) -> bytes:
    """sha256 of (model config, inference config, tensor-parallel rank, every byte of the
    weights): the extra key every prefix-cache hash chain starts from, so a cached block is
    reused only on the same weights and the same plan. Hashes the whole weights (SmolLM2-135M
    fp32, 540 MB: about 0.4 s), so a runtime computes it once; b"" when the plan does not cache
    prefixes."""
    if not plan.inference.enable_prefix_caching:
        return b""
    h = hashlib.sha256()
    h.update(json.dumps({"model": unstructure(plan.model), "inference": unstructure(plan.inference), "rank": plan.rank},
                        sort_keys=True).encode())
    _digest_into(h, weights)
    return h.digest()
