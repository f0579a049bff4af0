"""Returning freed heap memory to the OS after the big one-off phases (checkpoint load, compile).

Loading a GGUF checkpoint (dequantized through numpy) and compiling graphs (tracing, inductor's
codegen) free hundreds of MB of small objects; glibc keeps those pages resident until
``malloc_trim`` hands them back, so resident memory would overstate what the runtime holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


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
