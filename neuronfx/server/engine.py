"""The serving engine: one thread owns the runtime, the state and the scheduler queue.

HTTP handlers never touch them. A handler validates its request (against the immutable runtime's
plan), then calls :meth:`Engine.submit` with a :class:`Sink` (an asyncio queue on its own event
loop) and reads ``(choice, TokenEvent)`` pairs from it; :meth:`Engine.abort` drops requests
whose client went away. Both only put a command in the engine's inbox (a thread-safe queue).

The engine thread first builds the runtime (load or compile: minutes for a big model, so the
HTTP server is already up and answers 503 meanwhile), then loops: drain the inbox (blocking on
it only when nothing runs), run one :func:`neuronfx.runtime.scheduler.step`, and hand each token
event to its request's sink with ``loop.call_soon_threadsafe``, which never waits for a client.

With ``async_decode`` the loop runs :func:`neuronfx.runtime.overlap.overlap_step` instead: a
step returns while the next scheduler iteration runs in a worker thread, so routing its events
overlaps that iteration (``runtime/overlap.py``).

Admission is bounded: at most ``batch_size`` requests run and ``max_waiting`` wait; a submit
beyond that raises :class:`EngineOverloaded` at once and queues nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as queue_lib
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from neuronfx.errors import InputError
from neuronfx.memory import frozen_heap
from neuronfx.runtime.blocks import blocks_in_use
from neuronfx.runtime.embed import is_embedding
from neuronfx.runtime.overlap import Flight, busy, overlap_abort, overlap_step, settle
from neuronfx.runtime.prefix import prefix_stats
from neuronfx.runtime.prefix_pool import pool_nbytes
from neuronfx.runtime.prefix_store import PrefixStats
from neuronfx.runtime.runtime import Runtime, init_state
from neuronfx.runtime.scheduler import Queue, Request, TokenEvent, step, submit
from neuronfx.server.metrics import Metrics
from neuronfx.server.served import Served

logger = logging.getLogger("neuronfx.server")

RETRY_AFTER_S = 1
"""Retry-After (seconds) of a 503 for a full waiting queue: about the time a few requests take
to finish and free their slots."""


class EngineUnavailable(Exception):
    """The engine takes no request now (a 503)."""


class EngineNotReady(EngineUnavailable):
    """The runtime is still loading or compiling."""


class EngineStopping(EngineUnavailable):
    """The server is shutting down (or the engine failed)."""


class EngineOverloaded(EngineUnavailable):
    """Every slot is taken and ``max_waiting`` requests already wait."""


@attrs.frozen(eq=False)
class Sink:
    """Where one HTTP request receives its events: an asyncio queue on the handler's event loop.
    Items are ``(choice, TokenEvent)``; an aborted request ends with finish_reason "abort", one
    lost to an engine failure with "error" (token_id None)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: tuple[int, TokenEvent]) -> None:
        """Hand ``item`` to the handler's loop (thread-safe, never blocks)."""
        with contextlib.suppress(RuntimeError):  # the event loop closed: the server is gone, nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@attrs.frozen
class _Submit:
    ids: tuple[int, ...]
    requests: tuple[Request, ...]
    sink: Sink
    arrival: float  # time.perf_counter() at submit


@attrs.frozen
class _Abort:
    ids: tuple[int, ...]


@attrs.frozen
class _AbortAll:
    pass


@attrs.frozen
class _Stop:
    pass


@attrs.define
class _Live:
    """The engine thread's record of one accepted request (mutable; only that thread uses it)."""

    sink: Sink
    choice: int  # index of the request among its HTTP request's prompts
    prompt_len: int
    arrival: float
    started: bool = False  # its prefill ran
    last: float = 0.0  # time of its last token


class Engine:
    """Runs requests through the scheduler in its own thread (see the module doc).

    ``build`` returns the :class:`Served` runtime and tokenizer (called in the engine thread);
    ``on_failure`` is called there when ``build`` raises (the server should exit).
    ``max_num_batched_tokens``: the scheduler's token budget per iteration under chunked prefill
    (None: derived). Raises InputError for a negative ``max_waiting``, a budget that is not
    None or an int >= 1, or an ``async_decode`` that is not a bool.
    """

    def __init__(self, build: Callable[[], Served], *, max_waiting: int, metrics: Metrics,
                 on_failure: Callable[[BaseException], None] = lambda exc: None, max_num_batched_tokens: int | None = None,
                 async_decode: bool = False) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise InputError(f"max_waiting={max_waiting!r} must be an int >= 0 (requests waiting for a slot).")
        budget = max_num_batched_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise InputError(f"max_num_batched_tokens={budget!r} must be None (derived) or an int >= 1 (tokens per scheduler iteration).")
        if not isinstance(async_decode, bool):
            raise InputError(f"async_decode={async_decode!r} must be True or False.")
        self.max_num_batched_tokens = budget
        self.max_waiting = max_waiting
        self.async_decode = async_decode
        self.metrics = metrics
        metrics.waiting_limit.set(max_waiting)
        self.failure: BaseException | None = None  # what build raised
        self._build, self._on_failure = build, on_failure
        self._inbox: queue_lib.SimpleQueue = queue_lib.SimpleQueue()
        self._lock = threading.Lock()  # guards the fields below, shared by handlers and the engine thread
        self._served: Served | None = None
        self._accepting = True
        self._in_flight = 0  # accepted, not finished
        self._next_id = 0
        # owned by the engine thread alone
        self._live: dict[int, _Live] = {}
        self._prefix_seen = PrefixStats()  # the state's prefix-cache counters already added to the metrics
        self._preemptions_seen = 0  # the queue's preemptions already added to the metrics
        self._thread = threading.Thread(target=self._run, name="neuronfx-engine", daemon=True)
        for reason in ("stop", "length", "abort", "error"):
            metrics.requests.labels(reason)  # listed at 0 from the start

    # --- called from handlers (any thread) ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def served(self) -> Served | None:
        """The runtime and tokenizer once built, else None."""
        return self._served

    @property
    def ready(self) -> bool:
        """Built, running and accepting requests."""
        with self._lock:
            return self._served is not None and self._accepting and self._thread.is_alive()

    def submit(self, requests: Sequence[Request], sink: Sink) -> list[int]:
        """Queue ``requests`` (validated already: ``scheduler.check_request``) for one HTTP
        request, all or none; their events go to ``sink`` as ``(position in requests, event)``.
        A request's ``parent`` is a position in ``requests`` (another choice of its prompt); it
        becomes that request's engine id.
        Returns their engine ids. Raises EngineNotReady, EngineStopping or EngineOverloaded
        (nothing queued)."""
        with self._lock:
            if not self._accepting:
                raise EngineStopping("the server is shutting down; it takes no new request.")
            if self._served is None:
                raise EngineNotReady("the model is still loading or compiling; retry when GET /health answers 200.")
            slots = self._served.runtime.plan.inference.batch_size
            if self._in_flight + len(requests) > slots + self.max_waiting:
                self.metrics.rejected.inc()
                raise EngineOverloaded(f"the server is busy: all {slots} slots are taken and {self.max_waiting} requests wait "
                                       f"(--max-waiting); retry in {RETRY_AFTER_S} s.")
            ids = tuple(range(self._next_id, self._next_id + len(requests)))
            self._next_id += len(requests)
            self._in_flight += len(requests)
            requests = tuple(r if r.parent is None else attrs.evolve(r, parent=ids[r.parent]) for r in requests)
            self._inbox.put(_Submit(ids=ids, requests=requests, sink=sink, arrival=time.perf_counter()))
        return list(ids)

    def abort(self, ids: Sequence[int]) -> None:
        """Drop requests ``ids`` (a client went away): a waiting one leaves the queue, a running
        one frees its slot at the next step. Finished ids are ignored."""
        self._inbox.put(_Abort(ids=tuple(ids)))

    def begin_stop(self) -> None:
        """Take no new request (submit raises EngineStopping); in-flight ones run on."""
        with self._lock:
            self._accepting = False

    @property
    def in_flight(self) -> int:
        """Requests accepted and not finished yet (running or waiting)."""
        with self._lock:
            return self._in_flight

    def abort_all(self) -> None:
        """Abort every request running or waiting now (finish_reason "abort"); the engine serves
        on (a draining server's timeout)."""
        self._inbox.put(_AbortAll())

    def stop(self, timeout: float) -> None:
        """Stop: abort what still runs or waits (finish_reason "abort"), end the engine thread
        (waiting at most ``timeout`` seconds for it)."""
        self.begin_stop()
        self._inbox.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        served = self._build_served()
        if served is None:
            return
        runtime = served.runtime
        if is_embedding(runtime):  # no state, no scheduler: the handlers embed (server/embeddings.py)
            self._wait_for_stop(served)
            return
        with frozen_heap():  # what startup left alive is out of the collector's full walks: no step stalls 0.2 s (memory.py)
            self._serve(served, init_state(runtime), Queue(grammars=served.grammars))

    def _serve(self, served: Served, state: Flight, queue: Queue) -> None:
        """The serving loop: commands in, scheduler iterations while there is work, events out,
        until a stop command (which aborts every live request)."""
        runtime = served.runtime
        eos = frozenset(runtime.plan.model.eos_token_ids)
        self._announce_ready(served, state)
        while True:
            for command in self._commands(block=not busy(state, queue)):
                if isinstance(command, _Stop):
                    self._abort_all_live(runtime, state, queue)
                    return
                state, queue = self._apply(command, runtime, state, queue)
            events: list[TokenEvent] = []
            if busy(state, queue):
                events, state, queue = self._step(served, state, queue, eos)
            self._gauges(state, queue)  # before the events go out: a client that has its answer sees its slot free
            self._route(events)

    def _build_served(self) -> Served | None:
        """``build()``, or None after reporting its failure (the server should exit)."""
        try:
            return self._build()
        except BaseException as exc:  # the server cannot serve: report it and let it exit
            self.failure = exc
            with self._lock:
                self._accepting = False
            self._on_failure(exc)
            return None

    def _wait_for_stop(self, served: Served) -> None:
        """An embedding runtime: publish ``served`` (its handlers run the embed graphs) and wait
        for the stop; nothing is ever submitted to the engine."""
        with self._lock:
            self._served = served
        logger.info("ready: embeddings (pooling %s), max_context_length %d, backend %s", served.runtime.plan.inference.pooling,
                    served.runtime.plan.inference.max_context_length, served.runtime.plan.inference.backend)
        while not any(isinstance(c, _Stop) for c in self._commands(block=True)):
            pass

    def _announce_ready(self, served: Served, state: Flight) -> None:
        """Publish ``served`` (handlers start submitting) and log the runtime's capacities."""
        runtime = served.runtime
        self.metrics.slots.set(state.num_slots)
        self.metrics.max_model_len.set(runtime.plan.inference.sequence_length)
        with self._lock:
            self._served = served
        inf = runtime.plan.inference
        logger.info("ready: %d slots, max_context_length %d, sequence_length %d, backend %s", state.num_slots,
                    inf.max_context_length, inf.sequence_length, inf.backend)
        if state.prefix is not None:
            logger.info("prefix caching: %d blocks of %d tokens (%.0f MiB)", state.prefix.store.num_blocks,
                        state.prefix.store.block_size, pool_nbytes(runtime.plan) / 2**20)

    def _abort_all_live(self, runtime: Runtime, state: Flight, queue: Queue) -> None:
        """The engine's stop: abort every live request (finish_reason "abort") and let a step in
        flight end."""
        for index in list(self._live):
            state, queue = overlap_abort(runtime, state, queue, index)
            self._finish(index, _ended(index, "abort"))
        with contextlib.suppress(Exception):  # a decode step in flight ends before the engine does
            settle(state)

    def _step(self, served: Served, state: Flight, queue: Queue, eos: frozenset[int]) -> tuple[list[TokenEvent], Flight, Queue]:
        """One scheduler iteration (overlapped with ``async_decode``); a step that raises is a
        bug, not bad input (requests were checked): its requests end with an error, the engine
        serves on from a fresh state."""
        runtime, budget = served.runtime, self.max_num_batched_tokens
        try:
            if self.async_decode:
                return overlap_step(runtime, state, queue, eos, served.tokenizer, max_num_batched_tokens=budget)
            return step(runtime, state, queue, eos, served.tokenizer, max_num_batched_tokens=budget)
        except Exception:
            logger.exception("a scheduler step failed; its %d requests end with an error", len(self._live))
            for index in list(self._live):
                self._finish(index, _ended(index, "error"))
            self._prefix_seen, self._preemptions_seen = PrefixStats(), 0
            return [], init_state(runtime), Queue(grammars=served.grammars)

    def _commands(self, block: bool) -> list[object]:
        """Every command in the inbox; waits for one first when ``block`` (nothing to run)."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue_lib.Empty:
                return commands

    def _apply(self, command: object, runtime: Runtime, state: Flight, queue: Queue) -> tuple[Flight, Queue]:
        """Queue a submit's requests or abort requests (some or all); returns the new (state, queue)."""
        if isinstance(command, _Submit):
            for choice, (index, request) in enumerate(zip(command.ids, command.requests)):
                queue = submit(queue, index, request)
                self._live[index] = _Live(sink=command.sink, choice=choice, prompt_len=len(request.prompt), arrival=command.arrival)
        elif isinstance(command, _Abort | _AbortAll):
            for index in command.ids if isinstance(command, _Abort) else list(self._live):
                if index in self._live:  # else it finished already
                    state, queue = overlap_abort(runtime, state, queue, index)
                    self._finish(index, _ended(index, "abort"))
        return state, queue

    def _route(self, events: Sequence[TokenEvent]) -> None:
        """Count each event in the metrics and hand it to its request's sink."""
        m = self.metrics
        for event in events:
            live, now = self._live[event.index], time.perf_counter()
            if not live.started:
                live.started = True
                m.prompt_tokens.inc(live.prompt_len)
                m.ttft.observe(now - live.arrival)
            elif event.token_id is not None:
                m.itl.observe(now - live.last)
            if event.token_id is not None:
                m.generation_tokens.inc()
                live.last = now
            if event.finish_reason is None:
                live.sink.put((live.choice, event))
            else:
                self._finish(event.index, event)

    def _finish(self, index: int, event: TokenEvent) -> None:
        """Retire request ``index`` with its last event: counts first, so that a client that sees
        its answer also sees its slot and the metrics freed."""
        live = self._live.pop(index)
        with self._lock:
            self._in_flight -= 1
        self.metrics.requests.labels(event.finish_reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - live.arrival)
        live.sink.put((live.choice, event))

    def _gauges(self, state: Flight, queue: Queue) -> None:
        self.metrics.running.set(len(queue.running) + len(queue.prefilling))  # a prompt being chunked holds a slot
        self.metrics.waiting.set(len(queue.waiting))
        used = state.num_slots - len(state.free_slots)
        self.metrics.slots_used.set(used)
        self.metrics.kv_usage.set(used / state.num_slots)
        blocks = state.blocks  # a Pending carries its launched state's tables
        if blocks is not None:
            held, total = blocks_in_use(blocks)
            self.metrics.kv_blocks.set(total)
            self.metrics.kv_blocks_used.set(held)
            self.metrics.kv_usage.set(held / total)
        self.metrics.preemptions.inc(queue.preemptions - self._preemptions_seen)
        self._preemptions_seen = queue.preemptions
        stats = prefix_stats(state)  # a Pending carries its launched state's prefix cache
        if stats is not None:  # the counters grew by what this step's lookups, hits and evictions added
            seen, m = self._prefix_seen, self.metrics
            m.prefix_queries.inc(stats.queries - seen.queries)
            m.prefix_hits.inc(stats.hits - seen.hits)
            m.prefix_evictions.inc(stats.evictions - seen.evictions)
            m.prefix_hit_rate.set(stats.hits / stats.queries if stats.queries else 0.0)
            self._prefix_seen = stats


def _ended(index: int, reason: str) -> TokenEvent:
    """The last event of a request that ends without a token: "abort" or "error"."""
    return TokenEvent(index=index, token_id=None, text="", logprobs=None, finish_reason=reason, stop_reason=None)
