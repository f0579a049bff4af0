"""The block manager of the blocks KV layout (``kv_layout="blocks"``): which blocks each request
slot owns, reference counts, and the copy-on-write of shared blocks.

A slot's block table lists the blocks holding its positions in order, then the scratch block in
every column it does not own (``config.kv.KVLayout``); a step's graph reads and writes only
through the tables of its rows (``pipeline.step_inputs``). Before a step writes positions
[start, end) of a slot, :func:`reserve` gives the slot fresh blocks up to ``end`` and copies any
block in [start, end) another slot also holds (a fork shares its prompt's blocks,
:func:`share`), so no write lands in a block another request reads. Both are host tensors of the
state, updated in place like its output counts (a consumed state is never used again).
The slots layout has no tables: a row's table is ``[slot]`` (:func:`table_rows`).

vLLM's ``KVCacheManager`` / ``BlockPool`` (free list, ref counts, copy-on-write of a partial
block) is the model.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from neuronfx.config.kv_blocks import blocks_covering
from neuronfx.config.plan import Plan
from neuronfx.errors import KVCacheFullError
from neuronfx.graphs.phases.inputs import KVCache

Tensor = torch.Tensor


@attrs.frozen(eq=False)
class BlockTables:
    """The blocks layout's bookkeeping, host tensors updated in place:

    - ``tables``: (request slots, N) int32, each slot's blocks in position order, then the
      scratch block (N = ``plan.kv.max_blocks_per_seq``).
    - ``refs``: (num_blocks,) int32, the slots (and prefix-cache entries) holding each block
      (0: free; the scratch block stays 0 and is never handed out).
    - ``cached``: with prefix caching, (prefix-cache blocks,) int32: the KV block each block of
      the prefix store (``prefix_store.Entry.block``) holds, the scratch block for none; the
      cache holds one reference on each. None without prefix caching.
    """

    tables: Tensor
    refs: Tensor
    cached: Tensor | None = None


def empty_blocks(plan: Plan, prefix_blocks: int = 0) -> BlockTables | None:
    """Fresh tables for ``plan``'s blocks layout (every slot owning nothing; ``prefix_blocks``
    empty prefix-cache entries when > 0), None for slots."""
    kv = plan.kv
    if not kv.paged:
        return None
    tables = torch.full((kv.num_slots - 1, kv.max_blocks_per_seq), kv.scratch_block, dtype=torch.int32)
    cached = torch.full((prefix_blocks,), kv.scratch_block, dtype=torch.int32) if prefix_blocks else None
    return BlockTables(tables=tables, refs=torch.zeros(kv.total_blocks, dtype=torch.int32), cached=cached)


def owned(plan: Plan, blocks: BlockTables, slot: int) -> int:
    """Blocks ``slot`` holds (its table's columns before the first scratch entry)."""
    return _held(plan, blocks, [slot])[0]


def free_count(plan: Plan, blocks: BlockTables) -> int:
    """Blocks no slot holds, the scratch block excluded."""
    return int(np.count_nonzero(blocks.refs.numpy()[: plan.kv.scratch_block] == 0))


def _held(plan: Plan, blocks: BlockTables, slots: Sequence[int]) -> list[int]:
    """:func:`owned` of each of ``slots``, in one array op (a decode step asks for every row).
    The bookkeeping reads the host tensors through numpy views (the same memory): a small numpy
    op costs about 1 us where a torch op costs 3-5, and a batch-1 decode step of the blocks
    layout ran about 80 us of them (2026-12-07)."""
    if not slots:
        return []
    return (blocks.tables.numpy()[list(slots)] != plan.kv.scratch_block).sum(1).tolist()


def _written_held(plan: Plan, blocks: BlockTables, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                  held: Sequence[int]) -> tuple[list[tuple[int, int]], list[bool]]:
    """The (slot, column) of each held block that rows writing positions [starts[b], ends[b]) of
    ``slots[b]`` write into, in row then column order, and whether another slot shares it now
    (its reference count above 1), gathered in one op for all rows."""
    bs = plan.kv.block_size
    pairs = [(s, col) for s, start, end, h in zip(slots, starts, ends, held)
             for col in range(start // bs, min(h, blocks_covering(end, bs)))]
    if not pairs:
        return [], []
    rows, cols = zip(*pairs)
    ids = blocks.tables.numpy()[list(rows), list(cols)]
    return pairs, (blocks.refs.numpy()[ids] > 1).tolist()


def blocks_needed(plan: Plan, blocks: BlockTables | None, slots: Sequence[int], starts: Sequence[int],
                  ends: Sequence[int]) -> int:
    """Fresh blocks :func:`reserve` takes for rows writing positions [starts[b], ends[b]) of
    ``slots[b]``: those past each slot's held blocks, plus a copy of each held block in the
    range that another slot shares. 0 for the slots layout."""
    if blocks is None:
        return 0
    held = _held(plan, blocks, slots)
    return _need(plan, ends, held, _written_held(plan, blocks, slots, starts, ends, held)[1])


def _need(plan: Plan, ends: Sequence[int], held: Sequence[int], shared: Sequence[bool]) -> int:
    """Fresh blocks for rows ending at ``ends`` that hold ``held`` blocks: those past the held
    ones, plus one per shared block they write (:func:`_written_held`)."""
    bs = plan.kv.block_size
    return sum(max(0, blocks_covering(end, bs) - h) for end, h in zip(ends, held)) + sum(shared)


def check_blocks(plan: Plan, blocks: BlockTables | None, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> None:
    """Raise KVCacheFullError when the rows' writes need more blocks than are free (nothing changes)."""
    if blocks is None:
        return
    _check_free(plan, blocks, blocks_needed(plan, blocks, slots, starts, ends))


def _check_free(plan: Plan, blocks: BlockTables, need: int) -> None:
    """KVCacheFullError when ``need`` fresh blocks are more than are free."""
    if need == 0:  # most decode steps write inside a block they hold: no count of the free ones
        return
    free = free_count(plan, blocks)
    if need > free:
        raise KVCacheFullError(
            f"this step needs {need} free KV blocks of {plan.kv.block_size} positions and {free} are free "
            f"({plan.kv.total_blocks - 1} in all); release a request (or let the scheduler preempt one), or compile with a "
            "larger num_kv_blocks / kv_cache_memory.")


def _take(plan: Plan, blocks: BlockTables, count: int) -> list[int]:
    """``count`` free blocks, lowest first, now held once."""
    free = torch.nonzero(blocks.refs[: plan.kv.scratch_block] == 0).flatten()[:count]
    blocks.refs[free] = 1
    return free.tolist()


def inside_own_blocks(plan: Plan, blocks: BlockTables, slots: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> bool:
    """Whether every row writes positions [starts[b], ends[b]) inside one block ``slots[b]``
    already holds and no other slot shares: then :func:`reserve` has nothing to do (a decode
    step's rows but at each block's first position). One gather for all rows: a step's host code
    runs cold after its graph, and reserve's full bookkeeping took about 190 us of a batch-8
    decode step (SmolLM2, 2026-12-07)."""
    bs = plan.kv.block_size
    cols = [start // bs for start in starts]
    if any(end > (col + 1) * bs for col, end in zip(cols, ends)):
        return False
    # A held block no other slot shares counts 1; the scratch block (a column not held) counts 0.
    return bool((blocks.refs.numpy()[blocks.tables.numpy()[list(slots), cols]] == 1).all())


def reserve(plan: Plan, kv: KVCache, blocks: BlockTables | None, slots: Sequence[int], starts: Sequence[int],
            ends: Sequence[int]) -> None:
    """Make rows' positions [starts[b], ends[b]) of ``slots[b]`` writable: shared blocks in the
    range copied to fresh ones (every layer's K and V), fresh blocks past the held ones. Raises
    KVCacheFullError first when too few are free. Nothing to do for the slots layout."""
    if blocks is None or inside_own_blocks(plan, blocks, slots, starts, ends):
        return
    bs, held = plan.kv.block_size, _held(plan, blocks, slots)
    pairs, shared = _written_held(plan, blocks, slots, starts, ends, held)
    _check_free(plan, blocks, _need(plan, ends, held, shared))
    # Row by row: its shared blocks copied (copy-on-write), then its fresh ones. Counts only fall
    # here, so a block shared at the start may be this row's own by its turn (checked again), and
    # no block can have become shared.
    todo = iter(zip(pairs, shared))
    for s, start, end, h in zip(slots, starts, ends, held):
        want = blocks_covering(end, bs)
        for (_, col), was_shared in itertools.islice(todo, max(0, min(h, want) - start // bs)):
            if not was_shared:
                continue
            old = int(blocks.tables[s, col])
            if int(blocks.refs[old]) > 1:
                (new,) = _take(plan, blocks, 1)
                for i, layer in enumerate(kv):
                    if not plan.kv.in_ring(i):  # a ring layer's blocks are its slot's own
                        layer.k[new].copy_(layer.k[old])
                        layer.v[new].copy_(layer.v[old])
                blocks.refs[old] -= 1
                blocks.tables[s, col] = new
        if want > h:
            blocks.tables[s, h:want] = torch.tensor(_take(plan, blocks, want - h), dtype=torch.int32)


def share(plan: Plan, blocks: BlockTables | None, source: int, slot: int, positions: int) -> None:
    """Free ``slot`` takes ``source``'s blocks holding positions [0, ``positions``) by reference
    (a fork of its prompt); the first write into a shared block copies it (:func:`reserve`)."""
    if blocks is None:
        return
    count = blocks_covering(positions, plan.kv.block_size)
    ids = blocks.tables[source, :count]
    blocks.tables[slot, :count] = ids
    blocks.refs[ids.long()] += 1


def copy_ring(plan: Plan, kv: KVCache, sources: Sequence[int], slots: Sequence[int]) -> None:
    """Slots ``slots[b]`` take copies of ``sources[b]``'s window ring (every ring layer, K and V:
    a fork's window, which slots cannot share; ``config.kv.KVLayout``). Nothing without a ring."""
    w = plan.kv.ring_blocks
    if not w:
        return
    for i, layer in enumerate(kv):
        if plan.kv.in_ring(i):
            for t in (layer.k, layer.v):
                for src, dst in zip(sources, slots):
                    t[dst * w:(dst + 1) * w].copy_(t[src * w:(src + 1) * w])


def release(plan: Plan, blocks: BlockTables | None, slots: Sequence[int]) -> None:
    """``slots`` drop their blocks (a block no slot holds is free again); their tables point at
    the scratch block."""
    if blocks is None:
        return
    for s in slots:
        ids = blocks.tables[s, : owned(plan, blocks, s)].long()
        blocks.refs[ids] -= 1
        blocks.tables[s] = plan.kv.scratch_block


def table_rows(plan: Plan, blocks: BlockTables | None, slots: Sequence[int], rows: int) -> Tensor:
    """The block tables (``rows``, N) int32 of a graph's rows: ``slots``' tables, then padding rows
    all scratch. The slots layout: each row's ``[slot]``, padding rows the scratch slot."""
    kv = plan.kv
    if blocks is None:  # one tensor op: a step's host code runs cold after its graph, each op several us
        rest = [kv.scratch_block] * (kv.max_blocks_per_seq - 1)
        return torch.tensor([[s, *rest] for s in slots] + [[kv.scratch_block, *rest]] * (rows - len(slots)), dtype=torch.int32)
    if rows == len(slots):  # no padding rows: the gather is already a copy of its own (numpy's: 1 us, torch's 5)
        return torch.from_numpy(blocks.tables.numpy()[list(slots)])
    out = torch.full((rows, kv.max_blocks_per_seq), kv.scratch_block, dtype=torch.int32)
    out[: len(slots)] = blocks.tables[list(slots)]
    return out


# --- prefix caching: the store's blocks are KV blocks, shared by reference ----------------------------


def share_cached(plan: Plan, blocks: BlockTables, slot: int, entries: Sequence[int]) -> None:
    """Free ``slot`` takes the KV blocks of prefix-store blocks ``entries`` (a hit, in prompt
    order) as its first blocks, by reference: no copy."""
    if entries:
        ids = blocks.cached[list(entries)]
        blocks.tables[slot, : len(entries)] = ids
        blocks.refs[ids.long()] += 1


def adopt(plan: Plan, blocks: BlockTables, slot: int, placements: Sequence[tuple[int, int]]) -> None:
    """For each ``(j, entry)`` of a prefix-store insert: the store's block ``entry`` becomes
    ``slot``'s block j (a reference, no copy), dropping the one it held before (evicted)."""
    for j, entry in placements:
        old, new = int(blocks.cached[entry]), int(blocks.tables[slot, j])
        if old != plan.kv.scratch_block:
            blocks.refs[old] -= 1
        blocks.cached[entry] = new
        blocks.refs[new] += 1


def uncache(plan: Plan, blocks: BlockTables, entries: Sequence[int]) -> None:
    """Prefix-store blocks ``entries`` were evicted: drop their KV blocks' references."""
    for entry in entries:
        old = int(blocks.cached[entry])
        if old != plan.kv.scratch_block:
            blocks.refs[old] -= 1
        blocks.cached[entry] = plan.kv.scratch_block


def cache_only(plan: Plan, blocks: BlockTables, entry: int) -> bool:
    """Whether evicting prefix-store block ``entry`` frees its KV block (no slot holds it)."""
    kv_block = int(blocks.cached[entry])
    return kv_block != plan.kv.scratch_block and int(blocks.refs[kv_block]) == 1


def blocks_in_use(blocks: BlockTables) -> tuple[int, int]:
    """(blocks requests hold, blocks in all), the scratch block excluded: a cached block no slot
    holds counts as free, as vLLM counts its usage (it is evicted when blocks run short)."""
    total = int(blocks.refs.shape[0]) - 1  # the last block is the scratch block
    held = int((blocks.refs[:total] > 0).sum())
    if blocks.cached is not None:
        ids = blocks.cached[blocks.cached != total].long()
        held -= int((blocks.refs[ids] == 1).sum())
    return held, total
