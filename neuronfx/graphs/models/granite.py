"""Granite (HF ``model_type`` "granite"): Llama's layer with IBM's four scalars (its extras
record, ``config.extras.GraniteExtras``): embeddings times ``embedding_multiplier`` and logits
divided by ``logits_scaling`` (this file's hooks, which the phases call), each block's output
times ``residual_multiplier`` before the residual add, and ``attention_multiplier`` as the
attention scale. Reference: transformers ``models/granite/modeling_granite.py``.
"""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models import llama
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.layers import Attend, LayerWeights, attention_output, glu_mlp, rms_norm, scale_query
from neuronfx.graphs.models.ops import Ops


def embed_scale(cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    """The embedding rows h (B, T, hidden) times ``embedding_multiplier`` (``GraniteModel``)."""
    m = cfg.extras.embedding_multiplier
    return h if m == 1.0 else h * m


def logits(cfg: ModelConfig, out: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> float32 divided by ``logits_scaling`` (``GraniteForCausalLM``)."""
    scaling = cfg.extras.logits_scaling
    return out.float() if scaling == 1.0 else out.float() / scaling


def decoder_layer(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One pre-norm decoder layer: h (B, T, hidden) -> (B, T, hidden). The ops attend at scale
    1/sqrt(head_dim), so q is multiplied by ``attention_multiplier * sqrt(head_dim)`` first
    (RoPE is linear: scaling before it is the same)."""
    eps, m = cfg.rms_norm_eps, cfg.extras.residual_multiplier
    q, k, v = llama.qkv_heads(cfg, ops, lw, rms_norm(h, lw["attn_norm"], eps))
    q = scale_query(cfg, q, cfg.extras.attention_multiplier)
    h = h + attention_output(ops, lw, q, k, v, cos, sin, attend, cfg.attention_output_bias) * m
    return h + glu_mlp(ops, lw, rms_norm(h, lw["mlp_norm"], eps), cfg.mlp_bias) * m


MATH = FamilyMath(key_map=llama.key_map, layer_shapes=llama.layer_shapes, decoder_layer=decoder_layer, embed_scale=embed_scale,
                  logits=logits)
