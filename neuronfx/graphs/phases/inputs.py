"""Tensors at the graph boundary: the named per-layer KV cache and trace example inputs.

The step-input records themselves are defined once in ``neuronfx.config.inputs``; here they are
filled with tensors.
"""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

import torch

from neuronfx.config.dtypes import torch_dtype
from neuronfx.config.inputs import SamplerInputs, from_leaves
from neuronfx.config.plan import GraphSpec, Plan
from neuronfx.config.sampling import SamplingParams, pack_sampling
from neuronfx.errors import ConfigError
from neuronfx.graphs.phases.device import plan_device
from neuronfx.memory import huge_page_zeros


class LayerKV(NamedTuple):
    """One decoder layer's KV cache: each [num_slots, num_kv_heads, sequence_length, head_dim]
    in the plan's dtype; the last slot is the scratch slot padding rows write to."""

    k: torch.Tensor  # (slots, n_kv_heads, S, D)
    v: torch.Tensor  # (slots, n_kv_heads, S, D)


KVCache = tuple[LayerKV, ...]
"""The whole KV cache: one LayerKV per decoder layer, in layer order."""
KVPairs = list[tuple[torch.Tensor, torch.Tensor]]
"""A layer group's (K, V) per layer, as compiled parts take them (plain tensors)."""


def empty_kv(plan: Plan) -> KVCache:
    """A zero KV cache for ``plan`` (``plan.kv.nbytes`` bytes) on the plan's device; on the CPU
    each layer's K and V of a huge page or more on transparent huge pages
    (``memory.huge_page_zeros``: a step streams the cache; pages come in as they are written).
    Raises ConfigError (:func:`kv_too_large`), naming the cache's size and the fields that shrink
    it, when the device cannot allocate it (the mapping's ENOMEM, torch's allocator or CUDA out
    of memory)."""
    def zeros(layer: int) -> torch.Tensor:
        shape, dtype = plan.kv.layer_shape(layer), torch_dtype(plan.kv.dtype)
        if plan.inference.device == "cpu":
            return huge_page_zeros(tuple(shape), dtype)
        return torch.zeros(shape, dtype=dtype, device=plan_device(plan))

    try:
        return tuple(LayerKV(zeros(i), zeros(i)) for i in range(plan.kv.num_layers))
    except (MemoryError, OSError, RuntimeError) as exc:
        if not out_of_memory(exc):
            raise
        raise ConfigError(kv_too_large(plan, f"{type(exc).__name__}: {str(exc)[:120]}")) from None


def kv_too_large(plan: Plan, failure: str) -> str:
    """The message of a KV cache the device could not allocate (``failure``): its size, what
    sets it, the machine's memory (CPU plans) and the InferenceConfig fields that shrink it."""
    inf, kv = plan.inference, plan.kv
    if kv.paged:
        made_of = f"{kv.total_blocks} blocks of {kv.positions_per_block} positions (num_kv_blocks / kv_cache_memory)"
        fixes = ["fewer blocks (num_kv_blocks, kv_cache_memory)"]
    else:
        made_of = f"batch_size={inf.batch_size} slots of sequence_length={inf.sequence_length} positions"
        fixes = ["a lower batch_size or sequence_length", "kv_layout='blocks' with a kv_cache_memory budget"]
    if kv.dtype not in ("int8", "float8_e4m3fn"):
        fixes.append("kv_cache_dtype='int8' (a quarter of fp32's bytes)")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if inf.device == "cpu" else None
    has = f"; this machine has {total / 2**30:.1f} GiB of memory" if total else ""
    return (f"the plan's KV cache is {kv.nbytes / 2**20:.1f} MiB ({made_of}, {kv.num_layers} layers, {kv.dtype}) and "
            f"{inf.device} memory could not hold it ({failure}){has}; shrink it: {', or '.join(fixes)} (the CLI's flags of the same "
            "names).")


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed: MemoryError, an OSError with ENOMEM (``mmap``),
    torch's CPU allocator ("can't allocate memory") or CUDA's out-of-memory error."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    return "allocate memory" in str(exc) or "out of memory" in str(exc)


_LENGTHS = ("prompt_lens", "chunk_lens", "seq_lens")


def example_inputs(plan: Plan, spec: GraphSpec) -> object:
    """Trace inputs of ``spec``'s graph as its phase's record: zeros from the spec's shapes and
    dtypes, except the lengths (1: a prompt or chunk has a token), greedy sampling rows and an
    all-allowed token bitmask (-1); on the plan's device."""
    device = plan_device(plan)
    tensors = []
    for t in spec.inputs:
        if t.name == "sampling_params":
            tensors.append(torch.tensor(pack_sampling([SamplingParams()] * t.shape[0], plan.topk_width), dtype=torch.float32,
                                        device=device))
        else:
            fill = -1 if t.name == "token_bitmask" else int(t.name in _LENGTHS)
            tensors.append(torch.full(t.shape, fill, dtype=torch_dtype(t.dtype), device=device))
    return from_leaves(spec.record, tensors)


__all__ = ["KVCache", "KVPairs", "LayerKV", "SamplerInputs", "empty_kv", "example_inputs"]
