"""What the phases' prologues, layer groups and epilogues share: the embedding, the RoPE tables
and masks of the attention layout, each layer's pick among them, and the LM head with the
sampler. Where a family differs (embedding scale, final norm, logits, the NoPE table), its
``FamilyMath`` hook says how (the record is looked up when the parts are bound, outside any
traced code, and handed in as ``math``); nothing here names a family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neuronfx.config.attention import ROPE_GLOBAL, ROPE_LOCAL
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.inputs import SamplerInputs
from neuronfx.config.plan import Plan
from neuronfx.graphs.models import quant
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.layers import LayerWeights, default_inv_freq, rope_cos_sin, rope_tables
from neuronfx.graphs.models.ops import Ops
from neuronfx.graphs.phases.sampling import sample

Tensor = torch.Tensor


def lookup(plan: Plan, ops: Ops, embed: Tensor, input_ids: Tensor) -> Tensor:
    """ids (B, T) -> h (B, T, hidden); under tensor parallelism each rank looks up the ids of its
    vocabulary rows, zeros elsewhere, and ``ops.parallel_out`` sums (or reduce-scatters) them."""
    if isinstance(embed, quant.QUANTIZED_TYPES):  # tied to a quantized LM head: dequantize the rows read
        rows = quant.dequantize(quant.gather_rows(embed, input_ids.reshape(-1)), plan.model.hidden_size)
        return rows.to(torch_dtype(plan.inference.dtype)).reshape(*input_ids.shape, -1)
    if plan.tp_degree == 1:
        return embed[input_ids]
    local = input_ids - plan.shard.vocab_start
    mine = (local >= 0) & (local < plan.shard.vocab_size)
    rows = embed[local.clamp(0, plan.shard.vocab_size - 1)]
    return ops.parallel_out(torch.where(mine[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)))


def embed_tokens(plan: Plan, ops: Ops, math: FamilyMath, embed: Tensor, input_ids: Tensor, position_ids: Tensor,
                 seq_lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ids (B, T) -> h (B, T, hidden) (B, T / tp in sequence-parallel prefill), scaled as the
    family does, and the RoPE cos/sin tables of the layout's kinds, stacked: (R, B, 1, T,
    rotary_dim) (:func:`rope_stack`), for rows holding ``seq_lens`` (B,) tokens after this step
    (the length-dependent RoPE types, dynamic and longrope, choose their table per row from it:
    ``layers.row_inv_freq``)."""
    h = math.embed_scale(plan.model, lookup(plan, ops, embed, input_ids))
    cos, sin = rope_stack(plan, math, position_ids, seq_lens, h.dtype)
    return h, cos, sin


def rope_stack(plan: Plan, math: FamilyMath, position_ids: Tensor, seq_lens: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin (R, B, 1, T, rotary_dim), one table per RoPE kind of the attention layout:
    the model's RoPE (``layers.rope_tables``), the local base of sliding layers (no scaling), or
    for NoPE layers the family's ``nope_cos`` with sin 0 (ones by default: the rotation is then
    exactly the identity)."""
    model = plan.model
    tables = []
    for kind in plan.layout.ropes:
        if kind == ROPE_GLOBAL:
            tables.append(rope_tables(model, position_ids, seq_lens, dtype))
        elif kind == ROPE_LOCAL:
            inv_freq = default_inv_freq(model.sliding_rope_theta, model.rotary_dim, position_ids.device)
            tables.append(rope_cos_sin(position_ids, inv_freq, dtype))
        else:
            cos = math.nope_cos(model, position_ids, dtype)
            tables.append((cos, torch.zeros_like(cos)))
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


def mask_stack(plan: Plan, build: Callable[..., Tensor], *args: object) -> Tensor:
    """The masks of the attention layout's kinds, stacked (M, B, 1, T, S): ``build(*args, kind,
    size)`` (a builder of ``config.masks``) per kind."""
    sizes = {"full": None, "sliding": plan.model.sliding_window, "chunked": plan.model.attention_chunk_size}
    return torch.stack([build(*args, kind, sizes[kind]) for kind in plan.layout.masks])


def layer_tables(plan: Plan, lw: LayerWeights, cos: Tensor, sin: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """This layer's RoPE cos/sin (B, 1, T, D) and mask (B, 1, T, S) out of the stacks, by the
    indices its weights carry when layers differ (``config.attention``); a static pick when not."""
    cos, sin = (pick(cos, lw["rope_index"]), pick(sin, lw["rope_index"])) if len(plan.layout.ropes) > 1 else (cos[0], sin[0])
    return cos, sin, pick(mask, lw["mask_index"]) if len(plan.layout.masks) > 1 else mask[0]


def layer_pool(plan: Plan, lw: LayerWeights, stack: Tensor) -> Tensor:
    """This layer's block table (B, N) or write blocks (B, T) out of a (G, ...) stack of the KV
    pools (``kv_rows.pool_tables``): by its mask_index where the plan has a window ring (a pool
    per mask kind), else the one pool. As data, like the masks: one compiled layer group serves
    ring and full layers alike (their caches' block counts are dynamic, ``backends/inductor_parts.py``)."""
    return pick(stack, lw["mask_index"]) if plan.kv.ring_blocks else stack[0]


def pick(stack: Tensor, index: Tensor) -> Tensor:
    """``stack[index]`` for a 0-d int64 tensor ``index``, as a tensor op (a Python-style index
    would read the value on the host: a data-dependent guard in a traced graph)."""
    return stack.index_select(0, index.reshape(1))[0]


def logits(plan: Plan, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor, hidden: Tensor) -> Tensor:
    """hidden (..., hidden) -> float32 logits (..., V): the family's final norm, the LM head and
    its logits transform; under tensor parallelism the ranks' vocabulary columns are gathered
    and the padded ids dropped first."""
    model = plan.model
    local = ops.head_linear(math.final_norm(hidden, norm, model.rms_norm_eps), lm_head, None)
    out = local if plan.tp_degree == 1 else ops.gather_vocab(local)[..., :model.vocab_size]
    return math.logits(model, out)


def head(plan: Plan, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor, hidden: Tensor,
         sampler: SamplerInputs) -> dict[str, Tensor]:
    """hidden (B, hidden) -> {"tokens": (B,) int32, logprob outputs (see ``sample``) and/or
    "logits": (B, V) float32, and "finite": (B,) bool, False where a row's logits hold NaN/inf
    (its token is garbage; the runtime reports the row)}."""
    out_logits = logits(plan, ops, math, norm, lm_head, hidden)  # (B, V)
    out = {"finite": torch.isfinite(out_logits).all(-1)}  # (B,) one reduction over logits already here
    if plan.inference.on_device_sampling:
        out |= sample(out_logits, sampler, plan.topk_width, plan.logprobs_width, ops.topk)
    if plan.inference.output_logits:
        out["logits"] = out_logits
    return out


def greedy_head(plan: Plan, ops: Ops, math: FamilyMath, norm: Tensor, lm_head: Tensor, hidden: Tensor) -> dict[str, Tensor]:
    """hidden (B, hidden) -> {"tokens": (B,) int32 argmax of the logits (the first index of the
    largest value, as ``torch.argmax``), "finite": (B,) bool} and with ``output_logits``
    "logits" (B, V) float32: :func:`head` for rows the sampler would give their raw argmax."""
    out_logits = logits(plan, ops, math, norm, lm_head, hidden)  # (B, V)
    tokens, finite = ops.argmax(out_logits)
    out = {"finite": finite, "tokens": tokens}
    if plan.inference.output_logits:
        out["logits"] = out_logits
    return out


def last_rows(h: Tensor, last: Tensor) -> Tensor:
    """h (B, T, hidden) at each row's index ``last`` (B,) -> (B, hidden)."""
    return h[torch.arange(h.shape[0], device=h.device), last]
