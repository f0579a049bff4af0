"""Overlapped (async) decode: step n+1's graph runs in a worker thread while the host delivers
step n's tokens (detokenizes, stop-checks and streams them as TokenEvents).

The state stays an explicit value. NxD's async mode keeps ``prior_outputs``, ``prior_seq_ids``
and ``next_cpu_inputs`` on the model and returns each call the *previous* call's outputs
(NxDI ``modules/async_execution.py``; the seed's ``async_mode``); here a launched step is a
:class:`Pending` value:

- :func:`decode_launch` ``(runtime, state, batch) -> Pending`` checks everything
  :func:`~neuronfx.runtime.steps.decode_step` checks (raising before any change), consumes
  ``state`` (its lease is revoked: the step in flight owns the KV cache now) and runs the step
  in a worker thread (one per process; torch ops release the GIL, so the host thread runs
  meanwhile);
- :func:`defer_release` ``(pending, slots) -> Pending``: slots to free once the step is done
  (requests that ended, or were aborted, while it ran: "released one step later at most");
- :func:`decode_finish` ``(pending) -> (StepOutput, State)`` waits for it, frees those slots and
  consumes ``pending``;
- :func:`prepare_next` ``(pending, seq_ids, sampling) -> Pending``: while a step runs, the host
  makes the next step's inputs that do not depend on its tokens (:class:`Prepared`: the random
  numbers from the key and generated counts the step will leave, the min_tokens bias, the
  prompt-mask rows); :func:`decode_launch` uses them when they fit, so the worker only gathers
  the output counts before the graph.

What step n+1 needs from step n: its tokens (the input ids), and the counts the step itself
updates in the state it returns (cache_lens, generated: the index of each seeded row's draw and
the min_tokens bias; output_counts: the penalties; the RNG key). Launching from the state step n
returned gives exactly the inputs a synchronous decode would get, so a row's tokens are the
synchronous ones (greedy and seeded sampling alike) as long as its batch is the same.

The scheduler side (:func:`overlap_step`, :func:`overlap_schedule`) chains decode steps: when
step n's tokens come back it launches step n+1 for every running request that step n's token
does not end *for sure* (eos and stop ids after min_tokens, max_tokens, NaN/inf logits: cheap
integer checks), then delivers step n's tokens while step n+1 runs. A stop string is only seen
when the text is decoded, during the overlap: that request has already been launched once more;
its extra token is dropped (no TokenEvent, not counted) and its slot freed when that step
returns. Admission (a prefill), a longrope refill and a step with nothing to overlap run
synchronously through :func:`neuronfx.runtime.scheduler.step`; speculation is refused
(:func:`check_async`).

What differs from synchronous decode: a request stopped by a stop string rides one extra step
(its slot is freed, and a waiting request admitted, one step later), so the batch of the other
rows, and the order of the state's RNG keys, can differ from the synchronous run's. Greedy and
seeded requests produce the same tokens (a row's result does not depend on the other rows of
its batch, as continuous batching already relies on); unseeded sampling draws from the state's
key by row position and is reproducible, but not the same draws as the synchronous run's once a
stop string has ended a request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from neuronfx.config.buckets import select_bucket
from neuronfx.config.sampling import SamplingParams
from neuronfx.errors import ConfigError, InputError, StateConsumedError
from neuronfx.runtime.batch import draws, min_tokens_bias, sampler_inputs
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.scheduler import (
    Finished,
    Progress,
    Queue,
    Request,
    TokenEvent,
    abort,
    advance_request,
    rope_switch_refill,
    step,
    submit,
)
from neuronfx.runtime.state import State, _Lease, advance, free_slots_of
from neuronfx.runtime.steps import (  # _follow_draft, _one_token_each: decode_step's own tail, shared as is
    DecodeBatch,
    StepOutput,
    _follow_draft,
    _one_token_each,
    check_decode,
    check_params,
    check_room,
    one_token,
    release,
)

Tensor = torch.Tensor

# --- the step API: launch, defer a release, finish -----------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class Prepared:
    """The host-side inputs of one decode step that do not depend on the previous step's
    tokens (the seed's ``next_cpu_inputs``, as a value): made while the previous step runs
    (:func:`prepare_next`), used by :func:`decode_launch` only when the step it launches has
    exactly these rows, generated counts and RNG key (then they are what ``decode_step`` would
    compute: same random numbers, bias and prompt-mask rows)."""

    seq_ids: tuple[int, ...]  # [n] slots
    sampling: tuple[SamplingParams, ...]  # [n]
    generated: tuple[int, ...]  # [n] tokens each row has sampled before this step
    rng_key: int  # the state's key this step draws from
    bsz: int  # batch bucket
    rand: Tensor  # [bsz] float32 (batch.draws)
    next_key: int  # the key of the state this step returns
    bias: Tensor  # [bsz, vocab] float32 min_tokens bias
    prompt_mask: Tensor  # [n, vocab] bool, the rows' prompt masks


def prepare(runtime: Runtime, seq_ids: Sequence[int], sampling: Sequence[SamplingParams], generated: Sequence[int],
            rng_key: int, prompt_mask: Tensor) -> Prepared:
    """The Prepared inputs of a decode step over ``seq_ids`` whose rows have sampled
    ``generated`` tokens, drawing from ``rng_key``; ``prompt_mask`` is the state's
    [num_slots, vocab] tensor (prefill writes it; decode steps do not)."""
    slots, sampling, generated = tuple(seq_ids), tuple(sampling), tuple(generated)
    bsz = select_bucket(runtime.plan.batch_buckets, len(slots), "batch rows")
    rand, next_key = draws(rng_key, sampling, generated, bsz)
    return Prepared(seq_ids=slots, sampling=sampling, generated=generated, rng_key=rng_key, bsz=bsz, rand=rand, next_key=next_key,
                    bias=min_tokens_bias(runtime, sampling, generated, bsz), prompt_mask=prompt_mask[list(slots)])


def _fits(prepared: Prepared | None, state: State, batch: DecodeBatch) -> bool:
    """Whether ``prepared`` holds the inputs ``decode_step(state, batch)`` would compute."""
    return (prepared is not None and prepared.seq_ids == batch.seq_ids and prepared.rng_key == state.rng_key
            and prepared.generated == tuple(state.generated[s] for s in batch.seq_ids) and prepared.sampling == batch.sampling)


def _decode_prepared(runtime: Runtime, state: State, batch: DecodeBatch, prep: Prepared) -> tuple[StepOutput, State]:
    """:func:`~neuronfx.runtime.steps.decode_step` (already checked) with its host-side inputs
    from ``prep``: only the output counts (updated by the previous step) are gathered here."""
    slots = list(batch.seq_ids)
    sampler = sampler_inputs(runtime, batch.sampling, state.output_counts[slots], prep.prompt_mask, prep.bias, prep.rand, prep.bsz)
    positions = [state.cache_lens[s] for s in slots]
    out, bsz, bucket = one_token(runtime, state.kv, "decode", slots, batch.input_ids, positions, sampler, len(slots))
    draft = _follow_draft(runtime, state, slots, batch.input_ids)
    return _one_token_each(runtime, state, slots, batch.sampling, out, sampler, prep.next_key, draft, bucket, bsz)


@attrs.frozen(kw_only=True, eq=False)
class Pending:
    """A decode step running in a worker thread (:func:`decode_launch`): a State in flight.

    - ``runtime``, ``batch``: what it runs.
    - ``release``: slots :func:`decode_finish` frees after the step (:func:`defer_release`).
    - ``live``: [num_slots] which slots the returned state will hold requests in (after ``release``).
    - ``generated``: [num_slots] tokens sampled per slot once the step is done.
    - ``rng_key``: the RNG key of the state it returns.
    - ``prompt_mask``: the state's prompt masks (for :func:`prepare_next`).
    - ``next``: the next step's inputs made while it runs (:func:`prepare_next`), or None.
    - ``launched``: ``time.perf_counter()`` at launch.
    """

    runtime: Runtime
    batch: DecodeBatch
    release: tuple[int, ...]
    live: tuple[bool, ...]
    generated: tuple[int, ...]
    rng_key: int
    prompt_mask: Tensor
    launched: float
    next: Prepared | None = None
    _future: Future = attrs.field(alias="future")  # -> (StepOutput, State) of decode_step
    _lease: _Lease = attrs.field(factory=_Lease, alias="lease")

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
        """Whether :func:`decode_finish` or :func:`defer_release` already used this value."""
        return not self._lease.valid


def _check_pending(pending: object) -> None:
    if not isinstance(pending, Pending):
        raise InputError(f"pending is a {type(pending).__name__}; pass the Pending returned by decode_launch or defer_release.")
    if pending.consumed:
        raise StateConsumedError("this Pending was already finished or replaced (defer_release returns a new one); "
                                 "use the value that call returned.")


def decode_launch(runtime: Runtime, state: State, batch: DecodeBatch, prepared: Prepared | None = None) -> Pending:
    """Start :func:`~neuronfx.runtime.steps.decode_step` ``(runtime, state, batch)`` in a worker
    thread and return at once. ``state`` is consumed now (using it raises StateConsumedError);
    :func:`decode_finish` returns the step's output and new state. ``prepared``: inputs made
    ahead (:func:`prepare_next`), used when they fit this step, else made now. Raises, before
    any change, what ``decode_step`` raises for bad input; an error inside the step is raised by
    ``decode_finish``."""
    check_decode(runtime, state, batch, DecodeBatch)
    check_room(state, batch.seq_ids, 1, runtime.plan.inference.sequence_length, "release it or compile with a larger sequence_length.")
    check_params(runtime, batch.sampling)
    # Hand the state over: the caller's value is revoked, the worker gets a valid one on the
    # same tensors (decode_step checks it again, then consumes it).
    if not _fits(prepared, state, batch):
        prepared = prepare(runtime, batch.seq_ids, batch.sampling, [state.generated[s] for s in batch.seq_ids], state.rng_key,
                           state.prompt_mask)
    held = advance(state, cache_lens=state.cache_lens, generated=state.generated, live=state.live, rng_key=state.rng_key)
    future = _WORKER.submit(_decode_prepared, runtime, held, batch, prepared)
    generated = list(state.generated)
    for s in batch.seq_ids:
        generated[s] += 1
    return Pending(runtime=runtime, batch=batch, release=(), live=state.live, generated=tuple(generated), rng_key=prepared.next_key,
                   prompt_mask=state.prompt_mask, launched=time.perf_counter(), future=future)


_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neuronfx-decode")
"""The one thread every launched step runs in (started on the first launch, kept for the process;
shared by all runtimes: steps of two runtimes queue behind each other). One kept thread, not one
per step: a new thread would start a new OpenMP team for the graph at every step."""


def defer_release(pending: Pending, slots: Sequence[int]) -> Pending:
    """``pending`` with live slots ``slots`` also freed when it finishes (``pending`` is
    consumed). Raises InputError for a slot that is not live or already queued
    for release."""
    _check_pending(pending)
    slots = tuple(slots)
    for s in slots:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < pending.num_slots or not pending.live[s]:
            raise InputError(f"slot {s!r} is not a live slot of this step's state; free slots are {list(pending.free_slots)}.")
    if len(set(slots)) != len(slots):
        raise InputError(f"slots {list(slots)} contain duplicates.")
    pending._lease.valid = False
    live = tuple(on and s not in slots for s, on in enumerate(pending.live))
    return attrs.evolve(pending, release=pending.release + slots, live=live, lease=_Lease())


def prepare_next(pending: Pending, seq_ids: Sequence[int], sampling: Sequence[SamplingParams]) -> Pending:
    """``pending`` (consumed) with the inputs of a decode step over ``seq_ids`` after it made
    now (:class:`Prepared`, from the counts and key its state will have), for
    :func:`decode_launch` to use if the next step has exactly those rows."""
    _check_pending(pending)
    prepared = prepare(pending.runtime, seq_ids, sampling, [pending.generated[s] for s in seq_ids], pending.rng_key,
                       pending.prompt_mask)
    pending._lease.valid = False
    return attrs.evolve(pending, next=prepared, lease=_Lease())


def decode_finish(pending: Pending) -> tuple[StepOutput, State]:
    """Wait for ``pending``'s step; returns its (StepOutput, new State), with the slots of
    ``pending.release`` freed. ``pending`` is consumed. Raises what the step raised."""
    _check_pending(pending)
    pending._lease.valid = False
    out, state = pending._future.result()
    if pending.release:
        state = release(pending.runtime, state, list(pending.release))
    return out, state


Flight = State | Pending
"""What the overlapped scheduler passes from one iteration to the next: a State, or a Pending
decode step (the state in flight)."""


# --- the scheduler: chain decode steps, deliver while the next one runs ---------------------------


def check_async(runtime: Runtime, speculative: bool) -> None:
    """Raise ConfigError for a runtime or option overlapped decode cannot run: a runtime that
    speculates (``speculative`` and ``runtime.can_speculate``: the number of tokens a speculate
    step keeps is only known when it returns), tensor-parallel plans (the collectives would
    run in the worker thread; not supported yet) and chunked-prefill plans (prefix caching
    included: a prompt admitted by chunks would have to interleave with the overlapped steps)."""
    if speculative and runtime.can_speculate:
        raise ConfigError(
            "async_decode=True with a runtime that speculates: a speculate step's next input is only known when it "
            "returns, so there is nothing to overlap; pass speculative=False (--no-speculation) or drop async_decode."
        )
    if runtime.plan.inference.tp_degree > 1:
        raise ConfigError(
            f"async_decode=True with tp_degree={runtime.plan.inference.tp_degree}: overlapped decode runs one process's "
            "steps in a worker thread and is not supported with tensor-parallel ranks yet; drop async_decode."
        )
    if runtime.plan.inference.prefill_chunk_size is not None:
        raise ConfigError(
            f"async_decode=True with prefill_chunk_size={runtime.plan.inference.prefill_chunk_size}: overlapped decode does "
            "not interleave prompt chunks (nor prefix-cache hits, which continue by chunks) with its decode steps yet; "
            "drop async_decode or compile without prefill_chunk_size."
        )


def stops_for_sure(request: Request, count: int, token: int, eos: frozenset[int]) -> bool:
    """Whether the request's ``count``-th token ``token`` ends it whatever its text: eos (unless
    ignore_eos) or a stop id once ``min_tokens`` are out, or ``max_tokens`` reached; the same
    conditions as :func:`neuronfx.runtime.scheduler.stop_check` minus stop strings."""
    sp = request.sampling
    by_token = count >= sp.min_tokens and ((not sp.ignore_eos and token in eos) or token in sp.stop_token_ids)
    return by_token or count >= sp.max_tokens


def _decode_batch(rows: Sequence[Progress], input_ids: Sequence[int]) -> DecodeBatch:
    return DecodeBatch(seq_ids=[r.slot for r in rows], input_ids=input_ids, sampling=[r.request.sampling for r in rows])


def _needs_sync(runtime: Runtime, state: State, queue: Queue) -> bool:
    """Whether the next iteration must be a synchronous :func:`~neuronfx.runtime.scheduler.step`:
    a waiting request can be admitted (a prefill), or a running one reaches the longrope switch
    (a refill)."""
    switch = rope_switch_refill(runtime)
    refill = switch is not None and any(state.cache_lens[r.slot] == switch for r in queue.running)
    return bool(queue.waiting and state.free_slots) or refill


def _deliver(queue: Queue, rows: Sequence[Progress | None], out: StepOutput, tokenizer: Any,
             eos: frozenset[int]) -> tuple[Queue, list[Progress], list[TokenEvent]]:
    """Step ``out``'s tokens through the stop rule for each row still running (None: a row that
    ended while the step ran, its token dropped): (queue with the rows updated and the finished
    ones removed, the finished rows, the events). As the synchronous scheduler's
    ``_finish_step`` without the release."""
    updated: dict[int, Progress] = {}
    done, events = [], []
    for r, run in enumerate(rows):
        if run is None:
            continue
        run = attrs.evolve(run, passes=run.passes + 1)
        if out.finite[r]:
            run, event = advance_request(run, out.tokens[r], None if out.logprobs[r] is None else out.logprobs[r][0], tokenizer, eos)
        else:  # NaN/inf logits: the token is garbage; report the request, keep the others
            event = TokenEvent(index=run.index, token_id=None, text="", logprobs=None, finish_reason="error", stop_reason=None)
        events.append(event)
        if event.finish_reason is not None:
            done.append(run)
        else:
            updated[run.slot] = run
    ended = {r.slot for r in done}
    running = tuple(updated.get(r.slot, r) for r in queue.running if r.slot not in ended)
    return attrs.evolve(queue, running=running), done, events


def overlap_step(runtime: Runtime, flight: Flight, queue: Queue, eos_token_ids: frozenset[int],
                 tokenizer: Any = None) -> tuple[list[TokenEvent], Flight, Queue]:
    """One iteration of the overlapped scheduler; returns (events, flight, queue), ``flight``
    (a State or the Pending of the last iteration) is consumed.

    With a Pending: wait for it; launch the next decode step for every request its tokens do
    not end for sure (:func:`stops_for_sure`), unless a request can be admitted or refilled;
    then deliver its tokens (stop rules, text) while the new step runs; requests that ended are
    freed when that step returns (:func:`defer_release`). Otherwise (or after a synchronous
    delivery) run a synchronous :func:`~neuronfx.runtime.scheduler.step` when a request can be
    admitted or refilled, and launch a decode step for the running requests. Never speculates.
    """
    events: list[TokenEvent] = []
    if isinstance(flight, Pending):
        out, state = decode_finish(flight)
        by_slot = {r.slot: r for r in queue.running}
        rows = [by_slot.get(s) for s in flight.batch.seq_ids]  # None: ended while the step ran (freed now)
        t_decode = time.perf_counter() - flight.launched
        queue = attrs.evolve(queue, decode_s=queue.decode_s + t_decode)
        on = [(run, out.tokens[r]) for r, run in enumerate(rows)
              if run is not None and out.finite[r] and not stops_for_sure(run.request, len(run.tokens) + 1, out.tokens[r], eos_token_ids)]
        switch = rope_switch_refill(runtime)
        admit = queue.waiting and (state.free_slots or len(on) < sum(run is not None for run in rows))
        refill = switch is not None and any(state.cache_lens[run.slot] == switch for run, _ in on)
        if on and not admit and not refill:
            pending = decode_launch(runtime, state, _decode_batch([run for run, _ in on], [t for _, t in on]), flight.next)
            queue, done, events = _deliver(queue, rows, out, tokenizer, eos_token_ids)
            if done:
                pending = defer_release(pending, [run.slot for run in done])
            return events, _prepare_following(pending, queue), queue
        queue, done, events = _deliver(queue, rows, out, tokenizer, eos_token_ids)
        flight = release(runtime, state, [run.slot for run in done]) if done else state
    state = flight
    if _needs_sync(runtime, state, queue):
        more, state, queue = step(runtime, state, queue, eos_token_ids, tokenizer, speculative=False)
        events += more
    if queue.running and not _needs_sync(runtime, state, queue):
        pending = decode_launch(runtime, state, _decode_batch(queue.running, [r.tokens[-1] for r in queue.running]))
        return events, _prepare_following(pending, queue), queue
    return events, state, queue


def _prepare_following(pending: Pending, queue: Queue) -> Pending:
    """``pending`` with the next step's inputs prepared for the running requests whose token
    from ``pending`` cannot reach max_tokens (the other ends are only known from the tokens: the
    next launch then makes its own). Runs on the host while ``pending`` runs."""
    rows = [r for r in queue.running if len(r.tokens) + 1 < r.request.sampling.max_tokens]
    if not rows:
        return pending
    return prepare_next(pending, [r.slot for r in rows], [r.request.sampling for r in rows])


def overlap_abort(runtime: Runtime, flight: Flight, queue: Queue, index: int) -> tuple[Flight, Queue]:
    """:func:`neuronfx.runtime.scheduler.abort` for the overlapped scheduler: a running request
    in flight is dropped now and its slot freed when the step returns (its token is never
    delivered). Raises InputError for an index that is neither waiting nor running."""
    if isinstance(flight, State) or any(i == index for i, _ in queue.waiting):
        return abort(runtime, flight, queue, index)
    for run in queue.running:
        if run.index == index:
            flight = defer_release(flight, [run.slot])
            return flight, attrs.evolve(queue, running=tuple(r for r in queue.running if r.index != index))
    raise InputError(f"request index {index!r} is neither waiting nor running; nothing to abort.")


def busy(flight: Flight, queue: Queue) -> bool:
    """Whether :func:`overlap_step` has work: requests wait or run, or a step is in flight."""
    return not queue.idle or isinstance(flight, Pending)


def settle(flight: Flight) -> State:
    """The state of ``flight``: a Pending is waited for and its tokens dropped (call it once the
    requests it ran ended or were aborted)."""
    return decode_finish(flight)[1] if isinstance(flight, Pending) else flight


def overlap_schedule(runtime: Runtime, state: State, requests: Sequence[Request], eos_token_ids: frozenset[int],
                     tokenizer: Any = None) -> Iterator[TokenEvent | Finished]:
    """:func:`neuronfx.runtime.scheduler.schedule` with overlapped decode (:func:`overlap_step`):
    the events of decode step n are yielded while step n + 1 runs. Requests are assumed
    validated (and :func:`check_async` passed); ``state`` is consumed."""
    queue, flight = Queue(), state
    for i, req in enumerate(requests):
        queue = submit(queue, i, req)
    while busy(flight, queue):
        events, flight, queue = overlap_step(runtime, flight, queue, eos_token_ids, tokenizer)
        yield from events
    yield Finished(state=settle(flight), prefill_s=queue.prefill_s, decode_s=queue.decode_s, num_requests=len(requests))
