"""SmolLM3 (HF ``model_type`` "smollm3"): Llama's layer and checkpoint names; some layers skip
RoPE (``no_rope_layers``: NoPE every ``no_rope_layer_interval``-th layer by default), and
sliding-window layers apply only with ``use_sliding_window``. Both are read by its registry
entry into ``ModelConfig.rope_layers`` / ``layer_types``; the layer picks its RoPE table and
mask by the indices its weights carry (``config.attention``), so the math here is Llama's.
Reference: transformers ``models/smollm3/modeling_smollm3.py``."""

from neuronfx.graphs.llama import decoder_layer, key_map, layer_shapes

__all__ = ["decoder_layer", "key_map", "layer_shapes"]
