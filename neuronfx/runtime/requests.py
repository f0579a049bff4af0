"""The scheduler's requests and bookkeeping, as values: a :class:`Request` as submitted, its
:class:`Progress` once admitted, the :class:`Queue` of them, the events a schedule yields
(:class:`TokenEvent`, :class:`Finished`), and :func:`submit`, where a request is checked once
(:func:`check_request`; the server's handler and ``generate`` call the same check) before it
is queued. Nothing past ``submit`` checks a request again. :func:`step_batch` turns admitted
rows into the step batch of one kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from neuronfx.config.sampling import SamplingParams, check_sampling
from neuronfx.errors import InputError, SequenceLengthExceededError
from neuronfx.runtime.checks import check_prompts
from neuronfx.runtime.pipeline import Logprobs
from neuronfx.runtime.prefix_store import Match
from neuronfx.runtime.runtime import Runtime
from neuronfx.runtime.speculate import SpeculateBatch, SpeculationStats
from neuronfx.runtime.state import State
from neuronfx.runtime.steps import DecodeBatch, PrefillBatch
from neuronfx.runtime.structured import Grammars, Matcher, grammars_for


@attrs.frozen(kw_only=True)
class Request:
    """One request: prompt ids and its sampling. Its token budget is ``sampling.max_tokens``;
    None there means "until its slot is full", which :func:`submit` resolves to
    ``sequence_length - len(prompt)`` when given the runtime. ``priority`` (vLLM's): an int,
    lower is admitted first, ties in submission order; a running request is never preempted."""

    prompt: tuple[int, ...]  # [T] token ids
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    # Index of an earlier request with the same prompt (another of one prompt's n choices): while
    # it runs, this one copies its prompt's KV instead of prefilling (``runtime/fork.py``).
    parent: int | None = None
    priority: int = 0


@attrs.frozen(kw_only=True)
class TokenEvent:
    """One generated token of request ``index`` (input order)."""

    index: int
    token_id: int | None  # None only for finish_reason "error" (the logits were NaN/inf: no token)
    text: str  # text added by this token ("" without a tokenizer; may be held back, see delivery.py)
    logprobs: Logprobs | None  # when the request asked for logprobs
    finish_reason: str | None  # None while running, else "stop", "length" or "error" (NaN/inf logits)
    stop_reason: int | str | None  # the stop token id or stop string that ended it (vLLM's stop_reason)
    speculation: SpeculationStats | None = None  # on a speculative request's last event: its acceptance statistics
    # on the first event of a request asking SamplingParams.prompt_logprobs: one entry per prompt token, None first
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None


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
    tokens: tuple[int, ...] = ()  # tokens recorded (sampled and kept), in order
    delivered: int = 0  # of ``tokens``, those whose TokenEvents went out
    text: str = ""  # detokenized output of the delivered tokens (skip_special_tokens)
    sent: int = 0  # characters of ``text`` already emitted
    computed: int = 0  # prompt tokens in its slot (scheduled) while its prompt is chunked (vLLM's num_computed_tokens)
    prefix: Match | None = None  # its prefix-cache lookup, held while its prompt is chunked (prefix caching)
    passes: int = 0  # target passes after the prefill (decode and speculate steps)
    drafted: int = 0  # draft tokens proposed for it
    accepted: int = 0  # draft tokens accepted
    failed: bool = False  # its logits turned NaN/inf: it ends with finish_reason "error"
    matcher: Matcher | None = None  # its grammar state (structured outputs), consumed as its tokens are recorded
    grammar_done: int = 0  # tokens recorded when its matcher stopped (the grammar is complete): it ends there, "stop"
    prompt_logprobs: tuple[Logprobs | None, ...] = ()  # prompt logprobs its prefill or chunks scored so far (when asked)


@attrs.frozen(kw_only=True)
class Queue:
    """The scheduler's host-side bookkeeping, as a value: waiting requests (by priority, then
    oldest first: :func:`submit` keeps the order, so every reader of the head follows it),
    running ones (in slot-admission order), the one whose prompt is being prefilled in chunks
    (at most one; it holds a slot and has no token yet) and seconds spent in each phase
    (chunks count as prefill); with the blocks KV layout, the requests preempted (their blocks
    taken back, ``runtime/preempt.py``; they keep their slots) and how many evictions happened. ``grammars``: the compiled-grammar cache structured requests are
    checked with at submit and get their matchers from at admission (``runtime/structured.py``;
    ``scheduler.step`` makes one from its tokenizer when a structured request waits and there
    is none)."""

    waiting: tuple[tuple[int, Request], ...] = ()
    running: tuple[Progress, ...] = ()
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefilling: tuple[Progress, ...] = ()
    grammars: Grammars | None = None
    preempted: tuple[Progress, ...] = ()  # evicted from their KV blocks (blocks layout), to resume first
    preemptions: int = 0  # evictions so far

    @property
    def idle(self) -> bool:
        """Whether no request waits, runs, is being prefilled or is preempted."""
        return not self.waiting and not self.running and not self.prefilling and not self.preempted


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


def check_request(runtime: Runtime, index: int, request: Request, grammars: Grammars | None = None) -> None:
    """Raise the named error a step would raise for ``request`` later (bad prompt, sampling or
    token budget, a structured output the grammar library rejects: SamplingParamsError, checked
    with ``grammars``; InputError naming ``tokenizer=`` when it is structured and ``grammars``
    is None), so that it never reaches a batch it would fail for every other request in it. The
    one check of a request: the scheduler and the steps it drives trust it after."""
    if not isinstance(request, Request):
        raise InputError(f"request {index} is a {type(request).__name__}; submit a neuronfx.Request.")
    plan = runtime.plan
    if not isinstance(request.prompt, (list, tuple)):
        raise InputError(f"request {index}: prompt={request.prompt!r:.60} must be a tuple of token ids.")
    check_prompts(runtime, [request.prompt], start=index)
    check_sampling(request.sampling, plan.topk_width, plan.logprobs_width, plan.model.vocab_size, plan.inference.enable_prompt_logprobs)
    check_budget(runtime, index, len(request.prompt), budget(runtime, request))
    check_parent(index, request.parent)
    check_priority(index, request.priority)
    grammars_for(runtime, [request.sampling], None, grammars)


def check_parent(index: int, parent: object) -> None:
    """InputError unless ``parent`` is None or an int index below ``index`` (the request whose
    prompt KV request ``index`` may copy)."""
    if parent is not None and (isinstance(parent, bool) or not isinstance(parent, int) or parent >= index):
        raise InputError(f"request {index}: parent={parent!r} must be None or the index of an earlier request with the same "
                         "prompt (an int < its own index).")


def check_priority(index: int, priority: object) -> None:
    """InputError unless ``priority`` is an int (not a bool): lower runs first (vLLM's meaning)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InputError(f"request {index}: priority={priority!r} must be an int (lower is admitted first, default 0).")


def priorities(priority: object, n: int) -> tuple[int, ...]:
    """The ``n`` requests' priorities from one int for all or one int per request (vLLM's
    ``LLM.generate(priority=[...])``); InputError otherwise."""
    values = (priority,) * n if isinstance(priority, int) and not isinstance(priority, bool) else priority
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise InputError(f"priority={priority!r:.80} must be one int, or one int per prompt ({n}); lower runs first.")
    for b, value in enumerate(values):
        check_priority(b, value)
    return tuple(values)


def queued(waiting: tuple[tuple[int, Request], ...], index: int, request: Request) -> tuple[tuple[int, Request], ...]:
    """``waiting`` with ``(index, request)`` inserted after every request of the same or lower
    priority value (a stable insert: (priority, arrival) order, vLLM's priority scheduling)."""
    at = next((k for k, (_, r) in enumerate(waiting) if r.priority > request.priority), len(waiting))
    return waiting[:at] + ((index, request),) + waiting[at:]


def budget(runtime: Runtime, request: Request) -> int:
    """Tokens ``request`` may generate: ``sampling.max_tokens``, or the room its slot has after
    the prompt when that is None (vLLM's default for chat)."""
    max_tokens = request.sampling.max_tokens
    return runtime.plan.inference.sequence_length - len(request.prompt) if max_tokens is None else max_tokens


def submit(queue: Queue, index: int, request: Request, runtime: Runtime | None = None) -> Queue:
    """Queue ``request`` as ``index`` (a caller's id, unique among queued and running requests).

    With ``runtime``, the request is checked first (:func:`check_request`, a structured output
    with ``queue.grammars``) and a
    ``sampling.max_tokens`` of None becomes the slot's room (:func:`budget`); without it, it must
    already be checked (``neuronfx.runtime.generate.make_requests`` and the server's handler do
    it) and name its max_tokens. It waits behind every waiting request of the same or a lower
    ``priority`` value (:func:`queued`). Raises InputError for an index in use, a priority that
    is not an int or, without ``runtime``, no max_tokens; ``queue`` is a value and stays as it
    was when anything raises."""
    if any(i == index for i, _ in queue.waiting) or any(r.index == index for r in queue.running + queue.prefilling + queue.preempted):
        raise InputError(f"request index {index!r} is already queued or running; give each request its own index.")
    if runtime is not None:
        check_request(runtime, index, request, queue.grammars)
        request = attrs.evolve(request, sampling=attrs.evolve(request.sampling, max_tokens=budget(runtime, request)))
    elif not isinstance(request, Request) or request.sampling.max_tokens is None:
        raise InputError(f"request {index}: without runtime= its SamplingParams must give max_tokens (the scheduler cannot "
                         "tell the slot's room); pass runtime=, or SamplingParams(max_tokens=N).")
    check_priority(index, request.priority)
    return attrs.evolve(queue, waiting=queued(queue.waiting, index, request))


def step_batch(kind: str, rows: Sequence[Progress]) -> PrefillBatch | SpeculateBatch | DecodeBatch:
    """The step batch of ``rows``: a prefill gets each row's prompt, a refill each row's whole
    sequence, a decode or speculate batch each row's last token (a speculate batch each row's
    prompt and tokens too, its ``history``); structured rows their matchers."""
    slots, sampling = [r.slot for r in rows], [r.request.sampling for r in rows]
    constraints = None if all(r.matcher is None for r in rows) else [r.matcher for r in rows]
    if kind == "prefill":
        return PrefillBatch(seq_ids=slots, prompts=[r.request.prompt for r in rows], sampling=sampling, constraints=constraints)
    if kind == "refill":
        return PrefillBatch(seq_ids=slots, prompts=[r.request.prompt + r.tokens for r in rows], sampling=sampling,
                            constraints=constraints)
    if kind == "speculate":  # history: what prompt lookup searches
        return SpeculateBatch(seq_ids=slots, input_ids=[r.tokens[-1] for r in rows], sampling=sampling, constraints=constraints,
                              history=[r.request.prompt + r.tokens for r in rows])
    return DecodeBatch(seq_ids=slots, input_ids=[r.tokens[-1] for r in rows], sampling=sampling, constraints=constraints)
