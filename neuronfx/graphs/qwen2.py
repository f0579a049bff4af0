"""Qwen2 (HF ``model_type`` "qwen2"): Llama math with q/k/v projection biases."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs import llama
from neuronfx.graphs.layers import Attend, LayerWeights, llama_layer


def key_map(cfg: ModelConfig) -> dict[str, str]:
    # ModelConfig.from_hf sets attention_bias=True for qwen2, so the bias keys are included.
    return llama.key_map(cfg)


def decoder_layer(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One decoder layer: h (B, T, hidden) -> (B, T, hidden); ``attend`` owns the KV cache."""
    return llama_layer(cfg, lw, h, cos, sin, attend)
