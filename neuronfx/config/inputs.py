"""Step inputs: one record per phase, the single definition of what each graph takes.

A record is a NamedTuple; each field is one tensor whose symbolic shape, dtype and meaning are
written on its annotation (``Annotated[Tensor, "B T", "int32", "what it holds"]``, with the shape
repeated as a comment), or a nested record. From the record come the plan's
:class:`TensorSpec` tuple for every graph (:func:`input_specs`), the
trace example inputs and the flat argument order of compiled graphs (``neuronfx.graphs.phases.inputs``),
the runtime's call (the step functions fill the fields by name) and the docs
(:func:`describe`). Besides its step inputs every graph takes the shared weights and the KV
cache (per layer a named K and V, ``neuronfx.graphs.phases.inputs.LayerKV``).

Symbols: ``B`` rows of the graph (its batch bucket), ``T`` new tokens per row (prefill: the
prompt bucket; decode and draft: 1; speculate: ``speculation_length``; chunk:
``prefill_chunk_size``), ``V`` vocabulary size,
``N`` columns of a block table (``config.kv.KVLayout.max_blocks_per_seq``: 1 in the slots
layout), ``P`` sampling-parameter columns (``config.sampling.PARAM_COLUMNS``), ``W`` = ceil(V / 32) words of
a token bitmask, ``D`` draft tokens per row (fused speculation: T - 1).

Modelled on vLLM's ``InputBatch`` (``vllm/v1/worker/gpu/input_batch.py``): a plain record with a
shape comment per field, from which dummy inputs are made.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import attrs
import torch

from neuronfx.errors import InputError

if TYPE_CHECKING:
    Tensor = torch.Tensor
else:
    Tensor = Any  # annotations stay plain metadata at run time


@attrs.frozen
class TensorSpec:
    """One concrete graph input: name, shape (ints) and dtype name (a key of
    ``config.dtypes.DTYPES``, e.g. "int32")."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class SamplerInputs(NamedTuple):
    """What the in-graph sampler reads for each row (``neuronfx.graphs.phases.sampling.sample``)."""

    sampling_params: Annotated[Tensor, "B P", "float32", "the row's SamplingParams, columns PARAM_COLUMNS"]  # (B, P)
    output_counts: Annotated[Tensor, "B V", "int32", "times the row's request generated each token"]  # (B, V)
    prompt_mask: Annotated[Tensor, "B V", "bool", "token occurs in the row's prompt (repetition penalty)"]  # (B, V)
    logits_bias: Annotated[Tensor, "B V", "float32", "added to the logits: the request's logit_bias, -inf on eos ids until min_tokens"]  # (B, V)
    rand: Annotated[Tensor, "B", "float32", "uniform in [0, 1) for the row's draw"]  # (B,)
    token_bitmask: Annotated[Tensor, "B W", "int32",
                             "allowed tokens: bit j of word w allows token 32w + j (-1: all; structured outputs)"]  # (B, W)


class PrefillInputs(NamedTuple):
    """Prefill: right-padded prompts written into their slots from position 0; the output is
    sampled at each row's last real token."""

    input_ids: Annotated[Tensor, "B T", "int32", "prompt tokens, right-padded with 0"]  # (B, T)
    position_ids: Annotated[Tensor, "B T", "int32", "position of each token: 0 .. T - 1"]  # (B, T)
    seq_ids: Annotated[Tensor, "B", "int32", "slot of each row; padding rows use the scratch slot"]  # (B,)
    block_table: Annotated[Tensor, "B N", "int32", "the row's KV blocks in position order, then the scratch block (slots: [slot])"]  # (B, N)
    prompt_lens: Annotated[Tensor, "B", "int32", "real tokens per row, >= 1 (padding rows: 1)"]  # (B,)
    sampler: SamplerInputs  # the sampler's inputs, one per row


class DecodeInputs(NamedTuple):
    """Decode and draft: one new token per row at its slot's cache_len; the output is sampled."""

    input_ids: Annotated[Tensor, "B T", "int32", "the row's last token (T = 1)"]  # (B, T)
    position_ids: Annotated[Tensor, "B T", "int32", "its position: the slot's cache_len"]  # (B, T)
    seq_ids: Annotated[Tensor, "B", "int32", "slot of each row; padding rows use the scratch slot"]  # (B,)
    block_table: Annotated[Tensor, "B N", "int32", "the row's KV blocks in position order, then the scratch block (slots: [slot])"]  # (B, N)
    sampler: SamplerInputs  # the sampler's inputs, one per row


class SpeculateInputs(NamedTuple):
    """Speculate (verify): T = k tokens per row at consecutive positions; the output is the
    logits at every position (acceptance runs on the host)."""

    input_ids: Annotated[Tensor, "B T", "int32", "last accepted token, then the k - 1 drafted ones"]  # (B, T)
    position_ids: Annotated[Tensor, "B T", "int32", "cache_len .. cache_len + k - 1"]  # (B, T)
    seq_ids: Annotated[Tensor, "B", "int32", "slot of each row; padding rows use the scratch slot"]  # (B,)
    block_table: Annotated[Tensor, "B N", "int32", "the row's KV blocks in position order, then the scratch block (slots: [slot])"]  # (B, N)


class GreedyInputs(NamedTuple):
    """Greedy (a decode graph's argmax twin, ``config.plan.SHARED_PARTS``): one new token per
    row at its slot's cache_len; the output is the argmax of each row's logits, so no sampler
    inputs (the step still takes its draws: the state's RNG key moves as a decode step's)."""

    input_ids: Annotated[Tensor, "B T", "int32", "the row's last token (T = 1)"]  # (B, T)
    position_ids: Annotated[Tensor, "B T", "int32", "its position: the slot's cache_len"]  # (B, T)
    seq_ids: Annotated[Tensor, "B", "int32", "slot of each row; padding rows use the scratch slot"]  # (B,)
    block_table: Annotated[Tensor, "B N", "int32", "the row's KV blocks in position order, then the scratch block (slots: [slot])"]  # (B, N)


class ChunkInputs(NamedTuple):
    """Chunk (prefill at an offset): each row's next T prompt tokens written at positions
    [cache_len, cache_len + chunk_len) of its slot, attending the slot's cache plus causal
    within the chunk, right-padded; pad tokens repeat the row's last real position and write to
    the scratch block (``config.kv.pad_writes``). The output is sampled at each row's last
    real token."""

    input_ids: Annotated[Tensor, "B T", "int32", "the chunk's tokens, right-padded with 0"]  # (B, T)
    position_ids: Annotated[Tensor, "B T", "int32", "cache_len + t; pads repeat the last real one"]  # (B, T)
    seq_ids: Annotated[Tensor, "B", "int32", "slot of each row; padding rows use the scratch slot"]  # (B,)
    block_table: Annotated[Tensor, "B N", "int32", "the row's KV blocks in position order, then the scratch block (slots: [slot])"]  # (B, N)
    chunk_lens: Annotated[Tensor, "B", "int32", "real tokens of the chunk, >= 1 (padding rows: 1)"]  # (B,)
    seq_lens: Annotated[Tensor, "B", "int32", "the row's whole prompt length (length-dependent RoPE)"]  # (B,)
    sampler: SamplerInputs  # the sampler's inputs, one per row


class EmbedInputs(NamedTuple):
    """Embed: right-padded prompts from position 0, nothing written to a cache; the output is
    each row's pooled final hidden state (``InferenceConfig.pooling``)."""

    input_ids: Annotated[Tensor, "B T", "int32", "prompt tokens, right-padded with 0"]  # (B, T)
    position_ids: Annotated[Tensor, "B T", "int32", "position of each token: 0 .. T - 1"]  # (B, T)
    seq_ids: Annotated[Tensor, "B", "int32", "unused (0): an embed graph keeps no cache"]  # (B,)
    prompt_lens: Annotated[Tensor, "B", "int32", "real tokens per row, >= 1 (padding rows: 1)"]  # (B,)


class FusedSpeculateInputs(NamedTuple):
    """Fused speculation (``runtime/fused.py``): one speculate step of k = T tokens per row in one
    call, its T - 1 draft passes (D = T - 1), the verify pass and the acceptance. The rows'
    sampler inputs before the step: each speculated position's are derived in the call
    (``graphs/phases/speculation.py``). Rows: the larger of the two runtimes' batch buckets,
    each graph reading its first rows."""

    input_ids: Annotated[Tensor, "B", "int32", "the row's last token, not yet cached"]  # (B,)
    position_ids: Annotated[Tensor, "B", "int32", "its position: the slot's cache_len (padding rows: 0)"]  # (B,)
    seq_ids: Annotated[Tensor, "B", "int32", "slot of each row; padding rows use the scratch slot"]  # (B,)
    draft_seq_ids: Annotated[Tensor, "B", "int32", "the row's slot in the drafter's cache (its scratch slot for padding)"]  # (B,)
    block_table: Annotated[Tensor, "B N", "int32", "the row's KV blocks in the target's cache (``PrefillInputs``)"]  # (B, N)
    draft_block_table: Annotated[Tensor, "B Nd", "int32", "the row's KV blocks in the drafter's cache"]  # (B, Nd)
    sampling_params: Annotated[Tensor, "B P", "float32", "the row's SamplingParams, top_k packed for the target's width"]  # (B, P)
    draft_sampling_params: Annotated[Tensor, "B P", "float32", "the same, top_k packed for the drafter's width"]  # (B, P)
    output_counts: Annotated[Tensor, "B V", "int32", "times the row's request generated each token before the step"]  # (B, V)
    prompt_mask: Annotated[Tensor, "B V", "bool", "token occurs in the row's prompt (repetition penalty)"]  # (B, V)
    logits_bias: Annotated[Tensor, "B V", "float32", "the request's logit_bias"]  # (B, V)
    stop_mask: Annotated[Tensor, "B V", "bool", "the row's eos and stop ids, which min_tokens holds back"]  # (B, V)
    min_tokens_left: Annotated[Tensor, "B", "int32", "speculated positions before min_tokens is reached (0: none)"]  # (B,)
    draft_rand: Annotated[Tensor, "B D", "float32", "uniforms drawing the draft token at each position"]  # (B, D)
    accept_rand: Annotated[Tensor, "B D", "float32", "uniforms of the acceptance test of each draft"]  # (B, D)
    final_rand: Annotated[Tensor, "B T", "float32", "uniforms drawing the resampled or bonus token at each position"]  # (B, T)


PHASE_INPUTS: dict[str, type] = {
    "prefill": PrefillInputs, "decode": DecodeInputs, "greedy": GreedyInputs, "draft": DecodeInputs, "speculate": SpeculateInputs,
    "chunk": ChunkInputs, "embed": EmbedInputs,
}
"""The step-input record of each phase."""


@attrs.frozen
class Field:
    """One tensor of a record: its name, symbolic shape (symbols), dtype name, meaning, and its
    path from the outer record (``sampler.rand``)."""

    name: str
    shape: tuple[str, ...]
    dtype: str
    doc: str
    path: str


def _is_record(hint: object) -> bool:
    return isinstance(hint, type) and issubclass(hint, tuple)  # a nested record (NamedTuple)


def leaf_fields(cls: type, prefix: str = "") -> list[Field]:
    """The tensor fields of record class ``cls``, nested records expanded, in call order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for name in cls._fields:  # type: ignore[attr-defined]
        hint = hints[name]
        if _is_record(hint):
            out += leaf_fields(hint, f"{prefix}{name}.")
        else:
            shape, dtype, doc = typing.get_args(hint)[1:]
            out.append(Field(name, tuple(shape.split()), dtype, doc, prefix + name))
    return out


def input_specs(cls: type, dims: Mapping[str, int]) -> tuple[TensorSpec, ...]:
    """The TensorSpec of every tensor of ``cls`` with its symbols replaced by ``dims``
    (e.g. ``{"B": 4, "T": 1, "V": 256, "P": 7}``), in call order."""
    return tuple(TensorSpec(f.name, tuple(dims[s] for s in f.shape), f.dtype) for f in leaf_fields(cls))


def leaves(value: tuple) -> list[Any]:
    """The tensors of record ``value`` in call order (nested records expanded)."""
    out = []
    for item in value:
        out += leaves(item) if isinstance(item, tuple) else [item]
    return out


def from_leaves(cls: type, values: Sequence[Any]) -> Any:
    """Inverse of :func:`leaves`: the record of class ``cls`` holding ``values`` in call order.
    Raises InputError when the count differs from the record's tensors."""
    want = len(leaf_fields(cls))
    if len(values) != want:
        raise InputError(f"{cls.__name__} takes {want} tensors, got {len(values)}; pass one tensor per field.")
    return _build(cls, iter(values))


def _build(cls: type, it: Iterator[Any]) -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    return cls(*(_build(hints[name], it) if _is_record(hints[name]) else next(it) for name in cls._fields))  # type: ignore[attr-defined]


def dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a dense row-major tensor of ``shape`` (what ``torch.empty(shape)`` has).
    A size-1 dimension gets its row-major stride too: ``Tensor.is_contiguous`` ignores the
    stride of such a dimension, dynamo's guards of a compiled graph do not."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def check_inputs(specs: tuple[TensorSpec, ...], value: Any, what: str) -> None:
    """Raise InputError naming the field, the expected and the found shape or dtype when a
    tensor of record ``value`` does not match ``specs`` (the graph's TensorSpecs), or does not
    have dense row-major strides (:func:`dense_strides`; compiled graphs are specialised for
    them, size-1 dimensions included); ``what`` names the graph in the message."""
    tensors = leaves(value)
    if len(tensors) != len(specs):
        raise InputError(f"{what} takes {len(specs)} input tensors, got {len(tensors)}; build the step inputs from its GraphSpec.")
    for spec, t in zip(specs, tensors):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{what} input {spec.name!r} is a {type(t).__name__}, not a torch.Tensor; pass torch.as_tensor(...).")
        shape, dtype = tuple(t.shape), str(t.dtype).removeprefix("torch.")
        if shape != spec.shape or dtype != spec.dtype:
            raise InputError(
                f"{what} input {spec.name!r} is {dtype} {list(shape)}, the graph takes {spec.dtype} {list(spec.shape)}; "
                "build the step inputs from the graph's GraphSpec."
            )
        if t.stride() != dense_strides(shape):
            raise InputError(f"{what} input {spec.name!r} has strides {list(t.stride())}, the graph takes dense row-major strides "
                             f"{list(dense_strides(shape))}; pass {spec.name}.clone(memory_format=torch.contiguous_format).")


def describe() -> str:
    """The docs' tables of the step inputs, one per record (the phases that take it, T), each
    row a tensor in call order: field, shape, dtype, what it holds (docs/design.md shows it)."""
    tokens = {"PrefillInputs": "T = the prompt bucket", "DecodeInputs": "T = 1", "GreedyInputs": "T = 1",
              "SpeculateInputs": "T = speculation_length", "ChunkInputs": "T = prefill_chunk_size", "EmbedInputs": "T = the prompt bucket",
              "FusedSpeculateInputs": "T = speculation_length, D = T - 1"}
    out = []
    for cls in [*dict.fromkeys(PHASE_INPUTS.values()), FusedSpeculateInputs]:
        phases = ", ".join(p for p, c in PHASE_INPUTS.items() if c is cls) or "fused speculation"
        rows = [f"`{cls.__name__}` ({phases}; {tokens[cls.__name__]}):", "",
                "| field | shape | dtype | what it holds |", "| --- | --- | --- | --- |"]
        for f in leaf_fields(cls):
            shape = "(" + ", ".join(f.shape) + ("," if len(f.shape) == 1 else "") + ")"
            rows.append(f"| `{f.path}` | {shape} | {f.dtype} | {f.doc} |")
        out.append("\n".join(rows))
    return "\n\n".join(out)
