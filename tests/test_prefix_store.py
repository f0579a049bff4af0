"""The prefix cache's pure bookkeeping (``runtime/prefix_store.py``) against a naive model (a dict
and a list in LRU order), the chained hash against a from-scratch reference, and the pool copies
(``runtime/prefix_pool.py``) against element-by-element loops."""

from __future__ import annotations

import hashlib
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronfx.errors import InputError
from neuronfx.graphs.phases.inputs import LayerKV
from neuronfx.runtime import prefix_store as ps
from neuronfx.runtime.prefix_pool import copy_to_pool, copy_to_slot

KEY = b"plan-and-weights"


def naive_hashes(tokens: list[int], b: int, key: bytes) -> list[bytes]:
    """vLLM's chain written out: h_0 = H(root, block 0), h_j = H(h_{j-1}, block j)."""
    parent = hashlib.sha256(b"neuronfx-prefix-root\0" + key).digest()
    out = []
    for j in range(len(tokens) // b):
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[j * b:(j + 1) * b])).digest()
        out.append(parent)
    return out


class Naive:
    """The store's rules, spelled naively: ``lru`` lists cached hashes least recent first."""

    def __init__(self, b: int, n: int):
        self.b, self.free = b, set(range(n))
        self.entries: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # hash -> (block, tokens)
        self.refs: dict[bytes, int] = {}
        self.lru: list[bytes] = []
        self.queries = self.hits = self.evictions = 0

    def touch(self, chain: list[bytes]) -> None:
        for h in reversed(chain):
            self.lru.remove(h)
            self.lru.append(h)

    def match(self, prompt: list[int]) -> tuple[list[bytes], int]:
        hashes = naive_hashes(prompt, self.b, KEY)
        n = 0
        while n < min(len(hashes), (len(prompt) - 1) // self.b) and hashes[n] in self.entries:
            n += 1
        for h in hashes[:n]:
            self.refs[h] += 1
        self.touch(hashes[:n])
        self.queries += len(prompt)
        self.hits += n * self.b
        return hashes, n

    def release(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.refs[h] -= 1

    def insert(self, prompt: list[int]) -> list[tuple[int, int]]:
        hashes, placed, stored = naive_hashes(prompt, self.b, KEY), [], []
        for j, h in enumerate(hashes):
            if h not in self.entries:
                if not self.free:
                    victims = [v for v in self.lru if self.refs[v] == 0 and v not in hashes]
                    if not victims:
                        break
                    self.free.add(self.entries.pop(victims[0])[0])
                    self.lru.remove(victims[0])
                    del self.refs[victims[0]]
                    self.evictions += 1
                block = min(self.free)
                self.free.remove(block)
                self.entries[h], self.refs[h] = (block, tuple(prompt[j * self.b:(j + 1) * self.b])), 0
                self.lru.insert(0, h)
                placed.append((j, block))
            stored.append(h)
        self.touch(stored)
        return placed


def test_hash_chain_matches_reference_and_depends_on_everything_before() -> None:
    tokens = list(range(40))
    assert list(ps.block_hashes(tokens, 8, KEY)) == naive_hashes(tokens, 8, KEY)
    assert len(ps.block_hashes(tokens, 8, KEY)) == 5 and ps.block_hashes(tokens[:39], 8, KEY) == ps.block_hashes(tokens, 8, KEY)[:4]
    other = ps.block_hashes([99] + tokens[1:], 8, KEY)  # first token differs: every block's hash differs
    assert all(a != b for a, b in zip(other, ps.block_hashes(tokens, 8, KEY)))
    assert ps.block_hashes(tokens, 8, b"other weights")[0] != ps.block_hashes(tokens, 8, KEY)[0]


def test_match_leaves_one_token_to_prefill_and_skips_partial_blocks() -> None:
    store = ps.empty_store(4, 8)
    prompt = list(range(12))
    store, _ = ps.insert(store, prompt, ps.block_hashes(prompt, 4, KEY), KEY)
    assert store.num_cached == 3
    for length, hit in ((12, 8), (13, 12), (11, 8), (9, 8), (8, 4), (5, 4), (4, 0), (1, 0)):
        _, m = ps.match(store, (prompt + [50])[:length], KEY)
        assert m.num_tokens == hit, length
    _, m = ps.match(store, prompt + [50], b"another plan")
    assert m.num_tokens == 0


def test_hit_is_verified_against_the_cached_tokens() -> None:
    """A forged entry under the right hash but other tokens (a stand-in for a sha256 collision)
    is not a hit."""
    store = ps.empty_store(4, 8)
    prompt = list(range(9))
    hashes = ps.block_hashes(prompt, 4, KEY)
    store, _ = ps.insert(store, prompt, hashes, KEY)
    forged = dict(store.entries)
    forged[hashes[1]] = ps.Entry(block=1, parent=hashes[0], tokens=(7, 7, 7, 7), refs=0, last_use=0)
    store = ps.PrefixStore(block_size=4, num_blocks=8, entries=types.MappingProxyType(forged), free=store.free, clock=store.clock)
    _, m = ps.match(store, prompt, KEY)
    assert m.num_blocks == 1


def test_release_of_a_block_not_held_raises() -> None:
    store = ps.empty_store(4, 2)
    prompt = list(range(9))
    store, _ = ps.insert(store, prompt, ps.block_hashes(prompt, 4, KEY), KEY)
    store, m = ps.match(store, prompt, KEY)
    store = ps.release(store, m.hashes[: m.num_blocks])
    with pytest.raises(InputError, match="not held"):
        ps.release(store, m.hashes[:1])
    with pytest.raises(InputError, match="num_blocks=0"):
        ps.empty_store(4, 0)


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # a tiny alphabet: prefixes are shared often
ops = st.lists(st.tuples(st.sampled_from(["match", "insert", "release"]), prompts), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops=ops, b=st.sampled_from([1, 2, 3]), n=st.integers(1, 6))
def test_store_equals_naive_model(ops: list, b: int, n: int) -> None:
    """Random lookups, inserts and releases: the same hits, entries, blocks and counters as the
    naive model, and a simulated pool in which every hit block holds the prompt's tokens."""
    store, naive = ps.empty_store(b, n), Naive(b, n)
    pool: dict[int, tuple[int, ...]] = {}  # pool block -> tokens written to it (what copy_to_pool would copy)
    held: list[ps.Match] = []
    for op, prompt in ops:
        if op == "match":
            store, m = ps.match(store, prompt, KEY)
            hashes, hit = naive.match(prompt)
            assert list(m.hashes) == hashes and m.num_blocks == hit
            for j, blk in enumerate(m.blocks):
                assert pool[blk] == tuple(prompt[j * b:(j + 1) * b])
            held.append(m)
        elif op == "release" and held:
            m = held.pop(0)
            store = ps.release(store, m.hashes[: m.num_blocks])
            naive.release(list(m.hashes[: m.num_blocks]))
        elif op == "insert":
            store, placed = ps.insert(store, prompt, ps.block_hashes(prompt, b, KEY), KEY)
            assert list(placed) == naive.insert(prompt)
            for j, blk in placed:
                pool[blk] = tuple(prompt[j * b:(j + 1) * b])
        assert {h: (e.block, e.tokens) for h, e in store.entries.items()} == naive.entries
        assert {h: e.refs for h, e in store.entries.items()} == naive.refs
        assert set(store.free) == naive.free and len(store.free) + store.num_cached == n
        s = store.stats
        assert (s.queries, s.hits, s.evictions, s.misses) == (naive.queries, naive.hits, naive.evictions, naive.queries - naive.hits)


def test_copies_equal_elementwise_loops() -> None:
    g = torch.Generator().manual_seed(0)
    slots, heads, seq, d, b, nblk = 3, 2, 12, 4, 3, 5
    kv = tuple(LayerKV(torch.randn(slots, heads, seq, d, generator=g), torch.randn(slots, heads, seq, d, generator=g)) for _ in range(2))
    pool = tuple(LayerKV(torch.randn(nblk, heads, b, d, generator=g), torch.randn(nblk, heads, b, d, generator=g)) for _ in range(2))
    for placements in ([(0, 4), (2, 1), (3, 0)], [(1, 2), (2, 3)]):  # a gather, then contiguous blocks (a slice)
        want_pool = [[t.clone() for t in layer] for layer in pool]
        for layer, want in zip(kv, want_pool):
            for src, dst in zip(layer, want):
                for j, blk in placements:
                    for i in range(b):
                        dst[blk, :, i] = src[1, :, j * b + i]
        copy_to_pool(kv, pool, 1, placements)
        assert all(torch.equal(t, w) for layer, want in zip(pool, want_pool) for t, w in zip(layer, want))

    want_kv = [[t.clone() for t in layer] for layer in kv]
    blocks = [0, 4, 1]
    for layer, want in zip(pool, want_kv):
        for src, dst in zip(layer, want):
            for j, blk in enumerate(blocks):
                for i in range(b):
                    dst[2, :, j * b + i] = src[blk, :, i]
    copy_to_slot(kv, pool, 2, blocks)
    assert all(torch.equal(t, w) for layer, want in zip(kv, want_kv) for t, w in zip(layer, want))
