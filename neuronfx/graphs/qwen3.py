"""Qwen3 (HF ``model_type`` "qwen3"): Llama math with per-head RMSNorm on q and k before RoPE
and an explicit ``head_dim``."""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs import llama
from neuronfx.graphs.layers import Attend, Weights, llama_stack

QK_NORM_KEY_MAP = {
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.q_norm",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.k_norm",
}


def key_map(cfg: ModelConfig) -> dict[str, str]:
    return llama.key_map(cfg) | QK_NORM_KEY_MAP


def forward(w: Weights, cfg: ModelConfig, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
    """ids and position_ids (B, T) int -> final-normed hidden states (B, T, hidden)."""
    return llama_stack(w, cfg, input_ids, position_ids, attend, qk_norm=True)
