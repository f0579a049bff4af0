"""Fused speculation (``InferenceConfig.fused_speculation``, NxDI's fused speculation): a
speculate step as one call, :func:`fused_step`, from one input record built once on the host
(:func:`fused_inputs`): the drafter's k - 1 passes, each draft sampled inside its graph and fed
straight to the next pass, the target's verify pass of k tokens per row, and the acceptance of
every row at once (``graphs/phases/speculation.py``), the counts and min_tokens bias of each
position derived from the record in between; no host step, no token read back, until the call
returns each row's emitted tokens. A drafter with its own cache (a draft runtime) needs its last
draft cached only when a row accepted every draft: that k-th pass runs, inside the call, only
then (NxDI's draft runs k times every step; here a k-th pass in every step made a fused step
1.10-1.13x the unfused one, SmolLM2 with an 8-layer draft, more than fusing saves:
docs/usage/speculation.md#fused-speculation).

The same uniforms, samplers and functions as unfused speculation (``speculate.py``), so a step
emits the same tokens fused or not. ``speculate.speculate`` chooses it; rows with structured
outputs (a host grammar masks each draft) speculate unfused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.inputs import DecodeInputs, FusedSpeculateInputs, SamplerInputs, SpeculateInputs
from neuronfx.config.plan import bitmask_words
from neuronfx.config.sampling import SamplingParams, pack_sampling
from neuronfx.graphs.phases.device import device_scope, plan_device, to_device, to_host
from neuronfx.graphs.phases.inputs import KVCache
from neuronfx.graphs.phases.sampling import sample
from neuronfx.graphs.phases.speculation import accept_rows, position_sampler, stack_positions, with_drafts
from neuronfx.runtime.acceptance import RowFacts, Uniforms
from neuronfx.runtime.batch import dense_record, logits_bias, pad, pad_rows, stop_ids
from neuronfx.runtime.blocks import BlockTables, table_rows
from neuronfx.runtime.runtime import Runtime

Tensor = torch.Tensor


def batch_rows(runtime: Runtime, drafter: Runtime, n: int) -> tuple[int, int]:
    """(the target's batch bucket, the drafter's) for ``n`` rows."""
    return (select_bucket(runtime.plan.batch_buckets, n, "batch rows"), select_bucket(drafter.plan.batch_buckets, n, "batch rows"))


def fused_inputs(runtime: Runtime, drafter: Runtime, rows: RowFacts, x0: Sequence[int], starts: Sequence[int],
                 u: Uniforms, blocks: BlockTables | None, draft_blocks: BlockTables | None) -> FusedSpeculateInputs:
    """The step's record for the n rows of ``rows`` (last tokens ``x0``, cache_lens ``starts``,
    uniforms ``u``), padded to the larger of the two batch buckets with greedy rows in each
    runtime's scratch slot. ``drafter``: the runtime whose graphs draft (``runtime`` itself for
    self-speculation; a draft runtime holds the same slots). ``blocks`` / ``draft_blocks``: the
    two states' block tables (``blocks.table_rows``; None for the slots layout), already
    holding every position the step writes."""
    n, model = len(rows.slots), runtime.plan.model
    size = max(batch_rows(runtime, drafter, n))
    params = list(rows.params) + [SamplingParams()] * (size - n)
    stop_mask = torch.zeros(size, model.vocab_size, dtype=torch.bool)
    for r, (sp, done) in enumerate(zip(rows.params, rows.generated)):
        if done < sp.min_tokens:
            stop_mask[r, stop_ids(model.eos_token_ids, sp)] = True

    def ints(values: Sequence[int], fill: int) -> Tensor:
        return torch.tensor(pad(values, size, fill), dtype=torch.int32)

    return FusedSpeculateInputs(
        input_ids=ints(x0, 0), position_ids=ints(starts, 0), seq_ids=ints(rows.slots, runtime.plan.kv.scratch_slot),
        draft_seq_ids=ints(rows.slots, drafter.plan.kv.scratch_slot),
        block_table=table_rows(runtime.plan, blocks, rows.slots, size),
        draft_block_table=table_rows(drafter.plan, draft_blocks, rows.slots, size),
        sampling_params=torch.tensor(pack_sampling(params, runtime.plan.topk_width), dtype=torch.float32),
        draft_sampling_params=torch.tensor(pack_sampling(params, drafter.plan.topk_width), dtype=torch.float32),
        output_counts=pad_rows(rows.counts, size), prompt_mask=pad_rows(rows.prompt_mask, size),
        # generated = min_tokens: the request's logit_bias alone (the held-back stop ids are stop_mask's)
        logits_bias=logits_bias(runtime, rows.params, [sp.min_tokens for sp in rows.params], size),
        stop_mask=stop_mask, min_tokens_left=ints([max(0, sp.min_tokens - g) for sp, g in zip(rows.params, rows.generated)], 0),
        draft_rand=pad_rows(u.draft, size), accept_rand=pad_rows(u.accept, size), final_rand=pad_rows(u.final, size),
    )


def _first(record: SamplerInputs, rows: int) -> SamplerInputs:
    return SamplerInputs(*(t[:rows] for t in record))


def fused_step(runtime: Runtime, drafter: Runtime, phase: str, kv: KVCache, draft_kv: KVCache, inputs: FusedSpeculateInputs,
               n: int, starts: Sequence[int], sampled: bool, raw: bool = False) -> dict[str, Tensor]:
    """One fused speculate step of the n rows of ``inputs`` (cache_lens ``starts``): the
    drafter's ``phase`` graphs ("draft": the target's first layers on ``kv``; "decode": a draft
    runtime's on ``draft_kv``, and when a row accepted every draft one more pass caching the last
    draft), the target's speculate
    graph and :func:`~neuronfx.graphs.phases.speculation.accept_rows` (``sampled``: some row
    samples, so the draft's and target's distributions are needed; ``raw``: every row takes the
    argmax of its raw logits, ``acceptance.raw_argmax``, so acceptance reads the speculate graph's
    argmax, as unfused acceptance does). Every KV bucket is the
    smallest that holds the pass, as unfused. Returns on the host {"tokens": (n, k) int64,
    "emitted": (n,) int64 (row r emits tokens[r, :emitted[r]]), "logits": (n, k, V) float32 the
    verify pass's and their finiteness "finite" (n, k) bool}."""
    k, plan = runtime.plan.inference.speculation_length, runtime.plan
    bsz, dbsz = batch_rows(runtime, drafter, n)
    top = max(starts)
    with torch.no_grad(), device_scope(plan):
        x = to_device(inputs, plan_device(plan))
        ids, logits, targets, drawn = draft_all(runtime, drafter, phase, kv if phase == "draft" else draft_kv, x, dbsz, top)
        verify = SpeculateInputs(input_ids=ids[:bsz], position_ids=(x.position_ids[:, None] + torch.arange(k, dtype=torch.int32,
                                 device=ids.device))[:bsz], seq_ids=x.seq_ids[:bsz],
                                 block_table=x.block_table[:bsz])
        bucket = select_bucket(plan.decode_buckets, top + k, "attended KV length")
        spec = runtime.graphs[("speculate", bsz, bucket)](runtime.weights, kv, dense_record(verify))
        verified = spec["logits"][:n]
        tokens, emitted = accept_rows(
            ids[:n, 1:].long(), verified, torch.stack(logits, 1)[:n] if sampled else None,
            stack_positions([_first(s, n) for s in targets]), stack_positions([_first(s, n) for s in drawn]) if sampled else None,
            x.accept_rand[:n], x.final_rand[:n], plan.topk_width, drafter.plan.topk_width, spec["argmax"][:n] if raw else None)
        out = to_host({"tokens": tokens, "emitted": emitted, "logits": verified, "finite": spec["finite"][:n]})
        if phase == "decode" and bool((out["emitted"] == k).any()):  # a row kept every draft: cache the last one
            last = targets[-1]._replace(sampling_params=x.draft_sampling_params)
            draft_pass(drafter, phase, draft_kv, x, ids[:, -1], k - 1, _first(last, dbsz), top)
        return out


def draft_all(runtime: Runtime, drafter: Runtime, phase: str, kv: KVCache, x: FusedSpeculateInputs, dbsz: int,
              top: int) -> tuple[Tensor, list[Tensor], list[SamplerInputs], list[SamplerInputs]]:
    """The k - 1 draft passes on ``kv`` (the drafter's cache), each draft sampled in its graph
    and fed to the next, the output counts growing by each. Returns (ids (rows, k) int32: each
    row's last token and its drafts; the drafter's logits (dbsz, V) of each pass; the target's
    sampler inputs at each of the k positions; those each draft was drawn with)."""
    k, words = runtime.plan.inference.speculation_length, bitmask_words(runtime.plan.model.vocab_size)
    counts, token = x.output_counts, x.input_ids
    tokens, logits, targets, drawn = [token], [], [], []
    for i in range(k - 1):
        target = position_sampler(x, x.sampling_params, counts, i, x.draft_rand[:, i], words)
        draft = target._replace(sampling_params=x.draft_sampling_params)
        out = draft_pass(drafter, phase, kv, x, token, i, _first(draft, dbsz), top)
        if not drafter.plan.inference.on_device_sampling:
            out = out | sample(out["logits"], _first(draft, dbsz), drafter.plan.topk_width, 0)
        token = torch.cat([out["tokens"], token[dbsz:]])  # rows past the drafter's bucket keep padding
        counts = with_drafts(counts, token)
        tokens.append(token)
        logits.append(out["logits"])
        targets.append(target)
        drawn.append(draft)
    targets.append(position_sampler(x, x.sampling_params, counts, k - 1, x.draft_rand[:, 0], words))  # the bonus position
    return torch.stack(tokens, 1), logits, targets, drawn


def draft_pass(drafter: Runtime, phase: str, kv: KVCache, x: FusedSpeculateInputs, token: Tensor, i: int,
               sampler: SamplerInputs, top: int) -> dict[str, Tensor]:
    """Pass ``i`` of the drafter: each row's ``token`` (rows, ) int32 at its cache_len + i,
    in the smallest KV bucket that holds the longest row's, sampled with ``sampler``."""
    rows = sampler.rand.shape[0]
    record = DecodeInputs(input_ids=token[:rows, None], position_ids=(x.position_ids + i)[:rows, None],
                          seq_ids=x.draft_seq_ids[:rows], block_table=x.draft_block_table[:rows], sampler=sampler)
    bucket = select_bucket(drafter.plan.decode_buckets, top + i + 1, "attended KV length")
    return drafter.graphs[(phase, rows, bucket)](drafter.weights, kv, dense_record(record))
