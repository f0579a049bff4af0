"""The decode-type phases: T new tokens per row at position_ids (B, T) against the slot's cache.
Decode and draft run T = 1 and sample, greedy runs T = 1 and takes the argmax; speculate
runs T = k and returns the logits at every position with their argmax and finiteness
(acceptance runs on the host); the draft
runs the first ``draft_layers`` layers."""

from __future__ import annotations

import torch

from neuronfx.config.inputs import DecodeInputs, GreedyInputs, SamplerInputs, SpeculateInputs
from neuronfx.config.masks import decode_mask
from neuronfx.config.plan import Plan
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.kv_rows import block_writes, pool_tables
from neuronfx.graphs.models.layers import LayerWeights
from neuronfx.graphs.models.ops import Ops
from neuronfx.graphs.phases.common import embed_tokens, greedy_head, head, layer_pool, layer_tables, logits, mask_stack
from neuronfx.graphs.phases.inputs import KVPairs
from neuronfx.graphs.phases.records import DecodeHidden
from neuronfx.graphs.phases.sampling import sample

Tensor = torch.Tensor


def decode_prologue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, embed: Tensor,
                    inputs: DecodeInputs | GreedyInputs | SpeculateInputs) -> DecodeHidden:
    """ids/positions (B, T): T = 1 for decode, greedy and draft, k for speculate; a row then holds its
    last position + 1 tokens -> the layers' record, masks (M, B, 1, T, S = bucket), and the
    block and offset each token writes through the row's block table."""
    position_ids = inputs.position_ids
    h, cos, sin = embed_tokens(plan, ops, math, embed, inputs.input_ids, position_ids, position_ids.amax(-1) + 1)
    mask = mask_stack(plan, decode_mask, position_ids, bucket)  # (M, B, 1, T, S)
    tables = pool_tables(plan.kv, plan.layout.masks, inputs.block_table, inputs.seq_ids)  # (G, B, N)
    blocks, offsets = block_writes(tables, position_ids, plan.kv.positions_per_block)
    return DecodeHidden(h, cos, sin, mask, tables, blocks, offsets)


def decode_layers(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, lws: list[LayerWeights], kv: KVPairs,
                  x: DecodeHidden) -> Tensor:
    """``len(lws)`` consecutive layers of the family's decoder layer -> h (B, T, hidden). Each
    writes K/V of the T new tokens at ``x.positions`` into each slot, then attends positions
    [0, bucket) masked to ``j <= position`` (and the layer's window)
    (``config.kv.decode_access`` / ``speculate_access``) with ``ops.cached_attention``, which
    never lets positions past the row's last new token through (they may hold anything: stale
    rows, rejected speculation, NaN). The bucket is read from the mask's shape (S), not from
    ``bucket``, so one compiled group with a dynamic S serves every bucket of the phase
    (``backends/inductor_parts.py``)."""
    h, offsets = x.h, x.offsets
    for lw, (k_cache, v_cache) in zip(lws, kv):
        layer_cos, layer_sin, layer_mask = layer_tables(plan, lw, x.cos, x.sin, x.mask)

        def attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor = k_cache, v_cache: Tensor = v_cache,
                   mask: Tensor = layer_mask, blocks: Tensor = layer_pool(plan, lw, x.blocks),
                   table: Tensor = layer_pool(plan, lw, x.block_table)) -> Tensor:
            ops.store_kv(k_cache, v_cache, blocks, offsets, k.transpose(1, 2), v.transpose(1, 2))  # (B, T, n_kv, D)
            return ops.cached_attention(q, k_cache, v_cache, table, mask.shape[-1], mask)  # mask (B, 1, T, S)

        h = math.decoder_layer(plan.local_model, ops, lw, h, layer_cos, layer_sin, attend)
    return h


def decode_epilogue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor, x: DecodeHidden,
                    sampler: SamplerInputs) -> dict[str, Tensor]:
    """h (B, 1, hidden) -> the sampled token, logprobs, logits and finiteness of each row (``common.head``)."""
    return head(plan, ops, math, norm, lm_head, x.h[:, 0], sampler)


def greedy_epilogue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor,
                    x: DecodeHidden) -> dict[str, Tensor]:
    """h (B, 1, hidden) -> {"tokens": (B,) int32 argmax of each row's logits, "finite": (B,)
    bool} (and "logits" (B, V) float32 with ``output_logits``). For rows whose sampler would take
    the argmax of logits it leaves unchanged (``runtime.acceptance.raw_argmax``: greedy, no
    penalty, bias or grammar, no logprobs), the same token as ``decode_epilogue``'s without
    its passes over the vocabulary (``common.greedy_head``)."""
    return greedy_head(plan, ops, math, norm, lm_head, x.h[:, 0])


def speculate_epilogue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor,
                       x: DecodeHidden) -> dict[str, Tensor]:
    """{"logits": (B, k, V) float32 at every verified position, "argmax": (B, k) int32 the first
    index of each position's largest logit (as ``torch.argmax``), "finite": (B, k) bool, False
    where a position's logits hold NaN/inf}; acceptance runs on the host. The argmax and the
    finiteness come from the graph because on the host each is a pass over (B, k, V) logits
    that the weights' streaming left cold (0.3-0.4 ms each a 5-row step, measured on SmolLM2)."""
    out = logits(plan, ops, math, norm, lm_head, x.h)  # (B, k, V)
    argmax, finite = ops.argmax(out)
    return {"logits": out, "argmax": argmax, "finite": finite}


def draft_epilogue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor, x: DecodeHidden,
                   sampler: SamplerInputs) -> dict[str, Tensor]:
    """The draft's sampled token (B,) and its logits (B, V) (rejection sampling needs q)."""
    out = logits(plan, ops, math, norm, lm_head, x.h[:, 0])
    return sample(out, sampler, plan.topk_width, 0, ops.topk) | {"logits": out}
