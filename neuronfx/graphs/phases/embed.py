"""The embed phase (an embedding plan's only graphs, ``InferenceConfig.task="embed"``): right-padded
prompts through the prefill's prompt record and the decoder layers without writing any cache, then the
family's final norm, pooling over each row's real tokens and optional L2 normalisation. No LM
head. What transformers' ``model.model(ids).last_hidden_state`` pooled the same way gives, and
what sentence-transformers computes for decoder embedders (Qwen3-Embedding: last token,
normalised).
"""

from __future__ import annotations

import torch

from neuronfx.config.inputs import EmbedInputs
from neuronfx.config.plan import Plan
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.layers import LayerWeights
from neuronfx.graphs.models.ops import Ops
from neuronfx.graphs.phases.common import last_rows, layer_tables
from neuronfx.graphs.phases.inputs import KVPairs
from neuronfx.graphs.phases.prefill import prompt_hidden
from neuronfx.graphs.phases.records import PrefillHidden

Tensor = torch.Tensor


def embed_prologue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, embed: Tensor, inputs: EmbedInputs) -> PrefillHidden:
    """The prompts' record (``prefill.prompt_hidden``); an embed graph writes no cache, so its
    blocks and offsets are zeros."""
    h, cos, sin, mask, input_ids = prompt_hidden(plan, bucket, ops, math, embed, inputs)
    nothing = torch.zeros(input_ids.shape, dtype=torch.int64, device=input_ids.device)
    return PrefillHidden(h, cos, sin, mask, nothing[None], nothing, (inputs.prompt_lens - 1).long(), input_ids)


def embed_layers(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, lws: list[LayerWeights], kv: KVPairs,
                 x: PrefillHidden) -> Tensor:
    """``len(lws)`` consecutive decoder layers over the prompts -> h (B, T, hidden); the prompt
    attends only itself (causal, ``x.mask``) and nothing is written to ``kv`` (the plan's
    one-position placeholder cache, taken only to keep every phase's signature)."""
    h = x.h
    for lw in lws:
        layer_cos, layer_sin, layer_mask = layer_tables(plan, lw, x.cos, x.sin, x.mask)

        def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor = layer_mask) -> Tensor:
            return ops.attention(q, k, v, mask)

        h = math.decoder_layer(plan.local_model, ops, lw, h, layer_cos, layer_sin, attend)
    return h


def pool(h: Tensor, last: Tensor, pooling: str, normalize: bool) -> Tensor:
    """h (B, T, hidden) (final-normed) -> (B, hidden) float32: the hidden state at each row's
    last real token ``last`` (B,) for ``pooling="last"``, or the mean over positions
    0 .. last for "mean"; L2-normalised (eps 1e-12, as ``torch.nn.functional.normalize``)
    when ``normalize``."""
    h = h.float()
    if pooling == "mean":
        real = torch.arange(h.shape[1], device=h.device)[None, :] <= last[:, None]  # (B, T)
        pooled = (h * real[..., None]).sum(1) / (last + 1).to(h.dtype)[:, None]
    else:
        pooled = last_rows(h, last)
    return torch.nn.functional.normalize(pooled, p=2.0, dim=-1) if normalize else pooled


def embed_epilogue(plan: Plan, bucket: int, ops: Ops, math: FamilyMath, norm: Tensor, x: PrefillHidden) -> dict[str, Tensor]:
    """The family's final norm and :func:`pool` by the plan's ``pooling`` / ``normalize`` ->
    {"embeddings": (B, hidden) float32}."""
    h = math.final_norm(x.h, norm, plan.model.rms_norm_eps)
    return {"embeddings": pool(h, x.last, plan.inference.pooling, plan.inference.normalize)}

