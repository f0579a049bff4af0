"""Engine events to OpenAI responses: a whole response once every choice finished, or a stream of
Server-Sent Events (a chunk per text delta, the usage, ``data: [DONE]``), and the JSON shapes
both are made of (completions and chat choices, logprobs objects, usage).

A client that disconnects aborts its requests (Starlette cancels the stream; a whole response
watches for the disconnect). With vLLM's ``stream_options.continuous_usage_stats`` (and
``include_usage``) every chunk carries the usage so far. A stream whose request ends without
an answer (the server's stop aborted it, or the engine failed) ends with an error event, then
``data: [DONE]``. A chat with tools reads its text with a scanner (``tools.py``): whole, its
``message.tool_calls``; streamed, OpenAI's ``delta.tool_calls``, which add up to the whole answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import attrs
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from neuronfx.runtime.pipeline import Logprobs
from neuronfx.runtime.requests import Request as EngineRequest
from neuronfx.runtime.requests import TokenEvent
from neuronfx.server import protocol as p
from neuronfx.server.echo import echo_logprobs, joined, vllm_prompt_logprobs
from neuronfx.server.engine import RETRY_AFTER_S, Engine, EngineNotReady, EngineOverloaded, EngineStopping, Sink
from neuronfx.server.served import Served
from neuronfx.server.tool_parsers import Scanner
from neuronfx.server.tools import CallStream, advance, chat_call_deltas, chat_tool_calls, finish_reason

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    """A response id: ``cmpl-...`` or ``chatcmpl-...`` and 32 hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: Sequence[Logprobs], decode: Callable[[int], str], offset: int) -> dict:
    """The legacy completions logprobs object for ``entries`` (one per token): token strings,
    their logprobs, the top-N as {token string: logprob} and each token's text offset from
    ``offset`` (characters)."""
    tokens = [decode(e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{decode(i): lp for i, lp in zip(e.top_ids, e.top_logprobs)} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[Logprobs], decode: Callable[[int], str]) -> dict:
    """Chat's logprobs object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(e.token_id, e.logprob) | {"top_logprobs": [entry(i, lp) for i, lp in zip(e.top_ids, e.top_logprobs)]}
                        for e in entries]}


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_choice(index: int, text: str | None, logprobs: dict | None, finish_reason: str | None, stop_reason: int | str | None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text} | ({"tool_calls": tool_calls} if tool_calls else {})
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_delta_choice(index: int, delta: dict, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def response_body(kind: str, id: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
    """A whole response (``kind`` "text_completion" or "chat.completion") or a streamed chunk
    ("chat.completion.chunk"; completions chunks are "text_completion" too)."""
    return {"id": id, "object": kind, "created": created, "model": model, "choices": choices, "usage": usage}


@attrs.define
class Choice:
    """One choice as its events arrive."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[Logprobs] = attrs.Factory(list)  # every token's
    pending: list[Logprobs] = attrs.Factory(list)  # not yet streamed
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent: CallStream = attrs.Factory(CallStream)  # what a stream sent of its content and tool calls
    prompt_logprobs: tuple[Logprobs | None, ...] = ()  # its prompt's (SamplingParams.prompt_logprobs), from its first event
    started: bool = False  # its first completions choice (or stream chunk) was built: the prompt goes there
    echo_chars: int = 0  # characters of the echoed prompt before its text (text offsets count them)

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.token_id is not None:
            self.num_tokens += 1
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
            self.pending.append(event.logprobs)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason


@attrs.frozen(kw_only=True, eq=False)
class Job:
    """One HTTP generation request in the engine: submits its requests, then answers with the
    whole response or a stream of chunks."""

    engine: Engine
    served: Served
    model: str
    kind: str  # "text_completion" or "chat.completion"
    id: str
    requests: list[EngineRequest]
    usage: str | None  # streamed usage: None, "last" (a last chunk) or "every" (every chunk too: vLLM's continuous_usage_stats)
    token_ids_as_text: bool  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    scanner: Scanner | None = None  # chat with tools: reads content and tool calls from the text (tools.py)
    prompt_logprobs_extra: bool = False  # vLLM's prompt_logprobs extra asked: each choice carries them
    echo: bool = False  # completions' echo: the prompt's text (and logprobs) before the completion's
    created: int = attrs.Factory(lambda: int(time.time()))

    async def respond(self, request: Request, stream: bool) -> Response:
        sink, ids = submit_requests(self.engine, self.served, self.requests)
        if stream:
            return StreamingResponse(self._chunks(sink, ids), media_type="text/event-stream", headers=SSE_HEADERS)
        return await self._whole(request, sink, ids)

    def _decode(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>"."""
        return f"token_id:{token_id}" if self.token_ids_as_text else self.served.tokenizer.decode([token_id])

    def _usage(self, choices: Sequence[Choice]) -> dict:
        # a prompt counts once, however many choices (n) it has, as OpenAI counts it
        return usage(sum(len(r.prompt) for r in self.requests if r.parent is None), sum(c.num_tokens for c in choices))

    async def _whole(self, request: Request, sink: Sink, ids: list[int]) -> Response:
        """The whole response once every choice finished; a client that disconnects first
        aborts its requests."""
        choices = await whole_choices(request, self.engine, sink, ids, len(self.requests))
        if choices is None:
            return Response(status_code=499)  # nobody reads it
        body = [self._choice(k, c) for k, c in enumerate(choices)]
        return JSONResponse(response_body(self.kind, self.id, self.created, self.model, body, self._usage(choices)))

    def _choice(self, k: int, choice: Choice) -> dict:
        """Choice ``k`` of the whole response, with its logprobs when the request asked."""
        wants = self.requests[k].sampling.logprobs is not None
        if self.kind == "chat.completion":
            logprobs = chat_logprobs(choice.logprobs, self._decode) if wants else None
            if self.scanner is None:
                return chat_choice(k, choice.text, logprobs, choice.finish_reason, choice.stop_reason)
            scan = self.scanner(choice.text, True)
            return chat_choice(k, scan.content or None, logprobs, finish_reason(choice.finish_reason, scan), choice.stop_reason,
                               chat_tool_calls(scan))
        return self._completion(k, choice, choice.text, choice.logprobs, 0, choice.finish_reason, choice.stop_reason)

    def _completion(self, k: int, choice: Choice, text: str, entries: Sequence[Logprobs], offset: int,
                    reason: str | None, stop_reason: int | str | None) -> dict:
        """A completions choice of ``text`` and the logprobs ``entries`` (from text offset
        ``offset``); with echo, the prompt's text and logprobs first (once: a stream's first
        chunk); vLLM's ``prompt_logprobs`` when the request asked."""
        request, prompt_text, first = self.requests[k], "", not choice.started
        width, echo, choice.started = request.sampling.logprobs, self.echo and first, True
        if echo:
            prompt_text = self.served.tokenizer.decode(list(request.prompt))
            choice.echo_chars = len(prompt_text)
        logprobs = None if width is None else completion_logprobs(entries, self._decode, offset + choice.echo_chars)
        if echo and logprobs is not None:
            logprobs = joined(echo_logprobs(request.prompt, choice.prompt_logprobs, self._decode, width), logprobs)
        body = completion_choice(k, prompt_text + text, logprobs, reason, stop_reason)
        if self.prompt_logprobs_extra and first:
            body["prompt_logprobs"] = vllm_prompt_logprobs(choice.prompt_logprobs, self._decode)
        return body

    async def _chunks(self, sink: Sink, ids: list[int]) -> AsyncIterator[str]:
        """The SSE stream: a chunk per text delta (chat: a first one with the role), the last
        with the finish_reason, the usage chunk when asked, then ``data: [DONE]``; a choice that
        fails in the engine or is aborted by the server's stop gives an error event instead of
        its last chunk. A client that disconnects cancels it: its requests are aborted."""
        chunk_kind = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        choices = [Choice() for _ in self.requests]
        done = 0
        try:
            if self.kind == "chat.completion":
                for k in range(len(choices)):
                    first = chat_delta_choice(k, {"role": "assistant", "content": ""}, None, None, None)
                    yield sse(response_body(chunk_kind, self.id, self.created, self.model, [first], self._chunk_usage(k, choices)))
            while done < len(choices):
                k, event = await sink.queue.get()
                choice = choices[k]
                offset = len(choice.text)
                choice.add(event)
                done += event.finish_reason is not None
                if event.finish_reason in ENDED:
                    yield sse(ENDED[event.finish_reason])
                    continue
                delta = self._delta(k, choice, event, offset)
                if delta is None:
                    continue  # held back (a partial character, a possible stop string or tool tag): its logprobs go with the next
                yield sse(response_body(chunk_kind, self.id, self.created, self.model, [delta], self._chunk_usage(k, choices)))
            if self.usage is not None:
                yield sse(response_body(chunk_kind, self.id, self.created, self.model, [], self._usage(choices)))
            yield "data: [DONE]\n\n"
        finally:
            if done < len(choices):  # cancelled: the client went away
                self.engine.abort(ids)

    def _chat_delta(self, choice: Choice, event: TokenEvent) -> tuple[dict, str | None]:
        """(chat's delta, finish_reason) of ``event``: its text, or under tools the content and
        tool-call deltas a scan of the text so far adds (finish_reason "tool_calls" after calls)."""
        if self.scanner is None:
            return ({"content": event.text} if event.text else {}), event.finish_reason
        scan = self.scanner(choice.text, event.finish_reason is not None)
        content, calls = advance(scan, choice.sent)
        delta = ({"content": content} if content else {}) | ({"tool_calls": chat_call_deltas(calls)} if calls else {})
        return delta, finish_reason(event.finish_reason, scan)

    def _chunk_usage(self, k: int, choices: Sequence[Choice]) -> dict | None:
        """The usage a chunk of choice ``k`` carries: its prompt and tokens so far under vLLM's
        continuous_usage_stats, else None."""
        return usage(len(self.requests[k].prompt), choices[k].num_tokens) if self.usage == "every" else None

    def _delta(self, k: int, choice: Choice, event: TokenEvent, offset: int) -> dict | None:
        """The streamed choice of ``event`` (its text delta, or its content and tool-call deltas
        under tools; the logprobs of the tokens since the last chunk; its finish_reason),
        clearing the pending logprobs; None when it has nothing to send yet."""
        delta, reason = self._chat_delta(choice, event) if self.kind == "chat.completion" else ({}, event.finish_reason)
        if event.finish_reason is None and not (delta if self.kind == "chat.completion" else event.text):
            return None
        wants = self.requests[k].sampling.logprobs is not None
        pending, choice.pending = choice.pending, []
        if self.kind == "chat.completion":
            logprobs = chat_logprobs(pending, self._decode) if wants else None
            return chat_delta_choice(k, delta, logprobs, reason, event.stop_reason)
        return self._completion(k, choice, event.text, pending, offset, event.finish_reason, event.stop_reason)


ENDED = {
    "error": p.error_body("the model produced no valid token (NaN/inf logits) or the engine failed; see the server's log.",
                          "server_error", code="internal_error"),
    "abort": p.error_body("the server stopped before this request finished (its --shutdown-timeout ran out); retry.",
                          "server_error", code="shutting_down"),
}
"""The error event a stream sends for a choice that ends without an answer, by finish_reason
(an abort streams only at a server's stop: a client that went away reads nothing)."""


def raise_ended(choices: Sequence[Choice]) -> None:
    """ApiError for a whole response whose requests ended without an answer: aborted (the
    server is stopping) or failed in the engine."""
    reasons = {c.finish_reason for c in choices}
    if "abort" in reasons:
        raise p.ApiError(503, "the server stopped before this request finished; retry.", type="server_error", code="shutting_down")
    if "error" in reasons:
        raise p.ApiError(500, "the model produced no valid token (NaN/inf logits) or the engine failed; see the server's log.",
                         type="server_error", code="internal_error")


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def disconnected(request: Request) -> None:
    """Return when the client disconnects (the request body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def submit_requests(engine: Engine, served: Served, requests: Sequence[EngineRequest]) -> tuple[Sink, list[int]]:
    """Submit one HTTP request's engine requests: (the sink their events arrive in, their engine
    ids); ApiError 400 for more than the server ever holds, 503 when the engine takes none now."""
    limit = served.runtime.plan.inference.batch_size + engine.max_waiting
    if len(requests) > limit:
        raise p.ApiError(400, f"{len(requests)} prompts in one request > {limit} (slots + --max-waiting) the server ever "
                              "holds; send fewer per request.", param="prompt")
    sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
    try:
        return sink, engine.submit(requests, sink)
    except EngineOverloaded as exc:
        raise p.ApiError(503, str(exc), type="server_error", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
    except EngineNotReady as exc:
        raise p.ApiError(503, str(exc), type="server_error", code="model_not_ready", headers={"Retry-After": "5"}) from exc
    except EngineStopping as exc:
        raise p.ApiError(503, str(exc), type="server_error", code="shutting_down") from exc


async def collect(sink: Sink, n: int) -> list[Choice]:
    """The ``n`` choices of a submit, once each finished."""
    choices = [Choice() for _ in range(n)]
    done = 0
    while done < n:
        k, event = await sink.queue.get()
        choices[k].add(event)
        done += event.finish_reason is not None
    return choices


async def whole_choices(request: Request, engine: Engine, sink: Sink, ids: list[int], n: int) -> list[Choice] | None:
    """The ``n`` finished choices, or None when the client disconnected first (its requests are
    then aborted); ApiError when they ended without an answer (:func:`raise_ended`)."""
    gathered = asyncio.ensure_future(collect(sink, n))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({gathered, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not gathered.done():  # the client went away (or the server cancels this task): free the slots
            gathered.cancel()
            engine.abort(ids)
    if not gathered.done() or gathered.cancelled():
        return None
    choices = gathered.result()
    raise_ended(choices)
    return choices
