"""The heap around the big one-off phases (checkpoint load, compile) and the serving loop after
them, and the KV cache's memory (transparent huge pages, :func:`huge_page_zeros`).

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
import sys
import threading
from collections.abc import Iterator

import torch


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
    """(nbytes,) uint8 of fresh anonymous memory, zero, starting on a HUGE_PAGE_BYTES boundary
    (storage offset 0) and advised for transparent huge pages (``madvise(MADV_HUGEPAGE)``) before
    anything touches it, so each 2 MiB written is one page where the kernel has them (THP
    "madvise" or "always"); on other systems, or where the advice fails, ordinary pages. The
    mapping lives as long as a tensor viewing it.

    Why: a decode step streams the whole KV cache it attends, and with 4 KiB pages each page
    costs a TLB miss and restarts the hardware prefetcher. On a 2-core AMD EPYC (Zen 4, THP
    "madvise", 2026-12-07), SmolLM2 int8 weights with int8 activations, batch 8 at 1,920
    positions, the cache and the weights moved onto huge pages by hand: 18.1-18.7 ms a step with
    the int8 KV cache against 16.5-17.3, with bf16 KV 23.1-23.8 against 21.8-22.3 (best of 3 x
    48 steps, processes alternating); batch 1 at 128 positions unchanged. The weights are left
    where they are: a copy would double them while the caller's tensors live (a float32 plan
    runs on the caller's state dict), and views of one storage would have to be rebuilt."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if sys.platform == "linux":  # MADV_HUGEPAGE is Linux's; an error means no THP in this kernel
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=-address % HUGE_PAGE_BYTES)  # holds the mapping


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, in :func:`huge_page_buffer` memory when it
    is at least one huge page (smaller: torch.zeros). No page is touched until written, so
    resident memory grows in 2 MiB pages as the cache is written, not all at allocation."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_buffer(nbytes).view(dtype).view(shape)
