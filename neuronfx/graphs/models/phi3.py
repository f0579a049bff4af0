"""Phi-3 (HF ``model_type`` "phi3": Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini): Llama's layer with
the q/k/v projections fused into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` in the
checkpoint, RoPE on the first ``rotary_dim`` dims of each head (``partial_rotary_factor``,
``layers.apply_rope``) and usually longrope scaling (``layers.row_inv_freq``).
Reference: transformers ``models/phi3/modeling_phi3.py``.

The fused tensors are split at load into Llama's ``wq``/``wk``/``wv`` and ``gate``/``up``: the
key map names the parts of each fused tensor in their order along dim 0 (``qkv_proj`` is
[q; k; v] rows, ``gate_up_proj`` [gate; up], as ``Phi3Attention`` slices and ``Phi3MLP`` chunks
them), and ``io/weights.split_fused`` reads each part as a row slice of the checkpoint
tensor (tensor-parallel ranks read only their rows). Llama's layer, kernels and sharding rules
then serve Phi-3 unchanged, tensor parallel included (a rank's q/k/v rows are not one
contiguous block of ``qkv_proj``). Keeping the products fused in the graph measured 0-7 %
faster at decode batch 1 on inductor in fp32 and equal in bf16 (``scripts/phi3_fused_vs_split.py``,
4 layers of hidden 1024 on a shared 2-core CPU, noisy), since the split path already runs q/k/v
and gate/up as one kernel call each (the ops bundle's ``projections`` and ``glu``).
"""

from __future__ import annotations

from neuronfx.config.model import ModelConfig
from neuronfx.graphs.models import llama
from neuronfx.graphs.models.family import FamilyMath

KEY_MAP: dict[str, str | tuple[str, ...]] = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm",
    "model.layers.{i}.self_attn.qkv_proj.weight": ("layers.{i}.wq", "layers.{i}.wk", "layers.{i}.wv"),
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.wo",
    "model.layers.{i}.mlp.gate_up_proj.weight": ("layers.{i}.gate", "layers.{i}.up"),
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.down",
}


def key_map(cfg: ModelConfig) -> dict[str, str | tuple[str, ...]]:
    """HF checkpoint name -> neuronfx weight name, or the names stacked in a fused tensor."""
    return KEY_MAP


MATH = FamilyMath(key_map=key_map, layer_shapes=llama.layer_shapes, decoder_layer=llama.decoder_layer)
