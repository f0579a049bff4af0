"""Qwen3 (HF ``model_type`` "qwen3"): Llama's layer with per-head RMSNorm of q and k before RoPE
(``ModelConfig.qk_norm``, set by its registry entry) and an explicit ``head_dim`` that need not
be hidden_size / num_heads. Reference: transformers ``models/qwen3/modeling_qwen3.py``."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models import llama
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.layers import Attend, LayerWeights, attention_output, glu_mlp, rms_norm
from neuronfx.graphs.models.ops import Ops

QK_NORM_KEY_MAP = {
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.q_norm",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.k_norm",
}


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Llama's key map, plus the q/k norm weights when ``cfg.qk_norm``."""
    return llama.key_map(cfg) | (QK_NORM_KEY_MAP if cfg.qk_norm else {})


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Llama's per-layer shapes, plus q_norm / k_norm (head_dim,) when ``cfg.qk_norm``."""
    d = cfg.head_dim
    return llama.layer_shapes(cfg) | ({"q_norm": (d,), "k_norm": (d,)} if cfg.qk_norm else {})


def attention_block(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    attend: Attend) -> torch.Tensor:
    """The attention half of a pre-norm layer with its residual, h (B, T, hidden) -> (B, T,
    hidden); q and k are normalised per head (RMSNorm over head_dim, HF ``Qwen3RMSNorm``)
    before RoPE when ``cfg.qk_norm``."""
    eps = cfg.rms_norm_eps
    q, k, v = llama.qkv_heads(cfg, ops, lw, rms_norm(h, lw["attn_norm"], eps))
    if cfg.qk_norm:
        q, k = rms_norm(q, lw["q_norm"], eps), rms_norm(k, lw["k_norm"], eps)
    return h + attention_output(ops, lw, q, k, v, cos, sin, attend, cfg.attention_output_bias)


def decoder_layer(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One pre-norm decoder layer: h (B, T, hidden) -> (B, T, hidden) (q/k norm attention, SwiGLU MLP)."""
    h = attention_block(cfg, ops, lw, h, cos, sin, attend)
    return h + glu_mlp(ops, lw, rms_norm(h, lw["mlp_norm"], cfg.rms_norm_eps))


MATH = FamilyMath(key_map=key_map, layer_shapes=layer_shapes, decoder_layer=decoder_layer)
