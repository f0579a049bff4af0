"""Mistral (HF ``model_type`` "mistral"): Llama math; the plan rejects a sliding window shorter
than ``sequence_length``, so attention is always full here."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs import llama
from neuronfx.graphs.layers import Attend, Weights, llama_stack


def key_map(cfg: ModelConfig) -> dict[str, str]:
    return llama.key_map(cfg)


def forward(w: Weights, cfg: ModelConfig, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
    """ids and position_ids (B, T) int -> final-normed hidden states (B, T, hidden)."""
    return llama_stack(w, cfg, input_ids, position_ids, attend)
