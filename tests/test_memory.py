"""The heap around decoding (``neuronfx.memory``): ``frozen_heap`` freezes what is alive for its
block, nests, and lets go after it; the benchmarks' alternating rounds run inside it."""

from __future__ import annotations

import gc
import threading
import weakref

import neuronfx
from neuronfx.bench.rounds import alternate


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
