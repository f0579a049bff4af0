"""What the parts of one phase graph hand each other: a record per phase kind.

A phase graph is a prologue, layer groups and an epilogue (``phases/compose.py``). The prologue
turns the step-input record (``config.inputs``) into one of these records; every layer group
reads it by name and returns new hidden states (the runner puts them in with ``_replace``); the
epilogue reads it by name too. Each record is a NamedTuple of tensors (a pytree: compiled parts
take and return it as it is, and saved compiled parts keep its class by import path), and each
field's symbolic shape, dtype and meaning are written on its annotation, as for the step inputs,
so a backend can find every dimension of a symbol (:func:`symbol_dims`: the inductor backend
compiles the bucket's dimension dynamic from it).

KV pools (``G``): the block table alone, or with a window ring (``config.kv.KVLayout``) one per
mask kind (the ring's for windowed kinds); a layer picks its pool by its ``mask_index``
(``common.layer_pool``).

Symbols: ``G`` KV pools, ``B`` rows, ``T`` new tokens per row, ``N`` block-table columns, ``S`` attended cache positions (the decode-type
bucket), ``H`` hidden size (per sequence-parallel rank: T / tp), ``R`` RoPE kinds and ``M``
mask kinds of the attention layout (``config.attention``), ``D`` rotary dims. A dtype "float"
is the plan's dtype.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor
else:
    Tensor = Any  # annotations stay plain metadata at run time


class PrefillHidden(NamedTuple):
    """Prefill: right-padded prompts from position 0; each token writes its own position."""

    h: Annotated[Tensor, "B T H", "float", "hidden states"]  # (B, T, H)
    cos: Annotated[Tensor, "R B 1 T D", "float", "RoPE cos of each kind"]  # (R, B, 1, T, D)
    sin: Annotated[Tensor, "R B 1 T D", "float", "RoPE sin of each kind"]  # (R, B, 1, T, D)
    mask: Annotated[Tensor, "M B 1 T T", "bool", "causal prompt mask of each kind (True = attend)"]  # (M, B, 1, T, T)
    blocks: Annotated[Tensor, "G B T", "int64", "KV block position t writes in each pool (the row's table at t // block size)"]  # (G, B, T)
    offsets: Annotated[Tensor, "B T", "int64", "position in that block position t writes"]  # (B, T)
    last: Annotated[Tensor, "B", "int64", "index of the row's last real token (its output)"]  # (B,)
    ids: Annotated[Tensor, "B T", "int32", "the step's token ids (prompt logprobs read each next one)"]  # (B, T)


class DecodeHidden(NamedTuple):
    """Decode, draft and speculate: T new tokens per row at their positions, attending the
    slot's first S cache positions."""

    h: Annotated[Tensor, "B T H", "float", "hidden states"]  # (B, T, H)
    cos: Annotated[Tensor, "R B 1 T D", "float", "RoPE cos of each kind"]  # (R, B, 1, T, D)
    sin: Annotated[Tensor, "R B 1 T D", "float", "RoPE sin of each kind"]  # (R, B, 1, T, D)
    mask: Annotated[Tensor, "M B 1 T S", "bool", "mask of each kind over the cache (True = attend)"]  # (M, B, 1, T, S)
    block_table: Annotated[Tensor, "G B N", "int32", "each row's KV blocks in position order, per pool"]  # (G, B, N)
    blocks: Annotated[Tensor, "G B T", "int64", "KV block each token writes, per pool"]  # (G, B, T)
    offsets: Annotated[Tensor, "B T", "int64", "position in that block each token writes"]  # (B, T)


class ChunkHidden(NamedTuple):
    """Chunk: T prompt tokens per row at an offset, attending the slot's first S positions; pad
    tokens write to the scratch slot."""

    h: Annotated[Tensor, "B T H", "float", "hidden states"]  # (B, T, H)
    cos: Annotated[Tensor, "R B 1 T D", "float", "RoPE cos of each kind"]  # (R, B, 1, T, D)
    sin: Annotated[Tensor, "R B 1 T D", "float", "RoPE sin of each kind"]  # (R, B, 1, T, D)
    mask: Annotated[Tensor, "M B 1 T S", "bool", "mask of each kind over the cache (True = attend)"]  # (M, B, 1, T, S)
    block_table: Annotated[Tensor, "G B N", "int32", "each row's KV blocks in position order, per pool"]  # (G, B, N)
    blocks: Annotated[Tensor, "G B T", "int64", "KV block each token writes, per pool (pads: its scratch block)"]  # (G, B, T)
    offsets: Annotated[Tensor, "B T", "int64", "position in that block each token writes"]  # (B, T)
    last: Annotated[Tensor, "B", "int64", "index of the row's last real token (its output)"]  # (B,)
    ids: Annotated[Tensor, "B T", "int32", "the step's token ids (prompt logprobs read each next one)"]  # (B, T)


def field_shapes(cls: type) -> dict[str, tuple[str, ...]]:
    """Each field of record class ``cls`` -> its symbolic shape, e.g. ``{"h": ("B", "T", "H"), ...}``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: tuple(typing.get_args(hints[name])[1].split()) for name in cls._fields}  # type: ignore[attr-defined]


def symbol_dims(args: tuple, symbol: str) -> Iterator[tuple[Any, int]]:
    """(tensor, dim) of every dimension named ``symbol`` in the records among ``args`` (other
    arguments are skipped): what a backend marks dynamic to compile one part for every size
    of that symbol."""
    for arg in args:
        if isinstance(arg, (PrefillHidden, DecodeHidden, ChunkHidden)):
            for name, shape in field_shapes(type(arg)).items():
                yield from ((getattr(arg, name), dim) for dim, s in enumerate(shape) if s == symbol)
