"""Llama (HF ``model_type`` "llama", also SmolLM2): pre-norm decoder, GQA, RoPE, SwiGLU MLP,
q/k/v projection biases when the config sets ``attention_bias``, gate/up/down biases when it
sets ``mlp_bias`` (HF ``LlamaConfig``).

Reference: transformers ``models/llama/modeling_llama.py``. Mistral, Qwen2 and SmolLM3 run this
file as it is (``config.families.MODEL_REMAPPING``: their sliding windows, biases and NoPE
layers are shared ModelConfig fields that the masks, the key map and the attention layout read);
other families reuse its pieces or compose them with their own (qwen3's q/k norm).
"""

from __future__ import annotations

import torch

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.layers import Attend, LayerWeights, attention_output, glu_mlp, rms_norm, split_heads
from neuronfx.graphs.models.ops import Ops

# HF checkpoint name -> neuronfx weight name; "{i}" is the layer index. Embeddings, norms and
# attention: what the mixture-of-experts families (mixtral, qwen3_moe) share with Llama.
ATTENTION_KEY_MAP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.wq",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.wk",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.wv",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.wo",
}
MLP_KEY_MAP = {
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.gate",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.up",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.down",
}
KEY_MAP = ATTENTION_KEY_MAP | MLP_KEY_MAP
# Present only when ModelConfig.attention_bias is set.
BIAS_KEY_MAP = {
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.bq",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.bk",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.bv",
}


# Present only when ModelConfig.attention_output_bias is set (llama's attention_bias; not qwen2's).
O_BIAS_KEY_MAP = {"model.layers.{i}.self_attn.o_proj.bias": "layers.{i}.bo"}
# Present only when ModelConfig.mlp_bias is set.
MLP_BIAS_KEY_MAP = {
    "model.layers.{i}.mlp.gate_proj.bias": "layers.{i}.bgate",
    "model.layers.{i}.mlp.up_proj.bias": "layers.{i}.bup",
    "model.layers.{i}.mlp.down_proj.bias": "layers.{i}.bdown",
}


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """HF checkpoint name -> neuronfx weight name ("{i}": layer index)."""
    return attention_key_map(cfg) | MLP_KEY_MAP | (MLP_BIAS_KEY_MAP if cfg.mlp_bias else {})


def attention_key_map(cfg: ModelConfig) -> dict[str, str]:
    """The key map without the MLP (embeddings, norms, attention, q/k/v biases when set)."""
    biases = (BIAS_KEY_MAP if cfg.attention_bias else {}) | (O_BIAS_KEY_MAP if cfg.attention_output_bias else {})
    return ATTENTION_KEY_MAP | biases


def attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes of the two norms and the attention weights (HF layout: (out, in))."""
    h = cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"attn_norm": (h,), "mlp_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q)}
    shapes |= {"bq": (q,), "bk": (kv,), "bv": (kv,)} if cfg.attention_bias else {}
    return shapes | ({"bo": (h,)} if cfg.attention_output_bias else {})


def mlp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes of the SwiGLU MLP of ``intermediate_size`` (and its biases when
    ``cfg.mlp_bias``)."""
    h, i_sz = cfg.hidden_size, cfg.intermediate_size
    shapes = {"gate": (i_sz, h), "up": (i_sz, h), "down": (h, i_sz)}
    return shapes | ({"bgate": (i_sz,), "bup": (i_sz,), "bdown": (h,)} if cfg.mlp_bias else {})


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each per-layer weight (HF layout: linear weights are (out, in))."""
    return attention_shapes(cfg) | mlp_shapes(cfg)


def qkv_heads(cfg: ModelConfig, ops: Ops, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V of x (B, T, hidden) split into heads: (B, n_heads, T, D), (B, n_kv_heads, T, D) x 2;
    one ops call for the three projections, with their biases when ``cfg.attention_bias``
    (column-parallel under tensor parallelism: x enters through ``ops.parallel_in``)."""
    x = ops.parallel_in(x)
    biases = (lw["bq"], lw["bk"], lw["bv"]) if cfg.attention_bias else (None, None, None)
    q, k, v = ops.projections(x, (lw["wq"], lw["wk"], lw["wv"]), biases)
    d = cfg.head_dim
    return split_heads(q, cfg.num_attention_heads, d), split_heads(k, cfg.num_key_value_heads, d), split_heads(v, cfg.num_key_value_heads, d)


def attention_block(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    attend: Attend) -> torch.Tensor:
    """The attention half of a pre-norm layer with its residual: h (B, T, hidden) -> (B, T, hidden)."""
    x = rms_norm(h, lw["attn_norm"], cfg.rms_norm_eps)
    q, k, v = qkv_heads(cfg, ops, lw, x)
    return h + attention_output(ops, lw, q, k, v, cos, sin, attend, cfg.attention_output_bias)


def decoder_layer(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One pre-norm decoder layer: h (B, T, hidden) -> (B, T, hidden); ``attend`` owns the KV cache."""
    h = attention_block(cfg, ops, lw, h, cos, sin, attend)
    return h + glu_mlp(ops, lw, rms_norm(h, lw["mlp_norm"], cfg.rms_norm_eps), cfg.mlp_bias)


MATH = FamilyMath(key_map=key_map, layer_shapes=layer_shapes, decoder_layer=decoder_layer)
