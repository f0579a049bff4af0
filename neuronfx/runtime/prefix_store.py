"""The prefix cache's bookkeeping as a value: which full prompt blocks are cached, in which block
of the pool, in use by whom, and in what order they are evicted. Pure: no tensors, no I/O.

A prompt is cut into full blocks of ``block_size`` tokens (a partial last block is never
cached). Block j is identified by a chained hash (:func:`block_hashes`), after vLLM's
``hash_block_tokens`` (``vllm/v1/core/kv_cache_utils.py``): hash of (parent block's hash, the
block's token ids, extra keys), where the first block's parent is a root hash of the runtime's
identity (``extra_key``: the plan and the weights, see ``runtime/prefix.py``), so a block is
reused only by a prompt with the same tokens before it, on the same weights and the same plan.
sha256 as vLLM's ``--prefix-caching-hash-algo sha256`` (Python's ``hash`` of an int tuple has
collisions anyone can construct); on top of it every entry keeps its parent hash and its tokens,
and a lookup compares them, so a hit is exact even if sha256 ever collided.

Eviction is LRU over entries no request uses (``refs == 0``), vLLM's free-block queue: a
chain is touched tail first, so within a prefix the longest tail is evicted first and a parent
is never older than its children (no unreachable children left behind).

The store is immutable: every function returns a new store (like ``scheduler.Queue``); the
caller copies KV blocks as the returned placements say (``runtime/prefix.py``).
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable, Mapping, Sequence

import attrs

from neuronfx.errors import InputError

Hash = bytes  # a 32-byte sha256 digest


def root_hash(extra_key: bytes) -> Hash:
    """The parent hash of a prompt's first block: sha256 of ``extra_key`` (the runtime's identity)."""
    return hashlib.sha256(b"neuronfx-prefix-root\0" + extra_key).digest()


def hash_block(parent: Hash, tokens: Sequence[int]) -> Hash:
    """sha256 of (parent hash, the block's token ids as little-endian int64): vLLM's
    ``hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys)``, with
    the extra keys folded into the root (:func:`root_hash`) so every block of a chain carries them."""
    h = hashlib.sha256(parent)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


def block_hashes(tokens: Sequence[int], block_size: int, extra_key: bytes) -> tuple[Hash, ...]:
    """[len(tokens) // block_size] chained hashes of the full blocks of ``tokens``."""
    out, parent = [], root_hash(extra_key)
    for j in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[j * block_size:(j + 1) * block_size])
        out.append(parent)
    return tuple(out)


@attrs.frozen(kw_only=True)
class Entry:
    """One cached block."""

    block: int  # index of the pool block holding its K/V
    parent: Hash  # hash of the block before it (the root hash for a first block)
    tokens: tuple[int, ...]  # [block_size] its token ids
    refs: int  # requests using it now; evictable only at 0
    last_use: int  # store clock at its last touch (LRU)


@attrs.frozen(kw_only=True)
class PrefixStats:
    """Counters since the store was made. ``queries`` and ``hits`` count prompt TOKENS (vLLM's
    ``prefix_cache_queries`` / ``prefix_cache_hits``): every looked-up prompt's length, and the
    tokens of it served from the cache; ``misses = queries - hits``. ``evictions`` and
    ``inserted`` count BLOCKS."""

    lookups: int = 0  # prompts looked up
    queries: int = 0  # tokens of those prompts
    hits: int = 0  # tokens served from the cache (whole blocks)
    evictions: int = 0  # blocks evicted to make room
    inserted: int = 0  # blocks stored

    @property
    def misses(self) -> int:
        """Queried tokens not served from the cache (prefilled)."""
        return self.queries - self.hits


@attrs.frozen(kw_only=True)
class Match:
    """What a lookup found for one prompt: ``hashes`` of all its full blocks, the first
    ``num_blocks`` of them cached in pool blocks ``blocks``."""

    hashes: tuple[Hash, ...]  # [len(prompt) // block_size]
    blocks: tuple[int, ...]  # [num_blocks] pool block of each hit block, in prompt order
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_tokens(self) -> int:
        """Prompt tokens served from the cache: the slot continues from this offset."""
        return len(self.blocks) * self.block_size


def _frozen(d: dict) -> Mapping:
    return types.MappingProxyType(d)


@attrs.frozen(kw_only=True)
class PrefixStore:
    """The cache's metadata: ``entries`` by block hash, pool blocks holding nothing (``free``),
    a logical clock for LRU, and counters. ``num_blocks`` is the memory bound (pool blocks)."""

    block_size: int
    num_blocks: int
    entries: Mapping[Hash, Entry] = attrs.field(factory=lambda: _frozen({}))
    free: tuple[int, ...] = ()
    clock: int = 0
    stats: PrefixStats = PrefixStats()

    @property
    def num_cached(self) -> int:
        """Blocks cached (in use or not)."""
        return len(self.entries)


def empty_store(block_size: int, num_blocks: int) -> PrefixStore:
    """A store of ``num_blocks`` pool blocks of ``block_size`` tokens, all free. Raises
    InputError for a size that is not a positive int."""
    for name, v in (("block_size", block_size), ("num_blocks", num_blocks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name}={v!r} must be an int >= 1.")
    return PrefixStore(block_size=block_size, num_blocks=num_blocks, free=tuple(range(num_blocks)))


def _touch(entries: dict[Hash, Entry], chain: Sequence[Hash], clock: int, refs: int = 0) -> int:
    """Mark ``chain``'s entries used now, tail first (so a parent is never older than its
    children: vLLM frees a request's blocks in reverse order for the same reason), adding
    ``refs`` to each; returns the new clock."""
    for h in reversed(chain):
        e = entries[h]
        clock += 1
        entries[h] = attrs.evolve(e, last_use=clock, refs=e.refs + refs)
    return clock


def longest_hit(store: PrefixStore, prompt: Sequence[int], hashes: Sequence[Hash], extra_key: bytes) -> int:
    """Cached leading blocks of ``prompt`` (``hashes`` its block hashes), at most
    ``(len(prompt) - 1) // block_size``: at least one prompt token is always left to prefill, so
    that the prefill samples the first token. Each hit is verified on (parent, tokens)."""
    b, parent, n = store.block_size, root_hash(extra_key), 0
    limit = min(len(hashes), (len(prompt) - 1) // b)
    while n < limit:
        e = store.entries.get(hashes[n])
        if e is None or e.parent != parent or e.tokens != tuple(prompt[n * b:(n + 1) * b]):
            break
        parent, n = hashes[n], n + 1
    return n


def match(store: PrefixStore, prompt: Sequence[int], extra_key: bytes) -> tuple[PrefixStore, Match]:
    """Look ``prompt`` up and take a reference on its hit blocks (they stay cached until
    :func:`release`); counts the lookup in ``stats``. Returns (new store, Match)."""
    hashes = block_hashes(prompt, store.block_size, extra_key)
    n = longest_hit(store, prompt, hashes, extra_key)
    entries = dict(store.entries)
    clock = _touch(entries, hashes[:n], store.clock, refs=1)
    s = store.stats
    stats = attrs.evolve(s, lookups=s.lookups + 1, queries=s.queries + len(prompt), hits=s.hits + n * store.block_size)
    hit = Match(hashes=hashes, blocks=tuple(entries[h].block for h in hashes[:n]), block_size=store.block_size)
    return attrs.evolve(store, entries=_frozen(entries), clock=clock, stats=stats), hit


def release(store: PrefixStore, hashes: Sequence[Hash]) -> PrefixStore:
    """Drop one reference on each of ``hashes`` (the hit blocks of a :func:`match`). Raises
    InputError for a hash that is not cached or not referenced."""
    entries = dict(store.entries)
    for h in hashes:
        e = entries.get(h)
        if e is None or e.refs < 1:
            raise InputError(f"prefix block {h.hex()[:12]} is not held by a request; release only what match returned.")
        entries[h] = attrs.evolve(e, refs=e.refs - 1)
    return attrs.evolve(store, entries=_frozen(entries))


def _eviction_order(entries: Mapping[Hash, Entry], keep: set[Hash]) -> list[Hash]:
    """Entries nobody uses and not in ``keep``, most recently used first (pop() takes the least)."""
    return [h for _, h in sorted(((e.last_use, h) for h, e in entries.items() if e.refs == 0 and h not in keep), reverse=True)]


def insert(store: PrefixStore, prompt: Sequence[int], hashes: Sequence[Hash], extra_key: bytes,
           ) -> tuple[PrefixStore, tuple[tuple[int, int], ...]]:
    """Cache the full blocks of ``prompt`` (``hashes``: its :func:`block_hashes`) after its
    prefill. Blocks already cached are touched; each new one takes a free pool block, else the
    least recently used unused block is evicted (never one of this prompt's). Stops at the first
    block that finds no room (its children would be unreachable). Returns (new store, placements
    ``(j, pool block)``): copy the slot's tokens ``[j * block_size, (j + 1) * block_size)`` into
    that pool block."""
    b = store.block_size
    entries, free, stats = dict(store.entries), list(store.free), store.stats
    parent, stored, placed, victims = root_hash(extra_key), [], [], None
    for j, h in enumerate(hashes):
        tokens = tuple(prompt[j * b:(j + 1) * b])
        e = entries.get(h)
        if e is not None and (e.parent != parent or e.tokens != tokens):
            break  # a sha256 collision: keep the cached block, cache nothing past it
        if e is None:
            if not free:
                if victims is None:  # sorted once per insert: evicting changes no other entry's last use
                    victims = _eviction_order(entries, set(hashes))
                if not victims:
                    break
                free.append(entries.pop(victims.pop()).block)
                stats = attrs.evolve(stats, evictions=stats.evictions + 1)
            block = free.pop(0)
            entries[h] = Entry(block=block, parent=parent, tokens=tokens, refs=0, last_use=0)
            stats = attrs.evolve(stats, inserted=stats.inserted + 1)
            placed.append((j, block))
        stored.append(h)
        parent = h
    clock = _touch(entries, stored, store.clock)
    new = attrs.evolve(store, entries=_frozen(entries), free=tuple(sorted(free)), clock=clock, stats=stats)
    return new, tuple(placed)


def evict(store: PrefixStore, count: int, frees: Callable[[Entry], bool]) -> tuple[PrefixStore, tuple[int, ...]]:
    """Evict up to ``count`` unused entries (no request holds a reference) for which
    ``frees(entry)`` (the blocks KV layout: only the cache holds its KV block), least recently
    used first; returns (new store, the evicted entries' pool blocks, now free)."""
    entries, free, stats, out = dict(store.entries), list(store.free), store.stats, []
    order = [h for h in _eviction_order(entries, set()) if frees(entries[h])]
    while order and len(out) < count:
        out.append(entries.pop(order.pop()).block)
    free += out
    stats = attrs.evolve(stats, evictions=stats.evictions + len(out))
    return attrs.evolve(store, entries=_frozen(entries), free=tuple(sorted(free)), stats=stats), tuple(out)
