"""Which weights a plan quantizes, and to what: a pure function of the configs.

Weight-only quantization (gpt-fast's int8 / int4, NxDI's per-channel int8): the linear weights
of the decoder layers are stored quantized and multiplied with fp32 accumulation; activations,
norms, biases, the router of a mixture of experts and the KV cache stay in the plan's dtype.

- ``weight_format="float"``: nothing quantized (the default).
- ``"int8"``: symmetric per output channel, fp32 scales.
- ``"int4"``: asymmetric groups of ``weight_group_size`` weights along the input dim, fp32
  scale and offset per group.
- ``"gguf"``: the GGUF file's Q4_0 / Q4_1 / Q8_0 blocks kept as they are (other GGUF types
  are dequantized to the plan's dtype).

``activation_format="int8"`` (opt-in; quantized plans on the inductor backend) makes the
products integer products: int8 weights multiply x rounded to int8 per row (one scale per token,
torchao's dynamic activation quantization) through an integer GEMM, at every row count (the
int8 LM head keeps float x: the rounding of its input would land on every logit); the
decode products of 4-bit weights (int4, Q4_0, Q4_1) round x per 32 values and sum each block's
nibble x int8 products exactly (llama.cpp's arithmetic, AVX512-VNNI), then scale and accumulate
in fp32. It trades x's rounding error (at most absmax / 254 per value of a row or a block of
32) for less work per weight; Q8_0 weights and 4-bit prefill keep float x.
``activation_format="auto"`` takes int8 x only on the products where it measured faster on
this machine (``graphs/kernels/activation_choice.py``). Neither is token-exact.

The LM head is quantized too when ``quantize_lm_head`` (the default): decode reads it whole
every step (for SmolLM2-135M it is a fifth of all weights). An int4 plan gives it int8, as
llama.cpp's quantizer keeps ``output.weight`` at more bits than the layers (the error of the
head shows in every logit). The embeddings are quantized only when tied to a quantized head (one
tensor serves both; a lookup dequantizes just the rows it reads); untied ones stay float, since
a step reads only its tokens' rows. Mixture-of-experts expert weights stay float (their
products are plain torch einsums with no quantized kernel yet).
"""

from __future__ import annotations

from neuronfx.config.inference import InferenceConfig
from neuronfx.config.model import ModelConfig
from neuronfx.errors import ConfigError

LAYER_LINEARS = ("wq", "wk", "wv", "wo", "gate", "up", "down", "dense_gate", "dense_up", "dense_down")
"""neuronfx names of the per-layer linear weights a quantized plan quantizes (where a family
has them): attention projections and the dense MLP (llama4's dense layers included)."""
HEAD = "lm_head"


def layer_format(inference: InferenceConfig) -> str | None:
    """Format of the quantized layer weights: "int8", "int4", "gguf" (each tensor's own GGUF
    block type), or None for a float plan."""
    return None if inference.weight_format == "float" else inference.weight_format


def head_format(inference: InferenceConfig) -> str | None:
    """Format of the LM head: None when float (a float plan, or ``quantize_lm_head=False``),
    "int8" for int8 and int4 plans, "gguf" for gguf plans (the file's type of the head, or of
    the tied embeddings)."""
    if inference.weight_format == "float" or not inference.quantize_lm_head:
        return None
    return "gguf" if inference.weight_format == "gguf" else "int8"


def quantized_formats(inference: InferenceConfig) -> dict[str, str]:
    """neuronfx base weight name (``LAYER_LINEARS`` and ``"lm_head"``) -> format for every
    weight ``inference`` quantizes; empty for a float plan. The same for every family: names a
    family lacks are ignored by the converter."""
    fmt = layer_format(inference)
    if fmt is None:
        return {}
    out = dict.fromkeys(LAYER_LINEARS, fmt)
    head = head_format(inference)
    return out | ({HEAD: head} if head else {})


def check_quantization(model: ModelConfig, inference: InferenceConfig) -> None:
    """Raise ConfigError when ``model`` cannot run ``inference``'s weight format: an int4
    ``weight_group_size`` that does not divide ``hidden_size`` (every layer's first product
    reads it as K)."""
    if inference.weight_format == "int4" and model.hidden_size % inference.weight_group_size:
        raise ConfigError(
            f"weight_group_size={inference.weight_group_size} does not divide hidden_size={model.hidden_size}; "
            f"pick a group size that divides it (32, 64 or 128), or weight_format='int8'."
        )
