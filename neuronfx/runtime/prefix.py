"""Prefix caching over the step API: look a new request's prompt up, copy its cached blocks into
the request's slot, and after the prompt's prefill put its new full blocks in the cache. In the
blocks KV layout nothing is copied: a hit puts the cached KV blocks in the slot's block table
and a prefilled prompt's full blocks become cached as they are, by reference
(``blocks.share_cached`` / ``blocks.adopt``); a cached block no slot holds is evicted when
blocks run short (:func:`make_free`).

:func:`prefill_cached` is all of it as one step with :func:`neuronfx.prefill_step`'s signature
(the reference scheduler runs it instead of ``prefill_step`` when the plan caches prefixes).
Its parts, for a scheduler that interleaves chunks with decode steps: :func:`load_prefix` on
admission (a slot with a hit becomes live holding the hit tokens: cache_len = p, generated 0,
and ``chunk_step`` continues it from p; a miss leaves its slot free for an ordinary prefill from
0). Once a prompt is
wholly prefilled, :func:`store_prefix` inserts its full blocks (evicting least recently used
unused blocks to stay within the pool) and drops the references the lookup took. A request
aborted in between gives them back with :func:`drop_prefix`.

Each public function checks its input before it changes anything and consumes its input state
(the pool and the KV cache are updated in place), like the steps; the scheduler calls their
unchecked pipelines (:func:`load`, :func:`store`, :func:`drop`, :func:`prefill_reusing`,
:func:`cache_sequences`), its requests having been checked at submit.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.errors import InputError
from neuronfx.runtime import prefix_store
from neuronfx.runtime.blocks import adopt, blocks_needed, cache_only, free_count, share_cached, uncache
from neuronfx.runtime.checks import check_batch, check_kv_blocks, check_params, check_prompts, check_rows, check_slots
from neuronfx.runtime.chunked import ChunkBatch, chunk
from neuronfx.runtime.pipeline import StepOutput
from neuronfx.runtime.prefix_pool import copy_to_pool, copy_to_slot
from neuronfx.runtime.prefix_store import Match, PrefixStats
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.state import State, advance
from neuronfx.runtime.steps import PrefillBatch, prefill
from neuronfx.runtime.structured import check_constraints, pick


def check_prefix(runtime: Runtime, state: State) -> None:
    """Raise what ``check_state`` raises, and InputError when the state holds no prefix cache
    (the plan was compiled without ``enable_prefix_caching``)."""
    check_state(runtime, state)
    if state.prefix is None:
        raise InputError("this runtime does not cache prefixes; compile it with InferenceConfig(enable_prefix_caching=True, "
                         "prefill_chunk_size=C).")


def _check_rows(seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], matches: Sequence[Match] | None = None) -> None:
    for name, value in (("seq_ids", seq_ids), ("prompts", prompts), ("matches", matches)):
        if value is not None and not isinstance(value, (list, tuple)):
            raise InputError(f"{name}={value!r:.60} must be a list with one entry per slot.")
    if len(seq_ids) != len(prompts):
        raise InputError(f"give one prompt per slot: {len(seq_ids)} seq_ids, {len(prompts)} prompts.")
    if matches is not None and len(matches) != len(seq_ids):
        raise InputError(f"give one Match per slot: {len(seq_ids)} seq_ids, {len(matches)} matches.")


def _with_store(state: State, store: prefix_store.PrefixStore, **counts: tuple) -> State:
    """Revoke ``state``'s lease; the state with prefix store ``store`` (and any new host counts)."""
    counts = {"cache_lens": state.cache_lens, "generated": state.generated, "live": state.live} | counts
    return advance(state, rng_key=state.rng_key, prefix=attrs.evolve(state.prefix, store=store), **counts)


def load_prefix(runtime: Runtime, state: State, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                ) -> tuple[tuple[Match, ...], State]:
    """Look each prompt up and copy its cached leading blocks (at most ``len - 1`` tokens' worth)
    into its free slot ``seq_ids[r]``. A slot with a hit of p tokens becomes live with
    ``cache_len = p``, ``generated = 0``, its prompt mask the p tokens and its output counts
    zero; a miss leaves the slot free. Each Match holds references on its blocks until
    :func:`store_prefix` or :func:`drop_prefix`. Returns (matches, new state).

    Raises (before any change) InputError (no prefix cache, row counts differ), SlotError (slot
    out of range, duplicate or live), EmptyPromptError, PromptTooLongError, TokenOutOfVocabError,
    StateConsumedError / StateMismatchError."""
    check_prefix(runtime, state)
    _check_rows(seq_ids, prompts)
    check_slots(state, seq_ids, live=False)
    check_prompts(runtime, prompts)
    return load(runtime, state, seq_ids, prompts)


def load(runtime: Runtime, state: State, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]]) -> tuple[tuple[Match, ...], State]:
    """:func:`load_prefix` without its checks (free slots, valid prompts)."""
    blocks, matches = state.prefix.store, []
    for prompt in prompts:
        blocks, hit = prefix_store.match(blocks, prompt, runtime.prefix_key)
        matches.append(hit)
    cache_lens, live = list(state.cache_lens), list(state.live)
    hits = [(s, p, m) for s, p, m in zip(seq_ids, prompts, matches) if m.num_blocks]
    for s, _, m in hits:
        cache_lens[s], live[s] = m.num_tokens, True
    new = _with_store(state, blocks, cache_lens=tuple(cache_lens), live=tuple(live))
    for s, p, m in hits:  # after the lease is revoked: an interrupt leaves the old state consumed, never half-updated
        if new.blocks is None:
            copy_to_slot(new.kv, new.prefix.pool, s, m.blocks)
        else:  # the blocks layout: the cached KV blocks themselves, by reference
            share_cached(runtime.plan, new.blocks, s, m.blocks)
        new.prompt_mask[s] = False
        new.prompt_mask[s, torch.tensor(list(p[: m.num_tokens]), dtype=torch.long)] = True
        new.output_counts[s] = 0
    return tuple(matches), new


def store_prefix(runtime: Runtime, state: State, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                 matches: Sequence[Match]) -> State:
    """After ``prompts`` were prefilled into live slots ``seq_ids`` (their cache holds at least
    the prompt), cache their full blocks (new ones are copied from the slot into the pool,
    evicting least recently used unused blocks when it is full) and drop the references of
    ``matches`` (what :func:`load_prefix` returned for them). Returns the new state.

    Raises (before any change) InputError (no prefix cache, counts differ, a slot holding fewer
    tokens than its prompt, a match that is not this prompt's), SlotError (slot out of range,
    duplicate or free), StateConsumedError / StateMismatchError."""
    check_prefix(runtime, state)
    _check_rows(seq_ids, prompts, matches)
    check_slots(state, seq_ids, live=True)
    b = state.prefix.store.block_size
    for s, p, m in zip(seq_ids, prompts, matches):
        if state.cache_lens[s] < len(p):
            raise InputError(f"slot {s} holds {state.cache_lens[s]} tokens < its prompt's {len(p)}; store a prompt "
                             "once it is prefilled.")
        if not isinstance(m, Match) or m.hashes != prefix_store.block_hashes(p, b, runtime.prefix_key):
            raise InputError(f"slot {s}: pass the Match load_prefix returned for this prompt on this runtime.")
    return store(runtime, state, seq_ids, prompts, matches)


def store(runtime: Runtime, state: State, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], matches: Sequence[Match]) -> State:
    """:func:`store_prefix` without its checks (live slots holding their prompts, their matches)."""
    blocks = state.prefix.store
    for m in matches:
        blocks = prefix_store.release(blocks, m.hashes[: m.num_blocks])
    placed = []
    for p, m in zip(prompts, matches):
        blocks, placements = prefix_store.insert(blocks, p, m.hashes, runtime.prefix_key)
        placed.append(placements)
    new = _with_store(state, blocks)
    for s, placements in zip(seq_ids, placed):
        if new.blocks is None:
            copy_to_pool(new.kv, new.prefix.pool, s, placements)
        else:
            adopt(runtime.plan, new.blocks, s, placements)
    return new


def reclaimable(runtime: Runtime, state: State) -> int:
    """KV blocks :func:`make_free` could free: cached blocks no request uses and no slot holds."""
    plan, blocks = runtime.plan, state.blocks
    if state.prefix is None or blocks is None:
        return 0
    return sum(1 for e in state.prefix.store.entries.values() if e.refs == 0 and cache_only(plan, blocks, e.block))


def make_free(runtime: Runtime, state: State, want: int) -> State:
    """The blocks KV layout: evict unused cached blocks that only the prefix cache holds, least
    recently used first, until ``want`` KV blocks are free or none is left to evict. The state
    unchanged (not consumed) when nothing needs evicting; else ``state`` is consumed."""
    plan, blocks = runtime.plan, state.blocks
    missing = want - free_count(plan, blocks)
    if state.prefix is None or blocks is None or missing <= 0:
        return state
    store, evicted = prefix_store.evict(state.prefix.store, missing, lambda e: cache_only(plan, blocks, e.block))
    if not evicted:
        return state
    new = _with_store(state, store)
    uncache(plan, new.blocks, evicted)
    return new


def drop_prefix(runtime: Runtime, state: State, matches: Sequence[Match]) -> State:
    """Drop the references of ``matches`` without caching anything (a request aborted before
    its prompt was prefilled). Raises InputError (no prefix cache, a reference not held)."""
    check_prefix(runtime, state)
    return drop(state, matches)


def drop(state: State, matches: Sequence[Match]) -> State:
    """:func:`drop_prefix` without its checks (raises InputError for a reference not held)."""
    blocks = state.prefix.store
    for m in matches:
        blocks = prefix_store.release(blocks, m.hashes[: m.num_blocks])
    return _with_store(state, blocks)


def prefix_stats(state: State) -> PrefixStats | None:
    """The prefix cache's counters (tokens queried and hit, blocks evicted and inserted), or
    None when the state has no prefix cache."""
    return None if state.prefix is None else state.prefix.store.stats


def prefill_cached(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """:func:`neuronfx.prefill_step` reusing cached prefixes: prefill ``batch.prompts`` into free
    slots ``batch.seq_ids`` and return each row's first token.

    Each prompt is looked up (:func:`load_prefix`); rows with a hit, and prompts longer than the
    largest prefill bucket, are prefilled from their offset by ``chunk_step`` in chunks of at most
    ``prefill_chunk_size`` tokens (all such rows together, one chunk each per step); the other rows
    by one ``prefill_step``, as without prefix caching. Then every prompt's full blocks are cached
    (:func:`store_prefix`), except a row whose logits were NaN/inf. The output's rows are the
    batch's; ``bucket`` and ``batch_size`` are those of the last graph run. Prompts may be as
    long as ``max_context_length``.

    Raises (before any change) what :func:`prefill_step` raises (InputError, BatchTooLargeError,
    SlotError, EmptyPromptError, PromptTooLongError, TokenOutOfVocabError, SamplingParamsError,
    StateConsumedError / StateMismatchError), InputError when the runtime caches no prefixes, and
    KVCacheFullError (the blocks KV layout) when the prompts need more blocks than are free
    after evicting cached ones no request holds.
    """
    check_prefix(runtime, state)
    check_batch(batch, PrefillBatch)
    check_rows(runtime, batch.seq_ids, batch.prompts, "prefill")
    check_rows(runtime, batch.seq_ids, batch.sampling, "prefill")
    check_slots(state, batch.seq_ids, live=False)
    check_prompts(runtime, batch.prompts)
    check_params(runtime, batch.sampling)
    check_constraints(batch.constraints, batch.sampling)
    if state.blocks is not None:  # the blocks layout: cached blocks no request holds make room first
        starts, ends = [0] * len(batch.prompts), [len(p) for p in batch.prompts]
        want = blocks_needed(runtime.plan, state.blocks, batch.seq_ids, starts, ends)
        if want > free_count(runtime.plan, state.blocks) + reclaimable(runtime, state):
            check_kv_blocks(runtime, state, batch.seq_ids, starts, ends)  # raises before anything changes
        state = make_free(runtime, state, want)
    return prefill_reusing(runtime, state, batch)


def prefill_reusing(runtime: Runtime, state: State, batch: PrefillBatch) -> tuple[StepOutput, State]:
    """:func:`prefill_cached` without its checks (``batch`` must be valid for ``state``)."""
    slots, prompts, n = batch.seq_ids, batch.prompts, len(batch.seq_ids)
    matches, state = load(runtime, state, slots, prompts)
    whole = [r for r in range(n) if not matches[r].num_blocks and len(prompts[r]) <= runtime.plan.prefill_buckets[-1]]
    rows: dict[int, tuple] = {}  # row -> (token, logits, logprobs, finite)
    last = None
    if whole:
        sub = PrefillBatch(seq_ids=[slots[r] for r in whole], prompts=[prompts[r] for r in whole],
                           sampling=[batch.sampling[r] for r in whole], constraints=pick(batch.constraints, whole))
        last, state = prefill(runtime, state, sub)
        rows |= {r: _row(last, i) for i, r in enumerate(whole)}
    rest = [r for r in range(n) if r not in rows]
    if rest:
        last, state = _chunk_rest(runtime, state, batch, rest, [matches[r].num_tokens for r in rest], rows)
    ordered = [rows[r] for r in range(n)]
    ok = [r for r in range(n) if ordered[r][3]]  # a row whose logits were NaN/inf caches nothing
    state = store(runtime, state, [slots[r] for r in ok], [prompts[r] for r in ok], [matches[r] for r in ok])
    if len(ok) < n:
        state = drop(state, [matches[r] for r in range(n) if r not in ok])
    logits = None if last.logits is None else torch.stack([row[1] for row in ordered])
    return StepOutput(tokens=tuple(row[0] for row in ordered), new_tokens=tuple((row[0],) for row in ordered), logits=logits,
                      logprobs=tuple(row[2] for row in ordered), bucket=last.bucket, batch_size=last.batch_size,
                      finite=tuple(row[3] for row in ordered), num_drafted=(0,) * n), state


def _chunk_rest(runtime: Runtime, state: State, batch: PrefillBatch, rest: list[int], done: list[int], rows: dict[int, tuple],
                ) -> tuple[StepOutput, State]:
    """Prefill rows ``rest`` of ``batch`` by chunks from ``done[i]`` tokens (their hits), all
    together, one chunk each per step; each row's last chunk's output goes to ``rows``. Returns
    the last step's output and the state."""
    size, prompts = runtime.plan.inference.prefill_chunk_size, batch.prompts
    todo = list(zip(rest, done))
    while todo:
        chunks = [prompts[r][d:d + size] for r, d in todo]
        final = [d + len(c) == len(prompts[r]) for (r, d), c in zip(todo, chunks)]
        cb = ChunkBatch(seq_ids=[batch.seq_ids[r] for r, _ in todo], chunks=chunks, sampling=[batch.sampling[r] for r, _ in todo],
                        final=final, prompt_lens=[len(prompts[r]) for r, _ in todo],
                        constraints=pick(batch.constraints, [r for r, _ in todo]))
        last, state = chunk(runtime, state, cb)
        rows |= {r: _row(last, i) for i, (r, _) in enumerate(todo) if final[i]}
        todo = [(r, d + len(c)) for (r, d), c, f in zip(todo, chunks, final) if not f]
    return last, state


def _row(out: StepOutput, i: int) -> tuple:
    """(token, logits [vocab] or None, logprobs, finite) of row ``i`` of ``out``."""
    return (out.tokens[i], None if out.logits is None else out.logits[i], out.logprobs[i], out.finite[i])


def outputs_reusable(runtime: Runtime) -> bool:
    """Whether a finished request's generated tokens may be cached too (:func:`cache_sequences`):
    prefix caching is on and the model's RoPE does not depend on the sequence length (dynamic
    NTK and longrope rotate by it: decoded keys past their threshold are not what a prefill of
    the same tokens would compute)."""
    rs = runtime.plan.model.rope_scaling
    return runtime.plan.inference.enable_prefix_caching and (rs is None or rs.rope_type not in ("dynamic", "longrope"))


def cache_sequences(runtime: Runtime, state: State, seq_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> State:
    """Cache the full blocks of each live slot's ``sequences[r]`` (the tokens its cache holds, in
    order: prompt, then generated ones), e.g. when its request finishes, so that the next turn of
    a conversation (this prompt, this answer, a new message) reuses the answer's KV too, as vLLM
    caches decoded blocks. Unchecked (the scheduler's retire): live slots holding at least their
    sequences, on a state with a prefix cache."""
    b = state.prefix.store.block_size
    matches = [Match(hashes=prefix_store.block_hashes(seq, b, runtime.prefix_key), blocks=(), block_size=b) for seq in sequences]
    return store(runtime, state, seq_ids, sequences, matches)
