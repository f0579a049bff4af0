"""The heap around decoding (``neuronfx.memory``): ``frozen_heap`` freezes what is alive for its
block, nests, and lets go after it; the benchmarks' alternating rounds run inside it. The big
tensors on transparent huge pages: ``huge_page_zeros`` (the KV cache) and ``on_huge_pages`` (the
weights) keep values, shapes, strides and ties, and advise their memory."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch

import neuronfx
from neuronfx.bench.rounds import alternate
from neuronfx.memory import HUGE_PAGE_BYTES, huge_page_zeros, on_huge_pages


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
    starting on a 2 MiB boundary, its mapping advised for huge pages (smaps' ``hg`` flag, which
    MADV_HUGEPAGE sets whether or not the kernel has pages free); smaller ones are plain zeros."""
    t = huge_page_zeros((8, 3, 2048, 68), dtype)
    assert t.shape == (8, 3, 2048, 68) and t.dtype == dtype and t.is_contiguous() and not t.any()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0 and "hg" in _vm_flags(t.data_ptr())
    t[-1, -1, -1, -1] = 1  # the last byte is the tensor's: writable to its end
    assert int(t.sum()) == 1
    small = huge_page_zeros((4, 5), dtype)
    assert small.shape == (4, 5) and not small.any() and "hg" not in _vm_flags(small.data_ptr())


def test_on_huge_pages_copies_dense_tensors_once_each() -> None:
    """Weights: values, shapes, dtypes and strides kept; a tied tensor stays one tensor; a
    transposed view and a tree under one huge page come back as they are; each copy 64-byte
    aligned in one advised buffer."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 600, generator=g)
    weights = {"embed": big, "lm_head": big, "layers": [{"q": torch.randn(64, 3, generator=g).to(torch.bfloat16),
                                                         "t": torch.randn(8, 16, generator=g).t()}],
               "packed": (torch.randint(0, 255, (5, 7), dtype=torch.uint8, generator=g), torch.ones(1, 9)[:, :4])}
    moved = on_huge_pages(weights)
    assert moved["embed"] is moved["lm_head"] and moved["embed"] is not big and torch.equal(moved["embed"], big)
    assert moved["embed"].stride() == big.stride() and "hg" in _vm_flags(moved["embed"].data_ptr())
    q = moved["layers"][0]["q"]
    assert q.dtype == torch.bfloat16 and torch.equal(q, weights["layers"][0]["q"]) and q.data_ptr() % 64 == 0
    assert moved["layers"][0]["t"] is weights["layers"][0]["t"]  # not dense row-major: as it was
    assert torch.equal(moved["packed"][0], weights["packed"][0]) and moved["packed"][1] is weights["packed"][1]
    tiny = {"a": torch.ones(3)}
    assert on_huge_pages(tiny)["a"] is tiny["a"]
