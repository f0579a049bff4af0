"""Per-phase graph functions: (weights, KV cache, step inputs) -> outputs, KV updated in place.

Each phase is three small functions, specialised at build time (no phase branches, no
``.item()``, no shape sniffing): a prologue (embedding, RoPE tables, mask), a group of
consecutive decoder layers (run once per group with those layers' weights and K/V tensors) and
an epilogue (final norm, LM head, sampling). Backends compose them into a graph; the
``inductor`` backend compiles each part once per (phase, bucket) and reuses the compiled group
for every group of layers. Input names and
order follow ``neuronfx.config.plan.step_inputs``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import torch

from neuronfx.config.masks import decode_mask, prefill_mask
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs.layers import LayerWeights, Weights, linear, rms_norm, rope_cos_sin, rope_inv_freq, sdpa
from neuronfx.graphs.models import model_module
from neuronfx.graphs.sampling import sample

Tensor = torch.Tensor


def _embed(plan: Plan, embed: Tensor, input_ids: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ids (B, T) -> h (B, T, hidden) and RoPE cos/sin (B, 1, T, head_dim)."""
    h = embed[input_ids]
    cos, sin = rope_cos_sin(position_ids, rope_inv_freq(plan.model).to(h.device), h.dtype)
    return h, cos, sin


def _head(plan: Plan, norm: Tensor, lm_head: Tensor, hidden: Tensor, sampler_inputs: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """hidden (B, hidden) -> {"tokens": (B,) int32, logprob outputs (see ``sample``) and/or
    "logits": (B, V) float32}. ``sampler_inputs``: (sampling_params, output_counts, prompt_mask,
    logits_bias, rand) as in ``config.plan.step_inputs``."""
    hidden = rms_norm(hidden, norm, plan.model.rms_norm_eps)
    logits = linear(hidden, lm_head).float()  # (B, V)
    out = {}
    if plan.inference.on_device_sampling:
        out = sample(logits, *sampler_inputs, plan.topk_width, plan.inference.max_logprobs)
    if plan.inference.output_logits:
        out["logits"] = logits
    return out


# --- prefill: right-padded prompts (B, bucket) starting at position 0 -----------------------


def prefill_prologue(plan: Plan, bucket: int, embed: Tensor, input_ids: Tensor, position_ids: Tensor, prompt_lens: Tensor) -> tuple[Tensor, ...]:
    h, cos, sin = _embed(plan, embed, input_ids, position_ids)
    return h, cos, sin, prefill_mask(prompt_lens, bucket)  # mask (B, 1, T, T)


def prefill_layer(
    plan: Plan, bucket: int, lw: LayerWeights, k_cache: Tensor, v_cache: Tensor, h: Tensor,
    cos: Tensor, sin: Tensor, seq_ids: Tensor, mask: Tensor,
) -> Tensor:
    """Writes K/V positions [0, bucket) of each row's slot (``config.kv.prefill_access``); the
    prompt attends only itself, so nothing is read from the cache."""

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache[seq_ids, :, :bucket] = k  # (B, n_kv, T, D) into slots
        v_cache[seq_ids, :, :bucket] = v
        return sdpa(q, k, v, mask)

    return model_module(plan.model.model_type).decoder_layer(plan.model, lw, h, cos, sin, attend)


def prefill_epilogue(plan: Plan, bucket: int, norm: Tensor, lm_head: Tensor, h: Tensor, prompt_lens: Tensor, *sampler_inputs: Tensor) -> dict[str, Tensor]:
    """Output for the last real token of each row (index prompt_lens - 1)."""
    rows = torch.arange(h.shape[0], device=h.device)
    return _head(plan, norm, lm_head, h[rows, (prompt_lens - 1).long()], sampler_inputs)


# --- decode: one token per row at position_ids (B, 1) ----------------------------------------


def decode_prologue(plan: Plan, bucket: int, embed: Tensor, input_ids: Tensor, position_ids: Tensor) -> tuple[Tensor, ...]:
    h, cos, sin = _embed(plan, embed, input_ids, position_ids)
    return h, cos, sin, decode_mask(position_ids, bucket)  # mask (B, 1, 1, S)


def decode_layer(
    plan: Plan, bucket: int, lw: LayerWeights, k_cache: Tensor, v_cache: Tensor, h: Tensor,
    cos: Tensor, sin: Tensor, seq_ids: Tensor, position_ids: Tensor, mask: Tensor,
) -> Tensor:
    """Writes K/V at position_ids into each slot, then attends positions [0, bucket) masked to
    ``j <= position`` (``config.kv.decode_access``). Positions past ``position`` are zeroed after
    the read: they may hold anything (stale rows, NaN), and a masked NaN still poisons attention
    (NaN score + -inf mask is NaN; 0 weight * NaN value is NaN)."""
    pos = position_ids[:, 0].long()  # (B,)
    hidden_pos = ~mask[:, :, 0, :, None]  # (B, 1, S, 1)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache[seq_ids, :, pos] = k[:, :, 0]  # (B, n_kv, D)
        v_cache[seq_ids, :, pos] = v[:, :, 0]
        keys = k_cache[:, :, :bucket][seq_ids].masked_fill(hidden_pos, 0.0)  # (B, n_kv, S, D)
        values = v_cache[:, :, :bucket][seq_ids].masked_fill(hidden_pos, 0.0)
        return sdpa(q, keys, values, mask)

    return model_module(plan.model.model_type).decoder_layer(plan.model, lw, h, cos, sin, attend)


def decode_epilogue(plan: Plan, bucket: int, norm: Tensor, lm_head: Tensor, h: Tensor, *sampler_inputs: Tensor) -> dict[str, Tensor]:
    return _head(plan, norm, lm_head, h[:, 0], sampler_inputs)


# --- layer groups: one call runs several consecutive layers -----------------------------------


def prefill_layers(plan: Plan, bucket: int, lws: list[LayerWeights], kv: list[Tensor], h: Tensor,
                   cos: Tensor, sin: Tensor, seq_ids: Tensor, mask: Tensor) -> Tensor:
    """``len(lws)`` consecutive layers; ``kv`` holds their K/V tensors (K at 2j, V at 2j + 1)."""
    for j, lw in enumerate(lws):
        h = prefill_layer(plan, bucket, lw, kv[2 * j], kv[2 * j + 1], h, cos, sin, seq_ids, mask)
    return h


def decode_layers(plan: Plan, bucket: int, lws: list[LayerWeights], kv: list[Tensor], h: Tensor,
                  cos: Tensor, sin: Tensor, seq_ids: Tensor, position_ids: Tensor, mask: Tensor) -> Tensor:
    """``len(lws)`` consecutive layers; ``kv`` holds their K/V tensors (K at 2j, V at 2j + 1)."""
    for j, lw in enumerate(lws):
        h = decode_layer(plan, bucket, lw, kv[2 * j], kv[2 * j + 1], h, cos, sin, seq_ids, position_ids, mask)
    return h


# --- composition ------------------------------------------------------------------------------


@attrs.frozen
class PhaseParts:
    """The three callables of one (phase, bucket) graph, with plan and bucket already bound;
    ``layers`` runs ``group_size`` consecutive layers per call."""

    prologue: Callable[..., tuple[Tensor, ...]]
    layers: Callable[..., Tensor]
    epilogue: Callable[..., dict[str, Tensor]]
    group_size: int


PART_FUNCTIONS = {
    "prefill": (prefill_prologue, prefill_layers, prefill_epilogue),
    "decode": (decode_prologue, decode_layers, decode_epilogue),
}


def phase_parts(plan: Plan, spec: GraphSpec, group_size: int | None = None,
                wrap: Callable[[Callable], Callable] = lambda f: f) -> PhaseParts:
    """Bind plan and bucket into the phase's parts; ``wrap`` (e.g. torch.compile) wraps each.
    ``group_size`` (a divisor of num_layers, default all layers) sets layers per ``layers`` call."""
    n = plan.model.num_hidden_layers
    group_size = n if group_size is None else group_size
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must divide num_hidden_layers={n}")
    fns = PART_FUNCTIONS[spec.phase]
    bound = [wrap(functools.partial(f, plan, spec.bucket)) for f in fns]
    return PhaseParts(prologue=bound[0], layers=bound[1], epilogue=bound[2], group_size=group_size)


def _groups(parts: PhaseParts, w: Weights, kv: list[Tensor]) -> list[tuple[list[LayerWeights], list[Tensor]]]:
    g = parts.group_size
    return [(w["layers"][i:i + g], kv[2 * i:2 * (i + g)]) for i in range(0, len(w["layers"]), g)]


def run_prefill(parts: PhaseParts, w: Weights, kv: list[Tensor], input_ids: Tensor, position_ids: Tensor,
                seq_ids: Tensor, prompt_lens: Tensor, *sampler_inputs: Tensor) -> dict[str, Tensor]:
    h, cos, sin, mask = parts.prologue(w["embed"], input_ids, position_ids, prompt_lens)
    for lws, group_kv in _groups(parts, w, kv):
        h = parts.layers(lws, group_kv, h, cos, sin, seq_ids, mask)
    return parts.epilogue(w["norm"], w["lm_head"], h, prompt_lens, *sampler_inputs)


def run_decode(parts: PhaseParts, w: Weights, kv: list[Tensor], input_ids: Tensor, position_ids: Tensor,
               seq_ids: Tensor, *sampler_inputs: Tensor) -> dict[str, Tensor]:
    h, cos, sin, mask = parts.prologue(w["embed"], input_ids, position_ids)
    for lws, group_kv in _groups(parts, w, kv):
        h = parts.layers(lws, group_kv, h, cos, sin, seq_ids, position_ids, mask)
    return parts.epilogue(w["norm"], w["lm_head"], h, *sampler_inputs)


RUNNERS = {"prefill": run_prefill, "decode": run_decode}


class GraphModule(torch.nn.Module):
    """One (phase, bucket) graph as an nn.Module holding only static values (no parameters):
    ``forward(weights, kv, *step_inputs)``. Weights and KV cache are inputs, so every graph shares
    one copy of each. ``kv``: 2 * num_layers tensors, K of layer l at 2l and V at 2l + 1."""

    def __init__(self, parts: PhaseParts, phase: str):
        super().__init__()
        self.parts = parts
        self.run = RUNNERS[phase]

    def forward(self, w: Weights, kv: list[Tensor], *inputs: Tensor) -> dict[str, Tensor]:
        return self.run(self.parts, w, kv, *inputs)
