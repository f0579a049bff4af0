"""The registry of supported model families: one entry per HF ``model_type``.

Config, graphs and checkpoints all read this table. An entry says which :class:`ModelConfig`
fields the family sets from its transformers config beyond the ones every family shares; its
math lives in ``neuronfx/graphs/<model_type>.py`` (the file name is the model type). Adding a
family is one entry here plus that one file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from neuronfx.errors import ConfigError, UnsupportedModelError


@attrs.frozen
class Family:
    """One supported HF ``model_type``.

    ``options(hf_config) -> dict``: the family's own ModelConfig fields, read from its
    transformers config (e.g. qwen2's always-on q/k/v biases, qwen3's q/k norm); it raises
    UnsupportedModelError for an option of the family neuronfx does not implement.
    ``activations``: the MLP activations (transformers' ``ACT2FN`` names) its file implements.
    ``partial_rotary``: transformers' family applies ``partial_rotary_factor`` (RoPE on the
    first dims of each head only); elsewhere a factor below 1 is refused.
    ``recompute_at_rope_switch``: transformers' ``generate`` recomputes the whole KV cache when
    a longrope sequence grows past ``original_max_position_embeddings`` (Phi-3's
    ``prepare_inputs_for_generation``); the scheduler does the same (``refill_step``). Other
    families keep the keys cached before the switch, as transformers does for them.
    ``moe``: the family's MLPs are mixtures of experts (``ModelConfig.num_experts`` > 0), every
    layer's or, where ``ModelConfig.moe_layers`` lists some (llama4, qwen3_moe), those layers'
    (the others dense); else none is.
    ``tensor_parallel``: the sharding plan covers every weight of the family (else tp_degree > 1
    is refused before any rank starts).
    """

    model_type: str
    options: Callable[[Any], dict[str, Any]]
    activations: tuple[str, ...] = ("silu",)
    partial_rotary: bool = False
    recompute_at_rope_switch: bool = False
    moe: bool = False
    tensor_parallel: bool = True


def _flag(hf_config: Any, name: str) -> bool:
    return bool(getattr(hf_config, name, False))


def _qwen_window(hf_config: Any) -> int | None:
    # qwen2/qwen3 carry sliding_window but only use it when use_sliding_window is set.
    return getattr(hf_config, "sliding_window", None) if _flag(hf_config, "use_sliding_window") else None


def _attention_biases(hf_config: Any) -> dict[str, Any]:
    # q/k/v and o_proj biases both follow attention_bias (LlamaAttention and its copies).
    flag = _flag(hf_config, "attention_bias")
    return {"attention_bias": flag, "attention_output_bias": flag}


def _llama(hf_config: Any) -> dict[str, Any]:
    return _attention_biases(hf_config) | {"mlp_bias": _flag(hf_config, "mlp_bias")}


def _mistral(hf_config: Any) -> dict[str, Any]:
    window = getattr(hf_config, "sliding_window", None)  # MistralAttention: every layer slides when set
    return {"sliding_window": window, "layer_types": ("sliding_attention",) * hf_config.num_hidden_layers if window else ()}


def _qwen2(hf_config: Any) -> dict[str, Any]:
    return {"attention_bias": True, "sliding_window": _qwen_window(hf_config)}  # Qwen2Attention: bias=True


def _qwen3(hf_config: Any) -> dict[str, Any]:
    return _attention_biases(hf_config) | {"qk_norm": True, "sliding_window": _qwen_window(hf_config)}


def _granite(hf_config: Any) -> dict[str, Any]:
    return {
        **_attention_biases(hf_config),
        "mlp_bias": _flag(hf_config, "mlp_bias"),  # GraniteMLP: Llama's
        "embedding_multiplier": float(getattr(hf_config, "embedding_multiplier", 1.0)),
        "residual_multiplier": float(getattr(hf_config, "residual_multiplier", 1.0)),
        "attention_multiplier": float(getattr(hf_config, "attention_multiplier", 1.0)),  # GraniteAttention: scaling
        "logits_scaling": float(getattr(hf_config, "logits_scaling", 1.0)),
    }


def _smollm3(hf_config: Any) -> dict[str, Any]:
    # no_rope_layers[i] == 1 means layer i DOES use RoPE (SmolLM3Attention.use_rope); windows
    # apply only with use_sliding_window (SmolLM3Attention.sliding_window).
    sliding = _flag(hf_config, "use_sliding_window") and getattr(hf_config, "sliding_window", None) is not None
    types = tuple(getattr(hf_config, "layer_types", None) or ()) if sliding else ()
    return {
        **_attention_biases(hf_config),
        "rope_layers": tuple(bool(x) for x in hf_config.no_rope_layers),
        "sliding_window": hf_config.sliding_window if sliding else None,
        "layer_types": () if all(t == "full_attention" for t in types) else types,
    }


def _gemma3_text(hf_config: Any) -> dict[str, Any]:
    # Gemma3ForCausalLM (transformers models/gemma3/modeling_gemma3.py). The per-layer-type RoPE
    # bases (rope_parameters["full_attention"] / ["sliding_attention"]) are read by from_hf.
    for name in ("attn_logit_softcapping", "attention_bias", "use_bidirectional_attention"):
        if getattr(hf_config, name, None):
            raise UnsupportedModelError(
                f"{name}={getattr(hf_config, name)!r} is not supported for gemma3_text; neuronfx runs Gemma3ForCausalLM "
                f"with {name} unset (None / False), as the released Gemma 3 text models are."
            )
    hidden = hf_config.hidden_size
    return {
        "hidden_act": hf_config.hidden_activation,
        "qk_norm": True,
        "norm_unit_offset": True,  # Gemma3RMSNorm: x * (1 + w) in fp32, then the cast
        "embedding_multiplier": float(hidden) ** 0.5,  # Gemma3TextScaledWordEmbedding
        "embedding_multiplier_rounded": True,  # transformers casts the scale to the weights' dtype
        "attention_multiplier": float(hf_config.query_pre_attn_scalar) ** -0.5,  # Gemma3Attention.scaling
        "final_logit_softcapping": getattr(hf_config, "final_logit_softcapping", None),
        "sliding_window": getattr(hf_config, "sliding_window", None),
    }


# model types transformers knows that neuronfx refuses with a specific fix
REFUSED: dict[str, str] = {
    "gemma3": "Gemma3ForConditionalGeneration (the multimodal model with its vision tower) is not supported; run its "
              "text model: Gemma3ForCausalLM with the checkpoint's text_config (model_type 'gemma3_text', e.g. "
              "google/gemma-3-1b-it), or save Gemma3ForCausalLM's weights and text config with save_pretrained()",
    "llama4": "Llama4ForConditionalGeneration (the multimodal model with its vision tower) is not supported; run its "
              "text model: Llama4ForCausalLM with the checkpoint's text_config (model_type 'llama4_text')",
}


def _llama4_text(hf_config: Any) -> dict[str, Any]:
    # Llama4TextDecoderLayer: layers in moe_layers (every interleave_moe_layer_step-th by default)
    # are MoE with a shared expert of intermediate_size; the others dense MLPs of intermediate_size_mlp.
    moe_layers = tuple(int(i) for i in hf_config.moe_layers)
    dense = moe_layers != tuple(range(hf_config.num_hidden_layers))
    return {
        "moe_layers": moe_layers if dense else (),
        "dense_intermediate_size": hf_config.intermediate_size_mlp if dense else 0,
        **_attention_biases(hf_config),
        "rope_layers": tuple(bool(x) for x in hf_config.no_rope_layers),  # 1: the layer uses RoPE
        "attention_chunk_size": hf_config.attention_chunk_size,
        "num_experts": hf_config.num_local_experts,
        "num_experts_per_tok": hf_config.num_experts_per_tok,
        "moe_intermediate_size": hf_config.intermediate_size,  # experts and the shared expert alike
        "qk_l2_norm": _flag(hf_config, "use_qk_norm"),
        "attn_temperature_tuning": _flag(hf_config, "attn_temperature_tuning"),
        "floor_scale": float(hf_config.floor_scale),
        "attn_scale": float(hf_config.attn_scale),
    }


def _phi3(hf_config: Any) -> dict[str, Any]:
    return _mistral(hf_config)  # Phi3Model: every layer's mask slides when sliding_window is set


def _mixtral(hf_config: Any) -> dict[str, Any]:
    # MixtralTopKRouter always renormalises the top-k softmax; experts are intermediate_size
    # wide. router_jitter_noise, output_router_logits and router_aux_loss_coef only act in
    # training: inference ignores them, as transformers does in eval mode.
    return _mistral(hf_config) | {
        "num_experts": hf_config.num_local_experts, "num_experts_per_tok": hf_config.num_experts_per_tok,
        "norm_topk_prob": True, "moe_intermediate_size": hf_config.intermediate_size,
    }


def _qwen3_moe_layers(hf_config: Any) -> tuple[int, ...]:
    """The layers whose MLP is the sparse MoE block, as ``Qwen3MoeDecoderLayer`` decides: not
    listed in ``mlp_only_layers``, and ``(index + 1)`` a multiple of ``decoder_sparse_step``."""
    only = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = getattr(hf_config, "decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConfigError(f"qwen3_moe decoder_sparse_step={step!r} must be an int >= 1 (every step-th layer is MoE); "
                          "fix the model config.")
    return tuple(i for i in range(hf_config.num_hidden_layers)
                 if i not in only and hf_config.num_experts > 0 and (i + 1) % step == 0)


def _qwen3_moe(hf_config: Any) -> dict[str, Any]:
    # Qwen3MoeDecoderLayer: a layer listed in mlp_only_layers, or one whose index + 1 is not a
    # multiple of decoder_sparse_step, has a dense Qwen3MoeMLP of intermediate_size instead of
    # experts. As llama4's, those layers are recorded as the complement of moe_layers.
    moe_layers = _qwen3_moe_layers(hf_config)
    if not moe_layers:  # ModelConfig's moe_layers=() means every layer MoE: no way to say none
        only, step = list(getattr(hf_config, "mlp_only_layers", None) or []), getattr(hf_config, "decoder_sparse_step", 1)
        raise UnsupportedModelError(
            f"qwen3_moe with num_experts={hf_config.num_experts}, mlp_only_layers={only}, decoder_sparse_step={step} has "
            "no mixture-of-experts layer (every MLP is dense), which is not supported; a qwen3_moe model needs at "
            "least one MoE layer."
        )
    dense = moe_layers != tuple(range(hf_config.num_hidden_layers))
    window = _qwen_window(hf_config)  # Qwen3MoeAttention: every layer slides when it is set
    return _qwen3(hf_config) | {"layer_types": ("sliding_attention",) * hf_config.num_hidden_layers if window else ()} | {
        "num_experts": hf_config.num_experts, "num_experts_per_tok": hf_config.num_experts_per_tok,
        "norm_topk_prob": _flag(hf_config, "norm_topk_prob"), "moe_intermediate_size": hf_config.moe_intermediate_size,
        "moe_layers": moe_layers if dense else (),
        "dense_intermediate_size": hf_config.intermediate_size if dense else 0,
    }


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", _llama),
    Family("mistral", _mistral),
    Family("qwen2", _qwen2),
    Family("qwen3", _qwen3),
    Family("granite", _granite),
    Family("smollm3", _smollm3),
    Family("gemma3_text", _gemma3_text, activations=("gelu_pytorch_tanh",)),
    Family("llama4_text", _llama4_text, moe=True, tensor_parallel=False),  # experts in transformers' own layout
    Family("phi3", _phi3, partial_rotary=True, recompute_at_rope_switch=True),
    Family("mixtral", _mixtral, moe=True),
    Family("qwen3_moe", _qwen3_moe, moe=True),
)}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def unsupported_model_type(model_type: str, where: str = "") -> UnsupportedModelError:
    """The error for a ``model_type`` outside the registry (``where``: e.g. " in config.json"),
    with the specific fix when :data:`REFUSED` has one."""
    fix = REFUSED.get(model_type, "")
    return UnsupportedModelError(
        f"model_type={model_type!r}{where} is not supported{': ' + fix if fix else ''}; "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}."
    )
