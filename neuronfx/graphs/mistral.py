"""Mistral (HF ``model_type`` "mistral"): Llama's math (transformers ``modeling_mistral.py``
differs from ``modeling_llama.py`` only in its sliding window). Its registry entry marks every
layer "sliding_attention" when ``sliding_window`` is set; the prologue's masks hold the window
(``config.masks``), so the Llama functions serve as they are."""

from neuronfx.graphs.llama import decoder_layer, key_map, layer_shapes

__all__ = ["decoder_layer", "key_map", "layer_shapes"]
