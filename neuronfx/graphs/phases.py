"""Per-phase graph functions: (weights, KV cache, step inputs) -> outputs, KV updated in place.

Each phase is its own small function, specialised at build time by ``GraphModule``: no phase
branches, no ``.item()``, no shape sniffing. Input names and order follow
``neuronfx.config.plan.step_inputs``.
"""

from __future__ import annotations

import torch

from neuronfx.config.masks import decode_mask, prefill_mask
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.graphs.layers import Weights, sdpa
from neuronfx.graphs.models import model_module
from neuronfx.graphs.sampling import sample


def _head(w: Weights, hidden: torch.Tensor, sampling_params: torch.Tensor, rand: torch.Tensor, plan: Plan) -> dict[str, torch.Tensor]:
    """hidden (B, hidden) -> {"tokens": (B,) int32 and/or "logits": (B, V) float32}."""
    logits = (hidden @ w["lm_head"].T).float()  # (B, V)
    out = {}
    if plan.inference.on_device_sampling:
        out["tokens"] = sample(logits, sampling_params, rand, plan.topk_width)
    if plan.inference.output_logits:
        out["logits"] = logits
    return out


def prefill(
    plan: Plan, bucket: int, w: Weights, kv: list[torch.Tensor], input_ids: torch.Tensor,
    position_ids: torch.Tensor, seq_ids: torch.Tensor, prompt_lens: torch.Tensor,
    sampling_params: torch.Tensor, rand: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Prefill right-padded prompts (B, bucket) into slots ``seq_ids`` (B,) starting at position 0.

    Writes K/V positions [0, bucket) of each row's slot (see ``config.kv.prefill_access``); the
    prompt attends only itself. Output is for the last real token (index prompt_lens - 1).
    """
    cfg = plan.model

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv[2 * i][seq_ids, :, :bucket] = k  # (B, n_kv, T, D) into slots
        kv[2 * i + 1][seq_ids, :, :bucket] = v
        return sdpa(q, k, v, mask)

    mask = prefill_mask(prompt_lens, bucket)  # (B, 1, T, T)
    hidden = model_module(cfg.model_type).forward(w, cfg, input_ids, position_ids, attend)  # (B, T, H)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    last = hidden[rows, (prompt_lens - 1).long()]  # (B, H)
    return _head(w, last, sampling_params, rand, plan)


def decode(
    plan: Plan, bucket: int, w: Weights, kv: list[torch.Tensor], input_ids: torch.Tensor,
    position_ids: torch.Tensor, seq_ids: torch.Tensor, sampling_params: torch.Tensor, rand: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Decode one token per row: input_ids/position_ids (B, 1), slots ``seq_ids`` (B,).

    Writes K/V at position_ids into each slot, then attends KV positions [0, bucket) masked to
    ``j <= position`` (see ``config.kv.decode_access``). Positions past ``position`` are zeroed
    after the read: they may hold anything (stale rows, NaN), and a masked NaN still poisons
    attention (NaN score + -inf mask is NaN; 0 weight * NaN value is NaN).
    """
    cfg = plan.model
    pos = position_ids[:, 0].long()  # (B,)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = kv[2 * i], kv[2 * i + 1]
        k_cache[seq_ids, :, pos] = k[:, :, 0]  # (B, n_kv, D)
        v_cache[seq_ids, :, pos] = v[:, :, 0]
        keys = k_cache[:, :, :bucket][seq_ids].masked_fill(~visible, 0.0)  # (B, n_kv, S, D)
        values = v_cache[:, :, :bucket][seq_ids].masked_fill(~visible, 0.0)
        return sdpa(q, keys, values, mask)

    mask = decode_mask(position_ids, bucket)  # (B, 1, 1, S)
    visible = mask[:, :, 0, :, None]  # (B, 1, S, 1)
    hidden = model_module(cfg.model_type).forward(w, cfg, input_ids, position_ids, attend)  # (B, 1, H)
    return _head(w, hidden[:, 0], sampling_params, rand, plan)


PHASE_FUNCTIONS = {"prefill": prefill, "decode": decode}


class GraphModule(torch.nn.Module):
    """One (phase, bucket) graph as an nn.Module holding only static values (no parameters):
    ``forward(weights, kv, *step_inputs)``. Weights and KV cache are inputs, so every graph shares
    one copy of each."""

    def __init__(self, plan: Plan, spec: GraphSpec):
        super().__init__()
        self.plan = plan
        self.spec = spec
        self.fn = PHASE_FUNCTIONS[spec.phase]

    def forward(self, w: Weights, kv: list[torch.Tensor], *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.fn(self.plan, self.spec.bucket, w, kv, *inputs)
