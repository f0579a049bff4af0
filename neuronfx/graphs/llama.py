"""Llama (HF ``model_type`` "llama", also SmolLM2): pre-norm decoder, GQA, RoPE, SwiGLU MLP."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.layers import Attend, LayerWeights, llama_layer

# HF checkpoint name -> neuronfx weight name; "{i}" is the layer index.
KEY_MAP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.wq",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.wk",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.wv",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.wo",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.gate",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.up",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.down",
}
# Present only when ModelConfig.attention_bias is set.
BIAS_KEY_MAP = {
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.bq",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.bk",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.bv",
}


def key_map(cfg: ModelConfig) -> dict[str, str]:
    return KEY_MAP | (BIAS_KEY_MAP if cfg.attention_bias else {})


def decoder_layer(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One decoder layer: h (B, T, hidden) -> (B, T, hidden); ``attend`` owns the KV cache."""
    return llama_layer(cfg, lw, h, cos, sin, attend)
