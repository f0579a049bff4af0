"""Qwen3 (HF ``model_type`` "qwen3"): Llama math with per-head RMSNorm on q and k before RoPE
and an explicit ``head_dim``."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs import llama
from neuronfx.graphs.layers import Attend, LayerWeights, llama_layer

QK_NORM_KEY_MAP = {
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.q_norm",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.k_norm",
}


def key_map(cfg: ModelConfig) -> dict[str, str]:
    return llama.key_map(cfg) | QK_NORM_KEY_MAP


def decoder_layer(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One decoder layer: h (B, T, hidden) -> (B, T, hidden); ``attend`` owns the KV cache."""
    return llama_layer(cfg, lw, h, cos, sin, attend, qk_norm=True)
