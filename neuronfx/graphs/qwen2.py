"""Qwen2 (HF ``model_type`` "qwen2"): Llama's math with q/k/v projection biases, always on
(transformers ``Qwen2Attention`` builds q/k/v with ``bias=True``): its registry entry
(``config/families.py``) sets ``ModelConfig.attention_bias``, which Llama's key map, shapes and
``qkv_heads`` read. A sliding window is used only with ``use_sliding_window`` (registry entry)."""

from neuronfx.graphs.llama import decoder_layer, key_map, layer_shapes

__all__ = ["decoder_layer", "key_map", "layer_shapes"]
