"""What a family file gives the graphs: its math as one record, with defaults for the hooks
most families leave alone.

Each family file (``models/<model_type>.py``) ends with ``MATH = FamilyMath(...)``; the
registry lookup (``graphs.models.family_math``) returns it. The phases call the hooks by name
and never ask which family they run: an embedding scale, the final norm, the logits' transform
and the "RoPE table" of NoPE layers are the family's to say.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models.layers import rms_norm
from neuronfx.graphs.models.moe import ExpertSources

Tensor = torch.Tensor
Target = str | tuple[str, ...]
"""A key map value: one neuronfx name, or for a fused HF tensor (phi3's ``qkv_proj``) the names
of the weights stacked along its dim 0, in order."""


def unscaled(cfg: ModelConfig, h: Tensor) -> Tensor:
    """The embedding rows as they are: h (B, T, hidden)."""
    return h


def float_logits(cfg: ModelConfig, logits: Tensor) -> Tensor:
    """logits (..., V) in the weights' dtype -> float32, unchanged otherwise."""
    return logits.float()


def unit_cos(cfg: ModelConfig, position_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """The cos table of NoPE layers: ones (B, 1, T, rotary_dim) in ``dtype`` (with sin 0 the
    rotation is exactly the identity)."""
    return torch.ones((*position_ids.shape, cfg.rotary_dim), dtype=dtype, device=position_ids.device)[:, None]


@attrs.frozen(kw_only=True)
class FamilyMath:
    """One family's math and checkpoint names.

    - ``key_map(cfg) -> {HF name: neuronfx name or names}`` ("{i}": the layer index).
    - ``layer_shapes(cfg) -> {name: shape}``: each per-layer weight (HF layout: (out, in)).
    - ``decoder_layer(cfg, ops, lw, h, cos, sin, attend) -> h``: one layer, h (B, T, hidden);
      ``attend(q, k, v)`` owns the KV cache.
    - ``embed_scale(cfg, h) -> h``: the embedding rows (B, T, hidden) scaled as the family does
      (default: unchanged).
    - ``final_norm(h, weight, eps) -> h``: the norm before the LM head (default: RMSNorm).
    - ``logits(cfg, logits) -> logits``: (..., V) in the weights' dtype -> float32, the family's
      transform included (default: the cast alone).
    - ``nope_cos(cfg, position_ids, dtype) -> cos``: the cos table (B, 1, T, rotary_dim) of NoPE
      layers, whose sin is 0 (default: ones, the identity rotation).
    - ``expert_sources``: where its checkpoints keep a layer's MoE weights; None for a dense
      family.
    """

    key_map: Callable[[ModelConfig], Mapping[str, Target]]
    layer_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    decoder_layer: Callable[..., Tensor]
    embed_scale: Callable[[ModelConfig, Tensor], Tensor] = unscaled
    final_norm: Callable[[Tensor, Tensor, float], Tensor] = rms_norm
    logits: Callable[[ModelConfig, Tensor], Tensor] = float_logits
    nope_cos: Callable[[ModelConfig, Tensor, torch.dtype], Tensor] = unit_cos
    expert_sources: ExpertSources | None = None
