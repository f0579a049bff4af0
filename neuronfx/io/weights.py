"""HF state dict -> neuronfx weights: a declarative key map per model file plus one pure function."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import attrs
import torch

from neuronfx.config.attention import ROPE_NONE, attention_layout
from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.model import ModelConfig
from neuronfx.config.sharding import RankShard, Split, split_shape, weight_split
from neuronfx.errors import CheckpointError
from neuronfx.graphs.models import family_math, quant
from neuronfx.graphs.models.moe import ROUTER_NAME, STACKED_NAMES


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every neuronfx weight name for ``cfg`` (HF layout: linear weights are (out, in)):
    embedding, final norm and LM head, then the family file's ``layer_shapes`` per layer."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,), "lm_head": (cfg.vocab_size, h)}
    per_layer = family_math(cfg.model_type).layer_shapes(cfg)
    for layer in range(cfg.num_hidden_layers):
        shapes |= {f"layers.{layer}.{k}": s for k, s in per_layer.items()}
    return shapes


Target = str | tuple[str, ...]
"""A key map value: one neuronfx name, or for a fused HF tensor (phi3's ``qkv_proj``) the names
of the weights stacked along its dim 0, in order."""


def _format(ours: Target, i: int) -> Target:
    return ours.format(i=i) if isinstance(ours, str) else tuple(o.format(i=i) for o in ours)


def expand_key_map(cfg: ModelConfig) -> dict[str, Target]:
    """The model file's key map with ``{i}`` expanded over layers: HF name -> neuronfx name (or
    names, for a fused tensor)."""
    out: dict[str, Target] = {}
    for hf, ours in family_math(cfg.model_type).key_map(cfg).items():
        if "{i}" in hf:
            out |= {hf.format(i=i): _format(ours, i) for i in range(cfg.num_hidden_layers)}
        else:
            out[hf] = ours
    return out


def _target_shape(shapes: dict[str, tuple[int, ...]], ours: Target) -> tuple[int, ...]:
    """Shape of the HF tensor behind ``ours``: a fused one stacks its parts along dim 0."""
    if isinstance(ours, str):
        return shapes[ours]
    parts = [shapes[o] for o in ours]
    return (sum(p[0] for p in parts), *parts[0][1:])


def split_fused(state_dict: Mapping[str, object], required: dict[str, Target], cfg: ModelConfig) -> dict[str, object]:
    """neuronfx name -> its source in ``state_dict``: the HF tensor, or for a part of a fused
    one (phi3's ``qkv_proj``, ``gate_up_proj``) a :class:`RangeView` of its rows (given by the
    family's ``layer_shapes``), so tensor-parallel ranks still read only their rows."""
    shapes = expected_shapes(cfg)
    out: dict[str, object] = {}
    for hf, ours in required.items():
        if isinstance(ours, str):
            out[ours] = state_dict[hf]
            continue
        start = 0
        for name in ours:
            out[name] = RangeView(state_dict[hf], 0, start, shapes[name][0])
            start += shapes[name][0]
    return out


# --- expert weights: two checkpoint layouts, one stacked view -------------------------------------


def _index(index: object, ndim: int) -> list:
    """An index of slices (a tuple, or one slice for dim 0) as a list of ``ndim`` slices."""
    parts = list(index) if isinstance(index, tuple) else [index]
    if not all(isinstance(p, slice) for p in parts):
        raise TypeError(f"expert views take slices only, got {index!r}")
    return parts + [slice(None)] * (ndim - len(parts))


@attrs.frozen(eq=False)
class RangeView:
    """``source`` narrowed to ``[start, start + size)`` along ``dim``, read on indexing: a part of
    a fused tensor (rows of phi3's ``qkv_proj``, a half of a MoE's (E, 2I, H) gate_up). ``source`` is a tensor or a lazily read
    ``checkpoints.LazyTensor``; ``view[index]`` (slices) reads only the indexed part of it."""

    source: object
    dim: int
    start: int
    size: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.source.shape)  # type: ignore[attr-defined]
        shape[self.dim] = self.size
        return tuple(shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        parts = _index(index, len(self.shape))
        begin, end, step = parts[self.dim].indices(self.size)
        if step != 1:
            raise TypeError(f"expert views take unit-step slices, got {parts[self.dim]!r}")
        parts[self.dim] = slice(self.start + begin, self.start + max(begin, end))
        return torch.as_tensor(self.source[tuple(parts)])  # type: ignore[index]


@attrs.frozen(eq=False)
class StackedView:
    """Per-expert sources (each (I, H) or (H, I); tensors or ``LazyTensor``) seen as one (E, ...)
    tensor: ``view[experts, rows, cols]`` reads those rows and columns of those experts only,
    so a tensor-parallel rank reads its slice of every expert of a hub checkpoint."""

    parts: tuple[object, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)  # type: ignore[attr-defined]

    def __getitem__(self, index: object) -> torch.Tensor:
        first, *rest = _index(index, len(self.shape))
        return torch.stack([torch.as_tensor(p[tuple(rest)]) for p in self.parts[first]])  # type: ignore[index]


def expert_views(state_dict: Mapping[str, object], cfg: ModelConfig) -> Mapping[str, object]:
    """``state_dict`` with a MoE family's expert weights under the stacked names of
    ``moe.MOE_KEY_MAP``, from either layout of its ``EXPERT_SOURCES``: transformers 5's fused
    gate_up (split into two :class:`RangeView`) or the hub's per-expert tensors (each stacked
    in a :class:`StackedView`), and the router under its in-memory name. Nothing is read here;
    a layer with neither layout complete is left as it is (the check names what is missing).
    Dense models: ``state_dict`` itself."""
    if not cfg.num_experts:
        return state_dict
    sources = family_math(cfg.model_type).expert_sources
    out = dict(state_dict)
    stacked = STACKED_NAMES
    for i in range(cfg.num_hidden_layers):
        for alias in sources.router_aliases:
            if alias.format(i=i) in out:
                out[ROUTER_NAME.format(i=i)] = out.pop(alias.format(i=i))
        fused = sources.fused_gate_up.format(i=i)
        if fused in out:
            source = out.pop(fused)
            half = source.shape[1] // 2  # type: ignore[attr-defined]
            out[stacked["gate"].format(i=i)] = RangeView(source, 1, 0, half)
            out[stacked["up"].format(i=i)] = RangeView(source, 1, half, half)
        for part, pattern in sources.per_expert.items():
            names = [pattern.format(i=i, e=e) for e in range(cfg.num_experts)]
            if all(n in out for n in names):
                out[stacked[part].format(i=i)] = StackedView(tuple(out.pop(n) for n in names))
    return out


def _whole(source: object, dtype: str) -> torch.Tensor:
    """A weight whole in ``dtype``: a tensor as it is (no copy when it is already ``dtype`` and
    contiguous), an expert view read."""
    tensor = source if isinstance(source, torch.Tensor) else torch.as_tensor(source[:])  # type: ignore[index]
    return tensor.to(torch_dtype(dtype)).contiguous()


def check_state_dict(state_dict: Mapping[str, object], cfg: ModelConfig, source: str = "checkpoint") -> dict[str, Target]:
    """The one checkpoint check: raise CheckpointError listing missing, unexpected or
    mis-shaped tensors (expected vs found shape) of an HF-named ``state_dict`` (tensors, or
    anything with a ``shape``) for ``cfg``'s family; ``source`` names it in the message. MoE
    experts may come in either layout (:func:`expert_views`).
    Returns the key map to apply to ``expert_views(state_dict, cfg)`` (HF name -> neuronfx name
    or fused names, tied ``lm_head.weight`` left out)."""
    state_dict = expert_views(state_dict, cfg)
    names = expand_key_map(cfg)
    required = dict(names)
    if cfg.tie_word_embeddings:
        required.pop("lm_head.weight")
    # Tied checkpoints may still carry lm_head.weight (a copy); it is accepted and ignored.
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(required) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(names) - optional)
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match model_type={cfg.model_type!r}: missing tensors {missing[:5]} ({len(missing)} in all), "
            f"unexpected tensors {unexpected[:5]} ({len(unexpected)} in all); the weights and config.json must belong "
            "together (same model, transformers' names: re-save with save_pretrained())."
        )
    shapes = expected_shapes(cfg)
    for hf, ours in required.items():
        found, expected = tuple(state_dict[hf].shape), _target_shape(shapes, ours)  # type: ignore[attr-defined]
        if found != expected:
            raise CheckpointError(
                f"{source} tensor {hf!r} has shape {found}, expected {expected} from the config; "
                "the checkpoint does not match its config.json."
            )
    return required


def convert_hf_state_dict(state_dict: Mapping[str, object], cfg: ModelConfig, dtype: str, shard: RankShard | None = None,
                          formats: Mapping[str, str] | None = None, group_size: int = 32) -> dict:
    """Rename, check (:func:`check_state_dict`) and cast an HF state dict into neuronfx weights
    in ``dtype``: ``{"embed", "norm", "lm_head": tensor, "layers": [{"wq": ..., ...} per layer]}``.
    Tied embeddings reuse the embedding tensor as ``lm_head`` (no copy). A fused HF tensor is
    split into its parts (:func:`split_fused`). Layers that differ in
    RoPE or mask also get their indices (:func:`layer_indices`).

    ``formats`` (``config.quantization.quantized_formats``: base name -> "int8" / "int4" /
    "gguf") quantizes those weights (:func:`quantize_weights`; ``group_size`` for int4).

    With a tensor-parallel ``shard`` (tp_degree > 1) each weight is this rank's slices only
    (:func:`read_shard`); values may then be anything sliceable with a ``shape`` (tensors, or
    lazily read safetensors slices, so a rank reads only its part of the file). MoE experts are
    stacked per layer from either checkpoint layout (:func:`expert_views`)."""
    required = check_state_dict(state_dict, cfg)
    sources = split_fused(expert_views(state_dict, cfg), required, cfg)
    if shard is not None and shard.tp_degree > 1:
        flat = {ours: read_shard(src, weight_split(shard, _base(ours)), dtype) for ours, src in sources.items()}
    else:
        flat = quantize_weights(sources, dict(formats or {}), group_size, dtype, cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        flat["lm_head"] = flat["embed"]
    return nest(flat | layer_indices(cfg), cfg.num_hidden_layers)


def quantize_weights(sources: Mapping[str, object], formats: dict[str, str], group_size: int, dtype: str,
                     tied: bool) -> dict[str, object]:
    """neuronfx name -> weight: those whose base name ``formats`` lists quantized from their
    fp32 values ("int8": :func:`quant.quantize_int8`, "int4": :func:`quant.quantize_int4` with
    ``group_size``) or kept as the GGUF blocks they are ("gguf"), the rest in ``dtype``.
    GGUF blocks of a weight kept float are dequantized; so is a "gguf" weight whose layers do
    not all share one kept block type (one compiled layer group serves every layer, so every
    layer must hold the same structure). Tied embeddings take the head's format."""
    if tied and "lm_head" in formats:
        formats = formats | {"embed": formats["lm_head"]}
    kept = _uniform_blocks(sources, formats)
    out: dict[str, object] = {}
    for name, src in sources.items():
        fmt = formats.get(_base(name))
        if isinstance(src, quant.BLOCK_TYPES):
            out[name] = src if name in kept else quant.dequantize(src, src.shape[1]).to(torch_dtype(dtype))
        elif fmt == "int8":
            out[name] = quant.quantize_int8(_whole(src, "float32"))
        elif fmt == "int4":
            out[name] = quant.quantize_int4(_whole(src, "float32"), group_size)
        else:
            out[name] = _whole(src, dtype)
    return out


def _uniform_blocks(sources: Mapping[str, object], formats: dict[str, str]) -> set[str]:
    """Names of the GGUF block sources kept as blocks: "gguf" in ``formats`` for their base
    name, and every layer's tensor of that base name of the same block type."""
    types: dict[str, set[type]] = {}
    for name, src in sources.items():
        types.setdefault(_base(name), set()).add(type(src))
    return {
        name for name, src in sources.items()
        if isinstance(src, quant.BLOCK_TYPES) and formats.get(_base(name)) == "gguf" and len(types[_base(name)]) == 1
    }


def dequantized_state_dict(state_dict: Mapping[str, object], weights: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The HF-named ``state_dict`` with every weight that ``weights`` (its conversion, see
    :func:`convert_hf_state_dict`) holds quantized replaced by the float32 values the graphs
    multiply by (GGUF blocks of ``state_dict`` dequantized too): load it into transformers to
    get the reference of a quantized plan. Other tensors are passed through as they are."""
    flat = {k: v for k, v in weights.items() if k != "layers"}
    flat |= {f"layers.{i}.{k}": v for i, lw in enumerate(weights["layers"]) for k, v in lw.items()}
    out = dict(state_dict)
    for hf, ours in check_state_dict(state_dict, cfg).items():
        if hf not in state_dict:  # stacked MoE experts (never quantized) under their view names
            continue
        parts = [flat[o] for o in ((ours,) if isinstance(ours, str) else ours)]
        if any(isinstance(p, quant.QUANTIZED_TYPES) for p in parts) or isinstance(state_dict[hf], quant.QUANTIZED_TYPES):
            k = state_dict[hf].shape[1]  # type: ignore[attr-defined]
            out[hf] = torch.cat([quant.dequantize(p, k) if isinstance(p, quant.QUANTIZED_TYPES) else p.float() for p in parts])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def layer_indices(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-layer ``rope_index`` and ``mask_index`` (0-d int64) when the layers differ in RoPE
    or mask (``config.attention``), and ``use_rope`` (0-d bool) when some layers are NoPE and
    others not: the compiled layer group reads them as data, so one group serves every layer.
    Empty when all layers are alike."""
    layout = attention_layout(cfg)
    if not layout.per_layer:
        return {}
    out = {}
    for i, (r, m) in enumerate(zip(layout.rope_index, layout.mask_index)):
        out |= {f"layers.{i}.rope_index": torch.tensor(r), f"layers.{i}.mask_index": torch.tensor(m)}
        if ROPE_NONE in layout.ropes and len(layout.ropes) > 1:
            out[f"layers.{i}.use_rope"] = torch.tensor(layout.ropes[r] != ROPE_NONE)
    return out


def _base(name: str) -> str:
    """"layers.3.wq" -> "wq"; top-level names unchanged."""
    return name.split(".", 2)[2] if name.startswith("layers.") else name


def read_shard(source: object, split: Split, dtype: str) -> torch.Tensor:
    """One rank's part of a weight: ``source`` (a tensor, or anything indexable with slices that
    has a ``shape``, e.g. ``neuronfx.io.checkpoints.LazyTensor``) read block by block along
    ``split.dim`` with zeros for padding blocks, as a new contiguous tensor in ``dtype`` (never
    a view that would keep the whole weight alive)."""
    shape = tuple(source.shape)  # type: ignore[attr-defined]
    if split.dim is None:  # whole (a 0-d tensor has no slice to read)
        return torch.as_tensor(source[:] if shape else source).to(torch_dtype(dtype)).clone()  # type: ignore[index]
    parts = []
    for block in split.blocks:
        if block.start is None:
            pad_shape = list(shape)
            pad_shape[split.dim] = block.size
            parts.append(torch.zeros(pad_shape, dtype=torch_dtype(dtype)))
        else:
            index = (slice(None),) * split.dim + (slice(block.start, block.start + block.size),)
            parts.append(torch.as_tensor(source[index]).to(torch_dtype(dtype)))  # type: ignore[index]
    out = torch.cat(parts, split.dim) if len(parts) > 1 else parts[0].clone()
    assert tuple(out.shape) == split_shape(split, shape)  # internal invariant of the sharding plan
    return out.contiguous()


def weights_fingerprint(state_dict: Mapping[str, object]) -> str:
    """sha256 hex of an HF-named state dict's names, shapes and first and last rows (float32
    bytes): cheap to compute from a rank's lazily read checkpoint, and different for different
    checkpoints of one architecture, so tensor-parallel ranks can check they run the same weights."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name]
        shape = tuple(t.shape)  # type: ignore[attr-defined]
        digest.update(f"{name}:{shape};".encode())
        if shape and shape[0]:
            for row in (0, shape[0] - 1):
                digest.update(torch.as_tensor(t[row:row + 1]).float().numpy().tobytes())  # type: ignore[index]
    return digest.hexdigest()


def nest(flat: dict[str, torch.Tensor], num_layers: int) -> dict:
    """"layers.{i}.{name}" keys -> ``out["layers"][i][name]``; other keys stay at the top."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    out: dict = {"layers": layers}
    for key, t in flat.items():
        if key.startswith("layers."):
            _, i, name = key.split(".", 2)
            layers[int(i)][name] = t
        else:
            out[key] = t
    return out
