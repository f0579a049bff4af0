"""Family-only model options: one frozen record per family whose math reads options no other
family has.

``ModelConfig`` keeps what every family shares (sizes, RoPE, attention layout, biases, experts);
a family with options of its own declares them here, its registry entry names the record
(``config.families.Family.extras``), ``ModelConfig.extras`` holds one (None for a family without
any) and only that family's graphs file reads it. ``ModelConfig.from_hf`` fills it from the
transformers config; built by hand, a ModelConfig gets the record's defaults.
"""

from __future__ import annotations

import attrs

from neuronfx.config.validators import boolean, positive_number


@attrs.frozen(kw_only=True)
class GraniteExtras:
    """IBM Granite's four scalars (transformers ``GraniteConfig``, read by
    ``graphs/models/granite.py``): embeddings times ``embedding_multiplier``, each block's output
    times ``residual_multiplier`` before the residual add, ``attention_multiplier`` as the
    attention scale (instead of 1/sqrt(head_dim)) and logits divided by ``logits_scaling``.
    Field errors raise ConfigError."""

    embedding_multiplier: float = attrs.field(default=1.0, validator=positive_number)
    residual_multiplier: float = attrs.field(default=1.0, validator=positive_number)
    attention_multiplier: float = attrs.field(default=1.0, validator=positive_number)
    logits_scaling: float = attrs.field(default=1.0, validator=positive_number)


def _optional_positive(inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        positive_number(inst, attribute, value)


@attrs.frozen(kw_only=True)
class Gemma3Extras:
    """Gemma 3 text's own options (transformers ``Gemma3TextConfig``, read by
    ``graphs/models/gemma3_text.py``): the attention scale is ``query_pre_attn_scalar ** -0.5``,
    and logits become ``tanh(logits / cap) * cap`` with ``cap = final_logit_softcapping`` (None:
    off). Field errors raise ConfigError."""

    query_pre_attn_scalar: float = attrs.field(default=256.0, validator=positive_number)
    final_logit_softcapping: float | None = attrs.field(default=None, validator=_optional_positive)


@attrs.frozen(kw_only=True)
class Llama4Extras:
    """Llama 4 text's own options (transformers ``Llama4TextConfig``, read by
    ``graphs/models/llama4_text.py``): ``qk_l2_norm`` (its ``use_qk_norm``: q and k
    L2-normalised after RoPE on RoPE layers) and attention temperature tuning
    (``attn_temperature_tuning``: q of NoPE layers scaled by
    ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``, ``floor_scale`` in tokens).
    Field errors raise ConfigError."""

    qk_l2_norm: bool = attrs.field(default=False, validator=boolean)
    attn_temperature_tuning: bool = attrs.field(default=False, validator=boolean)
    floor_scale: float = attrs.field(default=8192.0, validator=positive_number)
    attn_scale: float = attrs.field(default=0.1, validator=positive_number)


FamilyExtras = GraniteExtras | Gemma3Extras | Llama4Extras
"""Any family's extras record."""
