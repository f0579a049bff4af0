"""Tensors at the graph boundary: the named per-layer KV cache and trace example inputs.

The step-input records themselves are defined once in ``neuronfx.config.inputs``; here they are
filled with tensors.
"""

from __future__ import annotations

import errno
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
    Raises ConfigError, naming the cache's size and the options that shrink it, when the device
    cannot allocate it (the mapping's ENOMEM, torch's allocator or CUDA out of memory)."""
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
        inf = plan.inference
        raise ConfigError(f"the plan's KV cache is {plan.kv.nbytes / 2**20:.1f} MiB (batch_size={inf.batch_size}, "
                          f"sequence_length={inf.sequence_length}, kv_cache_dtype={plan.kv.dtype}, {plan.kv.num_layers} layers) "
                          f"and {inf.device} memory could not hold it ({type(exc).__name__}: {str(exc)[:120]}); lower --batch-size or "
                          "--sequence-length, store it smaller (--kv-cache-dtype int8), or page it (--kv-layout blocks "
                          "--kv-cache-memory BYTES).") from None


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
