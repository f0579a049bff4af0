"""Qwen3-MoE (HF ``model_type`` "qwen3_moe"): Qwen3's attention (q/k norm, explicit head_dim) and
a mixture-of-experts MLP in every layer (``graphs/moe.py``; the registry refuses configs with
dense layers among them), each expert ``moe_intermediate_size`` wide, the picked probabilities
renormalised only when ``norm_topk_prob``. Reference: transformers
``models/qwen3_moe/modeling_qwen3_moe.py``.
"""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs import llama, moe, qwen3
from neuronfx.graphs.layers import Attend, LayerWeights, rms_norm
from neuronfx.graphs.ops import Ops

EXPERT_SOURCES = moe.ExpertSources(
    fused_gate_up="model.layers.{i}.mlp.experts.gate_up_proj",
    per_expert={
        "gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        "down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    },
)


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Llama's key map without its MLP, q/k norms, router and stacked experts."""
    return llama.attention_key_map(cfg) | (qwen3.QK_NORM_KEY_MAP if cfg.qk_norm else {}) | moe.MOE_KEY_MAP


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Attention shapes, q_norm / k_norm (head_dim,), and the MoE weights."""
    d = cfg.head_dim
    return llama.attention_shapes(cfg) | ({"q_norm": (d,), "k_norm": (d,)} if cfg.qk_norm else {}) | moe.moe_shapes(cfg)


def decoder_layer(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One pre-norm decoder layer: h (B, T, hidden) -> (B, T, hidden), q/k-norm attention then the MoE MLP."""
    h = qwen3.attention_block(cfg, ops, lw, h, cos, sin, attend)
    return h + moe.moe_mlp(cfg, ops, lw, rms_norm(h, lw["mlp_norm"], cfg.rms_norm_eps))
