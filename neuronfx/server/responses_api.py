"""OpenAI's Responses API, ``POST /v1/responses``: text input or input items (messages with
``input_text`` parts, ``function_call`` and ``function_call_output`` items), ``instructions``,
function tools (the flat shape), ``text.format`` (json_schema, json_object), streaming with
typed events (``response_events.py``), ``previous_response_id`` and ``store``.

A request becomes a chat: its instructions as a system message, the conversation of
``previous_response_id`` (its inputs and outputs, not its instructions, as OpenAI's), then its
input, through the chat template with its tools; tools and formats take chat's paths
(``tools.py``, ``structured.py``). Stored conversations live in the app's
:class:`ResponseStore` (bounded, oldest dropped first; nothing survives the server); an unknown
``previous_response_id`` is a 404, ``store: false`` keeps nothing.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from neuronfx.config.sampling import SamplingParams
from neuronfx.config.structured import StructuredOutputs
from neuronfx.errors import SamplingParamsError
from neuronfx.runtime.requests import Request as EngineRequest
from neuronfx.server import protocol as p
from neuronfx.server.engine import Engine
from neuronfx.server.requests import check_model, check_tools, checked_request, room, served_by, template_ids
from neuronfx.server.response_events import EventStream, item_id, output_items, output_messages, responses_usage, status_of
from neuronfx.server.responses import ENDED, SSE_HEADERS, Choice, submit_requests, whole_choices
from neuronfx.server.served import Served
from neuronfx.server.tool_parsers import Scan, Scanner
from neuronfx.server.tools import advance, tool_plan

MAX_STORED_RESPONSES = 1024
"""Conversations a server keeps for ``previous_response_id`` (the oldest is dropped first)."""


class InputPart(p.RequestModel):
    """A text part of an input message (an earlier answer's ``output_text`` too)."""

    type: Literal["input_text", "output_text"]
    text: p.Text
    annotations: list[Any] | None = None  # an earlier output's part sent back: ignored
    logprobs: list[Any] | None = None


class MessageItem(p.RequestModel):
    """An input message (``type`` may be left out, as OpenAI's EasyInputMessage)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: p.Text | list[InputPart]
    id: p.Text | None = None
    status: p.Text | None = None


class FunctionCallItem(p.RequestModel):
    """A call an earlier answer made (sent back as input)."""

    type: Literal["function_call"]
    call_id: p.Text
    name: p.Text
    arguments: p.Text
    id: p.Text | None = None
    status: p.Text | None = None


class FunctionCallOutputItem(p.RequestModel):
    """The result of call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: p.Text
    output: p.Text
    id: p.Text | None = None
    status: p.Text | None = None


class FunctionTool(p.RequestModel):
    """A Responses API function tool (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: p.Text
    description: p.Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(p.RequestModel):
    """A ``tool_choice`` forcing one function (the flat shape)."""

    type: Literal["function"]
    name: p.Text


class TextFormat(p.RequestModel):
    """``text.format``: text, any JSON object, or a JSON schema (``name``, ``schema``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: p.Text | None = None
    description: p.Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(p.RequestModel):
    """``text``: the answer's format."""

    format: TextFormat | None = None


class ResponsesRequest(p.RequestModel):
    """POST /v1/responses."""

    model: p.Text | None = None
    input: p.Text | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: p.Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = None  # None: the slot's room
    temperature: StrictFloat | None = None  # None: 1.0
    top_p: StrictFloat = 1.0
    stream: StrictBool = False
    previous_response_id: p.Text | None = None
    store: StrictBool = True
    metadata: dict[str, p.Text] | None = None
    user: p.Text | None = None
    seed: StrictInt | None = None  # vLLM's extras
    top_k: StrictInt = 0


class ResponseStore:
    """Conversations of stored responses by response id (template-ready messages: the inputs and
    the outputs, without instructions), at most ``max_responses``, oldest dropped first. One per
    app; thread-safe."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES) -> None:
        self.max_responses = max_responses
        self._lock = threading.Lock()
        self._conversations: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation through ``response_id``; ApiError 404 when it is not stored."""
        with self._lock:
            found = self._conversations.get(response_id)
        if found is None:
            raise p.ApiError(404, f"Previous response with id '{response_id}' not found (responses live in this server's memory, "
                                  f"the last {self.max_responses}, and only with store: true).", param="previous_response_id",
                             code="previous_response_not_found")
        return found

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._conversations[response_id] = conversation
            while len(self._conversations) > self.max_responses:
                self._conversations.popitem(last=False)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat-template messages (function calls as an assistant's
    ``tool_calls``, consecutive calls in one message; outputs as tool messages)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "\n".join(part.text for part in item.content)
            out.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = p.ToolCall(id=item.call_id, type="function", function=p.FunctionCall(name=item.name, arguments=item.arguments))
            if not (out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]):
                out.append({"role": "assistant", "content": "", "tool_calls": []})
            out[-1]["tool_calls"].append(p.chat_messages([p.ChatMessage(role="assistant", tool_calls=[call])])[0]["tool_calls"][0])
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def chat_tools(req: ResponsesRequest) -> tuple[list[p.Tool] | None, str | p.NamedToolChoice | None]:
    """The request's tools and tool_choice in chat's shapes."""
    tools = None if req.tools is None else [
        p.Tool(type="function", function=p.FunctionDef(name=t.name, description=t.description, parameters=t.parameters,
                                                       strict=t.strict)) for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        choice = p.NamedToolChoice(type="function", function=p.ToolName(name=choice.name))
    return tools, choice


def text_structure(req: ResponsesRequest) -> StructuredOutputs | None:
    """``text.format`` as a constraint (None for text); ApiError 400 naming ``text``."""
    fmt = None if req.text is None else req.text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.schema_ is None:
        raise p.ApiError(400, "text.format of type 'json_schema' needs schema (a JSON schema) and name.", param="text")
    return StructuredOutputs(json=fmt.schema_)


def plain(text: str, final: bool) -> Scan:
    """The scanner of an answer without tools: all content."""
    return Scan(text)


@attrs.frozen(kw_only=True, eq=False)
class Turn:
    """One /v1/responses request made ready: its id, engine request, how its answer is read,
    and the conversation it continues (without instructions) for the store."""

    id: str
    request: EngineRequest
    scanner: Scanner
    conversation: list[dict[str, Any]]
    store: bool


def prepare_turn(body: ResponsesRequest, served: Served, tool_parser: str | None, store: ResponseStore) -> Turn:
    """The checked :class:`Turn` of ``body``: every 400 (and the 404 of an unknown
    ``previous_response_id``) raised here, before anything is queued."""
    conversation = (store.get(body.previous_response_id) if body.previous_response_id else []) + input_messages(body)
    if not conversation:
        raise p.ApiError(400, "input is empty; give text or at least one input item.", param="input")
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    try:
        structured, field = text_structure(body), "text"
    except SamplingParamsError as exc:
        raise p.ApiError(400, f"text: {exc}", param="text") from exc
    tools, choice = chat_tools(body)
    check_tools(served, tools, where="tools.{i}.parameters")
    plan = tool_plan(tools, choice, body.parallel_tool_calls, tool_parser, served.tokenizer.chat_template, structured is not None)
    if plan.structured is not None:
        structured, field = plan.structured, "tool_choice"
    ids = template_ids(instructions + conversation, served, True, plan.template_tools, field="input")
    max_tokens = room(ids, served) if body.max_output_tokens is None else body.max_output_tokens
    try:
        sampling = SamplingParams(temperature=p.DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                                  top_p=body.top_p, top_k=body.top_k, seed=body.seed, max_tokens=max_tokens, structured=structured)
    except SamplingParamsError as exc:
        raise p.ApiError(400, str(exc), param=_param(body, exc)) from exc
    request = checked_request(ids, sampling, 0, served, "input", lambda exc: _param(body, exc), field)
    return Turn(id=item_id("resp"), request=request, scanner=plan.scanner or plain, conversation=conversation, store=body.store)


def _param(body: ResponsesRequest, exc: SamplingParamsError) -> str | None:
    name = p.sampling_param_name(body, exc)  # type: ignore[arg-type]  # only reads the message for this request kind
    return "max_output_tokens" if name == "max_tokens" else name


def response_base(body: ResponsesRequest, model: str, turn: Turn) -> dict:
    """The response object's fields that echo the request (status, output and usage apart)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    return {"id": turn.id, "object": "response", "created_at": int(time.time()), "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "store": body.store, "temperature": p.DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            "top_p": body.top_p, "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in body.tools or ()], "truncation": "disabled", "metadata": body.metadata or {},
            "user": body.user}


def remember(store: ResponseStore, turn: Turn, items: list[dict]) -> None:
    """Keep the turn's conversation and its output under its id (unless ``store`` is false)."""
    if turn.store:
        store.put(turn.id, turn.conversation + output_messages(items))


def add_responses_routes(app: FastAPI, engine: Engine, model_name: str, tool_parser: str | None, store: ResponseStore) -> None:
    """POST /v1/responses, whole or streamed."""

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        served = served_by(engine)
        check_model(body.model, model_name)
        turn = prepare_turn(body, served, tool_parser, store)
        base = response_base(body, model_name, turn)
        sink, ids = submit_requests(engine, served, [turn.request])
        usage = lambda choice: responses_usage(len(turn.request.prompt), choice.num_tokens)  # noqa: E731
        if body.stream:
            return StreamingResponse(_events(engine, sink, ids, turn, base, store, usage), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        choices = await whole_choices(request, engine, sink, ids, 1)
        if choices is None:
            return Response(status_code=499)  # nobody reads it
        choice = choices[0]
        items = output_items(turn.scanner(choice.text, True))
        status, details = status_of(choice.finish_reason)
        remember(store, turn, items)
        return JSONResponse(base | {"status": status, "incomplete_details": details, "output": items, "usage": usage(choice)})


async def _events(engine: Engine, sink: Any, ids: list[int], turn: Turn, base: dict, store: ResponseStore,
                  usage: Any) -> AsyncIterator[str]:
    """The typed event stream of one response (module doc of ``response_events.py``); a client
    that disconnects cancels it and its request is aborted."""
    stream, choice, done = EventStream(base=base), Choice(), False
    try:
        for e in stream.start():
            yield e
        while not done:
            _, event = await sink.queue.get()
            choice.add(event)
            done = event.finish_reason is not None
            if event.finish_reason in ENDED:
                error = ENDED[event.finish_reason]["error"]
                yield stream.emit("error", code=error["code"], message=error["message"], param=None)
                return
            content, calls = advance(turn.scanner(choice.text, done), stream.sent)
            for e in (stream.text(content) if content else []) + [e for d in calls for e in stream.call(d)]:
                yield e
        events, response = stream.finish(choice.finish_reason, usage(choice))
        remember(store, turn, response["output"])
        for e in events:
            yield e
    finally:
        if not done:  # cancelled: the client went away
            engine.abort(ids)
