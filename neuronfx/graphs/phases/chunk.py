"""The chunk phase: prefill at an offset, T = ``prefill_chunk_size`` prompt tokens per row
against the slot's cache, sampled at each row's last real token (``prefill.prefill_epilogue``)."""

from __future__ import annotations

import torch

from neuronfx.config.inputs import ChunkInputs
from neuronfx.config.kv import pad_writes
from neuronfx.config.masks import chunk_mask
from neuronfx.config.plan import Plan
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.kv_rows import block_writes, load_rows, pool_scratch, pool_tables, window_rows
from neuronfx.graphs.models.layers import LayerWeights
from neuronfx.graphs.models.ops import Ops
from neuronfx.graphs.phases.common import embed_tokens, layer_pool, layer_tables, mask_stack
from neuronfx.graphs.phases.inputs import KVPairs
from neuronfx.graphs.phases.records import ChunkHidden

Tensor = torch.Tensor


def chunk_prologue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, embed: Tensor, inputs: ChunkInputs) -> ChunkHidden:
    """ids/positions (B, T), block_table (B, N), chunk_lens / seq_lens (B,) -> the layers' record: h (B,
    T, hidden), RoPE cos/sin (R, B, 1, T, D) for rows whose whole prompt holds ``seq_lens``
    tokens (prefill picks its length-dependent RoPE table from the prompt length too), the masks
    (M, B, 1, T, S) (``config.masks.chunk_mask``) and the block and offset each token writes
    (B, T) int64: through the row's table for real tokens, the scratch block for pads
    (``config.kv.pad_writes``)."""
    input_ids, position_ids = inputs.input_ids, inputs.position_ids
    h, cos, sin = embed_tokens(plan, ops, math, embed, input_ids, position_ids, inputs.seq_lens)
    tables = pool_tables(plan.kv, plan.layout.masks, inputs.block_table, inputs.seq_ids)  # (G, B, N)
    blocks, offsets = block_writes(tables, position_ids, plan.kv.positions_per_block)
    scratch = pool_scratch(plan.kv, plan.layout.masks)
    writes = torch.stack([pad_writes(b, inputs.chunk_lens, scratch[p]) for p, b in enumerate(blocks)])  # (G, B, T)
    mask = mask_stack(plan, chunk_mask, position_ids, bucket)  # (M, B, 1, T, S)
    return ChunkHidden(h, cos, sin, mask, tables, writes, offsets, (inputs.chunk_lens - 1).long(), input_ids)


def chunk_layers(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, lws: list[LayerWeights], kv: KVPairs,
                 x: ChunkHidden) -> Tensor:
    """``len(lws)`` consecutive layers -> h (B, T, hidden). Each writes the K/V of the chunk's
    tokens at ``x.offsets`` of ``x.blocks`` (real tokens: the row's blocks; pads: the scratch
    block, ``config.kv.chunk_access``), then attends the row's blocks over [0, bucket)
    masked to ``j <= position``: the window is copied out, positions no token attends are
    zeroed (a masked NaN still poisons SDPA) and ``ops.attention`` (SDPA) runs on it, which at
    T = a chunk's hundreds of tokens beats the decode kernel's per-element reductions. The
    bucket is read from the mask's shape (S), so one compiled group with a dynamic S serves every
    chunk bucket (``backends/inductor_parts.py``)."""
    h, n = x.h, x.mask.shape[-1]
    for lw, (k_cache, v_cache) in zip(lws, kv):
        layer_cos, layer_sin, layer_mask = layer_tables(plan, lw, x.cos, x.sin, x.mask)

        def attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor = k_cache, v_cache: Tensor = v_cache,
                   mask: Tensor = layer_mask, blocks: Tensor = layer_pool(plan, lw, x.blocks),
                   table: Tensor = layer_pool(plan, lw, x.block_table)) -> Tensor:
            ops.store_kv(k_cache, v_cache, blocks, x.offsets, k.transpose(1, 2), v.transpose(1, 2))  # (B, T, n_kv, D)
            hidden = ~mask.any(dim=2)[..., None]  # (B, 1, S, 1): attended by no token of the row
            keys = load_rows(window_rows(k_cache, table, n), q.dtype).masked_fill(hidden, 0.0)  # (B, n_kv, S, D)
            values = load_rows(window_rows(v_cache, table, n), q.dtype).masked_fill(hidden, 0.0)
            return ops.attention(q, keys, values, mask)

        h = math.decoder_layer(plan.local_model, ops, lw, h, layer_cos, layer_sin, attend)
    return h
