"""Mistral (HF ``model_type`` "mistral"): Llama's math (transformers ``modeling_mistral.py``
differs from ``modeling_llama.py`` only in its sliding window). The plan refuses a window
shorter than ``sequence_length`` (``config.plan.make_plan``), so attention here is always full
and the Llama functions serve as they are."""

from neuronfx.graphs.llama import decoder_layer, key_map, layer_shapes

__all__ = ["decoder_layer", "key_map", "layer_shapes"]
