"""Tool calling on /v1/chat/completions (and /v1/responses): the request's tools checked, given
to the chat template, and turned into how the answer is read.

- ``tool_choice`` "none" (the default without tools): tools go to the template, the answer is text.
- "auto" (the default with tools): the model writes calls in its template's format, read by a
  parser (``tool_parsers.py``: the server's ``--tool-call-parser``, else the one the chat
  template's text calls for); no parser is a 400.
- "required" and a named function are enforced with a grammar, as vLLM does: a named function's
  answer is its arguments object, constrained by its ``parameters`` schema; "required"'s is a
  JSON array of ``{"name", "parameters"}`` objects, one of the tools' each (``maxItems`` 1
  without ``parallel_tool_calls``). So the arguments always parse and follow the schema.

Bad tools are 400s naming the field, before anything is queued: a tool whose ``parameters`` is
not a schema the grammar library takes, a duplicate name, ``tool_choice`` naming a function not
in ``tools``, "required" or a named function without tools, or a structured-output field with a
forced tool choice.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from neuronfx.config.structured import StructuredOutputs
from neuronfx.errors import SamplingParamsError
from neuronfx.server import protocol as p
from neuronfx.server.tool_parsers import PARSERS, Scan, Scanner, forced_function, forced_required, parser_for_template

NO_ARGUMENTS = {"type": "object", "properties": {}}
"""The schema of a function that gives no ``parameters``."""


@attrs.frozen(kw_only=True)
class ToolPlan:
    """How one request uses its tools: what goes to the chat template, the grammar that forces a
    call (or None) and the scanner that reads the answer (None: plain text)."""

    template_tools: list[dict[str, Any]] | None
    structured: StructuredOutputs | None
    scanner: Scanner | None


def new_call_id() -> str:
    """A tool call's id, OpenAI's shape: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_plan(tools: Sequence[p.Tool] | None, choice: str | p.NamedToolChoice | None, parallel: bool, parser: str | None,
              template: str | None, constrained: bool) -> ToolPlan:
    """The :class:`ToolPlan` of a request's ``tools``, ``tool_choice`` and
    ``parallel_tool_calls``; ``parser``: the server's ``--tool-call-parser`` (None: read from
    ``template``, the chat template's text); ``constrained``: the request has a structured-output
    field too. ApiError 400 naming the field for bad tools (module doc)."""
    tools = list(tools or ())
    choice = choice if choice is not None else ("auto" if tools else "none")
    names = _check_tools(tools)
    template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    if choice == "none":
        return ToolPlan(template_tools=template_tools, structured=None, scanner=None)
    if not tools:
        shown = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
        raise p.ApiError(400, f"tool_choice={shown!r} needs tools; give the functions in tools, or drop tool_choice.",
                         param="tool_choice")
    if choice == "auto":
        return ToolPlan(template_tools=template_tools, structured=None, scanner=_auto_scanner(parser, template))
    if constrained:
        raise p.ApiError(400, "tool_choice 'required' or a named function constrains the answer already; drop "
                              "response_format / structured_outputs.", param="tool_choice")
    if choice == "required":
        return ToolPlan(template_tools=template_tools, structured=_required_schema(tools, parallel), scanner=forced_required)
    if choice.function.name not in names:
        raise p.ApiError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools ({', '.join(names)}).",
                         param="tool_choice")
    schema = names[choice.function.name]
    return ToolPlan(template_tools=template_tools, structured=StructuredOutputs(json=schema),
                    scanner=forced_function(choice.function.name))


def _check_tools(tools: Sequence[p.Tool]) -> dict[str, dict[str, Any]]:
    """{name: parameters schema} of ``tools``; ApiError 400 for a duplicate name or a
    ``parameters`` that is no JSON schema (its shape here, the grammar library's verdict with
    the request: ``requests.check_constraint``)."""
    names: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        f = tool.function
        if f.name in names:
            raise p.ApiError(400, f"tools.{i}.function.name={f.name!r} is given twice; give each function once.", param="tools")
        schema = NO_ARGUMENTS if f.parameters is None else f.parameters
        if not _schema_shape_ok(schema):
            raise p.ApiError(400, f"tools.{i}.function.parameters={json.dumps(schema)[:80]} is not a JSON schema of an object "
                                  "(its 'type' must be 'object', 'properties' an object of schemas, 'required' a list of names).",
                             param="tools")
        names[f.name] = schema
    return names


def _schema_shape_ok(schema: dict[str, Any]) -> bool:
    """A function's parameters: an object schema whose properties are schemas (dicts or bools)."""
    props = schema.get("properties", {})
    required = schema.get("required", [])
    return (schema.get("type", "object") == "object" and isinstance(props, dict)
            and all(isinstance(v, (dict, bool)) for v in props.values())
            and isinstance(required, list) and all(isinstance(r, str) for r in required))


def tool_schemas(tools: Sequence[p.Tool]) -> list[tuple[int, StructuredOutputs]]:
    """(index, constraint) of every tool's parameters schema, for the grammar library's check."""
    return [(i, StructuredOutputs(json=NO_ARGUMENTS if t.function.parameters is None else t.function.parameters))
            for i, t in enumerate(tools)]


def _required_schema(tools: Sequence[p.Tool], parallel: bool) -> StructuredOutputs:
    """tool_choice "required": a JSON array of calls, each one of the tools (vLLM's schema)."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": NO_ARGUMENTS if t.function.parameters is None else t.function.parameters},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    try:
        return StructuredOutputs(json=schema)
    except SamplingParamsError as exc:
        raise p.ApiError(400, f"tools: {exc}", param="tools") from exc


def _auto_scanner(parser: str | None, template: str | None) -> Scanner:
    name = parser or parser_for_template(template)
    if name is None:
        raise p.ApiError(400, "tool_choice 'auto' needs a tool-call parser, and this model's chat template writes no known tool "
                              "format; start the server with --tool-call-parser (hermes, llama3_json) and a tools-aware "
                              "--chat-template, or send tool_choice 'required' or a named function.", param="tool_choice")
    return PARSERS[name]


@attrs.define
class CallStream:
    """What a stream sent of one answer so far: the content's length, each call's id and the
    length of its arguments (mutable; one per streamed choice)."""

    content: int = 0
    ids: list[str] = attrs.Factory(list)
    arguments: list[int] = attrs.Factory(list)


@attrs.frozen
class CallDelta:
    """New text of call ``index``: its id and name when it first appears, then arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


def advance(scan: Scan, sent: CallStream) -> tuple[str, list[CallDelta]]:
    """(new content, new call deltas) of ``scan`` past what ``sent`` records, which it updates."""
    content = scan.content[sent.content:]
    sent.content = max(sent.content, len(scan.content))
    deltas = []
    for i, call in enumerate(scan.calls):
        new = i == len(sent.ids)
        if new:
            sent.ids.append(new_call_id())
            sent.arguments.append(0)
        fragment = call.arguments[sent.arguments[i]:]
        sent.arguments[i] = max(sent.arguments[i], len(call.arguments))
        if new or fragment:
            deltas.append(CallDelta(i, sent.ids[i] if new else None, call.name if new else None, fragment))
    return content, deltas


def chat_tool_calls(scan: Scan) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls`` of a whole answer's calls (new ids)."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in scan.calls]


def chat_call_deltas(deltas: Sequence[CallDelta]) -> list[dict[str, Any]]:
    """OpenAI's streamed ``delta.tool_calls``: index, id, type and name first, then arguments."""
    out = []
    for d in deltas:
        if d.id is not None:
            out.append({"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def finish_reason(reason: str | None, scan: Scan) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when an answer that ended by itself made calls."""
    return "tool_calls" if reason == "stop" and scan.calls else reason
