"""ModelConfig: the architecture facts neuronfx needs, read once from a transformers config."""

from __future__ import annotations

from typing import Any

import attrs

from neuronfx.config.families import FAMILIES, SUPPORTED_MODEL_TYPES
from neuronfx.config.validators import boolean, non_negative_int, one_of, positive_int, positive_number
from neuronfx.errors import ConfigError, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@attrs.frozen(kw_only=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling`` / ``rope_parameters``).

    ``rope_type`` "linear" divides every frequency by ``factor``; "llama3" applies the
    piecewise rule of Meta's Llama 3.1 reference (``apply_scaling`` in meta-llama/llama-models,
    also transformers ``_compute_llama3_parameters``) using ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings`` (tokens).
    """

    rope_type: str = attrs.field(validator=one_of(("linear", "llama3")))
    factor: float = attrs.field(validator=positive_number)
    low_freq_factor: float = attrs.field(default=1.0, validator=positive_number)
    high_freq_factor: float = attrs.field(default=4.0, validator=positive_number)
    original_max_position_embeddings: int = attrs.field(default=8192, validator=positive_int)


def _check_experts(inst: ModelConfig, attribute: attrs.Attribute, value: int) -> None:
    moe = FAMILIES[inst.model_type].moe
    if moe != (value > 0):
        need = "> 0 (its layers are mixtures of experts)" if moe else "0 (its MLPs are dense)"
        raise ConfigError(f"ModelConfig.num_experts={value} for model_type={inst.model_type!r} must be {need}.")


def _check_topk(inst: ModelConfig, attribute: attrs.Attribute, value: int) -> None:
    if inst.num_experts and not 1 <= value <= inst.num_experts:
        raise ConfigError(
            f"ModelConfig.num_experts_per_tok={value} must be in [1, num_experts={inst.num_experts}]; fix the model config."
        )
    if not inst.num_experts and value:
        raise ConfigError(f"ModelConfig.num_experts_per_tok={value} needs num_experts > 0; pass 0 for a dense model.")


def _check_expert_width(inst: ModelConfig, attribute: attrs.Attribute, value: int) -> None:
    if inst.num_experts and not value:
        raise ConfigError("ModelConfig.moe_intermediate_size=0 with num_experts > 0; pass each expert's MLP width.")


def _check_heads(inst: ModelConfig, attribute: attrs.Attribute, value: int) -> None:
    if inst.num_attention_heads % value:
        raise ConfigError(
            f"num_key_value_heads={value} must divide num_attention_heads={inst.num_attention_heads}; "
            "fix the model config (grouped-query attention needs whole groups)."
        )


@attrs.frozen(kw_only=True, cache_hash=True)  # hashed on every step (state/plan check)
class ModelConfig:
    """Architecture of a decoder of one of the registered families (``config/families.py``).

    Sizes are counts (``num_*``) or widths in elements; ``rope_theta`` is the RoPE base;
    ``eos_token_ids`` come from the checkpoint's generation config (else its config).
    Family options: ``attention_bias`` (q/k/v projection biases: qwen2, llama with
    ``attention_bias``), ``qk_norm`` (per-head RMSNorm of q and k before RoPE: qwen3),
    ``sliding_window`` (tokens; the plan refuses one shorter than ``sequence_length``);
    granite's ``embedding_multiplier`` (embeddings scaled by it), ``residual_multiplier``
    (each block's output scaled by it before the residual add), ``attention_multiplier`` (the
    attention scale instead of 1/sqrt(head_dim); None = the default) and ``logits_scaling``
    (logits divided by it).
    Mixture of experts (mixtral, qwen3_moe; names as in transformers): ``num_experts`` experts
    per layer (0 = a dense model), of which the router picks ``num_experts_per_tok`` per token;
    ``norm_topk_prob`` renormalises the picked experts' softmax probabilities to sum to 1
    (mixtral always, qwen3_moe per its config); ``moe_intermediate_size`` is each expert's
    SwiGLU width (mixtral's is its ``intermediate_size``; 0 for a dense model).
    Build it with :meth:`from_hf`; field errors raise :class:`ConfigError`.
    """

    model_type: str = attrs.field(validator=one_of(SUPPORTED_MODEL_TYPES))
    vocab_size: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    num_hidden_layers: int = attrs.field(validator=positive_int)
    num_attention_heads: int = attrs.field(validator=positive_int)
    num_key_value_heads: int = attrs.field(validator=[positive_int, _check_heads])
    head_dim: int = attrs.field(validator=positive_int)
    intermediate_size: int = attrs.field(validator=positive_int)
    rope_theta: float = attrs.field(validator=positive_number)
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = attrs.field(validator=positive_number)
    tie_word_embeddings: bool = attrs.field(default=False, validator=boolean)
    attention_bias: bool = attrs.field(default=False, validator=boolean)
    qk_norm: bool = attrs.field(default=False, validator=boolean)
    max_position_embeddings: int = attrs.field(default=4096, validator=positive_int)
    sliding_window: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    embedding_multiplier: float = attrs.field(default=1.0, validator=positive_number)
    residual_multiplier: float = attrs.field(default=1.0, validator=positive_number)
    attention_multiplier: float | None = attrs.field(default=None, validator=attrs.validators.optional(positive_number))
    logits_scaling: float = attrs.field(default=1.0, validator=positive_number)
    num_experts: int = attrs.field(default=0, validator=[non_negative_int, _check_experts])
    num_experts_per_tok: int = attrs.field(default=0, validator=[non_negative_int, _check_topk])
    norm_topk_prob: bool = attrs.field(default=False, validator=boolean)
    moe_intermediate_size: int = attrs.field(default=0, validator=[non_negative_int, _check_expert_width])
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any = None) -> ModelConfig:
        """Read a transformers ``PretrainedConfig`` (and optional ``GenerationConfig``): the
        fields every family shares, then the family's own (its registry entry's ``options``).

        Raises UnsupportedModelError for a ``model_type`` outside
        ``SUPPORTED_MODEL_TYPES``, an unsupported activation or RoPE type.
        """
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported; only 'silu' GLU MLPs are.")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not supported; only bias-free MLPs are.")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        theta, scaling = _rope_from_hf(hf_config)
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
            eos_token_ids=_eos_ids(hf_config, generation_config),
            **FAMILIES[model_type].options(hf_config),
        )


def _rope_from_hf(hf_config: Any) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 folds theta and scaling into rope_parameters; 4.x has both fields.
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if rope_type == "default":
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, RopeScaling(rope_type=rope_type, **{k: params[k] for k in keys if k in params})


def _eos_ids(hf_config: Any, generation_config: Any) -> tuple[int, ...]:
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
