"""Llama (HF ``model_type`` "llama", also SmolLM2): pre-norm decoder, GQA, RoPE, SwiGLU MLP."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.layers import Attend, Weights, llama_stack

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
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down",
}
# Present only when ModelConfig.attention_bias is set.
BIAS_KEY_MAP = {
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.bq",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.bk",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.bv",
}


def key_map(cfg: ModelConfig) -> dict[str, str]:
    return KEY_MAP | (BIAS_KEY_MAP if cfg.attention_bias else {})


def forward(w: Weights, cfg: ModelConfig, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
    """ids and position_ids (B, T) int -> final-normed hidden states (B, T, hidden)."""
    return llama_stack(w, cfg, input_ids, position_ids, attend)
