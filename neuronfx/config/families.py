"""The registry of supported model families: one entry per HF ``model_type``.

Config, graphs and checkpoints all read this table. An entry says which :class:`ModelConfig`
fields the family sets from its transformers config beyond the ones every family shares, which
options of its own it has (an extras record, ``config/extras.py``) and how its own weights
split under tensor parallelism. Its math lives in ``neuronfx/graphs/models/<file>.py``, the
file named by the model type, or for a type whose math is another's, by
:data:`MODEL_REMAPPING` (mlx-lm's table of the same name). Adding a family is one entry here
plus that one file (or one remap line).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from neuronfx.config.extras import Gemma3Extras, GraniteExtras, Llama4Extras
from neuronfx.errors import ConfigError, UnsupportedModelError


@attrs.frozen(kw_only=True)
class Family:
    """One supported HF ``model_type``.

    ``options(hf_config) -> dict``: the family's own ModelConfig fields, read from its
    transformers config (e.g. qwen2's always-on q/k/v biases, qwen3's q/k norm), its extras
    record under "extras"; it raises UnsupportedModelError for an option of the family
    neuronfx does not implement.
    ``extras``: the class of ``ModelConfig.extras`` for this family (None: it has none).
    ``activations``: the MLP activations (transformers' ``ACT2FN`` names) its file implements.
    ``partial_rotary``: transformers' family applies ``partial_rotary_factor`` (RoPE on the
    first dims of each head only); elsewhere a factor below 1 is refused.
    ``recompute_at_rope_switch``: transformers' ``generate`` recomputes the whole KV cache when
    a longrope sequence grows past ``original_max_position_embeddings`` (Phi-3's
    ``prepare_inputs_for_generation``); the scheduler does the same (``refill_step``). Other
    families keep the keys cached before the switch, as transformers does for them.
    ``moe``: the family's MLPs are mixtures of experts (``ModelConfig.num_experts`` > 0), every
    layer's or, where ``ModelConfig.moe_layers`` lists some, those layers' (the others dense);
    else none is.
    ``tensor_parallel``: the sharding plan covers every weight of the family (else tp_degree > 1
    is refused before any rank starts).
    ``shard_rules`` / ``replicated``: the tensor-parallel rules of the family's own per-layer
    weights, beside the ones every family shares (``config.sharding.WEIGHT_RULES`` and
    ``REPLICATED``): weight name -> (what is split, dimension), and the names held whole.
    """

    model_type: str
    options: Callable[[Any], dict[str, Any]]
    extras: type | None = None
    activations: tuple[str, ...] = ("silu",)
    partial_rotary: bool = False
    recompute_at_rope_switch: bool = False
    moe: bool = False
    tensor_parallel: bool = True
    shard_rules: Mapping[str, tuple[str, int]] = attrs.field(factory=dict)
    replicated: frozenset[str] = frozenset()


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
    extras = GraniteExtras(
        embedding_multiplier=float(getattr(hf_config, "embedding_multiplier", 1.0)),
        residual_multiplier=float(getattr(hf_config, "residual_multiplier", 1.0)),
        attention_multiplier=float(getattr(hf_config, "attention_multiplier", 1.0)),  # GraniteAttention: scaling
        logits_scaling=float(getattr(hf_config, "logits_scaling", 1.0)),
    )
    return {**_attention_biases(hf_config), "mlp_bias": _flag(hf_config, "mlp_bias"), "extras": extras}  # GraniteMLP: Llama's


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
    extras = Gemma3Extras(query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),  # Gemma3Attention.scaling
                          final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None))
    return {"hidden_act": hf_config.hidden_activation, "qk_norm": True, "sliding_window": getattr(hf_config, "sliding_window", None),
            "extras": extras}


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
        "extras": Llama4Extras(qk_l2_norm=_flag(hf_config, "use_qk_norm"), attn_temperature_tuning=_flag(hf_config, "attn_temperature_tuning"),
                               floor_scale=float(hf_config.floor_scale), attn_scale=float(hf_config.attn_scale)),
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


QK_NORMS = frozenset({"q_norm", "k_norm"})
"""Per-head norms of q and k (qwen3's, gemma3's): whole on every rank, as every rank's heads
are whole heads."""
EXPERT_RULES = {"experts_gate": ("expert_intermediate", 1), "experts_up": ("expert_intermediate", 1),
                "experts_down": ("expert_intermediate", 2)}
"""Stacked experts split as a dense MLP per expert (gate / up (E, I, H) column, down (E, H, I)
row); the router is replicated: every rank routes every token."""

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family(model_type="llama", options=_llama),
    Family(model_type="mistral", options=_mistral),
    Family(model_type="qwen2", options=_qwen2),
    Family(model_type="qwen3", options=_qwen3, replicated=QK_NORMS),
    Family(model_type="granite", options=_granite, extras=GraniteExtras),
    Family(model_type="smollm3", options=_smollm3),
    Family(model_type="gemma3_text", options=_gemma3_text, extras=Gemma3Extras, activations=("gelu_pytorch_tanh",),
           replicated=QK_NORMS | {"post_attn_norm", "post_mlp_norm"}),  # its norms of each block's output
    Family(model_type="llama4_text", options=_llama4_text, extras=Llama4Extras, moe=True,
           tensor_parallel=False),  # experts in transformers' own layout
    Family(model_type="phi3", options=_phi3, partial_rotary=True, recompute_at_rope_switch=True),
    Family(model_type="mixtral", options=_mixtral, moe=True, shard_rules=EXPERT_RULES, replicated=frozenset({"router"})),
    Family(model_type="qwen3_moe", options=_qwen3_moe, moe=True, shard_rules=EXPERT_RULES, replicated=QK_NORMS | {"router"}),
)}

MODEL_REMAPPING: dict[str, str] = {"mistral": "llama", "qwen2": "llama", "smollm3": "llama"}
"""Model types whose math is another type's file (mlx-lm's ``MODEL_REMAPPING``): Mistral differs
from Llama only in its sliding window, Qwen2 in its always-on q/k/v biases, SmolLM3 in its NoPE
and sliding layers; their registry entries read those into the shared fields the Llama file
(and the attention layout, ``config/attention.py``) already reads."""


def math_file(model_type: str) -> str:
    """The name of the file under ``neuronfx/graphs/models/`` implementing ``model_type``'s math
    (through :data:`MODEL_REMAPPING`); UnsupportedModelError for a type outside the registry."""
    if model_type not in FAMILIES:
        raise unsupported_model_type(model_type)
    return MODEL_REMAPPING.get(model_type, model_type)


SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def unsupported_model_type(model_type: str, where: str = "") -> UnsupportedModelError:
    """The error for a ``model_type`` outside the registry (``where``: e.g. " in config.json"),
    with the specific fix when :data:`REFUSED` has one."""
    fix = REFUSED.get(model_type, "")
    return UnsupportedModelError(
        f"model_type={model_type!r}{where} is not supported{': ' + fix if fix else ''}; "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}."
    )
