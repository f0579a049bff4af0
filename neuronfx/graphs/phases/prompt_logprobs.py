"""Prompt logprobs (vLLM's ``prompt_logprobs``): the epilogues of prefill and chunk graphs of a
plan with ``InferenceConfig.enable_prompt_logprobs``. Besides what ``prefill_epilogue`` returns
(the token sampled at each row's last real position), they return, at every position t of the
step, the raw logprob (log_softmax of the model's logits, as vLLM's default ``raw_logprobs``
mode) of the step's next token ids[t + 1] and the top ``logprobs_width`` alternatives.

The LM head runs over T in blocks of :data:`BLOCK` positions, so a (B, BLOCK, V) float32 block
of logits exists at a time, never (B, T, V) for a long prompt bucket. Under tensor parallelism
each block's logits are gathered over the vocabulary (``common.logits``), as the sampler's are.

The next token of a position is read within the step: the last position of a chunk that is not
its prompt's last has its next token in the next chunk, so chunk graphs also return the whole
log_softmax row (B, V) at each row's last real position, from which the host reads it
(``runtime/prompt_logprobs.py``). These epilogues are compiled per bucket (the block loop
follows the static T).
"""

from __future__ import annotations

import torch

from neuronfx.config.inputs import SamplerInputs
from neuronfx.config.plan import Plan
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.ops import Ops
from neuronfx.graphs.phases.common import head, last_rows, logits
from neuronfx.graphs.phases.records import ChunkHidden, PrefillHidden

Tensor = torch.Tensor

BLOCK = 128
"""Positions whose logits (B, BLOCK, V) float32 exist at once."""


def position_logprobs(plan: Plan, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor, h: Tensor,
                      ids: Tensor) -> dict[str, Tensor]:
    """h (B, T, hidden) and the step's ids (B, T) int32 -> {"prompt_logprobs": (B, T) float32
    raw logprob at position t of ids[t + 1] (t = T - 1: of id 0, meaningless),
    "prompt_top_logprobs": (B, T, K) float32 descending and "prompt_top_ids": (B, T, K) int32},
    K = ``plan.logprobs_width``; the head runs :data:`BLOCK` positions at a time."""
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1).long()  # (B, T)
    picked, top_vals, top_ids = [], [], []
    for start in range(0, h.shape[1], BLOCK):
        block = logits(plan, ops, math, norm, lm_head, h[:, start:start + BLOCK])  # (B, t, V) float32
        lse = torch.logsumexp(block, dim=-1, keepdim=True)  # (B, t, 1)
        picked.append((block.gather(-1, nxt[:, start:start + BLOCK, None]) - lse)[..., 0])  # (B, t)
        vals, idx = torch.topk(block, plan.logprobs_width, dim=-1)  # (B, t, K)
        top_vals.append(vals - lse)
        top_ids.append(idx.to(torch.int32))
    return {"prompt_logprobs": torch.cat(picked, 1), "prompt_top_logprobs": torch.cat(top_vals, 1),
            "prompt_top_ids": torch.cat(top_ids, 1)}


def prefill_logprobs_epilogue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor,
                              x: PrefillHidden, sampler: SamplerInputs) -> dict[str, Tensor]:
    """``prefill_epilogue``'s outputs plus :func:`position_logprobs` at every prompt position
    (sequence-parallel prefill gathers the ranks' shards first)."""
    h = ops.parallel_in(x.h)
    out = head(plan, ops, math, norm, lm_head, last_rows(h, x.last), sampler)
    return out | position_logprobs(plan, ops, math, norm, lm_head, h, x.ids)


def chunk_logprobs_epilogue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor,
                            x: ChunkHidden, sampler: SamplerInputs) -> dict[str, Tensor]:
    """:func:`prefill_logprobs_epilogue` for a chunk, plus "prompt_last_logprobs" (B, V)
    float32: the raw log_softmax at each row's last real position (its next token is the next
    chunk's first)."""
    last = last_rows(x.h, x.last)  # (B, hidden)
    out = head(plan, ops, math, norm, lm_head, last, sampler)
    out["prompt_last_logprobs"] = torch.log_softmax(logits(plan, ops, math, norm, lm_head, last), dim=-1)
    return out | position_logprobs(plan, ops, math, norm, lm_head, x.h, x.ids)


PROMPT_LOGPROBS_EPILOGUES = {"prefill": prefill_logprobs_epilogue, "chunk": chunk_logprobs_epilogue}
"""The epilogue of each phase that returns prompt logprobs under ``enable_prompt_logprobs``."""
