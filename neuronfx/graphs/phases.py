"""Per-phase graph functions: (weights, KV cache, step-input record) -> outputs, KV updated in place.

Each phase is three small functions, specialised at build time with the plan, the bucket and
the ops bundle the backend chose (no phase branches, no ``.item()``, no shape sniffing, no
asking whether they are compiled): a prologue (embedding, RoPE tables, mask), a group of
consecutive decoder layers (run once per group with those layers' weights and K/V) and an
epilogue (final norm, LM head, sampling). Phases: prefill (right-padded prompts), decode
(1 token per row), speculate (k tokens per row, logits out), draft (decode through the first
``draft_layers`` layers) and chunk (prefill at an offset: ``prefill_chunk_size`` tokens per row
against the slot's cache). Backends compose them into a graph; the ``inductor`` backend compiles
the prologue once per (phase, batch, bucket) and, on one process, the layer group and the
epilogue once per (phase, batch) for all its buckets (they read the bucket from their inputs'
shapes), and reuses the compiled group for every group of layers. Parts take tensors (lists
and dicts of them), so that compiled parts have a plain calling convention; the records are
opened in the runners.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import torch

from neuronfx.config.attention import ROPE_GLOBAL, ROPE_LOCAL
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.inputs import ChunkInputs, DecodeInputs, PrefillInputs, SamplerInputs, SpeculateInputs, from_leaves, leaves
from neuronfx.config.kv import chunk_write_slots
from neuronfx.config.masks import chunk_mask, decode_mask, prefill_mask
from neuronfx.config.model import ModelConfig
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs import quant
from neuronfx.graphs.collectives import world_group
from neuronfx.graphs.inputs import KVCache, LayerKV
from neuronfx.graphs.layers import LayerWeights, Weights, default_inv_freq, final_norm, rope_cos_sin, rope_tables
from neuronfx.graphs.models import model_module
from neuronfx.graphs.ops import Ops, tensor_parallel_ops
from neuronfx.graphs.sampling import sample

Tensor = torch.Tensor
KVPairs = list[tuple[Tensor, Tensor]]  # a layer group's (K, V) per layer, as compiled parts take them
DecoderLayer = Callable[..., Tensor]  # a family file's decoder_layer(cfg, ops, lw, h, cos, sin, attend)


def _lookup(plan: Plan, ops: Ops, embed: Tensor, input_ids: Tensor) -> Tensor:
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


def _embed(plan: Plan, ops: Ops, embed: Tensor, input_ids: Tensor, position_ids: Tensor,
           seq_lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ids (B, T) -> h (B, T, hidden) (B, T / tp in sequence-parallel prefill) and the RoPE
    cos/sin tables of the layout's kinds, stacked: (R, B, 1, T, rotary_dim) (:func:`_rope_tables`),
    for rows holding ``seq_lens`` (B,) tokens after this step (the length-dependent RoPE types,
    dynamic and longrope, choose their table per row from it: ``layers.row_inv_freq``)."""
    h = _lookup(plan, ops, embed, input_ids)
    if plan.model.embedding_multiplier_rounded:  # gemma3: the multiplier in h's dtype (55.4256 -> 55.5 in bf16)
        # made by an op (torch.full), not torch.tensor: export cannot lift a tensor constant here
        h = h * torch.full((), plan.model.embedding_multiplier, dtype=h.dtype, device=h.device)
    elif plan.model.embedding_multiplier != 1.0:  # granite
        h = h * plan.model.embedding_multiplier
    cos, sin = _rope_tables(plan, position_ids, seq_lens, h.dtype)
    return h, cos, sin


def _rope_tables(plan: Plan, position_ids: Tensor, seq_lens: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin (R, B, 1, T, rotary_dim), one table per RoPE kind of the attention layout:
    the model's RoPE (``layers.rope_tables``), the local base of gemma3's sliding layers (no
    scaling), or for NoPE layers cos 1 and sin 0 (the rotation is then exactly the identity; with
    Llama 4's temperature tuning cos holds the temperature, which only its layer reads, see
    ``graphs/llama4_text.py``)."""
    model = plan.model
    tables = []
    for kind in plan.layout.ropes:
        if kind == ROPE_GLOBAL:
            tables.append(rope_tables(model, position_ids, seq_lens, dtype))
        elif kind == ROPE_LOCAL:
            inv_freq = default_inv_freq(model.sliding_rope_theta, model.rotary_dim, position_ids.device)
            tables.append(rope_cos_sin(position_ids, inv_freq, dtype))
        else:
            cos = _temperature(model, position_ids, dtype) if model.attn_temperature_tuning else torch.ones(
                (*position_ids.shape, model.rotary_dim), dtype=dtype, device=position_ids.device)[:, None]
            tables.append((cos, torch.zeros_like(cos)))
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


def _temperature(model: ModelConfig, position_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Llama 4's attention temperature of each position, (B, 1, T, head_dim) in ``dtype``:
    ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` (transformers
    ``Llama4TextAttention``, after Nakanishi 2025, arXiv:2501.19399), computed in fp32; its NoPE
    layers multiply q by it."""
    pos = position_ids.float()[:, None, :, None]  # (B, 1, T, 1)
    scale = torch.log1p(torch.floor((pos + 1.0) / model.floor_scale)) * model.attn_scale + 1.0
    return scale.expand(-1, -1, -1, model.rotary_dim).to(dtype)


def _masks(plan: Plan, build: Callable[..., Tensor], *args: object) -> Tensor:
    """The masks of the attention layout's kinds, stacked (M, B, 1, T, S): ``build(*args, kind,
    size)`` (``prefill_mask`` or ``decode_mask``) per kind."""
    sizes = {"full": None, "sliding": plan.model.sliding_window, "chunked": plan.model.attention_chunk_size}
    return torch.stack([build(*args, kind, sizes[kind]) for kind in plan.layout.masks])


def _layer_inputs(plan: Plan, lw: LayerWeights, cos: Tensor, sin: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """This layer's RoPE cos/sin (B, 1, T, D) and mask (B, 1, T, S) out of the stacks, by the
    indices its weights carry when layers differ (``config.attention``); a static pick when not."""
    cos, sin = (_pick(cos, lw["rope_index"]), _pick(sin, lw["rope_index"])) if len(plan.layout.ropes) > 1 else (cos[0], sin[0])
    return cos, sin, _pick(mask, lw["mask_index"]) if len(plan.layout.masks) > 1 else mask[0]


def _pick(stack: Tensor, index: Tensor) -> Tensor:
    """``stack[index]`` for a 0-d int64 tensor ``index``, as a tensor op (a Python-style index
    would read the value on the host: a data-dependent guard in a traced graph)."""
    return stack.index_select(0, index.reshape(1))[0]


def _logits(plan: Plan, ops: Ops, norm: Tensor, lm_head: Tensor, hidden: Tensor) -> Tensor:
    """hidden (..., hidden) -> float32 logits (..., V): final norm and LM head; under tensor
    parallelism the ranks' vocabulary columns are gathered and the padded ids dropped. Soft-capping
    (gemma3) runs in the weights' dtype before the fp32 cast, as in transformers'
    ``Gemma3ForCausalLM.forward``."""
    model = plan.model
    local = ops.linear(final_norm(model)(hidden, norm, model.rms_norm_eps), lm_head, None)
    logits = local if plan.tp_degree == 1 else ops.gather_vocab(local)[..., :model.vocab_size]
    if model.final_logit_softcapping is not None:
        logits = torch.tanh(logits / model.final_logit_softcapping) * model.final_logit_softcapping
    logits = logits.float()
    if plan.model.logits_scaling != 1.0:  # granite
        logits = logits / plan.model.logits_scaling
    return logits


def sequence_parallel_tokens(plan: Plan, bucket: int) -> int:
    """Tokens a prefill graph of ``bucket`` runs: ``bucket`` rounded up to a multiple of
    tp_degree under sequence parallelism (each rank holds an equal sequence shard), else
    ``bucket``. The extra positions are padding: never attended, never written to the cache."""
    tp = plan.tp_degree
    return -(-bucket // tp) * tp if plan.inference.sequence_parallel else bucket


def _head(plan: Plan, ops: Ops, norm: Tensor, lm_head: Tensor, hidden: Tensor, sampler: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """hidden (B, hidden) -> {"tokens": (B,) int32, logprob outputs (see ``sample``) and/or
    "logits": (B, V) float32, and "finite": (B,) bool, False where a row's logits hold NaN/inf
    (its token is garbage; the runtime reports the row)}. ``sampler``: the SamplerInputs
    tensors in record order."""
    logits = _logits(plan, ops, norm, lm_head, hidden)  # (B, V)
    out = {"finite": torch.isfinite(logits).all(-1)}  # (B,) one reduction over logits already here
    if plan.inference.on_device_sampling:
        out |= sample(logits, SamplerInputs(*sampler), plan.topk_width, plan.logprobs_width)
    if plan.inference.output_logits:
        out["logits"] = logits
    return out


# --- prefill: right-padded prompts (B, bucket) starting at position 0 -----------------------


def prefill_prologue(plan: Plan, bucket: int, ops: Ops, embed: Tensor, input_ids: Tensor, position_ids: Tensor,
                     prompt_lens: Tensor) -> tuple[Tensor, ...]:
    """ids/positions (B, T = bucket), prompt_lens (B,) -> h (B, T, hidden), RoPE cos/sin
    (R, B, 1, T, head_dim) and the causal prompt masks (M, B, 1, T, T) of the attention layout's
    kinds. Sequence-parallel prefill pads
    T to :func:`sequence_parallel_tokens` and h is this rank's shard (B, T / tp, hidden)."""
    t = sequence_parallel_tokens(plan, bucket)
    if t != bucket:
        input_ids = torch.nn.functional.pad(input_ids, (0, t - bucket))
        position_ids = torch.nn.functional.pad(position_ids, (0, t - bucket))
    h, cos, sin = _embed(plan, ops, embed, input_ids, position_ids, prompt_lens)
    return h, cos, sin, _masks(plan, prefill_mask, prompt_lens, t)  # mask (M, B, 1, T, T)


def prefill_layers(plan: Plan, bucket: int, ops: Ops, layer: DecoderLayer, lws: list[LayerWeights], kv: KVPairs,
                   h: Tensor, cos: Tensor, sin: Tensor, seq_ids: Tensor, mask: Tensor) -> Tensor:
    """``len(lws)`` consecutive layers of the family's ``layer``. Each writes K/V positions
    [0, bucket) of each row's slot (``config.kv.prefill_access``); the prompt attends only
    itself, so nothing is read from the cache. Without sequence parallelism the bucket is read
    from k's shape (T), not from ``bucket``, so one compiled group with a dynamic T serves every
    prefill bucket (``graphs/inductor.py``)."""
    for lw, (k_cache, v_cache) in zip(lws, kv):
        layer_cos, layer_sin, layer_mask = _layer_inputs(plan, lw, cos, sin, mask)

        def attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor = k_cache, v_cache: Tensor = v_cache,
                   mask: Tensor = layer_mask) -> Tensor:
            n = bucket if plan.inference.sequence_parallel else k.shape[2]  # sequence parallel pads T past the bucket
            k_cache[seq_ids, :, :n] = k[:, :, :n]  # (B, n_kv, T, D) into slots
            v_cache[seq_ids, :, :n] = v[:, :, :n]
            return ops.attention(q, k, v, mask)

        h = layer(plan.local_model, ops, lw, h, layer_cos, layer_sin, attend)
    return h


def prefill_epilogue(plan: Plan, bucket: int, ops: Ops, norm: Tensor, lm_head: Tensor, h: Tensor, prompt_lens: Tensor,
                     *sampler: Tensor) -> dict[str, Tensor]:
    """Output for the last real token of each row (index prompt_lens - 1); sequence-parallel
    prefill first gathers the ranks' sequence shards."""
    h = ops.parallel_in(h)
    rows = torch.arange(h.shape[0], device=h.device)
    return _head(plan, ops, norm, lm_head, h[rows, (prompt_lens - 1).long()], sampler)


# --- decode, draft, speculate: T new tokens per row at position_ids (B, T) --------------------


def decode_prologue(plan: Plan, bucket: int, ops: Ops, embed: Tensor, input_ids: Tensor, position_ids: Tensor) -> tuple[Tensor, ...]:
    """ids/positions (B, T): T = 1 for decode and draft, k for speculate; a row then holds its
    last position + 1 tokens."""
    h, cos, sin = _embed(plan, ops, embed, input_ids, position_ids, position_ids.amax(-1) + 1)
    return h, cos, sin, _masks(plan, decode_mask, position_ids, bucket)  # mask (M, B, 1, T, S)


def decode_layers(plan: Plan, bucket: int, ops: Ops, layer: DecoderLayer, lws: list[LayerWeights], kv: KVPairs,
                  h: Tensor, cos: Tensor, sin: Tensor, seq_ids: Tensor, position_ids: Tensor, mask: Tensor) -> Tensor:
    """``len(lws)`` consecutive layers of the family's ``layer``. Each writes K/V of the T new tokens at position_ids
    (B, T) into each slot, then attends positions [0, bucket) masked to ``j <= position`` (and
    the layer's window)
    (``config.kv.decode_access`` / ``speculate_access``) with ``ops.cached_attention``, which
    never lets positions past the row's last new token through (they may hold anything: stale
    rows, rejected speculation, NaN). The bucket is read from the mask's shape (S), not from
    ``bucket``, so one compiled group with a dynamic S serves every bucket of the phase
    (``graphs/inductor.py``)."""
    pos = position_ids.long()  # (B, T)
    for lw, (k_cache, v_cache) in zip(lws, kv):
        layer_cos, layer_sin, layer_mask = _layer_inputs(plan, lw, cos, sin, mask)

        def attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor = k_cache, v_cache: Tensor = v_cache,
                   mask: Tensor = layer_mask) -> Tensor:
            k_cache[seq_ids[:, None], :, pos] = k.transpose(1, 2)  # (B, T, n_kv, D)
            v_cache[seq_ids[:, None], :, pos] = v.transpose(1, 2)
            return ops.cached_attention(q, k_cache, v_cache, seq_ids, mask.shape[-1], mask)  # mask (B, 1, T, S)

        h = layer(plan.local_model, ops, lw, h, layer_cos, layer_sin, attend)
    return h


def decode_epilogue(plan: Plan, bucket: int, ops: Ops, norm: Tensor, lm_head: Tensor, h: Tensor, *sampler: Tensor) -> dict[str, Tensor]:
    """h (B, 1, hidden) -> the sampled token, logprobs, logits and finiteness of each row (``_head``)."""
    return _head(plan, ops, norm, lm_head, h[:, 0], sampler)


def speculate_epilogue(plan: Plan, bucket: int, ops: Ops, norm: Tensor, lm_head: Tensor, h: Tensor) -> dict[str, Tensor]:
    """{"logits": (B, k, V) float32} at every verified position; acceptance runs on the host."""
    return {"logits": _logits(plan, ops, norm, lm_head, h)}


def draft_epilogue(plan: Plan, bucket: int, ops: Ops, norm: Tensor, lm_head: Tensor, h: Tensor, *sampler: Tensor) -> dict[str, Tensor]:
    """The draft's sampled token (B,) and its logits (B, V) (rejection sampling needs q)."""
    logits = _logits(plan, ops, norm, lm_head, h[:, 0])
    return sample(logits, SamplerInputs(*sampler), plan.topk_width, 0) | {"logits": logits}


# --- chunk: prefill at an offset, T = prefill_chunk_size tokens per row ----------------------


def chunk_prologue(plan: Plan, bucket: int, ops: Ops, embed: Tensor, input_ids: Tensor, position_ids: Tensor, seq_ids: Tensor,
                   chunk_lens: Tensor, seq_lens: Tensor) -> tuple[Tensor, ...]:
    """ids/positions (B, T), seq_ids / chunk_lens / seq_lens (B,) -> h (B, T, hidden), RoPE
    cos/sin (R, B, 1, T, D) for rows whose whole prompt holds ``seq_lens`` tokens (prefill picks
    its length-dependent RoPE table from the prompt length too), the masks (M, B, 1, T, S)
    (``config.masks.chunk_mask``) and the slot each token writes (B, T) int64: the row's for real
    tokens, the scratch slot for pads (``config.kv.chunk_write_slots``)."""
    h, cos, sin = _embed(plan, ops, embed, input_ids, position_ids, seq_lens)
    writes = chunk_write_slots(seq_ids, chunk_lens, input_ids.shape[1], plan.kv.scratch_slot)
    return h, cos, sin, _masks(plan, chunk_mask, position_ids, bucket), writes


def chunk_layers(plan: Plan, bucket: int, ops: Ops, layer: DecoderLayer, lws: list[LayerWeights], kv: KVPairs, h: Tensor,
                 cos: Tensor, sin: Tensor, seq_ids: Tensor, write_slots: Tensor, position_ids: Tensor, mask: Tensor) -> Tensor:
    """``len(lws)`` consecutive layers. Each writes the K/V of the chunk's tokens at position_ids
    (B, T) into ``write_slots`` (B, T) (real tokens: the row's slot; pads: the scratch slot,
    ``config.kv.chunk_access``), then attends the row's slot over [0, bucket) masked to
    ``j <= position``: the window is copied out, positions no token attends are zeroed (a
    masked NaN still poisons SDPA) and ``ops.attention`` (SDPA) runs on it, which at T = a
    chunk's hundreds of tokens beats the decode kernel's per-element reductions. The bucket is
    read from the mask's shape (S), so one compiled group with a dynamic S serves every chunk
    bucket (``graphs/inductor.py``)."""
    pos = position_ids.long()  # (B, T)
    n = mask.shape[-1]
    for lw, (k_cache, v_cache) in zip(lws, kv):
        layer_cos, layer_sin, layer_mask = _layer_inputs(plan, lw, cos, sin, mask)

        def attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor = k_cache, v_cache: Tensor = v_cache,
                   mask: Tensor = layer_mask) -> Tensor:
            k_cache[write_slots, :, pos] = k.transpose(1, 2)  # (B, T, n_kv, D)
            v_cache[write_slots, :, pos] = v.transpose(1, 2)
            hidden = ~mask.any(dim=2)[..., None]  # (B, 1, S, 1): attended by no token of the row
            keys = k_cache[:, :, :n][seq_ids].masked_fill(hidden, 0.0)  # (B, n_kv, S, D)
            values = v_cache[:, :, :n][seq_ids].masked_fill(hidden, 0.0)
            return ops.attention(q, keys, values, mask)

        h = layer(plan.local_model, ops, lw, h, layer_cos, layer_sin, attend)
    return h


# --- composition ------------------------------------------------------------------------------


@attrs.frozen
class PhaseParts:
    """The three callables of one (phase, bucket) graph, with plan, bucket and ops already
    bound; ``layers`` runs ``group_size`` consecutive layers per call."""

    prologue: Callable[..., tuple[Tensor, ...]]
    layers: Callable[..., Tensor]
    epilogue: Callable[..., dict[str, Tensor]]
    group_size: int


PART_FUNCTIONS = {
    "prefill": (prefill_prologue, prefill_layers, prefill_epilogue),
    "decode": (decode_prologue, decode_layers, decode_epilogue),
    "speculate": (decode_prologue, decode_layers, speculate_epilogue),
    "draft": (decode_prologue, decode_layers, draft_epilogue),
    "chunk": (chunk_prologue, chunk_layers, prefill_epilogue),  # output at each row's last real token, as prefill
}


def phase_num_layers(plan: Plan, phase: str) -> int:
    """Decoder layers a phase runs: the draft runs the first ``draft_layers``, others all."""
    return plan.inference.draft_layers if phase == "draft" else plan.model.num_hidden_layers


def phase_parts(plan: Plan, spec: GraphSpec, ops: Ops, group_size: int | None = None,
                wrap: Callable[[Callable], Callable] = lambda f: f) -> PhaseParts:
    """Bind plan, bucket and ``ops`` (and the family's decoder layer, looked up here, outside
    any traced code) into the phase's parts; ``wrap`` (e.g. a compiler) wraps each.
    ``group_size`` (a divisor of the phase's layer count, default all) sets layers per
    ``layers`` call. Under tensor parallelism the ops get this rank's collectives (ConfigError
    when no process group of ``tp_degree`` ranks is initialised)."""
    n = phase_num_layers(plan, spec.phase)
    group_size = n if group_size is None else group_size
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must divide the phase's {n} layers; pick a divisor of {n}.")
    prologue, layers, epilogue = PART_FUNCTIONS[spec.phase]
    layer = model_module(plan.model.model_type).decoder_layer
    if plan.tp_degree > 1:
        sequence_parallel = plan.inference.sequence_parallel and spec.phase == "prefill"
        ops = tensor_parallel_ops(ops, plan.tp_degree, plan.rank, world_group(plan.tp_degree), sequence_parallel)
    return PhaseParts(
        prologue=wrap(functools.partial(prologue, plan, spec.bucket, ops)),
        layers=wrap(functools.partial(layers, plan, spec.bucket, ops, layer)),
        epilogue=wrap(functools.partial(epilogue, plan, spec.bucket, ops)),
        group_size=group_size,
    )


def _groups(parts: PhaseParts, w: Weights, kv: KVCache, num_layers: int) -> list[tuple[list[LayerWeights], KVPairs]]:
    g = parts.group_size
    return [(w["layers"][i:i + g], [(layer.k, layer.v) for layer in kv[i:i + g]]) for i in range(0, num_layers, g)]


def run_prefill(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: PrefillInputs) -> dict[str, Tensor]:
    """A prefill graph: prologue, ``num_layers`` layers in groups, epilogue (see the parts)."""
    h, cos, sin, mask = parts.prologue(w["embed"], inputs.input_ids, inputs.position_ids, inputs.prompt_lens)
    for lws, group_kv in _groups(parts, w, kv, num_layers):
        h = parts.layers(lws, group_kv, h, cos, sin, inputs.seq_ids, mask)
    return parts.epilogue(w["norm"], w["lm_head"], h, inputs.prompt_lens, *leaves(inputs.sampler))


def run_decode(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: DecodeInputs) -> dict[str, Tensor]:
    """Decode and draft (the first ``num_layers`` layers)."""
    h, cos, sin, mask = parts.prologue(w["embed"], inputs.input_ids, inputs.position_ids)
    for lws, group_kv in _groups(parts, w, kv, num_layers):
        h = parts.layers(lws, group_kv, h, cos, sin, inputs.seq_ids, inputs.position_ids, mask)
    return parts.epilogue(w["norm"], w["lm_head"], h, *leaves(inputs.sampler))


def run_speculate(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: SpeculateInputs) -> dict[str, Tensor]:
    """A speculate (verify) graph: k tokens per row through every layer, logits (B, k, V) out."""
    h, cos, sin, mask = parts.prologue(w["embed"], inputs.input_ids, inputs.position_ids)
    for lws, group_kv in _groups(parts, w, kv, num_layers):
        h = parts.layers(lws, group_kv, h, cos, sin, inputs.seq_ids, inputs.position_ids, mask)
    return parts.epilogue(w["norm"], w["lm_head"], h)


def run_chunk(parts: PhaseParts, num_layers: int, w: Weights, kv: KVCache, inputs: ChunkInputs) -> dict[str, Tensor]:
    """A chunk graph: T tokens per row at an offset, sampled at each row's last real token."""
    h, cos, sin, mask, writes = parts.prologue(w["embed"], inputs.input_ids, inputs.position_ids, inputs.seq_ids,
                                               inputs.chunk_lens, inputs.seq_lens)
    for lws, group_kv in _groups(parts, w, kv, num_layers):
        h = parts.layers(lws, group_kv, h, cos, sin, inputs.seq_ids, writes, inputs.position_ids, mask)
    return parts.epilogue(w["norm"], w["lm_head"], h, inputs.chunk_lens, *leaves(inputs.sampler))


RUNNERS = {"prefill": run_prefill, "decode": run_decode, "speculate": run_speculate, "draft": run_decode, "chunk": run_chunk}


class GraphModule(torch.nn.Module):
    """One (phase, bucket) graph as an nn.Module holding only static values (no parameters):
    ``forward(weights, kv, inputs)`` with ``kv`` the KV cache (one LayerKV per layer) and
    ``inputs`` the phase's step-input record. Weights and KV cache are inputs, so every graph
    shares one copy of each."""

    def __init__(self, parts: PhaseParts, phase: str, num_layers: int):
        super().__init__()
        self.parts = parts
        self.run = functools.partial(RUNNERS[phase], parts, num_layers)

    def forward(self, w: Weights, kv: KVCache, inputs: object) -> dict[str, Tensor]:
        return self.run(w, kv, inputs)


class FlatGraphModule(torch.nn.Module):
    """``graph`` with a flat calling convention for torch.export: ``forward(weights, kv_pairs,
    *tensors)``, ``kv_pairs`` a list of (K, V) per layer and ``tensors`` the record's tensors in
    call order (``config.inputs.leaves``); exported programs keep no neuronfx types."""

    def __init__(self, graph: GraphModule, record: type):
        super().__init__()
        self.graph = graph
        self.record = record

    def forward(self, w: Weights, kv_pairs: KVPairs, *tensors: Tensor) -> dict[str, Tensor]:
        return self.graph(w, tuple(LayerKV(k, v) for k, v in kv_pairs), from_leaves(self.record, tensors))


def build_module(plan: Plan, spec: GraphSpec, ops: Ops, group_size: int | None = None,
                 wrap: Callable[[Callable], Callable] = lambda f: f) -> GraphModule:
    """The GraphModule of ``spec`` with ``ops`` bound (see :func:`phase_parts`)."""
    return GraphModule(phase_parts(plan, spec, ops, group_size, wrap), spec.phase, phase_num_layers(plan, spec.phase))
