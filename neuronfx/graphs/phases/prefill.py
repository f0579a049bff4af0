"""The prefill phase: right-padded prompts (B, bucket) written into their slots from position 0,
sampled at each row's last real token. Its epilogue also serves the chunk phase."""

from __future__ import annotations

import torch

from neuronfx.config.inputs import EmbedInputs, PrefillInputs, SamplerInputs
from neuronfx.config.masks import prefill_mask
from neuronfx.config.plan import Plan
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.kv_rows import block_writes, pool_tables
from neuronfx.graphs.models.layers import LayerWeights
from neuronfx.graphs.models.ops import Ops
from neuronfx.graphs.phases.common import embed_tokens, head, last_rows, layer_pool, layer_tables, mask_stack
from neuronfx.graphs.phases.inputs import KVPairs
from neuronfx.graphs.phases.records import ChunkHidden, PrefillHidden

Tensor = torch.Tensor


def sequence_parallel_tokens(plan: Plan, bucket: int) -> int:
    """Tokens a prefill graph of ``bucket`` runs: ``bucket`` rounded up to a multiple of
    tp_degree under sequence parallelism (each rank holds an equal sequence shard), else
    ``bucket``. The extra positions are padding: never attended, never written to the cache."""
    tp = plan.tp_degree
    return -(-bucket // tp) * tp if plan.inference.sequence_parallel else bucket


def prompt_hidden(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, embed: Tensor,
                  inputs: PrefillInputs | EmbedInputs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What prefill and embed graphs compute from their prompts: (h (B, T, hidden), RoPE cos/sin
    (R, B, 1, T, head_dim), the causal prompt masks (M, B, 1, T, T) of the attention layout's
    kinds, the token ids (B, T)). Sequence-parallel prefill pads T to
    :func:`sequence_parallel_tokens` and h is this rank's shard (B, T / tp, hidden)."""
    input_ids, position_ids = inputs.input_ids, inputs.position_ids
    t = sequence_parallel_tokens(plan, bucket)
    if t != bucket:
        input_ids = torch.nn.functional.pad(input_ids, (0, t - bucket))
        position_ids = torch.nn.functional.pad(position_ids, (0, t - bucket))
    h, cos, sin = embed_tokens(plan, ops, math, embed, input_ids, position_ids, inputs.prompt_lens)
    mask = mask_stack(plan, prefill_mask, inputs.prompt_lens, t)  # (M, B, 1, T, T)
    return h, cos, sin, mask, input_ids


def prefill_prologue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, embed: Tensor, inputs: PrefillInputs) -> PrefillHidden:
    """The step inputs (ids/positions (B, T = bucket), block_table (B, N), prompt_lens (B,)) ->
    the layers' record (:func:`prompt_hidden`) with the block and offset of every position
    [0, bucket) of each row."""
    h, cos, sin, mask, input_ids = prompt_hidden(plan, bucket, ops, math, embed, inputs)
    # Every position of the bucket is written (pads past the prompt too, never attended), not
    # position_ids, whose pads repeat the last real position: they would overwrite its K/V.
    written = torch.arange(bucket, device=input_ids.device).expand(input_ids.shape[0], bucket)
    masks = plan.layout.masks
    blocks, offsets = block_writes(pool_tables(plan.kv, masks, inputs.block_table, inputs.seq_ids), written,
                                   plan.kv.positions_per_block)  # (G, B, T)
    if plan.kv.ring_blocks:  # the ring keeps the prompt's last positions it holds; the rest and the pads go to scratch
        lens = inputs.prompt_lens[:, None]
        kept = (written < lens) & (written >= lens - plan.kv.ring_blocks * plan.kv.positions_per_block)
        scratch = torch.full_like(blocks[0], plan.kv.scratch_ring_block)
        blocks = torch.stack([b if kind == "full" else torch.where(kept, b, scratch) for kind, b in zip(masks, blocks)])
    return PrefillHidden(h, cos, sin, mask, blocks, offsets, (inputs.prompt_lens - 1).long(), input_ids)


def prefill_layers(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, lws: list[LayerWeights], kv: KVPairs,
                   x: PrefillHidden) -> Tensor:
    """``len(lws)`` consecutive layers of the family's decoder layer -> h (B, T, hidden). Each
    writes K/V positions [0, bucket) of each row through its block table
    (``config.kv.prefill_access``: positions past the row's blocks land in the scratch block); the
    prompt attends only itself, so nothing is read from the cache. Without sequence
    parallelism the bucket is read from k's shape (T), not from ``bucket``, so one compiled group
    with a dynamic T serves every prefill bucket (``backends/inductor_parts.py``)."""
    h = x.h
    # Every layer full-attention: real tokens see only earlier ones, so causal attention (SDPA's
    # flag, or the kernel) gives them the mask's result (pad rows differ; nothing reads them)
    # with half the work.
    causal = plan.layout.masks == ("full",) and not plan.inference.sequence_parallel
    lengths = x.last + 1  # each row's prompt tokens: the attention kernel skips the pads after them
    for lw, (k_cache, v_cache) in zip(lws, kv):
        layer_cos, layer_sin, layer_mask = layer_tables(plan, lw, x.cos, x.sin, x.mask)

        def attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor = k_cache, v_cache: Tensor = v_cache,
                   mask: Tensor = layer_mask, written: Tensor = layer_pool(plan, lw, x.blocks)) -> Tensor:
            n = bucket if plan.inference.sequence_parallel else k.shape[2]  # sequence parallel pads T past the bucket
            blocks, offsets = written[:, :n], x.offsets[:, :n]  # (B, n)
            ops.store_kv(k_cache, v_cache, blocks, offsets, k[:, :, :n].transpose(1, 2), v[:, :, :n].transpose(1, 2))  # (B, n, n_kv, D)
            return ops.causal_attention(q, k, v, lengths) if causal else ops.attention(q, k, v, mask)

        h = math.decoder_layer(plan.local_model, ops, lw, h, layer_cos, layer_sin, attend)
    return h


def prefill_epilogue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor,
                     x: PrefillHidden | ChunkHidden, sampler: SamplerInputs) -> dict[str, Tensor]:
    """Output for the last real token of each row (``x.last``; chunk graphs too); sequence-
    parallel prefill first gathers the ranks' sequence shards."""
    return head(plan, ops, math, norm, lm_head, last_rows(ops.parallel_in(x.h), x.last), sampler)
