"""Mixtral (HF ``model_type`` "mixtral"): Llama's attention (with Mistral's sliding window, which
the plan refuses when shorter than ``sequence_length``) and a mixture-of-experts MLP
(``graphs/moe.py``): top-``num_experts_per_tok`` of ``num_experts`` SwiGLU experts, the picked
probabilities always renormalised. Reference: transformers ``models/mixtral/modeling_mixtral.py``.
"""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models import llama, moe
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.layers import Attend, LayerWeights, rms_norm
from neuronfx.graphs.models.ops import Ops

EXPERT_SOURCES = moe.ExpertSources(
    fused_gate_up="model.layers.{i}.mlp.experts.gate_up_proj",
    per_expert={
        "gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
        "up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
        "down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    },
    router_aliases=("model.layers.{i}.block_sparse_moe.gate.weight",),
)


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Llama's key map without its MLP, plus the router and stacked experts (``moe.MOE_KEY_MAP``)."""
    return llama.attention_key_map(cfg) | moe.MOE_KEY_MAP


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Llama's attention shapes plus the MoE weights (``moe.moe_shapes``)."""
    return llama.attention_shapes(cfg) | moe.moe_shapes(cfg)


def decoder_layer(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One pre-norm decoder layer: h (B, T, hidden) -> (B, T, hidden), attention then the MoE MLP."""
    h = llama.attention_block(cfg, ops, lw, h, cos, sin, attend)
    return h + moe.moe_mlp(cfg, ops, lw, rms_norm(h, lw["mlp_norm"], cfg.rms_norm_eps))


MATH = FamilyMath(key_map=key_map, layer_shapes=layer_shapes, decoder_layer=decoder_layer, expert_sources=EXPERT_SOURCES)
