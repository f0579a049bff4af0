"""The FastAPI app (llama.cpp's server "http" part): OpenAI's /v1/completions,
/v1/chat/completions (structured outputs and tools), /v1/responses (``responses_api.py``),
/v1/models and /v1/models/{id}, vLLM's /tokenize and /detokenize, /health (GET and HEAD) and
/metrics.

Every request is validated here, before it reaches the engine (types by pydantic in
``protocol.py``, values by neuronfx's named checks in ``requests.py``), so one bad request never
reaches a batch. Every error is OpenAI's error JSON (``errors.py``); bad input is a 400 (404 for
an unknown model or path), never a 500 or a traceback. Answers, whole or streamed, are
``responses.py``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from neuronfx.errors import InputError
from neuronfx.runtime.checks import check_token_ids
from neuronfx.runtime.fork import choices
from neuronfx.server import protocol as p
from neuronfx.server.embeddings import add_embeddings_routes
from neuronfx.server.engine import Engine
from neuronfx.server.errors import add_error_handlers
from neuronfx.server.requests import (
    chat_ids,
    check_model,
    check_tools,
    completion_prompts,
    engine_request,
    model_card,
    room,
    served_by,
    stream_usage,
)
from neuronfx.server.responses import Job, new_id
from neuronfx.server.responses_api import ResponseStore, add_responses_routes
from neuronfx.server.structured import structured_outputs
from neuronfx.server.tools import tool_plan
from neuronfx.version import __version__


def make_app(engine: Engine, model_name: str, stop_timeout: float = 5.0, tool_parser: str | None = None,
             store: ResponseStore | None = None) -> FastAPI:
    """The app serving ``engine`` as model ``model_name``. Its lifespan starts the engine
    thread (which builds the runtime) and, at shutdown, stops it (aborting what still runs;
    waiting at most ``stop_timeout`` seconds for the thread). ``tool_parser``: how "auto" tool
    calls are read (a ``tool_parsers.PARSERS`` name; None: chosen by the chat template);
    ``store``: where /v1/responses keeps answers for ``previous_response_id`` (None: a new
    :class:`ResponseStore` of this app)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop(stop_timeout)

    app = FastAPI(title="neuronfx", version=__version__, lifespan=lifespan)
    add_error_handlers(app)
    _add_status_routes(app, engine, model_name)
    _add_generation_routes(app, engine, model_name, tool_parser)
    add_responses_routes(app, engine, model_name, tool_parser, store if store is not None else ResponseStore())
    _add_token_routes(app, engine, model_name)
    add_embeddings_routes(app, engine, model_name)  # an embedding runtime's (--task embed)
    return app


def _add_status_routes(app: FastAPI, engine: Engine, model_name: str) -> None:
    """/health (GET and HEAD), /metrics, /v1/models and /v1/models/{id}."""
    created = int(time.time())

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        served_by(engine)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(model_name, created, served_by(engine))]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        served = served_by(engine)
        check_model(model_id, model_name)
        return JSONResponse(model_card(model_name, created, served))


def _add_generation_routes(app: FastAPI, engine: Engine, model_name: str, tool_parser: str | None) -> None:
    """/v1/completions and /v1/chat/completions: ``n`` choices per prompt (prompt p's choice c
    is choice p * n + c, as OpenAI), each a scheduler request; choices after a prompt's first
    copy its KV (``runtime/fork.py``)."""

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        served = served_by(engine)
        check_model(body.model, model_name)
        p.check_unsupported(body)
        max_tokens = p.COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        structured, field = structured_outputs(body)
        requests = choices([engine_request(body, ids, k, served, body.logprobs, max_tokens, "prompt", structured, field)
                            for k, ids in enumerate(completion_prompts(body, served))], body.n)
        job = Job(engine=engine, served=served, model=model_name, kind="text_completion", id=new_id("cmpl"),
                  requests=requests, usage=stream_usage(body), token_ids_as_text=body.return_tokens_as_token_ids, echo=body.echo,
                  prompt_logprobs_extra=body.prompt_logprobs is not None)
        return await job.respond(request, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        served = served_by(engine)
        check_model(body.model, model_name)
        p.check_unsupported(body)
        structured, field = structured_outputs(body)
        check_tools(served, body.tools)
        tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, tool_parser, served.tokenizer.chat_template,
                          constrained=structured is not None)
        if tools.structured is not None:
            structured, field = tools.structured, "tool_choice"
        ids = chat_ids(body.messages, served, add_generation_prompt=True, tools=tools.template_tools)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # vLLM: whatever room the slot has left
            max_tokens = room(ids, served)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        job = Job(engine=engine, served=served, model=model_name, kind="chat.completion", id=new_id("chatcmpl"),
                  requests=choices([engine_request(body, ids, 0, served, logprobs, max_tokens, "messages", structured, field)], body.n),
                  usage=stream_usage(body), token_ids_as_text=body.return_tokens_as_token_ids, scanner=tools.scanner)
        return await job.respond(request, body.stream)


def _add_token_routes(app: FastAPI, engine: Engine, model_name: str) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize."""

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> JSONResponse:
        served = served_by(engine)
        check_model(body.model, model_name)
        if (body.prompt is None) == (body.messages is None):
            raise p.ApiError(400, "give exactly one of prompt (text) and messages (a chat).", param="prompt")
        if body.messages is not None:
            ids = chat_ids(body.messages, served, body.add_generation_prompt, bool(body.add_special_tokens))
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(served.tokenizer(body.prompt, add_special_tokens=add)["input_ids"])
        strs = served.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": served.runtime.plan.inference.sequence_length, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> JSONResponse:
        served = served_by(engine)
        check_model(body.model, model_name)
        try:
            check_token_ids(body.tokens, served.runtime.plan.model.vocab_size)
        except InputError as exc:
            raise p.ApiError(400, str(exc), param="tokens") from exc
        return JSONResponse({"prompt": served.tokenizer.decode(body.tokens)})
