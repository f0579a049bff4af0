"""The heap around decoding (``neuronfx.memory``): ``frozen_heap`` freezes what is alive for its
block, nests, and lets go after it; the benchmarks' alternating rounds run inside it. The KV
cache's memory (``huge_page_zeros``): zeros, aligned, advised for transparent huge pages."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path

import pytest
import torch

import neuronfx
from neuronfx.bench.rounds import alternate
from neuronfx.memory import HUGE_PAGE_BYTES, huge_page_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()  # this kernel has transparent huge pages


class Node:
    """A gc-tracked object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """An unreachable two-node reference cycle; the caller gets only a weak reference to one
    node: only a garbage collection reclaims it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_frozen_heap_freezes_for_its_block_and_nests() -> None:
    assert gc.get_freeze_count() == 0  # nothing earlier in the session left the heap frozen
    with neuronfx.frozen_heap() as frozen:
        assert frozen > 10_000 and gc.get_freeze_count() > 10_000  # torch's and neuronfx's objects (freed ones leave the count)
        with neuronfx.frozen_heap():
            pass
        assert gc.get_freeze_count() > 10_000  # the inner block left it to the outer one
    assert gc.get_freeze_count() == 0


def test_cyclic_garbage_frozen_in_the_block_is_reclaimed_after_it() -> None:
    """A cycle alive when the block starts is frozen: dropped inside, no collection reclaims it
    there; after the block the next one does. A cycle made inside is collected as usual."""
    assert gc.get_freeze_count() == 0
    held = [Node()]
    held[0].other = Node()
    held[0].other.other = held[0]
    early = weakref.ref(held[0])
    with neuronfx.frozen_heap():
        held.clear()
        late = cycle()
        gc.collect()
        assert early() is not None and late() is None
    gc.collect()
    assert early() is None


def test_alternating_rounds_run_with_the_heap_frozen() -> None:
    seen = alternate({"a": gc.get_freeze_count, "b": gc.get_freeze_count}, rounds=3)
    assert all(n > 0 for runs in seen.values() for n in runs) and len(seen["a"]) == len(seen["b"]) == 3
    assert gc.get_freeze_count() == 0


def test_blocks_of_two_threads_unfreeze_when_the_last_leaves() -> None:
    """One thread's block opens, another's opens and leaves first: the heap stays frozen until
    the first one leaves too."""
    opened, release = threading.Event(), threading.Event()

    def other() -> None:
        with neuronfx.frozen_heap():
            opened.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert opened.wait(10)
    with neuronfx.frozen_heap():
        pass
    assert gc.get_freeze_count() > 0  # the other thread's block is still open
    release.set()
    thread.join(10)
    assert gc.get_freeze_count() == 0


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_huge_page_zeros_are_aligned_advised_zeros(dtype: torch.dtype) -> None:
    """A KV cache layer of a huge page or more: zeros of its shape and dtype with dense strides,
    starting on a 2 MiB boundary at storage offset 0, its mapping advised for huge pages where
    the kernel has them (smaps' ``hg`` flag, which MADV_HUGEPAGE sets whether or not pages are
    free); smaller ones are plain zeros."""
    t = huge_page_zeros((8, 3, 2048, 68), dtype)
    assert t.shape == (8, 3, 2048, 68) and t.dtype == dtype and t.is_contiguous() and not t.any()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0 and t.storage_offset() == 0
    assert ("hg" in _vm_flags(t.data_ptr())) == THP
    t[-1, -1, -1, -1] = 1  # the last byte is the tensor's: writable to its end
    assert int(t.sum()) == 1
    small = huge_page_zeros((4, 5), dtype)
    assert small.shape == (4, 5) and not small.any() and "hg" not in _vm_flags(small.data_ptr())


def test_a_kv_cache_the_memory_cannot_hold_is_a_config_error(monkeypatch) -> None:
    """When the KV cache's allocation fails (the mapping's ENOMEM, as ``neuronfx generate
    --batch-size 100000`` met it: 2.2 TB for SmolLM2) the error is a ConfigError naming the
    cache's size, the plan's numbers and the options that shrink it; another OSError is not
    taken for it."""
    import errno

    from helpers import tiny_hf_model, tiny_plan

    from neuronfx.errors import ConfigError
    from neuronfx.graphs.phases import inputs

    def failing(exc: BaseException):
        def allocate(*args: object) -> torch.Tensor:
            raise exc
        return allocate

    plan = tiny_plan(tiny_hf_model(), batch_size=2, sequence_length=64)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    for exc in (OSError(errno.ENOMEM, "Cannot allocate memory"), RuntimeError("DefaultCPUAllocator: can't allocate memory")):
        monkeypatch.setattr(inputs, "huge_page_zeros", failing(exc))
        with pytest.raises(ConfigError) as raised:
            inputs.empty_kv(plan)
        assert str(raised.value) == (
            f"the plan's KV cache is {plan.kv.nbytes / 2**20:.1f} MiB (batch_size=2 slots of sequence_length=64 positions, 2 "
            f"layers, float32) and cpu memory could not hold it ({type(exc).__name__}: {str(exc)[:120]}); this machine has "
            f"{memory:.1f} GiB of memory; shrink it: a lower batch_size or sequence_length, or kv_layout='blocks' with a "
            "kv_cache_memory budget, or kv_cache_dtype='int8' (a quarter of fp32's bytes) (the CLI's flags of the same names).")
    paged = tiny_plan(tiny_hf_model(), kv_layout="blocks", kv_block_size=8, kv_cache_dtype="int8")
    monkeypatch.setattr(inputs, "huge_page_zeros", failing(MemoryError()))
    with pytest.raises(ConfigError, match=rf"\({paged.kv.total_blocks} blocks of 8 positions \(num_kv_blocks / kv_cache_memory\), "
                       r"2 layers, int8\) .*; shrink it: fewer blocks \(num_kv_blocks, kv_cache_memory\) \(the CLI"):
        inputs.empty_kv(paged)
    monkeypatch.setattr(inputs, "huge_page_zeros", failing(OSError(errno.EACCES, "denied")))
    with pytest.raises(PermissionError):
        inputs.empty_kv(plan)
