"""A reference continuous-batching scheduler over the step pipelines: first come, first served
within a priority (``Request.priority``, vLLM's: a lower value is admitted first; ``submit`` keeps
``Queue.waiting`` in that order, so "oldest" below means first in it; no preemption but the
blocks layout's, "KV blocks" below).

Read it as a template for your own. Each iteration (:func:`step`) is vLLM v1's: no decoding
phase nor prefill phase, each request is scheduled once with the tokens it needs next.

1. plan (:func:`plan`, an :class:`Iteration` decided before any graph runs): admit waiting
   requests into free slots (their whole prompts; with chunked prefill see "Chunked prefill",
   with prefix caching "Prefix caching"), and advance every running request: by one token
   (decode), by 1 to k tokens when the runtime can speculate (rows with no room left for k
   more tokens decode), or, for a longrope request reaching its switch length, by recomputing it
   whole (refill, see :func:`rope_switch_refill`);
2. execute (:func:`execute`): run those steps, one graph call each;
3. record and deliver (``delivery.py``): each new token through one stop rule, in order
   (tokens a speculate step produced past a stop are dropped with the request), text and
   events; a request whose logits turn NaN/inf (``StepOutput.finite``) finishes at once with
   ``finish_reason="error"`` (its event carries ``token_id=None``), the others run on;
4. retire (:func:`retire`): finished requests release their slots.

An admitted request's first token comes from its prefill; it decodes from the next iteration.
The overlapped scheduler (``overlap.py``) runs the same plan and execute, launching iteration
n + 1 before it delivers iteration n.

Chunked prefill. When the runtime has chunk graphs, an iteration has a token budget
(``max_num_batched_tokens``, vLLM's name; default ``prefill_chunk_size + batch_size``): the
running requests' tokens come first, the rest goes to prompts, as vLLM v1 fills its budget
(running requests first, then waiting prefills, which may be partial). A prompt longer than the
largest prefill bucket is admitted alone into a slot and then advances by one chunk per
iteration (at most ``prefill_chunk_size`` tokens, at most the budget left, at least one) with
the chunk pipeline; its last chunk samples its first token and it runs. Only one prompt is
chunked at a time, first come first served; while it is, nothing else is admitted. Shorter
prompts are admitted in one prefill step, as many as fit the budget left (the oldest always).

Prefix caching. Prompts admitted together go through ``prefix.prefill_reusing`` (a prefill for
the misses, chunks from its offset for each hit); a prompt chunked alone copies its cached
blocks in when it takes its slot (``prefix.load``) and caches its blocks after its last chunk
(``prefix.store``; an abort in between gives its references back, ``prefix.drop``). A finished
request's blocks (prompt and generated tokens) are cached before its slot is released
(``prefix.cache_sequences``, unless the model's RoPE depends on the length).

KV blocks. With ``kv_layout="blocks"`` requests are admitted while their prompts fit the free
blocks beside what the running requests' next step needs; when a running request needs a
block and none is free, the newest request is preempted: its blocks go back, it keeps its slot,
and once blocks are free again its cache is recomputed from its tokens before it decodes on
(vLLM's recompute preemption, ``preempt.py``; nothing is admitted while one waits). A plan that
cannot recompute every sequence (no chunk graphs, prompts shorter than ``sequence_length``)
admits a request only while the blocks hold all it may ever need, and never preempts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from neuronfx.config.families import FAMILIES
from neuronfx.errors import InputError
from neuronfx.runtime.chunked import ChunkBatch, chunk
from neuronfx.runtime.delivery import FIRST, Ran, deliver, record
from neuronfx.runtime.fork import fork, fork_batch, forks_from, has_ring, split_forks
from neuronfx.runtime.ngram import ngram_propose
from neuronfx.runtime.pipeline import StepOutput
from neuronfx.runtime.preempt import block_room, cached_tokens, make_room, resume
from neuronfx.runtime.prefix import cache_sequences, drop, load, outputs_reusable, prefill_reusing, store
from neuronfx.runtime.requests import Finished, Progress, Queue, Request, TokenEvent, step_batch, submit
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.speculate import speculate
from neuronfx.runtime.state import State
from neuronfx.runtime.steps import decode, free, prefill, refill
from neuronfx.runtime.structured import Grammars, Matcher


@attrs.frozen(kw_only=True)
class Iteration:
    """What one scheduler iteration runs, decided before any graph runs (vLLM's
    ``SchedulerOutput``): each request it schedules appears once."""

    prefill: tuple[Progress, ...] = ()  # admitted now: whole prompts (prefix caching: from their cached blocks)
    resume: tuple[Progress, ...] = ()  # preempted requests whose caches are recomputed first (they decode too)
    fork: tuple[Progress, ...] = ()  # admitted now: copying a running or just-prefilled parent's prompt (``fork.py``)
    fork_sources: tuple[int, ...] = ()  # [len(fork)] the slot each fork row copies its prompt from
    chunk: Progress | None = None  # the prompt being chunked, ``computed`` counting this chunk
    chunk_len: int = 0  # tokens of that chunk
    refill: tuple[Progress, ...] = ()  # recomputed whole (longrope switch), one token each
    speculate: tuple[Progress, ...] = ()  # 1 to k tokens each
    decode: tuple[Progress, ...] = ()  # one token each

    @property
    def empty(self) -> bool:
        """Whether it runs nothing."""
        return not (self.prefill or self.fork or self.chunk or self.refill or self.speculate or self.decode)


def token_budget(runtime: Runtime, max_num_batched_tokens: int | None) -> int | None:
    """Tokens one iteration may process (decode tokens plus prompt tokens) when the runtime
    chunks prompts: ``max_num_batched_tokens``, default ``prefill_chunk_size + batch_size`` (a
    whole chunk beside a full decode batch); None for a runtime without chunk graphs (it prefills
    whole prompts, as many as slots are free). Raises InputError for a value that is not None
    or an int >= 1."""
    if max_num_batched_tokens is not None and (isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int)
                                               or max_num_batched_tokens < 1):
        raise InputError(f"max_num_batched_tokens={max_num_batched_tokens!r} must be None (derived) or an int >= 1 "
                         "(tokens one scheduler iteration processes).")
    inference = runtime.plan.inference
    if inference.prefill_chunk_size is None:
        return None
    return max_num_batched_tokens or inference.prefill_chunk_size + inference.batch_size


# --- plan -----------------------------------------------------------------------------------------


def _admit(queue: Queue, state: State, count: int) -> tuple[Progress, ...]:
    """The ``count`` oldest waiting requests (at most one per free slot), each given a free slot
    (and a fresh matcher when structured)."""
    pairs = zip(queue.waiting[:count], state.free_slots)
    return tuple(Progress(index=i, request=r, slot=s, matcher=_matcher(queue, r)) for (i, r), s in pairs)


def _matcher(queue: Queue, request: Request) -> Matcher | None:
    """A fresh matcher for a structured request (from ``queue.grammars``, which its submit
    checked it with), else None."""
    structured = request.sampling.structured
    if structured is None:
        return None
    if queue.grammars is None:
        raise InputError("a structured request reached the scheduler without grammars: give step() the tokenizer, or build "
                         "the Queue with grammars=Grammars.for_runtime(runtime, tokenizer).")
    return queue.grammars.matcher(structured)


def with_grammars(runtime: Runtime, queue: Queue, tokenizer: Any) -> Queue:
    """``queue`` holding a Grammars over ``tokenizer`` when a structured request waits and it
    holds none (made once, then cached with the queue); else ``queue`` itself."""
    if queue.grammars is not None or tokenizer is None or all(r.sampling.structured is None for _, r in queue.waiting):
        return queue
    return attrs.evolve(queue, grammars=Grammars.for_runtime(runtime, tokenizer))


def _admit_count(runtime: Runtime, queue: Queue, state: State, left: int) -> int:
    """How many of the oldest waiting prompts one prefill step takes under chunking: those that
    fit a prefill bucket, while their tokens fit ``left`` (the oldest always, so it never
    starves) and slots are free; 0 when the oldest needs chunks."""
    limit, count, tokens = runtime.plan.prefill_buckets[-1], 0, 0
    holders = {} if has_ring(runtime) else {r.index: r.request for r in queue.running}  # as split_forks forks
    for i, request in queue.waiting[:len(state.free_slots)]:
        n = 1 if forks_from(holders.get(request.parent), request) else len(request.prompt)  # a fork computes one token
        if n > limit or (count and tokens + n > left):
            break
        count, tokens = count + 1, tokens + n
        holders[i] = request
    return count


def _next_chunk(runtime: Runtime, queue: Queue, left: int) -> tuple[Progress, int, Queue]:
    """The prefilling request with its next chunk scheduled (at most ``prefill_chunk_size``
    tokens and at most ``left``, at least one), the chunk's length, and the queue holding it."""
    (run,) = queue.prefilling
    n = min(runtime.plan.inference.prefill_chunk_size, max(1, left), len(run.request.prompt) - run.computed)
    run = attrs.evolve(run, computed=run.computed + n)
    return run, n, attrs.evolve(queue, prefilling=(run,))


def _start_chunked(runtime: Runtime, state: State, queue: Queue) -> tuple[State, Queue]:
    """The oldest waiting prompt (one that needs chunks) takes a free slot alone; with prefix
    caching its cached blocks are copied in first and its chunks start after them."""
    (i, request), slot = queue.waiting[0], state.free_slots[0]
    run = Progress(index=i, request=request, slot=slot, matcher=_matcher(queue, request))
    if runtime.plan.inference.enable_prefix_caching:
        (hit,), state = load(runtime, state, [slot], [request.prompt])
        run = attrs.evolve(run, computed=hit.num_tokens, prefix=hit)
    return state, attrs.evolve(queue, waiting=queue.waiting[1:], prefilling=(run,))


def _admission(runtime: Runtime, state: State, queue: Queue, budget: int | None, speculative: bool) -> tuple[Iteration, State, Queue]:
    """The prompts an iteration admits or advances within ``budget`` and the free KV blocks
    (the module doc's rules); admitted requests join the running ones."""
    count = block_room(runtime, state, queue, speculative)
    if budget is not None and not queue.prefilling:
        short = _admit_count(runtime, queue, state, budget - len(queue.running))
        if not short and count and queue.waiting and state.free_slots:
            state, queue = _start_chunked(runtime, state, queue)
        count = min(count, short)
    if queue.prefilling:
        run, n, queue = _next_chunk(runtime, queue, budget - len(queue.running))
        return Iteration(chunk=run, chunk_len=n), state, queue
    admitted = _admit(queue, state, count)
    prefilled, forks, sources = split_forks(queue, admitted, has_ring(runtime))
    queue = attrs.evolve(queue, waiting=queue.waiting[len(admitted):], running=queue.running + admitted)
    return Iteration(prefill=prefilled, fork=forks, fork_sources=sources), state, queue


def plan(runtime: Runtime, state: State, queue: Queue, budget: int | None, speculative: bool) -> tuple[Iteration, State, Queue]:
    """One iteration's :class:`Iteration` and the (state, queue) it starts from: the blocks
    layout's evictions or resumptions (``preempt.make_room``, which consumes ``state``),
    admission (:func:`_admission`; a chunked prompt's prefix-cache lookup consumes ``state``), then every
    running request's step: refill at the longrope switch, speculate when ``speculative`` and
    it has room (prompt lookup: and its sequence has a match), else decode. Runs no graph."""
    state, queue, resumed = make_room(runtime, state, queue, speculative)
    running, back = queue.running, {r.slot for r in resumed}  # resumed rows are recomputed, then step
    # an iteration that resumes admits nothing: the room left was counted before the recompute
    it, state, queue = (Iteration(), state, queue) if resumed else _admission(runtime, state, queue, budget, speculative)
    switch = rope_switch_refill(runtime)
    refilled = {r.slot for r in running if r.slot not in back and state.cache_lens[r.slot] == switch}
    # a resumed row speculates as it would have uninterrupted (a seeded row's draws depend on the step kind)
    held = {r.slot: len(cached_tokens(r)) for r in resumed}
    spec = {r.slot for r in running if r.slot not in refilled and speculative and _can_speculate(runtime, state, r, switch, held.get(r.slot))}
    return attrs.evolve(it, resume=resumed, refill=tuple(r for r in running if r.slot in refilled),
                        speculate=tuple(r for r in running if r.slot in spec),
                        decode=tuple(r for r in running if r.slot not in refilled | spec)), state, queue


def rope_switch_refill(runtime: Runtime) -> int | None:
    """The cache length at which a request is recomputed (``steps.refill_step``) instead of
    decoded, or None: longrope's ``original_max_position_embeddings`` L, when a whole sequence of
    L + 1 tokens fits a prefill bucket (the largest is ``max_context_length``, or
    ``prefill_chunk_size`` with chunked prefill). The token at position L is the first whose
    sequence is longer than L, where longrope switches to its long factors; transformers' Phi-3
    ``generate`` recomputes the cache there, and so does this scheduler for the families whose
    registry entry says so (``Family.recompute_at_rope_switch``). A plan whose prefill buckets
    are shorter decodes on: the keys cached before the switch keep their short-factor rotation
    (greedy tokens may then differ from transformers' past L)."""
    model = runtime.plan.model
    rs = model.rope_scaling
    if (rs is None or rs.rope_type != "longrope" or not FAMILIES[model.model_type].recompute_at_rope_switch
            or rs.original_max_position_embeddings >= runtime.plan.prefill_buckets[-1]):
        return None
    return rs.original_max_position_embeddings


def _can_speculate(runtime: Runtime, state: State, run: Progress, switch: int | None, held: int | None = None) -> bool:
    """The runtime can speculate, the request's slot has room for k more tokens, the k tokens
    do not reach the longrope switch ``switch`` (the row decodes up to it, then is refilled)
    and, for prompt lookup (``speculative_method="ngram"``), its sequence has an n-gram match:
    a row without one decodes (as vLLM's, which drafts nothing for it). ``held``: the tokens
    the row's cache will hold when its step runs (a resumed row's, recomputed first), else its
    cache_len now."""
    inf = runtime.plan.inference
    k, n = inf.speculation_length, state.cache_lens[run.slot] if held is None else held
    crosses = switch is not None and n <= switch < n + k
    if not (runtime.can_speculate and n + k <= inf.sequence_length and not crosses):
        return False
    return inf.speculative_method != "ngram" or bool(ngram_propose(run.request.prompt + run.tokens, 1, inf.prompt_lookup_min,
                                                                   inf.prompt_lookup_max))


# --- execute --------------------------------------------------------------------------------------


def _chunk_row(runtime: Runtime, state: State, it: Iteration) -> tuple[StepOutput, State]:
    """The chunk pipeline for ``it.chunk``'s scheduled chunk (its last ``it.chunk_len`` computed
    tokens); after its last chunk (or NaN/inf logits) its prefix-cache references are stored
    (or given back)."""
    run, prompt = it.chunk, it.chunk.request.prompt
    final = run.computed == len(prompt)
    batch = ChunkBatch(seq_ids=(run.slot,), chunks=(prompt[run.computed - it.chunk_len:run.computed],),
                       sampling=(run.request.sampling,), final=(final,), prompt_lens=(len(prompt),),
                       constraints=None if run.matcher is None else (run.matcher,),
                       next_tokens=(None if final else prompt[run.computed],))  # scored by this chunk (prompt logprobs)
    out, state = chunk(runtime, state, batch)
    if run.prefix is not None and (final or not out.finite[0]):
        state = store(runtime, state, [run.slot], [prompt], [run.prefix]) if out.finite[0] else drop(state, [run.prefix])
    return out, state


PIPELINES: dict[str, Callable[[Runtime, State, Any], tuple[StepOutput, State]]] = {
    "chunk": _chunk_row, "refill": refill, "speculate": speculate, "decode": decode,
}
"""The pipeline of each kind of step but prefill (``prefill`` or, with prefix caching, ``prefill_reusing``)."""


def _timed(ran: list[Ran], kind: str, rows: tuple[Progress, ...], pipeline: Callable[[Runtime, State, Any], tuple[StepOutput, State]],
           runtime: Runtime, state: State, batch: Any) -> State:
    """Run ``pipeline(runtime, state, batch)`` (one step of ``rows``), append its :class:`Ran`
    to ``ran``; the new state."""
    t0 = time.perf_counter()
    out, state = pipeline(runtime, state, batch)
    ran.append(Ran(kind=kind, rows=rows, out=out, seconds=time.perf_counter() - t0))
    return state


def execute(runtime: Runtime, state: State, it: Iteration) -> tuple[tuple[Ran, ...], State]:
    """Run ``it``'s steps in order (the resumed rows' recompute, prefill, chunk, fork, refill,
    speculate, decode), each with its
    pipeline (no checks: its requests were checked at submit); (what each ran, the new state).
    ``state`` is consumed."""
    ran: list[Ran] = []
    if it.resume:
        state = resume(runtime, state, it.resume)
    if it.prefill:
        pipeline = prefill_reusing if runtime.plan.inference.enable_prefix_caching else prefill
        state = _timed(ran, "prefill", it.prefill, pipeline, runtime, state, step_batch("prefill", it.prefill))
    if it.chunk is not None:
        state = _timed(ran, "chunk", (it.chunk,), _chunk_row, runtime, state, it)
    if it.fork:
        state = _timed(ran, "fork", it.fork, fork, runtime, state, fork_batch(it.fork, it.fork_sources))
    for kind, rows in (("refill", it.refill), ("speculate", it.speculate), ("decode", it.decode)):
        if rows:
            state = _timed(ran, kind, rows, PIPELINES[kind], runtime, state, step_batch(kind, rows))
    return tuple(ran), state


def timed(queue: Queue, ran: Sequence[Ran]) -> Queue:
    """``queue`` with the seconds of ``ran`` added (prefill and chunk steps as prefill, the rest
    as decode)."""
    first = sum(r.seconds for r in ran if r.kind in FIRST)
    return attrs.evolve(queue, prefill_s=queue.prefill_s + first, decode_s=queue.decode_s + sum(r.seconds for r in ran) - first)


# --- retire, step, schedule, abort --------------------------------------------------------------


def retire(runtime: Runtime, state: State, done: Sequence[Progress]) -> State:
    """Release the slots of finished requests ``done``; with prefix caching, first cache what
    the slots of those that did not fail hold (prompt and generated tokens) for a next turn."""
    cached = [r for r in done if not r.failed] if outputs_reusable(runtime) else []
    if cached:
        sequences = [(r.request.prompt + r.tokens)[: state.cache_lens[r.slot]] for r in cached]
        state = cache_sequences(runtime, state, [r.slot for r in cached], sequences)
    return free(runtime, state, [r.slot for r in done]) if done else state


def step(
    runtime: Runtime, state: State, queue: Queue, eos_token_ids: frozenset[int], tokenizer: Any = None,
    speculative: bool = True, max_num_batched_tokens: int | None = None,
) -> tuple[list[TokenEvent], State, Queue]:
    """One scheduler iteration (the module doc's plan, execute, record and deliver, retire);
    returns its events (one per token), the new state and queue. ``state`` is consumed;
    ``queue`` is a value. Structured requests get matchers from ``queue.grammars`` (made from
    ``tokenizer`` when missing, :func:`with_grammars`); the scheduler consumes their tokens as
    it records them and ends one ("stop") as soon as its grammar is complete. ``speculative=False`` decodes even on a runtime that can speculate.
    Raises (before any change) InputError for a ``max_num_batched_tokens`` that is not None or
    an int >= 1, and what ``check_state`` raises for ``state``."""
    budget = token_budget(runtime, max_num_batched_tokens)
    check_state(runtime, state)
    queue = with_grammars(runtime, queue, tokenizer)
    it, state, queue = plan(runtime, state, queue, budget, speculative)
    ran, state = execute(runtime, state, it)
    queue, ended = record(timed(queue, ran), ran, eos_token_ids)
    queue, done, events = deliver(queue, ended, ran, tokenizer, eos_token_ids, speculative and runtime.can_speculate)
    return events, retire(runtime, state, done), queue


def schedule(
    runtime: Runtime, state: State, requests: Sequence[Request], eos_token_ids: frozenset[int], tokenizer: Any = None,
    speculative: bool = True, max_num_batched_tokens: int | None = None, grammars: Grammars | None = None,
) -> Iterator[TokenEvent | Finished]:
    """Run ``requests`` to completion, first come first served: yields every token's
    :class:`TokenEvent`, then :class:`Finished` with the new state (``state`` is consumed).
    ``grammars``: the compiled grammars structured requests use (``generate`` passes the one it
    checked them with; None: made from ``tokenizer`` when needed).

    Requests are assumed checked (``neuronfx.generate`` does it first, ``check_request``); a
    step error is raised before that step changes anything. ``tokenizer`` (transformers)
    enables text and stop strings; ``speculative=False`` decodes one token per step even on a
    runtime that can speculate. ``max_num_batched_tokens``: the token budget of each iteration
    of a runtime with chunked prefill (:func:`token_budget`). A caller that stops iterating
    early keeps no usable state (slots stay live).
    """
    token_budget(runtime, max_num_batched_tokens)  # checked before the first step
    queue = Queue(grammars=grammars)
    for i, req in enumerate(requests):
        queue = submit(queue, i, req)
    while not queue.idle:
        events, state, queue = step(runtime, state, queue, eos_token_ids, tokenizer, speculative, max_num_batched_tokens)
        yield from events
    yield Finished(state=state, prefill_s=queue.prefill_s, decode_s=queue.decode_s, num_requests=len(requests))


def abort(runtime: Runtime, state: State, queue: Queue, index: int) -> tuple[State, Queue]:
    """Drop request ``index`` (vLLM's ``abort_request``): a waiting one leaves the queue, a
    running (or preempted) one releases its slot (``state`` is then consumed; a prompt being chunked gives its
    prefix-cache references back first). Raises InputError for an index that is neither waiting
    nor running, and what ``check_state`` raises for ``state``, before any change."""
    if any(i == index for i, _ in queue.waiting):
        return state, attrs.evolve(queue, waiting=tuple(w for w in queue.waiting if w[0] != index))
    for run in queue.running + queue.prefilling + queue.preempted:
        if run.index == index:
            check_state(runtime, state)
            state = drop(state, [run.prefix]) if run.prefix is not None else state
            return free(runtime, state, [run.slot]), attrs.evolve(
                queue, running=tuple(r for r in queue.running if r.index != index),
                prefilling=tuple(r for r in queue.prefilling if r.index != index),
                preempted=tuple(r for r in queue.preempted if r.index != index))
    raise InputError(f"request index {index!r} is neither waiting nor running; nothing to abort.")
