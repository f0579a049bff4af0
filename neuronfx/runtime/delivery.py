"""What the scheduler does with a step's tokens, in two parts that touch no tensor:

- :func:`record`: integer bookkeeping (each request's new tokens, up to the first that ends it
  for sure: eos or a stop id once min_tokens are out, max_tokens, NaN/inf logits, a complete
  grammar; its passes and acceptance counts; a chunked prompt's progress; a structured
  request's matcher consumes its tokens here). Cheap; what the next iteration's plan needs.
- :func:`deliver`: the text (detokenize, stop strings, held-back deltas) and one
  :class:`TokenEvent` per delivered token.

The synchronous scheduler records then delivers; the overlapped one records, launches the next
iteration, and delivers while it runs (``overlap.py``). One stop rule for both
(:func:`stop_check`, vLLM's ``StopChecker``); :func:`stops_for_sure` is that rule without stop
strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from neuronfx.runtime.pipeline import Logprobs, StepOutput
from neuronfx.runtime.requests import Progress, Queue, Request, TokenEvent
from neuronfx.runtime.speculate import SpeculationStats

FIRST = frozenset({"prefill", "chunk", "fork"})
"""Kinds of step that give a request its first token (the others count as target passes)."""


@attrs.frozen(kw_only=True, eq=False)
class Ran:
    """One step a scheduler iteration ran: its kind ("prefill", "chunk", "fork", "refill",
    "speculate" or "decode"), its requests in batch order, its output and its seconds."""

    kind: str
    rows: tuple[Progress, ...]
    out: StepOutput
    seconds: float


def stop_check(req: Request, tokens: Sequence[int], text: str, eos: frozenset[int], new_chars: int,
               grammar_done: int = 0) -> tuple[str | None, int | str | None, str]:
    """(finish_reason, stop_reason, text) after ``tokens[-1]`` was appended, vLLM's order:
    a complete grammar first (``grammar_done``: the token count at which the request's matcher
    stopped; 0: never; nothing can follow it, min_tokens or not); nothing else stops before
    ``min_tokens``; then eos (unless ``ignore_eos``), ``stop_token_ids`` (the token's text is
    dropped), stop strings (text cut before the string unless ``include_stop_str_in_output``;
    searched only where the last ``new_chars`` characters could complete one), and finally
    ``max_tokens`` ("length")."""
    sp, last = req.sampling, tokens[-1]
    if grammar_done and len(tokens) >= grammar_done:
        return "stop", None, text
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


def stops_for_sure(request: Request, count: int, token: int, eos: frozenset[int]) -> bool:
    """Whether the request's ``count``-th token ``token`` ends it whatever its text: eos (unless
    ignore_eos) or a stop id once ``min_tokens`` are out, or ``max_tokens`` reached; the same
    conditions as :func:`stop_check` minus stop strings."""
    sp = request.sampling
    by_token = count >= sp.min_tokens and ((not sp.ignore_eos and token in eos) or token in sp.stop_token_ids)
    return by_token or count >= sp.max_tokens


# --- record: tokens and counts ------------------------------------------------------------------


def _record_row(run: Progress, ran: Ran, r: int, eos: frozenset[int]) -> tuple[Progress, bool]:
    """``run`` after row ``r`` of ``ran``, and whether that ends it for sure. A chunk that is not
    its prompt's last records nothing; a row with NaN/inf logits records ``failed``."""
    out = ran.out
    if out.prompt_logprobs and out.prompt_logprobs[r] is not None:  # prefill or chunk of a request asking prompt logprobs
        run = attrs.evolve(run, prompt_logprobs=run.prompt_logprobs + out.prompt_logprobs[r])
    if ran.kind not in FIRST:
        accepted = min(len(out.new_tokens[r]) - 1, out.num_drafted[r])  # a padded proposal's accepted filler is no draft
        run = attrs.evolve(run, passes=run.passes + 1, drafted=run.drafted + out.num_drafted[r], accepted=run.accepted + accepted)
    if not out.finite[r]:
        return attrs.evolve(run, failed=True, prefix=None), True
    tokens = run.tokens
    for t in out.new_tokens[r]:
        tokens += (t,)
        if run.matcher is not None:  # structured: the matcher follows the recorded tokens
            if not run.matcher.consume([t]):  # never under its own mask: a backend fault, reported as an error
                return attrs.evolve(run, tokens=tokens[:-1], failed=True, prefix=None), True
            if run.matcher.is_stopped():
                return attrs.evolve(run, tokens=tokens, prefix=None, grammar_done=len(tokens)), True
        if stops_for_sure(run.request, len(tokens), t, eos):
            return attrs.evolve(run, tokens=tokens, prefix=None), True
    return attrs.evolve(run, tokens=tokens, prefix=None if tokens else run.prefix), False


def record(queue: Queue, ran: Sequence[Ran], eos: frozenset[int]) -> tuple[Queue, tuple[Progress, ...]]:
    """(``queue`` after the steps of ``ran``, the requests they ended for sure, removed from it).
    A request not in ``queue`` any more (aborted, or ended by a stop string while the steps ran)
    is skipped: its tokens are dropped. A chunked prompt whose last chunk ran joins the running
    requests (at the end, as an admitted one does)."""
    current = {r.index: r for r in queue.running + queue.prefilling}
    ended: dict[int, Progress] = {}
    for step in ran:
        for r, row in enumerate(step.rows):
            if row.index in current:
                run, done = _record_row(current[row.index], step, r, eos)
                current[row.index] = run
                if done:
                    ended[run.index] = run
    running = [current[r.index] for r in queue.running if r.index not in ended]
    prefilling = [current[r.index] for r in queue.prefilling if r.index not in ended]
    running += [r for r in prefilling if r.tokens]  # its last chunk gave its first token
    prefilling = [r for r in prefilling if not r.tokens]
    return attrs.evolve(queue, running=tuple(running), prefilling=tuple(prefilling)), tuple(ended.values())


# --- deliver: text and events -------------------------------------------------------------------


def deliver_token(run: Progress, logprobs: Logprobs | None, tokenizer: Any, eos: frozenset[int]) -> tuple[Progress, TokenEvent]:
    """Deliver ``run``'s next recorded token: detokenize, check the stop rules and cut the text
    delta to emit. While running, a trailing partial UTF-8 character (decoded as U+FFFD) and
    anything that could still become a stop string are held back; when the request finishes, a
    partial character left at the end is dropped from the text (vLLM's detokenizer does the
    same; its tokens still count), so a final text never ends in U+FFFD, and recorded tokens
    past the stop are dropped."""
    tokens = run.tokens[: run.delivered + 1]
    text = tokenizer.decode(list(tokens), skip_special_tokens=True) if tokenizer is not None else ""
    reason, stop_reason, text = stop_check(run.request, tokens, text, eos, max(0, len(text) - len(run.text)), run.grammar_done)
    if reason is None:
        hold = max((len(s) - 1 for s in run.request.sampling.stop), default=0)
        ready = max(run.sent, len(text.rstrip("\ufffd")) - hold)
    else:
        text = text.rstrip("\ufffd")
        ready = max(run.sent, len(text))
    event = TokenEvent(index=run.index, token_id=tokens[-1], text=text[run.sent:ready], logprobs=logprobs,
                       finish_reason=reason, stop_reason=stop_reason)
    run = attrs.evolve(run, tokens=tokens if reason else run.tokens, delivered=len(tokens), text=text, sent=ready)
    return run, event


def _deliver_row(run: Progress, logprobs: Sequence[Logprobs] | None, tokenizer: Any, eos: frozenset[int],
                 stats: bool) -> tuple[Progress, list[TokenEvent]]:
    """Events of ``run``'s recorded tokens not yet delivered (``logprobs``: one per new token of
    its step), until one finishes it; a failed request's one "error" event. With ``stats`` (the
    schedule speculates) the finishing event carries the request's SpeculationStats."""
    if run.failed:  # NaN/inf logits: its tokens are garbage; report the request, keep the others
        return run, [TokenEvent(index=run.index, token_id=None, text="", logprobs=None, finish_reason="error", stop_reason=None)]
    events, base = [], run.delivered
    while run.delivered < len(run.tokens):
        run, event = deliver_token(run, None if logprobs is None else logprobs[run.delivered - base], tokenizer, eos)
        if run.delivered == 1 and run.prompt_logprobs:  # its first event (a fork of n > 1 scored no prompt: none)
            event = attrs.evolve(event, prompt_logprobs=run.prompt_logprobs)
        events.append(event)
        if event.finish_reason is not None:
            if stats:
                summary = SpeculationStats(target_passes=run.passes, drafted=run.drafted, accepted=run.accepted,
                                           emitted=len(run.tokens) - 1)
                events[-1] = attrs.evolve(event, speculation=summary)
            break
    return run, events


def deliver(queue: Queue, ended: Sequence[Progress], ran: Sequence[Ran], tokenizer: Any, eos: frozenset[int],
            stats: bool = False) -> tuple[Queue, list[Progress], list[TokenEvent]]:
    """Deliver what :func:`record` recorded for the steps of ``ran`` (``ended``: the requests it
    ended): (queue with the running requests' text advanced and those a stop string ended
    removed, every request that finished here, the events in step and row order). A request in
    neither ``queue`` nor ``ended`` (aborted meanwhile) gets no event."""
    current = {r.index: r for r in (*queue.running, *ended)}
    done: dict[int, Progress] = {}
    events: list[TokenEvent] = []
    for step in ran:
        for r, row in enumerate(step.rows):
            run = current.get(row.index)
            if run is None or run.index in done:
                continue
            run, row_events = _deliver_row(run, step.out.logprobs[r], tokenizer, eos, stats)
            current[run.index] = run
            events += row_events
            if row_events and row_events[-1].finish_reason is not None:
                done[run.index] = run
    running = tuple(current[r.index] for r in queue.running if r.index not in done)
    return attrs.evolve(queue, running=running), list(done.values()), events
