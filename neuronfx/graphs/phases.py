"""Per-phase graph functions: (weights, KV cache, step inputs) -> outputs, KV updated in place.

Each phase is three small functions, specialised at build time (no phase branches, no
``.item()``, no shape sniffing): a prologue (embedding, RoPE tables, mask), a group of
consecutive decoder layers (run once per group with those layers' weights and K/V tensors) and
an epilogue (final norm, LM head, sampling). Phases: prefill (right-padded prompts), decode
(1 token per row), speculate (k tokens per row, logits out) and draft (decode through the first
``draft_layers`` layers). Backends compose them into a graph; the ``inductor`` backend compiles
each part once per (phase, batch, bucket) and reuses the compiled group for every group of
layers. Input names and order follow ``neuronfx.config.plan.step_inputs``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import torch

from neuronfx.config.masks import decode_mask, prefill_mask
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs.layers import LayerWeights, Weights, cached_attention, inductor_tracing, linear, rms_norm, rope_cos_sin, rope_inv_freq, sdpa
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
    "logits": (B, V) float32, and "finite": (B,) bool, False where a row's logits hold NaN/inf
    (its token is garbage; the runtime reports the row)}. ``sampler_inputs``: (sampling_params,
    output_counts, prompt_mask, logits_bias, rand) as in ``config.plan.step_inputs``."""
    hidden = rms_norm(hidden, norm, plan.model.rms_norm_eps)
    logits = linear(hidden, lm_head).float()  # (B, V)
    out = {"finite": torch.isfinite(logits).all(-1)}  # (B,) one reduction over logits already here
    if plan.inference.on_device_sampling:
        out |= sample(logits, *sampler_inputs, plan.topk_width, plan.logprobs_width)
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
    """ids/positions (B, T): T = 1 for decode and draft, k for speculate."""
    h, cos, sin = _embed(plan, embed, input_ids, position_ids)
    return h, cos, sin, decode_mask(position_ids, bucket)  # mask (B, 1, T, S)


def decode_layer(
    plan: Plan, bucket: int, lw: LayerWeights, k_cache: Tensor, v_cache: Tensor, h: Tensor,
    cos: Tensor, sin: Tensor, seq_ids: Tensor, position_ids: Tensor, mask: Tensor,
) -> Tensor:
    """Writes K/V of the T new tokens at position_ids (B, T) into each slot, then attends
    positions [0, bucket) masked to ``j <= position`` (``config.kv.decode_access`` /
    ``speculate_access``). Positions past the row's last new token are zeroed after the read:
    they may hold anything (stale rows, rejected speculation, NaN), and a masked NaN still poisons
    attention (NaN score + -inf mask is NaN; 0 weight * NaN value is NaN)."""
    pos = position_ids.long()  # (B, T)
    hidden_pos = ~mask[:, :, -1, :, None]  # (B, 1, S, 1): beyond the last new token

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache[seq_ids[:, None], :, pos] = k.transpose(1, 2)  # (B, T, n_kv, D)
        v_cache[seq_ids[:, None], :, pos] = v.transpose(1, 2)
        if inductor_tracing():
            return cached_attention(q, k_cache, v_cache, seq_ids, bucket, mask)
        keys = k_cache[:, :, :bucket][seq_ids].masked_fill(hidden_pos, 0.0)  # (B, n_kv, S, D)
        values = v_cache[:, :, :bucket][seq_ids].masked_fill(hidden_pos, 0.0)
        return sdpa(q, keys, values, mask)

    return model_module(plan.model.model_type).decoder_layer(plan.model, lw, h, cos, sin, attend)


def decode_epilogue(plan: Plan, bucket: int, norm: Tensor, lm_head: Tensor, h: Tensor, *sampler_inputs: Tensor) -> dict[str, Tensor]:
    return _head(plan, norm, lm_head, h[:, 0], sampler_inputs)


def speculate_epilogue(plan: Plan, bucket: int, norm: Tensor, lm_head: Tensor, h: Tensor) -> dict[str, Tensor]:
    """{"logits": (B, k, V) float32} at every verified position; acceptance runs on the host."""
    hidden = rms_norm(h, norm, plan.model.rms_norm_eps)
    return {"logits": linear(hidden, lm_head).float()}


def draft_epilogue(plan: Plan, bucket: int, norm: Tensor, lm_head: Tensor, h: Tensor, *sampler_inputs: Tensor) -> dict[str, Tensor]:
    """The draft's sampled token and its logits (B, V) (rejection sampling needs q)."""
    hidden = rms_norm(h[:, 0], norm, plan.model.rms_norm_eps)
    logits = linear(hidden, lm_head).float()
    return sample(logits, *sampler_inputs, plan.topk_width, 0) | {"logits": logits}


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
    "speculate": (decode_prologue, decode_layers, speculate_epilogue),
    "draft": (decode_prologue, decode_layers, draft_epilogue),
}


def phase_num_layers(plan: Plan, phase: str) -> int:
    """Decoder layers a phase runs: the draft runs the first ``draft_layers``, others all."""
    return plan.inference.draft_layers if phase == "draft" else plan.model.num_hidden_layers


def phase_parts(plan: Plan, spec: GraphSpec, group_size: int | None = None,
                wrap: Callable[[Callable], Callable] = lambda f: f) -> PhaseParts:
    """Bind plan and bucket into the phase's parts; ``wrap`` (e.g. torch.compile) wraps each.
    ``group_size`` (a divisor of the phase's layer count, default all) sets layers per ``layers`` call."""
    n = phase_num_layers(plan, spec.phase)
    group_size = n if group_size is None else group_size
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must divide num_hidden_layers={n}")
    fns = PART_FUNCTIONS[spec.phase]
    bound = [wrap(functools.partial(f, plan, spec.bucket)) for f in fns]
    return PhaseParts(prologue=bound[0], layers=bound[1], epilogue=bound[2], group_size=group_size)


def _groups(parts: PhaseParts, w: Weights, kv: list[Tensor], num_layers: int) -> list[tuple[list[LayerWeights], list[Tensor]]]:
    g = parts.group_size
    return [(w["layers"][i:i + g], kv[2 * i:2 * (i + g)]) for i in range(0, num_layers, g)]


def run_prefill(parts: PhaseParts, w: Weights, kv: list[Tensor], input_ids: Tensor, position_ids: Tensor,
                seq_ids: Tensor, prompt_lens: Tensor, *sampler_inputs: Tensor) -> dict[str, Tensor]:
    h, cos, sin, mask = parts.prologue(w["embed"], input_ids, position_ids, prompt_lens)
    for lws, group_kv in _groups(parts, w, kv, len(w["layers"])):
        h = parts.layers(lws, group_kv, h, cos, sin, seq_ids, mask)
    return parts.epilogue(w["norm"], w["lm_head"], h, prompt_lens, *sampler_inputs)


def run_decode(parts: PhaseParts, w: Weights, kv: list[Tensor], input_ids: Tensor, position_ids: Tensor,
               seq_ids: Tensor, *sampler_inputs: Tensor, num_layers: int | None = None) -> dict[str, Tensor]:
    """Decode, speculate (T = k tokens, no sampler inputs) and draft (``num_layers`` first layers)."""
    h, cos, sin, mask = parts.prologue(w["embed"], input_ids, position_ids)
    for lws, group_kv in _groups(parts, w, kv, num_layers or len(w["layers"])):
        h = parts.layers(lws, group_kv, h, cos, sin, seq_ids, position_ids, mask)
    return parts.epilogue(w["norm"], w["lm_head"], h, *sampler_inputs)


RUNNERS = {"prefill": run_prefill, "decode": run_decode, "speculate": run_decode, "draft": run_decode}


class GraphModule(torch.nn.Module):
    """One (phase, bucket) graph as an nn.Module holding only static values (no parameters):
    ``forward(weights, kv, *step_inputs)``. Weights and KV cache are inputs, so every graph shares
    one copy of each. ``kv``: 2 * num_layers tensors, K of layer l at 2l and V at 2l + 1."""

    def __init__(self, parts: PhaseParts, phase: str, num_layers: int | None = None):
        super().__init__()
        self.parts = parts
        self.run = functools.partial(RUNNERS[phase], num_layers=num_layers) if phase != "prefill" else RUNNERS[phase]

    def forward(self, w: Weights, kv: list[Tensor], *inputs: Tensor) -> dict[str, Tensor]:
        return self.run(self.parts, w, kv, *inputs)
