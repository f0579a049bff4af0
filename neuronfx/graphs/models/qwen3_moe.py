"""Qwen3-MoE (HF ``model_type`` "qwen3_moe"): Qwen3's attention (q/k norm, explicit head_dim) and
a mixture-of-experts MLP (``graphs/moe.py``), each expert ``moe_intermediate_size`` wide, the
picked probabilities renormalised only when ``norm_topk_prob``.

Layers listed in ``mlp_only_layers``, or whose index + 1 is not a multiple of
``decoder_sparse_step``, have a dense SwiGLU MLP of ``intermediate_size`` instead
(``Qwen3MoeMLP``, Llama's weights: ``gate``, ``up``, ``down``); the registry records the others
as ``ModelConfig.moe_layers``. As in llama4, a layer's weights say which MLP it has (a router or
not), and the inductor backend compiles one group of a whole number of periods of the pattern
(``config.attention.layer_period``; the whole stack when it does not repeat), so every group
has the same structure. Reference: transformers ``models/qwen3_moe/modeling_qwen3_moe.py``.
"""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models import llama, moe, qwen3
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.layers import Attend, LayerWeights, glu_mlp, rms_norm
from neuronfx.graphs.models.ops import Ops

EXPERT_SOURCES = moe.ExpertSources(
    fused_gate_up="model.layers.{i}.mlp.experts.gate_up_proj",
    per_expert={
        "gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        "down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    },
)


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Llama's key map without its MLP, q/k norms, and the router and stacked experts; with
    ``moe_layers``, each layer's own MLP names (MoE, or Llama's dense ``mlp.*_proj``), spelled
    out per layer."""
    attention = llama.attention_key_map(cfg) | (qwen3.QK_NORM_KEY_MAP if cfg.qk_norm else {})
    if not cfg.moe_layers:
        return attention | moe.MOE_KEY_MAP
    for i in range(cfg.num_hidden_layers):
        mlp = moe.MOE_KEY_MAP if i in cfg.moe_layers else llama.MLP_KEY_MAP
        attention |= {hf.format(i=i): ours.format(i=i) for hf, ours in mlp.items()}
    return attention


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Attention shapes, q_norm / k_norm (head_dim,), the MoE weights, and with dense layers
    their MLP (intermediate_size, hidden) x 2 and (hidden, intermediate_size): the width the
    tensor-parallel plan splits for ``gate`` / ``up`` / ``down``."""
    d = cfg.head_dim
    shapes = llama.attention_shapes(cfg) | ({"q_norm": (d,), "k_norm": (d,)} if cfg.qk_norm else {}) | moe.moe_shapes(cfg)
    return shapes | (llama.mlp_shapes(cfg) if cfg.moe_layers else {})


def decoder_layer(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One pre-norm decoder layer: h (B, T, hidden) -> (B, T, hidden), q/k-norm attention then
    the MoE MLP when the layer's weights hold a router (a layer of ``moe_layers``, or every
    layer), else the dense one: the weights' structure is static, so a traced group fixes it
    per layer position."""
    h = qwen3.attention_block(cfg, ops, lw, h, cos, sin, attend)
    x = rms_norm(h, lw["mlp_norm"], cfg.rms_norm_eps)
    return h + (moe.moe_mlp(cfg, ops, lw, x) if "router" in lw else glu_mlp(ops, lw, x))


MATH = FamilyMath(key_map=key_map, layer_shapes=layer_shapes, decoder_layer=decoder_layer, expert_sources=EXPERT_SOURCES)
