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
from neuronfx.graphs.models import model_module


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every neuronfx weight name for ``cfg`` (HF layout: linear weights are (out, in)):
    embedding, final norm and LM head, then the family file's ``layer_shapes`` per layer."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,), "lm_head": (cfg.vocab_size, h)}
    per_layer = model_module(cfg.model_type).layer_shapes(cfg)
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
    for hf, ours in model_module(cfg.model_type).key_map(cfg).items():
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


@attrs.frozen
class RowSlice:
    """Rows ``[start, start + rows)`` of a fused weight ``source`` (a tensor or a lazily read
    ``checkpoints.LazyTensor``), read without copying the rest: ``shape``, and indexing with
    slices whose first one (dim 0, step 1) is offset into the source. A fused checkpoint tensor
    (phi3's ``qkv_proj``, ``gate_up_proj``) is split at load into one RowSlice per part, so
    tensor-parallel ranks still read only their rows (:func:`read_shard`)."""

    source: object
    start: int
    rows: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *tuple(self.source.shape)[1:])  # type: ignore[attr-defined]

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else slice(None)
        start, stop, step = first.indices(self.rows)
        if step != 1:
            raise ValueError(f"RowSlice supports step-1 row slices only, got {first!r}.")
        return self.source[(slice(self.start + start, self.start + max(start, stop)), *index[1:])]  # type: ignore[index]


def split_fused(state_dict: Mapping[str, object], required: dict[str, Target], cfg: ModelConfig) -> dict[str, object]:
    """neuronfx name -> its source in ``state_dict``: the HF tensor, or for a part of a fused
    one a :class:`RowSlice` of it (rows given by the family's ``layer_shapes``)."""
    shapes = expected_shapes(cfg)
    out: dict[str, object] = {}
    for hf, ours in required.items():
        if isinstance(ours, str):
            out[ours] = state_dict[hf]
            continue
        start = 0
        for name in ours:
            out[name] = RowSlice(state_dict[hf], start, shapes[name][0])
            start += shapes[name][0]
    return out


def check_state_dict(state_dict: Mapping[str, object], cfg: ModelConfig, source: str = "checkpoint") -> dict[str, Target]:
    """The one checkpoint check: raise CheckpointError listing missing, unexpected or
    mis-shaped tensors (expected vs found shape) of an HF-named ``state_dict`` (tensors, or
    anything with a ``shape``) for ``cfg``'s family; ``source`` names it in the message.
    Returns the key map to apply (HF name -> neuronfx name or fused names, tied
    ``lm_head.weight`` left out)."""
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


def convert_hf_state_dict(state_dict: Mapping[str, object], cfg: ModelConfig, dtype: str, shard: RankShard | None = None) -> dict:
    """Rename, check (:func:`check_state_dict`) and cast an HF state dict into neuronfx weights
    in ``dtype``: ``{"embed", "norm", "lm_head": tensor, "layers": [{"wq": ..., ...} per layer]}``.
    Tied embeddings reuse the embedding tensor as ``lm_head`` (no copy). A fused HF tensor is
    split into its parts (:func:`split_fused`). Layers that differ in
    RoPE or mask also get their indices (:func:`layer_indices`).

    With a tensor-parallel ``shard`` (tp_degree > 1) each weight is this rank's slices only
    (:func:`read_shard`); values may then be anything sliceable with a ``shape`` (tensors, or
    lazily read safetensors slices, so a rank reads only its part of the file)."""
    sources = split_fused(state_dict, check_state_dict(state_dict, cfg), cfg)
    if shard is not None and shard.tp_degree > 1:
        flat = {ours: read_shard(src, weight_split(shard, _base(ours)), dtype) for ours, src in sources.items()}
    else:  # a tensor's row slice is a view: cast (and copied) only when the dtype differs
        flat = {ours: torch.as_tensor(src[:]).to(torch_dtype(dtype)).contiguous() for ours, src in sources.items()}  # type: ignore[index]
    if cfg.tie_word_embeddings:
        flat["lm_head"] = flat["embed"]
    return nest(flat | layer_indices(cfg), cfg.num_hidden_layers)


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
    has a ``shape``, e.g. ``neuronfx.checkpoints.LazyTensor``) read block by block along
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
