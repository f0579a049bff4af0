"""Recompute preemption for the blocks KV layout (vLLM's ``PreemptionMode.RECOMPUTE``): when the
running requests need more KV blocks than are free, the scheduler takes the newest request's
blocks (:func:`evict`) and later rebuilds its cache from its tokens (:func:`recompute`) before
it decodes on.

An evicted request keeps its slot, its sampling state (tokens generated, output counts, prompt
mask, so penalties and seeded draws go on as if nothing happened) and its matcher; only its KV
blocks go back to the free list and its cache_len becomes 0. :func:`recompute` runs its prompt
and the tokens it generated but the last through the prefill graph (or the chunk graphs when
the sequence is longer than the largest prefill bucket), discarding what they sample, so the
row's next decode step feeds its last token exactly as before: greedy and seeded requests give
the same tokens as an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from neuronfx.config.kv_blocks import admissible, blocks_covering, request_blocks
from neuronfx.config.sampling import SamplingParams
from neuronfx.runtime.batch import sampler_inputs
from neuronfx.runtime.blocks import free_count, owned, release
from neuronfx.runtime.pipeline import plan_rows, run_rows
from neuronfx.runtime.prefix import make_free
from neuronfx.runtime.requests import Progress, Queue, Request
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.state import State, advance, with_draft_state

GREEDY = SamplingParams()


def recomputable(runtime: Runtime) -> bool:
    """Whether any sequence a slot can hold can be recomputed: the plan has chunk graphs
    (``prefill_chunk_size``), or its largest prefill bucket holds ``sequence_length`` tokens."""
    plan = runtime.plan
    return plan.inference.prefill_chunk_size is not None or plan.inference.sequence_length <= plan.prefill_buckets[-1]


def evict(runtime: Runtime, state: State, slots: Sequence[int]) -> State:
    """``slots`` give their KV blocks back (the draft runtime's too) and hold 0 cached tokens;
    they stay live with their sampling state. ``state`` is consumed."""
    draft = evict(runtime.draft, state.draft, slots) if runtime.draft is not None else None
    release(runtime.plan, state.blocks, slots)
    lens = list(state.cache_lens)
    for s in slots:
        lens[s] = 0
    return advance(state, cache_lens=tuple(lens), generated=state.generated, live=state.live, rng_key=state.rng_key, draft=draft)


def recompute(runtime: Runtime, state: State, slots: Sequence[int], sequences: Sequence[Sequence[int]]) -> State:
    """Rebuild the KV cache of evicted ``slots``: positions [0, len(sequences[b])) from
    ``sequences[b]`` (each >= 1 token), in one prefill call when every sequence fits the largest
    prefill bucket, else chunk by chunk; what the graphs sample is discarded. The slots then
    hold their sequences (the draft runtime's cache too). ``state`` is consumed."""
    draft = recompute(runtime.draft, state.draft, slots, sequences) if runtime.draft is not None else None
    plan = runtime.plan
    if max(len(s) for s in sequences) <= plan.prefill_buckets[-1]:
        _run(runtime, state, plan_rows(runtime, "prefill", plan.prefill_buckets, slots, sequences, (0,) * len(slots)))
    else:
        size = plan.inference.prefill_chunk_size
        for start in range(0, max(len(s) for s in sequences), size):
            rows = [(s, seq) for s, seq in zip(slots, sequences) if start < len(seq)]
            _run(runtime, state, plan_rows(runtime, "chunk", plan.chunk_buckets, [s for s, _ in rows],
                                           [seq[start:start + size] for _, seq in rows], [start] * len(rows), width=size,
                                           seq_lens=[len(seq) for _, seq in rows]))
    lens = list(state.cache_lens)
    for s, seq in zip(slots, sequences):
        lens[s] = len(seq)
    new = advance(state, cache_lens=tuple(lens), generated=state.generated, live=state.live, rng_key=state.rng_key)
    return new if draft is None else with_draft_state(new, draft)


def _run(runtime: Runtime, state: State, rows: object) -> None:
    """Run ``rows``' graph for its cache writes, greedy, its outputs dropped."""
    n, vocab = len(rows.slots), runtime.plan.model.vocab_size
    zeros = torch.zeros(n, vocab)
    run_rows(runtime, state, rows, sampler_inputs(runtime, [GREEDY] * n, zeros.int(), zeros.bool(), zeros, torch.zeros(n), rows.bsz))


# --- the scheduler's policy ------------------------------------------------------------------------


def cached_tokens(run: Progress) -> list[int]:
    """The tokens an evicted request's cache held: its prompt and every token but the last (which
    its next decode step feeds)."""
    return list(run.request.prompt) + list(run.tokens[:-1])


def _step_need(runtime: Runtime, state: State, queue: Queue, tokens: int) -> int:
    """Fresh blocks the running requests' next step may take (``tokens`` positions each: k when
    they may speculate, else 1) and the chunked prompt's next chunk."""
    plan, inf = runtime.plan, runtime.plan.inference
    bs, blocks = plan.kv.block_size, state.blocks

    def need(slot: int, end: int) -> int:
        return max(0, blocks_covering(min(end, inf.sequence_length), bs) - owned(plan, blocks, slot))

    chunks = [need(r.slot, min(r.computed + inf.prefill_chunk_size, len(r.request.prompt))) for r in queue.prefilling]
    return sum(need(r.slot, state.cache_lens[r.slot] + tokens) for r in queue.running) + sum(chunks)


def step_tokens(runtime: Runtime, speculative: bool) -> int:
    """Positions a running request may write in one step: k when it may speculate, else 1."""
    return runtime.plan.inference.speculation_length if speculative and runtime.can_speculate else 1


def make_room(runtime: Runtime, state: State, queue: Queue, speculative: bool) -> tuple[State, Queue, tuple[Progress, ...]]:
    """The blocks layout's turn at the start of a scheduler iteration, when every sequence can
    be recomputed (:func:`recomputable`): while the running requests' next step needs more
    blocks than are free, evict the newest (the largest (priority, index)) into
    ``queue.preempted`` (reclaiming cached blocks its eviction left to the prefix cache alone
    before evicting another); when none was evicted, resume preempted requests, oldest first,
    while their recomputed caches and their next step (k tokens when they may speculate) fit. Cached prefix blocks no request holds are
    evicted first, for the running requests and for the next request to resume or be admitted
    (``prefix.make_free``). Returns (state, queue, the resumed requests:
    running again, to be recomputed by this iteration before they decode). Nothing happens in
    the slots layout or without recompute."""
    if state.blocks is None or not recomputable(runtime):
        return state, queue, ()
    plan, tokens, evicted = runtime.plan, step_tokens(runtime, speculative), []
    state = make_free(runtime, state, _step_need(runtime, state, queue, tokens))  # cached blocks go before requests
    while queue.running and _step_need(runtime, state, queue, tokens) > free_count(plan, state.blocks):
        victim = max(queue.running, key=lambda r: (r.request.priority, r.index))
        state = evict(runtime, state, [victim.slot])
        queue = attrs.evolve(queue, running=tuple(r for r in queue.running if r is not victim))
        evicted.append(victim)
        # its prompt's blocks may now be held by the prefix cache alone: reclaim those before evicting more
        state = make_free(runtime, state, _step_need(runtime, state, queue, tokens))
    if evicted:
        waiting = sorted(queue.preempted + tuple(evicted), key=lambda r: (r.request.priority, r.index))
        return state, attrs.evolve(queue, preempted=tuple(waiting), preemptions=queue.preemptions + len(evicted)), ()
    need, bs = _step_need(runtime, state, queue, tokens), plan.kv.block_size
    wanted = [blocks_covering(min(len(cached_tokens(r)) + tokens, plan.inference.sequence_length), bs) for r in queue.preempted]
    following = wanted[:1] or [blocks_covering(len(r.prompt), bs) for _, r in queue.waiting[:1]]
    state = make_free(runtime, state, need + sum(following))  # room for the next to resume or be admitted
    room = free_count(plan, state.blocks) - need
    count = admissible(room, 0, wanted)
    resumed = queue.preempted[:count]
    return state, attrs.evolve(queue, running=queue.running + resumed, preempted=queue.preempted[count:]), resumed


def block_room(runtime: Runtime, state: State, queue: Queue, speculative: bool) -> int:
    """How many of the oldest waiting requests the KV blocks can take now (all of them in the
    slots layout; none while a preempted request waits to resume):

    - with recompute (:func:`recomputable`): those whose prompts fit the blocks left after the
      running requests' next step (vLLM's admission; a request that later finds no block is
      preempted, :func:`make_room`);
    - without: each is held to the blocks it may ever need (``config.kv_blocks.request_blocks``)
      beside what the running ones may still take, so a running request always finds its next
      block and nothing is preempted."""
    plan, blocks = runtime.plan, state.blocks
    if blocks is None:
        return len(queue.waiting)
    if queue.preempted:
        return 0
    bs, inf = plan.kv.block_size, plan.inference
    if recomputable(runtime):
        need = _step_need(runtime, state, queue, step_tokens(runtime, speculative))
        return admissible(free_count(plan, blocks), need, [blocks_covering(len(r.prompt), bs) for _, r in queue.waiting])

    def most(request: Request) -> int:
        return request_blocks(len(request.prompt), request.sampling.max_tokens, inf.sequence_length, inf.speculation_length, bs)

    outstanding = sum(max(0, most(r.request) - owned(plan, blocks, r.slot)) for r in queue.running + queue.prefilling)
    return admissible(free_count(plan, blocks), outstanding, [most(r) for _, r in queue.waiting])


def resume(runtime: Runtime, state: State, rows: Sequence[Progress]) -> State:
    """Recompute the caches of resumed ``rows`` (:func:`recompute`); ``state`` is consumed."""
    return recompute(runtime, state, [r.slot for r in rows], [cached_tokens(r) for r in rows])
