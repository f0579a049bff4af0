"""The heap around the big one-off phases (checkpoint load, compile) and the serving loop after
them, and the memory the big tensors live in (weights and the KV cache on transparent huge pages).

Loading a GGUF checkpoint (dequantized through numpy) and compiling graphs (tracing, inductor's
codegen) free hundreds of MB of small objects; glibc keeps those pages resident until
``malloc_trim`` hands them back, so resident memory would overstate what the runtime holds
(:func:`trim_heap`). What stays alive after them (torch, transformers, the runtime: about 465,000
objects the garbage collector tracks) is walked by every full collection of the collector's
oldest generation; :func:`frozen_heap` takes it out of those walks while a loop decodes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import math
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from neuronfx.config.inputs import dense_strides


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def trim_heap() -> int:
    """Collect garbage, then release free heap pages to the OS (glibc ``malloc_trim(0)``).

    Returns 1 when memory was released, 0 when nothing was or the C library has no
    ``malloc_trim`` (musl, macOS): a no-op there. The collection walks every live object: about
    0.2 s in a process holding a few hundred thousand (torch, transformers, a tiny model).
    """
    gc.collect()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None  # glibc only
    return int(trim(0)) if trim is not None else 0


# The collector's frozen generation is one per process, so the blocks of every thread (a server's
# engine beside an application's own loop, say) count together: the last to leave unfreezes.
_FROZEN = threading.Lock()
_holders = {"blocks": 0, "frozen_before": False}


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """Collect garbage, then freeze every object alive (``gc.freeze``: moved to a permanent
    generation that collections skip) for the block; yields how many objects are frozen. Blocks
    nest and overlap across threads: each entry collects and freezes what is alive then, and when
    the last open block (of any thread) leaves, the heap is unfrozen (``gc.unfreeze``), unless
    something outside these blocks had frozen it before the first one opened. What becomes cyclic
    garbage among the frozen objects is reclaimed after that, not before; everything else is
    collected as usual.

    Why: a full collection walks every tracked object, about 465,000 after SmolLM2 is compiled,
    and stalls the step it lands in by 215-231 ms (a 2-core AMD EPYC, 2026-12-06, batch-1 steps
    of 7-9 ms: the longest of 2,100 steps 239 ms, 19.9 ms with the heap frozen; one such
    collection in those steps, so the mean step did not change). Entering the outermost block
    costs one full collection itself (about 0.25 s), so it suits long-lived loops: ``neuronfx
    chat`` and ``serve`` and the benchmarks' timed rounds run in it, a one-shot ``generate`` does
    not. vLLM freezes its engine's heap after startup the same way (``vllm/utils/gc_utils.py``,
    ``freeze_gc_heap``). An embedding application can wrap its own serving loop in it, after its
    runtimes are built.
    """
    with _FROZEN:
        if _holders["blocks"] == 0:
            _holders["frozen_before"] = gc.get_freeze_count() > 0
        _holders["blocks"] += 1
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
    try:
        yield frozen
    finally:
        with _FROZEN:
            _holders["blocks"] -= 1
            if _holders["blocks"] == 0 and not _holders["frozen_before"]:
                gc.unfreeze()


HUGE_PAGE_BYTES = 2 << 20
"""A transparent huge page on x86-64 (and the smallest above 4 KiB on arm64 with 4 KiB pages)."""


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """(nbytes,) uint8 of fresh anonymous memory, zero, its start aligned to HUGE_PAGE_BYTES and
    advised for transparent huge pages (``madvise(MADV_HUGEPAGE)``) before anything touches it,
    so each 2 MiB is one page where the kernel has them (THP "madvise" or "always"); elsewhere,
    or where the advice fails, ordinary pages. The mapping lives as long as a tensor viewing it.

    Why: the weights and the KV cache are streamed every step, and with 4 KiB pages each page of
    them costs a TLB miss and restarts the hardware prefetcher. On a 2-core AMD EPYC (Zen 4,
    THP "madvise", 2026-12-07), SmolLM2 int8 weights with int8 activations, batch 8 at 1,920
    positions: 18.1-18.7 ms a step with the int8 KV cache, 16.5-17.3 on huge pages; with bf16
    KV 23.1-23.8 against 21.8-22.3 (the best of 3 x 48 steps in alternating processes)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE (macOS), or THP not built in
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + nbytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, in :func:`huge_page_buffer` memory when it
    is at least one huge page (smaller: torch.zeros). Its pages are not touched until written:
    resident memory grows with the positions a cache holds, not at allocation."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_buffer(nbytes).view(dtype).view(shape)


_ALIGN = 64  # each tensor in a shared buffer starts on a cache line


def on_huge_pages(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples and NamedTuples of tensors: the runtime's weights) with its
    contiguous CPU tensors copied into one :func:`huge_page_buffer`, each with its shape, dtype
    and strides (a compiled graph's guards see no change), one copy per distinct tensor (tied
    weights stay one tensor). Trees under one huge page, and other tensors, come back as they
    are."""
    distinct: dict[tuple, torch.Tensor] = {}
    for t in _movable(tree):
        distinct.setdefault(_identity(t), t)
    total = sum(_padded(t.nbytes) for t in distinct.values())
    if total < HUGE_PAGE_BYTES:
        return tree
    buffer, offset, copies = huge_page_buffer(total), 0, {}
    for key, t in distinct.items():
        copy = buffer[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        copies[key] = copy.copy_(t)
        offset += _padded(t.nbytes)
    return tree_map_only(torch.Tensor, lambda t: copies.get(_identity(t), t) if _is_movable(t) else t, tree)


def _movable(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, lambda t: found.append(t) if _is_movable(t) else None, tree)
    return found


def _is_movable(t: torch.Tensor) -> bool:
    """A CPU tensor with dense row-major strides (a size-1 dimension's stride included: a copy
    gets those, and a compiled part's guards compare strides)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.numel() > 0 and not t.requires_grad
            and t.stride() == dense_strides(t.shape))


def _identity(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape))


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
