"""Qwen2 (HF ``model_type`` "qwen2"): Llama math with q/k/v projection biases."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs import llama
from neuronfx.graphs.layers import Attend, Weights, llama_stack


def key_map(cfg: ModelConfig) -> dict[str, str]:
    # ModelConfig.from_hf sets attention_bias=True for qwen2, so the bias keys are included.
    return llama.key_map(cfg)


def forward(w: Weights, cfg: ModelConfig, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
    """ids and position_ids (B, T) int -> final-normed hidden states (B, T, hidden)."""
    return llama_stack(w, cfg, input_ids, position_ids, attend)
