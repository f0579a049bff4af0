"""Overlapped (async) scheduling: iteration n + 1's steps run in a worker thread while the host
delivers iteration n's tokens (detokenizes, stop-checks and streams them as TokenEvents). Two
hooks over the same scheduler (vLLM's ``AsyncScheduler``): :func:`launch` an iteration the
scheduler planned (``scheduler.plan``), :func:`finish` it; everything else is the synchronous
scheduler's plan, execute, record, deliver and retire. So speculation, chunked prefill, prefix
caching, longrope refills and tensor-parallel ranks (each rank's worker issues its collectives
in the same order) run overlapped as they run synchronously.

The state stays an explicit value. NxD's async mode keeps ``prior_outputs`` and
``next_cpu_inputs`` on the model (NxDI ``modules/async_execution.py``); here a launched
iteration is a :class:`Pending` value: the state in flight, consumed by :func:`finish`.

:func:`overlap_step`: finish iteration n, record its tokens (``delivery.record``: the requests
its tokens end *for sure*, by eos, a stop id, max_tokens or NaN/inf logits, are retired now),
plan and launch iteration n + 1 from the state n returned, then deliver n's tokens while n + 1
runs. A stop string is only seen when the text is decoded, during the overlap: that request has
already been scheduled once more; its extra tokens are dropped (no TokenEvent, not counted) and
its slot freed when n + 1 returns (:attr:`Pending.retire`). An abort while an iteration runs
frees the slot when it returns too (:attr:`Pending.aborted`).

What differs from synchronous scheduling: a request stopped by a stop string rides one extra
iteration (its slot is freed, and a waiting request admitted, one iteration later), so the
batches of the other rows, and the order of the state's RNG keys, can differ from the
synchronous run's. Greedy and seeded requests produce the same tokens (a row's result does not
depend on the other rows of its batch, as continuous batching already relies on); unseeded
sampling draws from the state's key by row position and is reproducible, and without stop
strings it is the synchronous run's too (the same iterations in the same order).

Structured outputs need no extra wait: :func:`overlap_step` records iteration n (each matcher
consumes its request's tokens) before it plans n + 1, whose masks are built in the worker from
those matchers; only the delivery of n's text overlaps n + 1. A request a stop string ends
during the overlap rides n + 1 with its matcher read, never consumed (its tokens are dropped).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

from neuronfx.errors import InputError, StateConsumedError
from neuronfx.runtime.blocks import BlockTables
from neuronfx.runtime.delivery import Ran, deliver, record
from neuronfx.runtime.prefix import drop
from neuronfx.runtime.prefix_pool import PrefixCache
from neuronfx.runtime.requests import Finished, Progress, Queue, Request, TokenEvent, submit
from neuronfx.runtime.runtime import Runtime, check_state
from neuronfx.runtime.scheduler import Iteration, abort, execute, plan, retire, timed, token_budget, with_grammars
from neuronfx.runtime.state import Lease, State, advance, free_slots_of
from neuronfx.runtime.steps import free
from neuronfx.runtime.structured import Grammars

_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neuronfx-step")
"""The one thread every launched iteration runs in (started on the first launch, kept for the
process; shared by all runtimes: iterations of two runtimes queue behind each other). One kept
thread, not one per iteration: a new thread would start a new OpenMP team for the graphs."""


@attrs.frozen(kw_only=True, eq=False)
class Pending:
    """A scheduler iteration running in the worker thread (:func:`launch`): a State in flight.

    - ``runtime``, ``iteration``: what it runs.
    - ``live``: [num_slots] which slots the state :func:`finish` returns holds requests in.
    - ``prefix``: the launched state's prefix cache (its store as of the launch), or None.
    - ``retire``: requests a stop string ended while it ran: cached and freed after it.
    - ``aborted``: requests aborted while it ran: freed after it (no caching).
    - ``launched``: ``time.perf_counter()`` at launch.
    - ``blocks``: the launched state's block tables (blocks KV layout; the same host tensors the
      iteration updates: read them for a gauge only), or None.
    """

    runtime: Runtime
    iteration: Iteration
    live: tuple[bool, ...]
    prefix: PrefixCache | None
    launched: float
    blocks: BlockTables | None = None
    retire: tuple[Progress, ...] = ()
    aborted: tuple[Progress, ...] = ()
    _future: Future = attrs.field(alias="future")  # -> (tuple[Ran, ...], State) of scheduler.execute
    _lease: Lease = attrs.field(factory=Lease, alias="lease")

    @property
    def num_slots(self) -> int:
        """Request slots (as State.num_slots)."""
        return len(self.live)

    @property
    def free_slots(self) -> tuple[int, ...]:
        """Slots the returned state will have free, ascending (as State.free_slots)."""
        return free_slots_of(self.live)

    @property
    def consumed(self) -> bool:
        """Whether :func:`finish` or :func:`defer` already used this value."""
        return not self._lease.valid

    @property
    def done(self) -> bool:
        """Whether its iteration has returned (:func:`finish` will not wait)."""
        return self._future.done()


Flight = State | Pending
"""What the overlapped scheduler passes from one iteration to the next: a State, or a Pending
iteration (the state in flight)."""


def _check_pending(pending: object) -> None:
    if not isinstance(pending, Pending):
        raise InputError(f"pending is a {type(pending).__name__}; pass the Pending returned by launch or defer.")
    if pending.consumed:
        raise StateConsumedError("this Pending was already finished or replaced (defer returns a new one); "
                                 "use the value that call returned.")


def launch(runtime: Runtime, state: State, iteration: Iteration) -> Pending:
    """Start ``scheduler.execute(runtime, state, iteration)`` in the worker thread and return at
    once. ``state`` is consumed now (the iteration in flight owns the KV cache); :func:`finish`
    returns what it ran and the new state; an error inside it is raised by ``finish``."""
    held = advance(state, cache_lens=state.cache_lens, generated=state.generated, live=state.live, rng_key=state.rng_key)
    admitted = {r.slot for r in (*iteration.prefill, *([iteration.chunk] if iteration.chunk else ()))}
    return Pending(runtime=runtime, iteration=iteration, live=tuple(on or s in admitted for s, on in enumerate(state.live)),
                   prefix=state.prefix, launched=time.perf_counter(), blocks=state.blocks,
                   future=_WORKER.submit(execute, runtime, held, iteration))


def defer(pending: Pending, retire: Sequence[Progress] = (), aborted: Sequence[Progress] = ()) -> Pending:
    """``pending`` (consumed) with requests ``retire`` (ended by a stop string) and ``aborted``
    also freed when it finishes; their slots are free in its ``live`` from now on."""
    _check_pending(pending)
    pending._lease.valid = False
    slots = {r.slot for r in (*retire, *aborted)}
    return attrs.evolve(pending, retire=pending.retire + tuple(retire), aborted=pending.aborted + tuple(aborted),
                        live=tuple(on and s not in slots for s, on in enumerate(pending.live)), lease=Lease())


def finish(pending: Pending) -> tuple[tuple[Ran, ...], State]:
    """Wait for ``pending``'s iteration; (what it ran, the new state with its deferred requests
    retired). ``pending`` is consumed. Raises what the iteration raised."""
    _check_pending(pending)
    pending._lease.valid = False
    ran, state = pending._future.result()
    state = retire(pending.runtime, state, pending.retire)
    held = [r.prefix for r in pending.aborted if r.prefix is not None and not _settled(r, ran)]
    state = drop(state, held) if held else state
    return ran, free(pending.runtime, state, [r.slot for r in pending.aborted]) if pending.aborted else state


def _settled(run: Progress, ran: Sequence[Ran]) -> bool:
    """Whether ``ran`` stored or gave back ``run``'s prefix-cache references: its last chunk,
    or a chunk with NaN/inf logits, ran (``scheduler._chunk_row``)."""
    return any(step.kind == "chunk" and step.rows[0].index == run.index
               and (run.computed == len(run.request.prompt) or not step.out.finite[0]) for step in ran)


# --- the scheduler: launch n + 1, deliver n ---------------------------------------------------


def overlap_step(runtime: Runtime, flight: Flight, queue: Queue, eos_token_ids: frozenset[int], tokenizer: Any = None,
                 speculative: bool = True, max_num_batched_tokens: int | None = None) -> tuple[list[TokenEvent], Flight, Queue]:
    """One iteration of the overlapped scheduler; returns (events, flight, queue); ``flight``
    (a State or the Pending of the last call) is consumed. Finishes the iteration in flight,
    records its tokens and retires the requests they end for sure, plans and launches the next
    iteration (``scheduler.plan``, with ``speculative`` and the token budget
    ``max_num_batched_tokens`` as in ``scheduler.step``), then delivers the finished one's
    tokens while the next runs. Raises InputError for a bad ``max_num_batched_tokens`` and what
    ``check_state`` raises for a State, before any change."""
    budget = token_budget(runtime, max_num_batched_tokens)
    if isinstance(flight, Pending):
        ran, state = finish(flight)
    else:
        check_state(runtime, flight)
        ran, state = (), flight
    queue, ended = record(timed(queue, ran), ran, eos_token_ids)
    state = retire(runtime, state, ended)
    # Matchers consumed n's tokens in record, before n + 1's masks are built: no wait is needed.
    it, state, queue = plan(runtime, state, with_grammars(runtime, queue, tokenizer), budget, speculative)
    following: Flight = state if it.empty else launch(runtime, state, it)
    queue, done, events = deliver(queue, ended, ran, tokenizer, eos_token_ids, speculative and runtime.can_speculate)
    seen = {r.index for r in ended}
    late = [r for r in done if r.index not in seen]  # ended by a stop string: scheduled again in ``following``
    if late:
        following = defer(following, retire=late) if isinstance(following, Pending) else retire(runtime, following, late)
    return events, following, queue


def overlap_abort(runtime: Runtime, flight: Flight, queue: Queue, index: int) -> tuple[Flight, Queue]:
    """``scheduler.abort`` for the overlapped scheduler: a request in flight leaves the queue now
    and its slot is freed when the iteration returns (its tokens are never delivered). Raises
    InputError for an index that is neither waiting nor running."""
    if isinstance(flight, State) or any(i == index for i, _ in queue.waiting):
        return abort(runtime, flight, queue, index)
    for run in queue.running + queue.prefilling + queue.preempted:
        if run.index == index:
            return defer(flight, aborted=[run]), attrs.evolve(queue, running=tuple(r for r in queue.running if r.index != index),
                                                               prefilling=tuple(r for r in queue.prefilling if r.index != index),
                                                               preempted=tuple(r for r in queue.preempted if r.index != index))
    raise InputError(f"request index {index!r} is neither waiting nor running; nothing to abort.")


def busy(flight: Flight, queue: Queue) -> bool:
    """Whether :func:`overlap_step` has work: requests wait or run, or an iteration is in flight."""
    return not queue.idle or isinstance(flight, Pending)


def settle(flight: Flight) -> State:
    """The state of ``flight``: a Pending is waited for and its tokens dropped (call it once the
    requests it ran ended or were aborted)."""
    return finish(flight)[1] if isinstance(flight, Pending) else flight


def overlap_schedule(runtime: Runtime, state: State, requests: Sequence[Request], eos_token_ids: frozenset[int],
                     tokenizer: Any = None, speculative: bool = True,
                     max_num_batched_tokens: int | None = None, grammars: Grammars | None = None) -> Iterator[TokenEvent | Finished]:
    """``scheduler.schedule`` with overlapped iterations (:func:`overlap_step`): the events of
    iteration n are yielded while iteration n + 1 runs. Requests are assumed checked;
    ``state`` is consumed; ``grammars`` as in ``scheduler.schedule``."""
    token_budget(runtime, max_num_batched_tokens)  # checked before the first step
    queue, flight = Queue(grammars=grammars), state
    for i, req in enumerate(requests):
        queue = submit(queue, i, req)
    while busy(flight, queue):
        events, flight, queue = overlap_step(runtime, flight, queue, eos_token_ids, tokenizer, speculative, max_num_batched_tokens)
        yield from events
    yield Finished(state=settle(flight), prefill_s=queue.prefill_s, decode_s=queue.decode_s, num_requests=len(requests))
