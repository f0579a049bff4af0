"""Which RoPE table and which attention mask each decoder layer uses: a pure function of the
ModelConfig.

Families whose layers differ only in RoPE (smollm3's NoPE layers, gemma3's local and global
bases) or in the mask (sliding-window and chunked layers beside full ones) keep one weight
structure per layer, so the compiled layer group still serves every layer: the prologue builds
each distinct table and mask once per step, stacked, and each layer picks its own by an index
held with its weights (``rope_index``, ``mask_index``; present only when there is a choice).
Layer types follow transformers' ``config.layer_types`` ("full_attention",
"sliding_attention", "chunked_attention").
"""

from __future__ import annotations

import attrs

from neuronfx.config.model import ModelConfig

ROPE_GLOBAL = "global"  # rope_theta with rope_scaling
ROPE_LOCAL = "local"  # gemma3's sliding layers: sliding_rope_theta, no scaling
ROPE_NONE = "none"  # NoPE: positions enter only through the causal mask
MASK_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


@attrs.frozen
class AttentionLayout:
    """``ropes``: the distinct RoPE kinds the layers use, in first-use order (ROPE_GLOBAL,
    ROPE_LOCAL, ROPE_NONE); ``masks``: the distinct mask kinds ("full", "sliding", "chunked");
    ``rope_index`` / ``mask_index``: per layer, its kind's position in ``ropes`` / ``masks``."""

    ropes: tuple[str, ...]
    masks: tuple[str, ...]
    rope_index: tuple[int, ...]
    mask_index: tuple[int, ...]

    @property
    def per_layer(self) -> bool:
        """Whether layers differ (the weights then carry the per-layer indices)."""
        return len(self.ropes) > 1 or len(self.masks) > 1


def layer_rope(model: ModelConfig, layer: int) -> str:
    """The RoPE kind of ``layer``."""
    if model.rope_layers and not model.rope_layers[layer]:
        return ROPE_NONE
    if model.sliding_rope_theta is not None and layer_mask(model, layer) == "sliding":
        return ROPE_LOCAL
    return ROPE_GLOBAL


def layer_mask(model: ModelConfig, layer: int) -> str:
    """The mask kind of ``layer``: its layer type's, or "full" when the config lists none."""
    return MASK_KINDS[model.layer_types[layer]] if model.layer_types else "full"


def _distinct(values: list[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    kinds = tuple(dict.fromkeys(values))
    return kinds, tuple(kinds.index(v) for v in values)


def attention_layout(model: ModelConfig) -> AttentionLayout:
    """The layout of ``model``'s layers (see the module docstring)."""
    layers = range(model.num_hidden_layers)
    ropes, rope_index = _distinct([layer_rope(model, i) for i in layers])
    masks, mask_index = _distinct([layer_mask(model, i) for i in layers])
    return AttentionLayout(ropes, masks, rope_index, mask_index)


def layer_kinds(model: ModelConfig) -> tuple[str, ...]:
    """Each layer's weight structure: "moe" or "dense" where ``moe_layers`` mixes them (llama4,
    qwen3_moe), else "same" for every layer."""
    if not model.moe_layers:
        return ("same",) * model.num_hidden_layers
    return tuple("moe" if i in model.moe_layers else "dense" for i in range(model.num_hidden_layers))


def layer_period(model: ModelConfig, num_layers: int) -> int:
    """The smallest p dividing ``num_layers`` with the first ``num_layers`` layers' structure
    repeating every p layers (1 when all are alike; ``num_layers`` when nothing repeats): a
    compiled layer group of a multiple of p layers serves every group."""
    kinds = layer_kinds(model)[:num_layers]
    return min(p for p in range(1, num_layers + 1) if num_layers % p == 0 and all(
        kinds[i] == kinds[i % p] for i in range(num_layers)))
