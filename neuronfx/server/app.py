"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions, /v1/models and
/v1/models/{id}, vLLM's /tokenize and /detokenize, /health (GET and HEAD) and /metrics.

Every request is validated here, before it reaches the engine (types by pydantic, values by
neuronfx's named checks: ``SamplingParams``, ``scheduler.check_request``, the stop strings), so
one bad request never reaches a batch. Every error is OpenAI's error JSON; bad input is a 400
(404 for an unknown model or path), never a 500 or a traceback.

Streaming is Server-Sent Events through Starlette's StreamingResponse, which cancels the stream
when the client disconnects (the request is then aborted and its slot freed at the next step);
a non-streaming request whose client disconnects is aborted too. With vLLM's
``stream_options.continuous_usage_stats`` (and ``include_usage``) every chunk carries the usage
so far. A stream whose request ends without an answer (the server's stop aborted it, or the
engine failed) ends with an error event, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from neuronfx.errors import InputError, PromptTooLongError, SamplingParamsError, SequenceLengthExceededError
from neuronfx.runtime.checks import check_prompts, check_token_ids
from neuronfx.runtime.generate import check_stop_strings
from neuronfx.runtime.pipeline import Logprobs
from neuronfx.runtime.requests import Request as EngineRequest
from neuronfx.runtime.requests import TokenEvent, check_request
from neuronfx.server import protocol as p
from neuronfx.server.engine import RETRY_AFTER_S, Engine, EngineNotReady, EngineOverloaded, EngineStopping, Served, Sink
from neuronfx.version import __version__

logger = logging.getLogger("neuronfx.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def make_app(engine: Engine, model_name: str, stop_timeout: float = 5.0) -> FastAPI:
    """The app serving ``engine`` as model ``model_name``. Its lifespan starts the engine
    thread (which builds the runtime) and, at shutdown, stops it (aborting what still runs;
    waiting at most ``stop_timeout`` seconds for the thread)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop(stop_timeout)

    app = FastAPI(title="neuronfx", version=__version__, lifespan=lifespan)
    _add_error_handlers(app)
    created = int(time.time())

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        _served(engine)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        served = _served(engine)
        return JSONResponse({"object": "list", "data": [_model_card(model_name, created, served)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        served = _served(engine)
        _check_model(model_id, model_name)
        return JSONResponse(_model_card(model_name, created, served))

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        served = _served(engine)
        _check_model(body.model, model_name)
        p.check_unsupported(body)
        prompts = _completion_prompts(body, served)
        max_tokens = p.COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        requests = [_engine_request(body, ids, k, served, body.logprobs, max_tokens, "prompt") for k, ids in enumerate(prompts)]
        job = _Job(engine=engine, served=served, model=model_name, kind="text_completion", id=p.new_id("cmpl"),
                   requests=requests, usage=_stream_usage(body), token_ids_as_text=body.return_tokens_as_token_ids)
        return await job.respond(request, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        served = _served(engine)
        _check_model(body.model, model_name)
        p.check_unsupported(body)
        ids = _chat_ids(body.messages, served, add_generation_prompt=True)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # vLLM: whatever room the slot has left
            max_tokens = _room(ids, served)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        job = _Job(engine=engine, served=served, model=model_name, kind="chat.completion", id=p.new_id("chatcmpl"),
                   requests=[_engine_request(body, ids, 0, served, logprobs, max_tokens, "messages")],
                   usage=_stream_usage(body), token_ids_as_text=body.return_tokens_as_token_ids)
        return await job.respond(request, body.stream)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> JSONResponse:
        served = _served(engine)
        _check_model(body.model, model_name)
        if (body.prompt is None) == (body.messages is None):
            raise p.ApiError(400, "give exactly one of prompt (text) and messages (a chat).", param="prompt")
        if body.messages is not None:
            ids = _chat_ids(body.messages, served, body.add_generation_prompt, bool(body.add_special_tokens))
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(served.tokenizer(body.prompt, add_special_tokens=add)["input_ids"])
        strs = served.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": served.runtime.plan.inference.sequence_length, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> JSONResponse:
        served = _served(engine)
        _check_model(body.model, model_name)
        try:
            check_token_ids(body.tokens, served.runtime.plan.model.vocab_size)
        except InputError as exc:
            raise p.ApiError(400, str(exc), param="tokens") from exc
        return JSONResponse({"prompt": served.tokenizer.decode(body.tokens)})

    return app


# --- errors -------------------------------------------------------------------------------------


class ErrorJSON(JSONResponse):
    """An error's JSON with every non-ASCII character escaped: its message may quote the request,
    whose strings JSON lets hold a lone surrogate, which UTF-8 cannot encode."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _add_error_handlers(app: FastAPI) -> None:
    """OpenAI's error JSON for every error: ApiError as raised, FastAPI's 422 as a 400, unknown
    paths (404) and methods (405), and a 500 without a traceback for anything unexpected."""

    @app.exception_handler(p.ApiError)
    async def api_error(request: Request, exc: p.ApiError) -> JSONResponse:
        return ErrorJSON(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = p.validation_message(exc.errors())
        return ErrorJSON(p.error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            body = p.error_body(f"Invalid URL ({where}): no such endpoint; see /docs.", "invalid_request_error", code="unknown_url")
        elif exc.status_code == 405:
            body = p.error_body(f"Method not allowed ({where}); see /docs.", "invalid_request_error", code="method_not_allowed")
        elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI: not JSON, not UTF-8
            body = p.error_body("the request body could not be read: send a JSON object as UTF-8 text.", "invalid_request_error")
        else:
            body = p.error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")
        return ErrorJSON(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return ErrorJSON(p.error_body("internal server error; see the server's log.", "server_error", code="internal_error"),
                         status_code=500)


def _served(engine: Engine) -> Served:
    """The engine's runtime and tokenizer; ApiError 503 while it loads or after it stopped."""
    served = engine.served
    if served is None:
        message = "the model is still loading or compiling; retry when GET /health answers 200."
        raise p.ApiError(503, message, type="server_error", code="model_not_ready", headers={"Retry-After": "5"})
    if not engine.ready:
        raise p.ApiError(503, "the server is shutting down; it takes no new request.", type="server_error", code="shutting_down")
    return served


def _stream_usage(body: p.GenerationRequest) -> str | None:
    """Where a stream reports usage: None, "last" (include_usage: one last chunk) or "every"
    (vLLM's continuous_usage_stats with include_usage: every chunk too, so far)."""
    options = body.stream_options
    if options is None or not options.include_usage:
        return None
    return "every" if options.continuous_usage_stats else "last"


def _model_card(model_name: str, created: int, served: Served) -> dict:
    """The served model as /v1/models lists it (OpenAI's model object and vLLM's extras)."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "neuronfx", "root": model_name, "parent": None,
            "max_model_len": served.runtime.plan.inference.sequence_length}


def _check_model(name: str | None, served_name: str) -> None:
    """ApiError 404 (OpenAI's model_not_found) when ``name`` is given and is not the served model."""
    if name is not None and name != served_name:
        raise p.ApiError(404, f"The model `{name}` does not exist; this server serves `{served_name}` (GET /v1/models).",
                         param="model", code="model_not_found")


# --- requests -> engine requests ----------------------------------------------------------------


def _completion_prompts(body: p.CompletionRequest, served: Served) -> list[list[int]]:
    """Token ids of each prompt: text is tokenized (special tokens added, as vLLM); ids pass."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise p.ApiError(400, "prompt is an empty list; give a string, a list of strings or token ids.", param="prompt")
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = prompt
    return [list(served.tokenizer(x)["input_ids"]) if isinstance(x, str) else list(x) for x in prompts]


def _chat_ids(messages: Sequence[p.ChatMessage], served: Served, add_generation_prompt: bool,
              add_special_tokens: bool = False) -> list[int]:
    """The messages through the model's chat template, as token ids; ApiError 400 for no
    messages, a template that refuses them (e.g. roles out of order) or no template."""
    from jinja2 import TemplateError

    if not messages:
        raise p.ApiError(400, "messages is empty; give at least one message.", param="messages")
    tokenizer = served.tokenizer
    try:
        ids = tokenizer.apply_chat_template(p.chat_messages(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=True)["input_ids"]
    except TemplateError as exc:
        raise p.ApiError(400, f"the model's chat template refused these messages: {exc}", param="messages") from exc
    except ValueError as exc:  # transformers: no chat template
        raise p.ApiError(400, f"this model's tokenizer has no chat template ({exc}); use /v1/completions.", param="messages") from exc
    ids = list(ids)
    if add_special_tokens:  # /tokenize's option; the template writes the special tokens it wants
        ids = list(tokenizer.build_inputs_with_special_tokens(ids))
    return ids


def _room(prompt: Sequence[int], served: Served) -> int:
    """Tokens left in a slot after ``prompt`` (chat's default max_tokens); ApiError 400 when none."""
    try:
        check_prompts(served.runtime, [prompt])
    except InputError as exc:
        raise _prompt_error(exc, "messages") from exc
    room = served.runtime.plan.inference.sequence_length - len(prompt)
    if room < 1:
        raise p.ApiError(400, f"the messages take {len(prompt)} tokens, which leaves no room to generate in sequence_length="
                              f"{served.runtime.plan.inference.sequence_length}; shorten them.", param="messages",
                         code="context_length_exceeded")
    return room


def _engine_request(body: p.GenerationRequest, prompt: list[int], index: int, served: Served, logprobs: int | None,
                    max_tokens: int, prompt_field: str) -> EngineRequest:
    """The scheduler request for one prompt, checked as the scheduler would check it
    (``check_request``) and its stop strings against the tokenizer; ApiError 400 otherwise."""
    sampling = p.sampling_params(body, logprobs, max_tokens)
    request = EngineRequest(prompt=tuple(prompt), sampling=sampling)  # sampling.max_tokens is the budget
    try:
        check_stop_strings(sampling, served.tokenizer)
        check_request(served.runtime, index, request)
    except SamplingParamsError as exc:
        raise p.ApiError(400, str(exc), param=p.sampling_param_name(body, exc)) from exc
    except InputError as exc:
        raise _prompt_error(exc, prompt_field) from exc
    return request


def _prompt_error(exc: InputError, prompt_field: str) -> p.ApiError:
    """The 400 of a prompt the plan cannot take: too long (OpenAI's "context_length_exceeded"),
    empty, or ids outside the vocabulary."""
    if isinstance(exc, SequenceLengthExceededError):
        return p.ApiError(400, str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, PromptTooLongError):
        return p.ApiError(400, str(exc), param=prompt_field, code="context_length_exceeded")
    return p.ApiError(400, str(exc), param=prompt_field)


# --- responses ----------------------------------------------------------------------------------


@attrs.define
class _Choice:
    """One choice as its events arrive."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[Logprobs] = attrs.Factory(list)  # every token's
    pending: list[Logprobs] = attrs.Factory(list)  # not yet streamed
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        if event.token_id is not None:
            self.num_tokens += 1
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
            self.pending.append(event.logprobs)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason


@attrs.frozen(kw_only=True, eq=False)
class _Job:
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
    created: int = attrs.Factory(lambda: int(time.time()))

    async def respond(self, request: Request, stream: bool) -> Response:
        limit = self.served.runtime.plan.inference.batch_size + self.engine.max_waiting
        if len(self.requests) > limit:
            raise p.ApiError(400, f"{len(self.requests)} prompts in one request > {limit} (slots + --max-waiting) the server ever "
                                  "holds; send fewer per request.", param="prompt")
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        try:
            ids = self.engine.submit(self.requests, sink)
        except EngineOverloaded as exc:
            raise p.ApiError(503, str(exc), type="server_error", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except EngineNotReady as exc:
            raise p.ApiError(503, str(exc), type="server_error", code="model_not_ready", headers={"Retry-After": "5"}) from exc
        except EngineStopping as exc:
            raise p.ApiError(503, str(exc), type="server_error", code="shutting_down") from exc
        if stream:
            return StreamingResponse(self._chunks(sink, ids), media_type="text/event-stream", headers=SSE_HEADERS)
        return await self._whole(request, sink, ids)

    def _decode(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>"."""
        return f"token_id:{token_id}" if self.token_ids_as_text else self.served.tokenizer.decode([token_id])

    def _usage(self, choices: Sequence[_Choice]) -> dict:
        return p.usage(sum(len(r.prompt) for r in self.requests), sum(c.num_tokens for c in choices))

    async def _collect(self, sink: Sink) -> list[_Choice]:
        choices = [_Choice() for _ in self.requests]
        done = 0
        while done < len(choices):
            k, event = await sink.queue.get()
            choices[k].add(event)
            done += event.finish_reason is not None
        return choices

    async def _whole(self, request: Request, sink: Sink, ids: list[int]) -> Response:
        """The whole response once every choice finished; a client that disconnects first
        aborts its requests."""
        collect = asyncio.ensure_future(self._collect(sink))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or the server cancels this task): free the slots
                collect.cancel()
                self.engine.abort(ids)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody reads it
        choices = collect.result()
        _raise_ended(choices)
        body = [self._choice(k, c) for k, c in enumerate(choices)]
        return JSONResponse(p.response_body(self.kind, self.id, self.created, self.model, body, self._usage(choices)))

    def _choice(self, k: int, choice: _Choice) -> dict:
        """Choice ``k`` of the whole response, with its logprobs when the request asked."""
        wants = self.requests[k].sampling.logprobs is not None
        if self.kind == "chat.completion":
            logprobs = p.chat_logprobs(choice.logprobs, self._decode) if wants else None
            return p.chat_choice(k, choice.text, logprobs, choice.finish_reason, choice.stop_reason)
        logprobs = p.completion_logprobs(choice.logprobs, self._decode, 0) if wants else None
        return p.completion_choice(k, choice.text, logprobs, choice.finish_reason, choice.stop_reason)

    async def _chunks(self, sink: Sink, ids: list[int]) -> AsyncIterator[str]:
        """The SSE stream: a chunk per text delta (chat: a first one with the role), the last
        with the finish_reason, the usage chunk when asked, then ``data: [DONE]``; a choice that
        fails in the engine or is aborted by the server's stop gives an error event instead of
        its last chunk. A client that disconnects cancels it: its requests are aborted."""
        chunk_kind = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        choices = [_Choice() for _ in self.requests]
        done = 0
        try:
            if self.kind == "chat.completion":
                for k in range(len(choices)):
                    first = p.chat_delta_choice(k, {"role": "assistant", "content": ""}, None, None, None)
                    yield _sse(p.response_body(chunk_kind, self.id, self.created, self.model, [first], self._chunk_usage(k, choices)))
            while done < len(choices):
                k, event = await sink.queue.get()
                choice = choices[k]
                offset = len(choice.text)
                choice.add(event)
                done += event.finish_reason is not None
                if event.finish_reason in _ENDED:
                    yield _sse(_ENDED[event.finish_reason])
                    continue
                if not event.text and event.finish_reason is None:
                    continue  # held back (a partial character or a possible stop string): its logprobs go with the next
                yield _sse(p.response_body(chunk_kind, self.id, self.created, self.model, [self._delta(k, choice, event, offset)],
                                           self._chunk_usage(k, choices)))
            if self.usage is not None:
                yield _sse(p.response_body(chunk_kind, self.id, self.created, self.model, [], self._usage(choices)))
            yield "data: [DONE]\n\n"
        finally:
            if done < len(choices):  # cancelled: the client went away
                self.engine.abort(ids)

    def _chunk_usage(self, k: int, choices: Sequence[_Choice]) -> dict | None:
        """The usage a chunk of choice ``k`` carries: its prompt and tokens so far under vLLM's
        continuous_usage_stats, else None."""
        return p.usage(len(self.requests[k].prompt), choices[k].num_tokens) if self.usage == "every" else None

    def _delta(self, k: int, choice: _Choice, event: TokenEvent, offset: int) -> dict:
        """The streamed choice of ``event`` (its text delta, the logprobs of the tokens since the
        last chunk, its finish_reason), clearing the pending logprobs."""
        wants = self.requests[k].sampling.logprobs is not None
        pending, choice.pending = choice.pending, []
        if self.kind == "chat.completion":
            logprobs = p.chat_logprobs(pending, self._decode) if wants else None
            delta = {"content": event.text} if event.text else {}
            return p.chat_delta_choice(k, delta, logprobs, event.finish_reason, event.stop_reason)
        logprobs = p.completion_logprobs(pending, self._decode, offset) if wants else None
        return p.completion_choice(k, event.text, logprobs, event.finish_reason, event.stop_reason)


_ENDED = {
    "error": p.error_body("the model produced no valid token (NaN/inf logits) or the engine failed; see the server's log.",
                          "server_error", code="internal_error"),
    "abort": p.error_body("the server stopped before this request finished (its --shutdown-timeout ran out); retry.",
                          "server_error", code="shutting_down"),
}
"""The error event a stream sends for a choice that ends without an answer, by finish_reason
(an abort streams only at a server's stop: a client that went away reads nothing)."""


def _raise_ended(choices: Sequence[_Choice]) -> None:
    """ApiError for a whole response whose requests ended without an answer: aborted (the
    server is stopping) or failed in the engine."""
    reasons = {c.finish_reason for c in choices}
    if "abort" in reasons:
        raise p.ApiError(503, "the server stopped before this request finished; retry.", type="server_error", code="shutting_down")
    if "error" in reasons:
        raise p.ApiError(500, "the model produced no valid token (NaN/inf logits) or the engine failed; see the server's log.",
                         type="server_error", code="internal_error")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the request body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

