"""A reference continuous-batching scheduler over the step API: first come, first served.

Read it as a template for your own. Each iteration of :func:`schedule`:

1. admit: while requests wait and slots are free, prefill the oldest waiting ones (one step);
   with chunked prefill (``InferenceConfig.prefill_chunk_size``), see "Chunked prefill" below,
   and with prefix caching (``enable_prefix_caching``), "Prefix caching";
2. decode: every running request advances (one step, padded to a batch bucket): by one token
   with ``decode_step``, or, when the runtime can speculate, by 1 to k tokens with
   ``speculate_step`` (rows with no room left for k more tokens take a ``decode_step``); a
   longrope request reaching its switch length is recomputed whole (``refill_step``, see
   :func:`rope_switch_refill`);
3. retire: requests that met a stop condition release their slots.

Plain and speculative requests share this bookkeeping and one stop rule, applied to every new
token in order (tokens a speculate step produced past a stop are dropped with the request).

A request whose logits turn NaN/inf (``StepOutput.finite``) finishes at once with
``finish_reason="error"`` (its event carries ``token_id=None``); the others run on unaffected.

Chunked prefill. When the runtime has chunk graphs, an iteration has a token budget
(``max_num_batched_tokens``, vLLM's name; an argument of :func:`step` and :func:`schedule`,
default ``prefill_chunk_size + batch_size``): the running requests' decode step comes first (one
token each), and the rest of the budget goes to prompts, as vLLM v1's scheduler fills its budget
(``vllm/v1/core/sched/scheduler.py``: running requests first, then waiting prefills, which may be
partial). A prompt longer than the largest prefill bucket is admitted alone into a slot and then
advances by one chunk per iteration (at most ``prefill_chunk_size`` tokens, at most the budget
left; at least one token, so it never starves) with ``chunk_step``; its last chunk samples its
first token and it joins the running requests. Only one prompt is chunked at a time, first come
first served; while it is, nothing else is admitted. Shorter prompts are admitted as before, in
one prefill step, as many as fit the budget left (the oldest always). So a running request waits
at most one decode step plus one chunk (or one short-prompt prefill) per token, however long
the prompt being admitted, and every request's tokens are those of an unchunked prefill.

Prefix caching. A prompt's cached leading blocks are copied into its slot when it is admitted
and only the rest is prefilled (``runtime/prefix.py``): prompts admitted together in one step
go through :func:`neuronfx.runtime.prefix.prefill_cached` (one prefill step for the misses, a
chunk step from its offset for each hit), and a prompt chunked alone starts its chunks after its
hit (:func:`~neuronfx.runtime.prefix.load_prefix` when it takes its slot,
:func:`~neuronfx.runtime.prefix.store_prefix` after its last chunk; an abort in between gives
its references back with :func:`~neuronfx.runtime.prefix.drop_prefix`). Every prompt's full
blocks are cached once it is prefilled, and a finished request's (prompt and generated tokens)
before its slot is released (:func:`~neuronfx.runtime.prefix.cache_sequences`, unless the
model's RoPE depends on the length), so a conversation's next turn reuses the answer too.

It never looks inside tensors; it only calls ``prefill_step``, ``chunk_step``, ``decode_step``,
``speculate_step`` and ``release`` and yields one :class:`TokenEvent` per generated token, then a
:class:`Finished` with the new state. Stop rules follow vLLM's ``StopChecker`` (see
:func:`stop_check`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from neuronfx.config.families import FAMILIES
from neuronfx.config.sampling import SamplingParams, check_sampling
from neuronfx.errors import InputError, SequenceLengthExceededError
from neuronfx.runtime.chunked import ChunkBatch, chunk_step
from neuronfx.runtime.prefix import cache_sequences, drop_prefix, load_prefix, outputs_reusable, prefill_cached, store_prefix
from neuronfx.runtime.prefix_store import Match
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.speculate import SpeculateBatch, SpeculationStats, speculate_step
from neuronfx.runtime.state import State
from neuronfx.runtime.steps import (
    DecodeBatch,
    Logprobs,
    PrefillBatch,
    StepOutput,
    check_prompts,
    decode_step,
    prefill_step,
    refill_step,
    release,
)


@attrs.frozen(kw_only=True)
class Request:
    """One request: prompt ids and its sampling. Its token budget is ``sampling.max_tokens``;
    None there means "until its slot is full", which :func:`submit` resolves to
    ``sequence_length - len(prompt)`` when given the runtime."""

    prompt: tuple[int, ...]  # [T] token ids
    sampling: SamplingParams = attrs.field(factory=SamplingParams)


@attrs.frozen(kw_only=True)
class TokenEvent:
    """One generated token of request ``index`` (input order)."""

    index: int
    token_id: int | None  # None only for finish_reason "error" (the logits were NaN/inf: no token)
    text: str  # text added by this token ("" without a tokenizer; may be held back, see module doc)
    logprobs: Logprobs | None  # when the request asked for logprobs
    finish_reason: str | None  # None while running, else "stop", "length" or "error" (NaN/inf logits)
    stop_reason: int | str | None  # the stop token id or stop string that ended it (vLLM's stop_reason)
    speculation: SpeculationStats | None = None  # on a speculative request's last event: its acceptance statistics


@attrs.frozen(kw_only=True, eq=False)
class Finished:
    """Last item of a schedule: the state after every request was released, and step timings."""

    state: State
    prefill_s: float  # seconds in prefill steps
    decode_s: float  # seconds in decode and speculate steps
    num_requests: int = 0  # requests the schedule ran (indices 0 .. num_requests - 1)


@attrs.frozen(kw_only=True)
class Progress:
    """One admitted request: its slot and what it produced so far."""

    index: int  # caller's request index
    request: Request
    slot: int
    tokens: tuple[int, ...] = ()
    text: str = ""  # detokenized output so far (skip_special_tokens)
    sent: int = 0  # characters of ``text`` already emitted
    computed: int = 0  # prompt tokens in its slot so far while its prompt is chunked (vLLM's num_computed_tokens)
    prefix: Match | None = None  # its prefix-cache lookup, held while its prompt is chunked (prefix caching)
    passes: int = 0  # target passes after the prefill (decode and speculate steps)
    drafted: int = 0  # draft tokens proposed for it
    accepted: int = 0  # draft tokens accepted


@attrs.frozen(kw_only=True)
class Queue:
    """The scheduler's host-side bookkeeping, as a value: waiting requests (oldest first),
    running ones (in slot-admission order), the one whose prompt is being prefilled in chunks
    (at most one; it holds a slot and has no token yet) and seconds spent in each phase
    (chunks count as prefill)."""

    waiting: tuple[tuple[int, Request], ...] = ()
    running: tuple[Progress, ...] = ()
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefilling: tuple[Progress, ...] = ()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.prefilling


def check_budget(runtime: Runtime, index: int, prompt_len: int, max_tokens: int) -> None:
    """Raise InputError unless ``max_tokens`` is an int >= 1, SequenceLengthExceededError when
    prompt + max_tokens does not fit a slot (``sequence_length``): nothing is ever cropped."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InputError(f"request {index}: max_tokens={max_tokens!r} must be an int >= 1.")
    seq_len = runtime.plan.inference.sequence_length
    if prompt_len + max_tokens > seq_len:
        raise SequenceLengthExceededError(
            f"prompt {index} has {prompt_len} tokens + max tokens {max_tokens} = {prompt_len + max_tokens} "
            f"> sequence_length={seq_len}; lower max_new_tokens/max_tokens or compile with a larger sequence_length."
        )


def check_request(runtime: Runtime, index: int, request: Request) -> None:
    """Raise the named error :func:`prefill_step` / :func:`decode_step` would raise for
    ``request`` later (bad prompt, sampling or token budget), so that it never reaches a batch
    it would fail for every other request in it."""
    if not isinstance(request, Request):
        raise InputError(f"request {index} is a {type(request).__name__}; submit a neuronfx.Request.")
    plan = runtime.plan
    if not isinstance(request.prompt, (list, tuple)):
        raise InputError(f"request {index}: prompt={request.prompt!r:.60} must be a tuple of token ids.")
    check_prompts(runtime, [request.prompt], start=index)
    check_sampling(request.sampling, plan.topk_width, plan.logprobs_width, plan.model.vocab_size)
    check_budget(runtime, index, len(request.prompt), budget(runtime, request))


def budget(runtime: Runtime, request: Request) -> int:
    """Tokens ``request`` may generate: ``sampling.max_tokens``, or the room its slot has after
    the prompt when that is None (vLLM's default for chat)."""
    max_tokens = request.sampling.max_tokens
    return runtime.plan.inference.sequence_length - len(request.prompt) if max_tokens is None else max_tokens


def submit(queue: Queue, index: int, request: Request, runtime: Runtime | None = None) -> Queue:
    """Queue ``request`` as ``index`` (a caller's id, unique among queued and running requests).

    With ``runtime``, the request is validated first (:func:`check_request`) and a
    ``sampling.max_tokens`` of None becomes the slot's room (:func:`budget`); without it, it must
    already be validated (``neuronfx.runtime.generate.make_requests`` does it) and name its
    max_tokens. Raises InputError for an index in use or, without ``runtime``, no max_tokens;
    ``queue`` is a value and stays as it was when anything raises."""
    if any(i == index for i, _ in queue.waiting) or any(r.index == index for r in queue.running + queue.prefilling):
        raise InputError(f"request index {index!r} is already queued or running; give each request its own index.")
    if runtime is not None:
        check_request(runtime, index, request)
        request = attrs.evolve(request, sampling=attrs.evolve(request.sampling, max_tokens=budget(runtime, request)))
    elif not isinstance(request, Request) or request.sampling.max_tokens is None:
        raise InputError(f"request {index}: without runtime= its SamplingParams must give max_tokens (the scheduler cannot "
                         "tell the slot's room); pass runtime=, or SamplingParams(max_tokens=N).")
    return attrs.evolve(queue, waiting=queue.waiting + ((index, request),))


def abort(runtime: Runtime, state: State, queue: Queue, index: int) -> tuple[State, Queue]:
    """Drop request ``index`` (vLLM's ``abort_request``): a waiting one leaves the queue, a
    running one releases its slot (``state`` is then consumed). Raises InputError for an index
    that is neither waiting nor running."""
    if any(i == index for i, _ in queue.waiting):
        return state, attrs.evolve(queue, waiting=tuple(w for w in queue.waiting if w[0] != index))
    for run in queue.running + queue.prefilling:
        if run.index == index:
            if run.prefix is not None:  # chunked and not prefilled yet: give its prefix-cache references back
                state = drop_prefix(runtime, state, [run.prefix])
            state = release(runtime, state, [run.slot])
            return state, attrs.evolve(queue, running=tuple(r for r in queue.running if r.index != index),
                                       prefilling=tuple(r for r in queue.prefilling if r.index != index))
    raise InputError(f"request index {index!r} is neither waiting nor running; nothing to abort.")


def stop_check(req: Request, tokens: Sequence[int], text: str, eos: frozenset[int], new_chars: int) -> tuple[str | None, int | str | None, str]:
    """(finish_reason, stop_reason, text) after ``tokens[-1]`` was appended, vLLM's order:
    nothing stops before ``min_tokens``; then eos (unless ``ignore_eos``), ``stop_token_ids``
    (the token's text is dropped), stop strings (text cut before the string unless
    ``include_stop_str_in_output``; searched only where the last ``new_chars`` characters could
    complete one), and finally ``max_tokens`` ("length")."""
    sp, last = req.sampling, tokens[-1]
    if len(tokens) >= sp.min_tokens:
        if not sp.ignore_eos and last in eos:
            return "stop", None, text
        if last in sp.stop_token_ids:  # an eos id the caller passed as eos_token_ids is still eos: reason None
            return "stop", None if last in eos else last, text[: len(text) - new_chars] if new_chars else text
        for stop in sp.stop:
            at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if at >= 0:
                return "stop", stop, text[: at + len(stop) if sp.include_stop_str_in_output else at]
    if len(tokens) >= sp.max_tokens:
        return "length", None, text
    return None, None, text


def advance_request(run: Progress, token: int, logprobs: Logprobs | None, tokenizer: Any, eos: frozenset[int]) -> tuple[Progress, TokenEvent]:
    """Append ``token`` to ``run``: detokenize, check stop rules, and cut the text delta to emit.
    While running, a trailing partial UTF-8 character (decoded as U+FFFD) and anything that could
    still become a stop string are held back; when the request finishes, a partial character
    left at the end is dropped from the text (vLLM's detokenizer does the same; its tokens still
    count), so a final text never ends in U+FFFD."""
    tokens = run.tokens + (token,)
    text = tokenizer.decode(list(tokens), skip_special_tokens=True) if tokenizer is not None else ""
    reason, stop_reason, text = stop_check(run.request, tokens, text, eos, max(0, len(text) - len(run.text)))
    if reason is None:
        hold = max((len(s) - 1 for s in run.request.sampling.stop), default=0)
        ready = max(run.sent, len(text.rstrip("\ufffd")) - hold)
    else:
        text = text.rstrip("\ufffd")
        ready = max(run.sent, len(text))
    event = TokenEvent(index=run.index, token_id=token, text=text[run.sent:ready], logprobs=logprobs,
                       finish_reason=reason, stop_reason=stop_reason)
    return attrs.evolve(run, tokens=tokens, text=text, sent=ready), event


def step(
    runtime: Runtime, state: State, queue: Queue, eos_token_ids: frozenset[int], tokenizer: Any = None,
    speculative: bool = True, max_num_batched_tokens: int | None = None,
) -> tuple[list[TokenEvent], State, Queue]:
    """One scheduler iteration: admit waiting requests into free slots (one prefill step; with
    chunked prefill, one chunk or one prefill step within the token budget
    ``max_num_batched_tokens``, see the module doc), advance every running request (a
    speculate step when ``speculative`` and the runtime can speculate, a decode step for the
    rest), release finished ones. Returns the iteration's events (one per token), the new state
    and queue. ``state`` is consumed. Raises InputError for a ``max_num_batched_tokens`` that is
    not None or an int >= 1 (before any change)."""
    events: list[TokenEvent] = []
    budget = token_budget(runtime, max_num_batched_tokens)
    if budget is None:
        admitted = _admit(queue, state, len(queue.waiting))
    elif queue.prefilling:
        admitted = []
        state, queue = _next_chunk(runtime, state, queue, budget - len(queue.running), tokenizer, eos_token_ids, events)
    else:
        admitted = _admit(queue, state, _admit_count(runtime, queue, state, budget - len(queue.running)))
        if not admitted and queue.waiting and state.free_slots:  # the oldest prompt is chunked: it takes a slot alone
            i, request = queue.waiting[0]
            run = Progress(index=i, request=request, slot=state.free_slots[0])
            if runtime.plan.inference.enable_prefix_caching:  # its cached blocks first; chunks start after them
                (hit,), state = load_prefix(runtime, state, [run.slot], [request.prompt])
                run = attrs.evolve(run, computed=hit.num_tokens, prefix=hit)
            queue = attrs.evolve(queue, waiting=queue.waiting[1:], prefilling=(run,))
            state, queue = _next_chunk(runtime, state, queue, budget - len(queue.running), tokenizer, eos_token_ids, events)
    queue = attrs.evolve(queue, waiting=queue.waiting[len(admitted):])
    if admitted:
        t0 = time.perf_counter()
        batch = PrefillBatch(seq_ids=[r.slot for r in admitted], prompts=[r.request.prompt for r in admitted],
                             sampling=[r.request.sampling for r in admitted])
        prefill = prefill_cached if runtime.plan.inference.enable_prefix_caching else prefill_step
        out, state = prefill(runtime, state, batch)
        queue = attrs.evolve(queue, prefill_s=queue.prefill_s + time.perf_counter() - t0)
        state, queue = _finish_step(runtime, state, queue, admitted, out, tokenizer, eos_token_ids, events, speculative, first=True)
    running, queue = list(queue.running), attrs.evolve(queue, running=())
    switch = rope_switch_refill(runtime)
    refilling = [r for r in running if state.cache_lens[r.slot] == switch]
    speculating = [r for r in running if r not in refilling and speculative and _can_speculate(runtime, state, r, switch)]
    for rows, run, kind in ((refilling, refill_step, PrefillBatch), (speculating, speculate_step, SpeculateBatch),
                            ([r for r in running if r not in speculating + refilling], decode_step, DecodeBatch)):
        if not rows:
            continue
        t0 = time.perf_counter()
        out, state = run(runtime, state, _batch(kind, rows))
        queue = attrs.evolve(queue, decode_s=queue.decode_s + time.perf_counter() - t0)
        state, queue = _finish_step(runtime, state, queue, rows, out, tokenizer, eos_token_ids, events, speculative)
    return events, state, queue


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


def _admit(queue: Queue, state: State, count: int) -> list[Progress]:
    """The ``count`` oldest waiting requests (at most one per free slot), each given a free slot."""
    pairs = zip(queue.waiting[:count], state.free_slots)
    return [Progress(index=i, request=r, slot=s) for (i, r), s in pairs]


def _admit_count(runtime: Runtime, queue: Queue, state: State, left: int) -> int:
    """How many of the oldest waiting prompts one prefill step takes under chunking: those that
    fit a prefill bucket, while their tokens fit ``left`` (the oldest always, so it never
    starves) and slots are free; 0 when the oldest needs chunks."""
    limit, count, tokens = runtime.plan.prefill_buckets[-1], 0, 0
    for _, request in queue.waiting[:len(state.free_slots)]:
        n = len(request.prompt)
        if n > limit or (count and tokens + n > left):
            break
        count, tokens = count + 1, tokens + n
    return count


def _next_chunk(runtime: Runtime, state: State, queue: Queue, left: int, tokenizer: Any, eos: frozenset[int],
                events: list[TokenEvent]) -> tuple[State, Queue]:
    """Prefill the next chunk of the prefilling request: at most ``prefill_chunk_size`` tokens
    and at most ``left`` (at least one); its last chunk gives its first token (it then runs)."""
    (run,) = queue.prefilling
    prompt = run.request.prompt
    n = min(runtime.plan.inference.prefill_chunk_size, max(1, left), len(prompt) - run.computed)
    final = run.computed + n == len(prompt)
    batch = ChunkBatch(seq_ids=[run.slot], chunks=[prompt[run.computed:run.computed + n]], sampling=[run.request.sampling],
                       final=[final], prompt_lens=[len(prompt)])
    t0 = time.perf_counter()
    out, state = chunk_step(runtime, state, batch)
    if run.prefix is not None and (final or not out.finite[0]):  # prefilled (cache its blocks) or failing
        done = final and out.finite[0]
        state = (store_prefix(runtime, state, [run.slot], [prompt], [run.prefix]) if done
                 else drop_prefix(runtime, state, [run.prefix]))
        run = attrs.evolve(run, prefix=None)  # its references are given back: an abort while it decodes has none to drop
    queue = attrs.evolve(queue, prefill_s=queue.prefill_s + time.perf_counter() - t0, prefilling=())
    if final or not out.finite[0]:  # its first token, or NaN/inf logits: the request ends with "error"
        return _finish_step(runtime, state, queue, [run], out, tokenizer, eos, events, False, first=True)
    return state, attrs.evolve(queue, prefilling=(attrs.evolve(run, computed=run.computed + n),))


def rope_switch_refill(runtime: Runtime) -> int | None:
    """The cache length at which a request is recomputed (:func:`refill_step`) instead of
    decoded, or None: longrope's ``original_max_position_embeddings`` L, when a whole sequence of
    L + 1 tokens fits a prefill bucket (the largest is ``max_context_length``, or
    ``prefill_chunk_size`` with chunked prefill). The token at position L is the first whose sequence is
    longer than L, where longrope switches to its long factors (``graphs.layers.row_inv_freq``);
    transformers' Phi-3 ``generate`` recomputes the cache there, and so does this scheduler for
    the families whose registry entry says so (``Family.recompute_at_rope_switch``; the others
    keep the keys cached before the switch, as transformers does for them). A plan whose prefill
    buckets are shorter decodes on: the keys cached before the switch keep their short-factor
    rotation (greedy tokens may then differ from transformers' past L)."""
    model = runtime.plan.model
    rs = model.rope_scaling
    if (rs is None or rs.rope_type != "longrope" or not FAMILIES[model.model_type].recompute_at_rope_switch
            or rs.original_max_position_embeddings >= runtime.plan.prefill_buckets[-1]):
        return None
    return rs.original_max_position_embeddings


def _batch(kind: type, rows: list[Progress]) -> PrefillBatch | SpeculateBatch | DecodeBatch:
    """The step batch of ``rows``: a refill (PrefillBatch) gets each row's whole sequence, a
    decode or speculate batch each row's last token."""
    slots, sampling = [r.slot for r in rows], [r.request.sampling for r in rows]
    if kind is PrefillBatch:
        return PrefillBatch(seq_ids=slots, prompts=[r.request.prompt + r.tokens for r in rows], sampling=sampling)
    return kind(seq_ids=slots, input_ids=[r.tokens[-1] for r in rows], sampling=sampling)


def _can_speculate(runtime: Runtime, state: State, run: Progress, switch: int | None) -> bool:
    """The runtime can speculate, the request's slot has room for k more tokens and the k tokens
    do not reach the longrope switch ``switch`` (the row decodes up to it, then is refilled)."""
    k, n = runtime.plan.inference.speculation_length, state.cache_lens[run.slot]
    crosses = switch is not None and n <= switch < n + k
    return runtime.can_speculate and n + k <= runtime.plan.inference.sequence_length and not crosses


def _finish_step(runtime: Runtime, state: State, queue: Queue, rows: list[Progress], out: StepOutput, tokenizer: Any,
                 eos: frozenset[int], events: list[TokenEvent], speculative: bool, first: bool = False) -> tuple[State, Queue]:
    """Record one step's new tokens for ``rows``, each through the stop rule in order (tokens
    past a stop are dropped); finished rows release their slots, the others run on."""
    keep, done, cached = [], [], []
    for r, run in enumerate(rows):
        if not first:  # accepted: what the verifier accepted, tokens a stop drops afterwards included
            accepted = len(out.new_tokens[r]) - 1 if out.num_drafted[r] else 0
            run = attrs.evolve(run, passes=run.passes + 1, drafted=run.drafted + out.num_drafted[r], accepted=run.accepted + accepted)
        if out.finite[r]:
            stats = speculative and runtime.can_speculate
            run, row_events = _advance_tokens(run, out.new_tokens[r], out.logprobs[r], tokenizer, eos, stats)
        else:  # NaN/inf logits: the tokens are garbage; report the request, keep the others
            row_events = [TokenEvent(index=run.index, token_id=None, text="", logprobs=None, finish_reason="error", stop_reason=None)]
        events += row_events
        (done if row_events[-1].finish_reason is not None else keep).append(run)
        if row_events[-1].finish_reason not in (None, "error") and outputs_reusable(runtime):
            cached.append(run)
    if cached:  # prefix caching: what their slots hold (prompt and generated tokens but the last) for the next turn
        sequences = [(r.request.prompt + r.tokens)[: state.cache_lens[r.slot]] for r in cached]
        state = cache_sequences(runtime, state, [r.slot for r in cached], sequences)
    if done:
        state = release(runtime, state, [r.slot for r in done])
    return state, attrs.evolve(queue, running=queue.running + tuple(keep))


def _advance_tokens(run: Progress, tokens: Sequence[int], logprobs: Sequence[Logprobs] | None, tokenizer: Any,
                    eos: frozenset[int], stats: bool) -> tuple[Progress, list[TokenEvent]]:
    """:func:`advance_request` for each new token until one finishes the request; with
    ``stats`` (the schedule speculates) the finishing event carries its SpeculationStats."""
    events = []
    for j, token in enumerate(tokens):
        run, event = advance_request(run, token, None if logprobs is None else logprobs[j], tokenizer, eos)
        events.append(event)
        if event.finish_reason is not None:
            if stats:
                summary = SpeculationStats(target_passes=run.passes, drafted=run.drafted, accepted=run.accepted,
                                           emitted=len(run.tokens) - 1)
                events[-1] = attrs.evolve(event, speculation=summary)
            break
    return run, events


def schedule(
    runtime: Runtime, state: State, requests: Sequence[Request], eos_token_ids: frozenset[int], tokenizer: Any = None,
    speculative: bool = True, max_num_batched_tokens: int | None = None,
) -> Iterator[TokenEvent | Finished]:
    """Run ``requests`` to completion, first come first served: yields every token's
    :class:`TokenEvent`, then :class:`Finished` with the new state (``state`` is consumed).

    Requests are assumed validated (``neuronfx.generate`` does it first); a step error is
    raised before that step changes anything. ``tokenizer`` (transformers) enables text and stop
    strings; ``speculative=False`` decodes one token per step even on a runtime that can
    speculate. ``max_num_batched_tokens``: the token budget of each iteration of a runtime with
    chunked prefill (:func:`token_budget`). A caller that stops iterating early keeps no usable
    state (slots stay live).
    """
    token_budget(runtime, max_num_batched_tokens)  # checked before the first step
    queue = Queue()
    for i, req in enumerate(requests):
        queue = submit(queue, i, req)
    while not queue.idle:
        events, state, queue = step(runtime, state, queue, eos_token_ids, tokenizer, speculative, max_num_batched_tokens)
        yield from events
    yield Finished(state=state, prefill_s=queue.prefill_s, decode_s=queue.decode_s, num_requests=len(requests))
