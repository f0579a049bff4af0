"""Gemma 3 text (HF ``model_type`` "gemma3_text", ``Gemma3ForCausalLM``): a pre- and post-norm
decoder. Each block's input and output are normalised (four RMSNorms per layer), every RMSNorm
is Gemma's ``x * (1 + w)`` in fp32 (``layers.unit_offset_rms_norm``), q and k are normalised per
head before RoPE, the attention scale is ``query_pre_attn_scalar ** -0.5``, the MLP gates with
tanh-approximated GELU, sliding-window layers (their own RoPE base) interleave with global ones,
and the logits may be soft-capped. Reference: transformers ``models/gemma3/modeling_gemma3.py``
(``Gemma3DecoderLayer``, ``Gemma3Attention``, ``Gemma3MLP``).

Its hooks (which the phases call): the embedding multiplier sqrt(hidden_size) rounded to the
weights' dtype, the final unit-offset norm and the soft-capping of the logits. Its own options
are its extras record (``config.extras.Gemma3Extras``); the registry entry
(``config/families.py``) sets the shared fields, and the layer types pick each layer's mask and
RoPE table (``config/attention.py``). Sliding layers keep a full-length KV cache like every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models import llama, qwen3
from neuronfx.graphs.models.family import FamilyMath
from neuronfx.graphs.models.layers import Attend, LayerWeights, attention_output, scale_query
from neuronfx.graphs.models.layers import unit_offset_rms_norm as norm
from neuronfx.graphs.models.ops import Ops

# Llama's names except the norms: Gemma's post_attention_layernorm normalises the attention
# output (Llama's is the MLP's input norm, here pre_feedforward_layernorm).
NORM_KEY_MAP = {
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attn_norm",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.mlp_norm",
    "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_mlp_norm",
}
# transformers ACT2FN names -> the function (GELUTanh is F.gelu(approximate="tanh"))
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """HF checkpoint name -> neuronfx weight name ("{i}": layer index): Llama's projections and
    input norm, qwen3's q/k norms, Gemma's three other norms."""
    llama_map = {k: v for k, v in llama.key_map(cfg).items() if "post_attention_layernorm" not in k}
    return llama_map | qwen3.QK_NORM_KEY_MAP | NORM_KEY_MAP


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shapes: qwen3's (Llama's plus q_norm / k_norm (head_dim,)) and the two
    post-block norms (hidden,)."""
    h = cfg.hidden_size
    return qwen3.layer_shapes(cfg) | {"post_attn_norm": (h,), "post_mlp_norm": (h,)}


def embed_scale(cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    """The embedding rows h (B, T, hidden) times sqrt(hidden_size) rounded to h's dtype (55.4256
    -> 55.5 in bf16), as ``Gemma3TextScaledWordEmbedding`` casts its scale."""
    # made by an op (torch.full), not torch.tensor: export cannot lift a tensor constant here
    return h * torch.full((), float(cfg.hidden_size) ** 0.5, dtype=h.dtype, device=h.device)


def logits(cfg: ModelConfig, out: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> float32, soft-capped first in the weights' dtype when
    ``final_logit_softcapping`` is set: ``tanh(logits / cap) * cap`` (``Gemma3ForCausalLM.forward``)."""
    cap = cfg.extras.final_logit_softcapping
    return out.float() if cap is None else (torch.tanh(out / cap) * cap).float()


def gated_mlp(cfg: ModelConfig, ops: Ops, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with ``cfg.hidden_act`` (transformers ``Gemma3MLP``), x (B, T,
    hidden) -> (B, T, hidden); gate/up column-parallel (one ``ops.projections`` call), down
    row-parallel under tensor parallelism. ``ops.glu`` is SiLU's fused product, so not used."""
    gate, up = ops.projections(ops.parallel_in(x), (lw["gate"], lw["up"]), (None, None))  # (B, T, I) x 2
    return ops.parallel_out(ops.linear(ACTIVATIONS[cfg.hidden_act](gate) * up, lw["down"], None))


def decoder_layer(cfg: ModelConfig, ops: Ops, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One Gemma 3 layer: h (B, T, hidden) -> (B, T, hidden); ``attend`` owns the KV cache.
    The attention scale is ``query_pre_attn_scalar ** -0.5``; the ops attend at
    1/sqrt(head_dim), so q is multiplied by sqrt(head_dim / query_pre_attn_scalar) after its
    norm (RoPE is linear: before or after it is the same)."""
    eps = cfg.rms_norm_eps
    q, k, v = llama.qkv_heads(cfg, ops, lw, norm(h, lw["attn_norm"], eps))  # (B, H, T, D), (B, H_kv, T, D) x 2
    q, k = norm(q, lw["q_norm"], eps), norm(k, lw["k_norm"], eps)
    q = scale_query(cfg, q, float(cfg.extras.query_pre_attn_scalar) ** -0.5)  # Gemma3Attention.scaling
    h = h + norm(attention_output(ops, lw, q, k, v, cos, sin, attend), lw["post_attn_norm"], eps)
    return h + norm(gated_mlp(cfg, ops, lw, norm(h, lw["mlp_norm"], eps)), lw["post_mlp_norm"], eps)


MATH = FamilyMath(key_map=key_map, layer_shapes=layer_shapes, decoder_layer=decoder_layer, embed_scale=embed_scale,
                  final_norm=norm, logits=logits)
