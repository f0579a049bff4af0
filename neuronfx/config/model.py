"""ModelConfig: the architecture facts neuronfx needs, read once from a transformers config."""

from __future__ import annotations

from typing import Any

import attrs

from neuronfx.config.extras import FamilyExtras
from neuronfx.config.families import FAMILIES, SUPPORTED_MODEL_TYPES, unsupported_model_type
from neuronfx.config.validators import boolean, non_negative_int, one_of, positive_int, positive_number
from neuronfx.errors import ConfigError, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")

# rope_parameters keys each type reads (transformers ``RotaryEmbeddingConfigMixin._validate_*``);
# any other key would change the math in a way neuronfx does not, so it is an error.
_COMMON_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"}),
}


def _optional_number(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        positive_number(inst, attribute, value)


def _factors(inst: RopeScaling, attribute: attrs.Attribute, value: tuple[float, ...]) -> None:
    if inst.rope_type == "longrope" and (not value or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf") for x in value)):
        raise ConfigError(f"RopeScaling.{attribute.name}={value!r} must be a non-empty list of finite numbers > 0 for "
                          "rope_type='longrope' (one per rotary frequency); fix the model config's rope_parameters.")


@attrs.frozen(kw_only=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling`` / ``rope_parameters``); the math is in
    ``graphs/models/layers.py`` (``rope_inv_freq``, ``rope_tables``), after transformers'
    ``modeling_rope_utils.py``.

    - "linear": every frequency divided by ``factor``.
    - "llama3": Meta's piecewise rule (``_compute_llama3_parameters``) from ``low_freq_factor``,
      ``high_freq_factor`` and ``original_max_position_embeddings`` (tokens).
    - "yarn": YaRN (``_compute_yarn_parameters``): frequencies blended between interpolated
      (/ ``factor``) and original by a ramp over dims set by ``beta_fast`` / ``beta_slow``
      (rotations in ``original_max_position_embeddings``; ``truncate`` rounds the ramp ends);
      cos/sin times ``attention_factor`` (None: from ``factor``, ``mscale``, ``mscale_all_dim``).
    - "dynamic": dynamic NTK (``_compute_dynamic_ntk_parameters``): the base grows with the
      row's sequence length past ``ModelConfig.max_position_embeddings`` by ``factor``.
    - "longrope": LongRoPE (``_compute_longrope_parameters``): frequencies divided by
      ``short_factor`` while the row's sequence length is <= ``original_max_position_embeddings``,
      by ``long_factor`` beyond; cos/sin times ``attention_factor`` (None: from ``factor``).
    ``factor`` left out of a yarn / longrope config is max_position_embeddings /
    original_max_position_embeddings, as transformers reads it (``from_hf`` resolves it).
    """

    rope_type: str = attrs.field(validator=one_of(("linear", "llama3", "yarn", "dynamic", "longrope")))
    factor: float = attrs.field(validator=positive_number)
    low_freq_factor: float = attrs.field(default=1.0, validator=positive_number)
    high_freq_factor: float = attrs.field(default=4.0, validator=positive_number)
    original_max_position_embeddings: int = attrs.field(default=8192, validator=positive_int)
    attention_factor: float | None = attrs.field(default=None, validator=_optional_number)
    beta_fast: float = attrs.field(default=32.0, validator=positive_number)
    beta_slow: float = attrs.field(default=1.0, validator=positive_number)
    mscale: float | None = attrs.field(default=None, validator=_optional_number)
    mscale_all_dim: float | None = attrs.field(default=None, validator=_optional_number)
    truncate: bool = attrs.field(default=True, validator=boolean)
    short_factor: tuple[float, ...] = attrs.field(default=(), converter=tuple, validator=_factors)
    long_factor: tuple[float, ...] = attrs.field(default=(), converter=tuple, validator=_factors)


def _check_rotary(inst: ModelConfig, attribute: attrs.Attribute, value: float) -> None:
    dim = int(inst.head_dim * value)
    if value > 1 or dim < 2 or dim % 2:
        raise ConfigError(
            f"partial_rotary_factor={value!r} gives rotary_dim=int(head_dim={inst.head_dim} * {value!r})={dim}; it must "
            "be in (0, 1] and give an even rotary_dim >= 2; fix the model config's partial_rotary_factor."
        )


LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _check_layer_types(inst: ModelConfig, attribute: attrs.Attribute, value: tuple) -> None:
    if value and len(value) != inst.num_hidden_layers:
        raise ConfigError(f"{attribute.name} has {len(value)} entries for num_hidden_layers={inst.num_hidden_layers}; give one per layer.")
    unknown = sorted({t for t in value if t not in LAYER_TYPES}) if attribute.name == "layer_types" else []
    if unknown:
        raise UnsupportedModelError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}.")
    needs = {"sliding_attention": ("sliding_window", inst.sliding_window), "chunked_attention": ("attention_chunk_size", inst.attention_chunk_size)}
    for kind, (field, size) in needs.items():
        if attribute.name == "layer_types" and kind in value and size is None:
            raise ConfigError(f"layer_types has {kind!r} layers but {field} is None; set {field}.")


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _check_activation(inst: ModelConfig, attribute: attrs.Attribute, value: str) -> None:
    supported = FAMILIES[inst.model_type].activations if inst.model_type in FAMILIES else ACTIVATIONS
    if value not in supported:
        raise UnsupportedModelError(
            f"hidden_act={value!r} is not supported for {inst.model_type}; only {', '.join(map(repr, supported))} MLPs are."
        )


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


def _check_moe_layers(inst: ModelConfig, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if value and (not inst.num_experts or not inst.dense_intermediate_size or sorted(set(value)) != list(value)
                  or not all(0 <= i < inst.num_hidden_layers for i in value)):
        raise ConfigError(
            f"moe_layers={value} must be increasing layer indices in [0, num_hidden_layers={inst.num_hidden_layers}) of a "
            "model with num_experts > 0 and dense_intermediate_size > 0 (the other layers' MLP width); () = every layer MoE."
        )


def _check_expert_width(inst: ModelConfig, attribute: attrs.Attribute, value: int) -> None:
    if inst.num_experts and not value:
        raise ConfigError("ModelConfig.moe_intermediate_size=0 with num_experts > 0; pass each expert's MLP width.")


def _default_extras(inst: ModelConfig) -> FamilyExtras | None:
    """The family's extras record with its defaults (None for a family without one, or an
    unknown type, which the model_type validator then refuses)."""
    family = FAMILIES.get(inst.model_type)
    return None if family is None or family.extras is None else family.extras()


def _check_extras(inst: ModelConfig, attribute: attrs.Attribute, value: object) -> None:
    want = FAMILIES[inst.model_type].extras
    if type(value) is not (type(None) if want is None else want):
        name = "None" if want is None else f"a {want.__name__}"
        raise ConfigError(f"ModelConfig.extras={value!r} for model_type={inst.model_type!r} must be {name} (the family's own "
                          "options, config/extras.py); build the config with ModelConfig.from_hf or leave extras out.")


def _check_heads(inst: ModelConfig, attribute: attrs.Attribute, value: int) -> None:
    if inst.num_attention_heads % value:
        raise ConfigError(
            f"num_key_value_heads={value} must divide num_attention_heads={inst.num_attention_heads}; "
            "fix the model config (grouped-query attention needs whole groups)."
        )


@attrs.frozen(kw_only=True, cache_hash=True)  # hashed on every step (state/plan check)
class ModelConfig:
    """Architecture of a decoder of one of the registered families (``config/families.py``):
    what every family shares; a family's own options are its ``extras`` record.

    Sizes are counts (``num_*``) or widths in elements; ``rope_theta`` is the RoPE base;
    ``eos_token_ids`` come from the checkpoint's generation config (else its config).
    Attention: ``attention_bias`` (q/k/v projection biases), ``attention_output_bias`` (the
    o_proj bias, which transformers ties to ``attention_bias`` in most families), ``qk_norm``
    (per-head RMSNorm of q and k before RoPE), ``partial_rotary_factor`` (RoPE on the first
    ``rotary_dim`` dims of each head), ``layer_types`` (one per layer, transformers'
    "full_attention" / "sliding_attention" / "chunked_attention"; empty = all full) with
    ``sliding_window`` and ``attention_chunk_size`` (tokens: a sliding layer attends the last
    ``sliding_window`` positions, itself included; a chunked one the positions of its own
    chunk), ``rope_layers`` (one bool per layer, False = no RoPE; empty = all RoPE) and
    ``sliding_rope_theta`` (the RoPE base of sliding layers when it differs from
    ``rope_theta``), the last four read by ``config.attention.attention_layout``.
    MLP: ``hidden_act`` (the gate activation, transformers' ``ACT2FN`` name; each family
    implements its registry entry's ``activations``), ``mlp_bias`` (gate/up/down biases).
    Mixture of experts (names as in transformers): ``num_experts`` experts per layer (0 = a
    dense model), of which the router picks ``num_experts_per_tok`` per token;
    ``norm_topk_prob`` renormalises the picked experts' softmax probabilities to sum to 1;
    ``moe_intermediate_size`` is each expert's SwiGLU width (0 for a dense model);
    ``moe_layers``: the MoE layers when others are dense, whose MLPs are
    ``dense_intermediate_size`` wide (() = every layer MoE; ``config.attention.layer_kinds``
    names each layer's kind).
    ``extras``: the family's own options (``config/extras.py``; None for a family without
    any), by default the record's defaults.
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
    attention_chunk_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    layer_types: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_check_layer_types)
    rope_layers: tuple[bool, ...] = attrs.field(default=(), converter=tuple, validator=_check_layer_types)
    sliding_rope_theta: float | None = attrs.field(default=None, validator=attrs.validators.optional(positive_number))
    partial_rotary_factor: float = attrs.field(default=1.0, validator=[positive_number, _check_rotary])
    mlp_bias: bool = attrs.field(default=False, validator=boolean)
    attention_output_bias: bool = attrs.field(default=False, validator=boolean)
    hidden_act: str = attrs.field(default="silu", validator=[one_of(ACTIVATIONS), _check_activation])
    num_experts: int = attrs.field(default=0, validator=[non_negative_int, _check_experts])
    num_experts_per_tok: int = attrs.field(default=0, validator=[non_negative_int, _check_topk])
    norm_topk_prob: bool = attrs.field(default=False, validator=boolean)
    moe_intermediate_size: int = attrs.field(default=0, validator=[non_negative_int, _check_expert_width])
    moe_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple, validator=_check_moe_layers)
    dense_intermediate_size: int = attrs.field(default=0, validator=non_negative_int)
    extras: FamilyExtras | None = attrs.field(default=attrs.Factory(_default_extras, takes_self=True), validator=_check_extras)
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates: ``int(head_dim * partial_rotary_factor)``
        (transformers' ``dim`` in ``modeling_rope_utils``); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    def __attrs_post_init__(self) -> None:
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(rs, name)) != self.rotary_dim // 2:
                    raise ConfigError(
                        f"rope_scaling.{name} has {len(getattr(rs, name))} values, expected rotary_dim // 2 = "
                        f"{self.rotary_dim // 2} (head_dim={self.head_dim}, partial_rotary_factor={self.partial_rotary_factor}); "
                        "fix the model config's rope_parameters."
                    )

    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any = None) -> ModelConfig:
        """Read a transformers ``PretrainedConfig`` (and optional ``GenerationConfig``): the
        fields every family shares, then the family's own (its registry entry's ``options``).

        Raises UnsupportedModelError for a ``model_type`` outside
        ``SUPPORTED_MODEL_TYPES``, an unsupported activation, RoPE type or option.
        """
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise unsupported_model_type(model_type)
        _check_activation_hf(hf_config, model_type)
        theta, scaling, partial, sliding_theta = _rope_from_hf(hf_config)
        options = {"layer_types": _layer_types(hf_config), "sliding_rope_theta": sliding_theta} | FAMILIES[model_type].options(hf_config)
        _check_family_options(hf_config, model_type, options, partial)
        num_heads = hf_config.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            intermediate_size=hf_config.intermediate_size,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
            partial_rotary_factor=partial,
            eos_token_ids=_eos_ids(hf_config, generation_config),
            **options,
        )


def _check_activation_hf(hf_config: Any, model_type: str) -> None:
    """UnsupportedModelError when the config's MLP activation is not one the family implements
    (gemma names it ``hidden_activation``; its options pass it on as ``hidden_act``)."""
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    if act not in FAMILIES[model_type].activations:
        supported = ", ".join(map(repr, FAMILIES[model_type].activations))
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported for {model_type}; only {supported} MLPs are.")


def _check_family_options(hf_config: Any, model_type: str, options: dict[str, Any], partial: float) -> None:
    """UnsupportedModelError for MLP biases the family's options did not read, or a partial
    rotary factor of a family that rotates whole heads."""
    if getattr(hf_config, "mlp_bias", False) and not options.get("mlp_bias"):
        raise UnsupportedModelError(f"mlp_bias=True is not supported for model_type={model_type!r}; "
                                    "only llama and granite read MLP biases.")
    if partial != 1.0 and not FAMILIES[model_type].partial_rotary:
        partial_ones = ", ".join(t for t, f in FAMILIES.items() if f.partial_rotary)
        raise UnsupportedModelError(
            f"partial_rotary_factor={partial!r} is not supported for model_type={model_type!r}: transformers' "
            f"{model_type} rotates the whole head; only {partial_ones} applies a partial rotary factor."
        )


def _layer_types(hf_config: Any) -> tuple[str, ...]:
    """transformers' ``layer_types``; () when every layer is full attention (the default)."""
    types = tuple(getattr(hf_config, "layer_types", None) or ())
    return () if all(t == "full_attention" for t in types) else types


def _rope_from_hf(hf_config: Any) -> tuple[float, RopeScaling | None, float, float | None]:
    """(rope_theta, rope_scaling, partial_rotary_factor, sliding_rope_theta). transformers >= 5
    folds theta and scaling into ``rope_parameters``, per layer type for models whose layer types
    differ in RoPE (gemma3: ``{"full_attention": {...}, "sliding_attention": {...}}``); 4.x has
    both fields. sliding_rope_theta is None unless sliding layers use another RoPE than full ones."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "full_attention" not in params:
        legacy = getattr(hf_config, "rope_scaling", None)
        if legacy and not params.get("rope_type"):
            params.update(legacy)
        theta, scaling, partial = _rope_params(hf_config, params, getattr(hf_config, "rope_theta", 10000.0), "rope_parameters")
        return theta, scaling, partial, None
    full = dict(params["full_attention"])
    theta, scaling, partial = _rope_params(hf_config, full, 10000.0, "rope_parameters['full_attention']")
    sliding = dict(params.get("sliding_attention") or {})
    if "sliding_attention" not in (getattr(hf_config, "layer_types", None) or ()) or not sliding:
        return theta, scaling, partial, None
    local, local_scaling, _ = _rope_params(hf_config, sliding, theta, "rope_parameters['sliding_attention']")
    if local_scaling is not None:  # attention.ROPE_LOCAL tables are unscaled
        raise UnsupportedModelError(
            f"rope_parameters['sliding_attention'] has rope_type={local_scaling.rope_type!r}; sliding layers support "
            "only the 'default' RoPE (their own rope_theta)."
        )
    return theta, scaling, partial, (local if (local, None) != (theta, scaling) else None)


def _rope_params(hf_config: Any, params: dict[str, Any], default_theta: float, where: str) -> tuple[float, RopeScaling | None, float]:
    """(theta, scaling, partial_rotary_factor) of one ``rope_parameters`` dict (``where`` names it
    in errors); UnsupportedModelError for a RoPE type outside SUPPORTED_ROPE_TYPES or a key that
    type does not read."""
    theta = params.get("rope_theta", default_theta)
    partial = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type={rope_type!r} ({where}) is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    unknown = sorted(set(params) - _COMMON_ROPE_KEYS - ROPE_KEYS[rope_type])
    if unknown:
        raise UnsupportedModelError(
            f"rope_parameters keys {unknown} are not read for rope_type={rope_type!r} (it reads "
            f"{sorted(ROPE_KEYS[rope_type])}); neuronfx would compute different RoPE tables than the model expects: "
            "remove them from the config if they are stray, else this model is not supported."
        )
    if rope_type == "default":
        return theta, None, partial
    fields = {k: params[k] for k in ROPE_KEYS[rope_type] if params.get(k) is not None}
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if key in fields and not fields[key]:  # transformers treats 0 as unset (``or`` / truthiness)
            del fields[key]
    if rope_type in ("yarn", "longrope") and "factor" not in fields:  # transformers' default factor
        max_pos = getattr(hf_config, "max_position_embeddings", 4096)
        fields["factor"] = max_pos / fields.get("original_max_position_embeddings", max_pos)
    return theta, RopeScaling(rope_type=rope_type, **fields), partial


def _eos_ids(hf_config: Any, generation_config: Any) -> tuple[int, ...]:
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
