"""Mistral (HF ``model_type`` "mistral"): Llama math; the plan rejects a sliding window shorter
than ``sequence_length``, so attention is always full here."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs import llama
from neuronfx.graphs.layers import Attend, LayerWeights, llama_layer


def key_map(cfg: ModelConfig) -> dict[str, str]:
    return llama.key_map(cfg)


def decoder_layer(cfg: ModelConfig, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One decoder layer: h (B, T, hidden) -> (B, T, hidden); ``attend`` owns the KV cache."""
    return llama_layer(cfg, lw, h, cos, sin, attend)
