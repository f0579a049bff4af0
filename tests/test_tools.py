"""Tool calls read from model text (``neuronfx.server.tool_parsers``), whole and streamed one
token (here: one character) at a time, the request-side tool checks (``tools.tool_plan``) and the
structured-output field mapping (``server/structured.py``) and the Responses API's input
items and store, all without a server."""

from __future__ import annotations

import json

import pytest

from neuronfx import StructuredOutputs
from neuronfx.cli.serve import TOOL_PARSERS
from neuronfx.server import protocol as p
from neuronfx.server.structured import structured_outputs
from neuronfx.server.tool_parsers import (
    PARSERS,
    CallScan,
    Scan,
    forced_function,
    forced_required,
    hermes,
    llama3_json,
    parser_for_template,
)
from neuronfx.server.tools import CallStream, advance, tool_plan

WEATHER = '{"city": "Paris", "days": [1, 2], "note": "a \\"quoted\\" } brace"}'
HERMES_TEXTS = {
    "one call": (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
                 Scan("", (CallScan("get_weather", WEATHER, True),))),
    "content then two calls": ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
                               '<tool_call>{"name": "b", "arguments": {"x": 1.5}}</tool_call>',
                               Scan("Let me check.\n", (CallScan("a", "{}", True), CallScan("b", '{"x": 1.5}', True)))),
    "arguments before the name": ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',
                                  Scan("", (CallScan("f", '{"x": 1}', True),))),
    "plain text": ("No tools needed: 2 < 3.", Scan("No tools needed: 2 < 3.")),
    "broken call is content": ("<tool_call>{not json}</tool_call>", Scan("<tool_call>{not json}</tool_call>")),
    "unclosed last call": ('<tool_call>{"name": "f", "arguments": {"x": [1, 2', Scan("", (CallScan("f", '{"x": [1, 2', False),))),
}
LLAMA_TEXTS = {
    "one call": (f'{{"name": "get_weather", "parameters": {WEATHER}}}', Scan("", (CallScan("get_weather", WEATHER, True),))),
    "python tag and two calls": ('<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "arguments": {}}',
                                 Scan("", (CallScan("a", '{"q": "x"}', True), CallScan("b", "{}", True)))),
    "plain text": ("The answer is {42}.", Scan("The answer is {42}.")),
    "leading blanks then text": ("  Hello", Scan("  Hello")),
}


@pytest.mark.parametrize("case", HERMES_TEXTS, ids=list(HERMES_TEXTS))
def test_hermes_whole(case):
    text, expected = HERMES_TEXTS[case]
    assert hermes(text, True) == expected


@pytest.mark.parametrize("case", LLAMA_TEXTS, ids=list(LLAMA_TEXTS))
def test_llama3_json_whole(case):
    text, expected = LLAMA_TEXTS[case]
    assert llama3_json(text, True) == expected


def streamed(scanner, text: str) -> tuple[str, dict[int, dict]]:
    """``text`` fed one character at a time: (the content sent, {call index: {id, name,
    arguments}} from the deltas concatenated)."""
    sent, content, calls = CallStream(), "", {}
    for end in range(1, len(text) + 1):
        new, deltas = advance(scanner(text[:end], end == len(text)), sent)
        content += new
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls  # an id and a name once per call
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    return content, calls


@pytest.mark.parametrize("parser, case", [("hermes", c) for c in HERMES_TEXTS] + [("llama3_json", c) for c in LLAMA_TEXTS])
def test_streamed_deltas_concatenate_to_the_whole_answer(parser, case):
    """Character by character, the content and each call's arguments sent add up to the whole
    answer's; names arrive once, each call with its own id."""
    text, expected = (HERMES_TEXTS if parser == "hermes" else LLAMA_TEXTS)[case]
    content, calls = streamed(PARSERS[parser], text)
    assert content == expected.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in expected.calls]
    assert len({c["id"] for c in calls.values()}) == len(calls) and all(c["id"].startswith("call_") for c in calls.values())


def test_streamed_content_never_sends_a_tag_before_it_is_known():
    """A tail that may start ``<tool_call>`` is held back, and sent once it turns out to be text."""
    sent = CallStream()
    assert advance(hermes("Hi <tool_", False), sent)[0] == "Hi "
    assert advance(hermes("Hi <tool_x", False), sent)[0] == "<tool_x"
    assert advance(llama3_json("  <|python", False), CallStream()) == ("", [])


def test_forced_shapes_whole_and_streamed():
    array = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}}]'
    assert forced_required(array, True) == Scan("", (CallScan("a", '{"x":1}', True), CallScan("b", "{}", True)))
    assert streamed(forced_required, array)[1][1]["arguments"] == "{}"
    assert forced_function("f")('{"x":1}', True) == Scan("", (CallScan("f", '{"x":1}', True),))
    assert [c["arguments"] for c in streamed(forced_function("f"), '{"x":1}')[1].values()] == ['{"x":1}']


def test_parser_choice_by_template():
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template('<|python_tag|>{"name": ...}') == "llama3_json"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
    assert set(TOOL_PARSERS) == set(PARSERS)


def tools(*names: str, parameters: dict | None = None) -> list[p.Tool]:
    return [p.Tool(type="function", function=p.FunctionDef(name=n, parameters=parameters)) for n in names]


PARAMS = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def test_tool_plan_forces_calls_with_the_schema():
    named = tool_plan(tools("f", "g", parameters=PARAMS), p.NamedToolChoice(type="function", function=p.ToolName(name="g")),
                      True, None, None, False)
    assert named.structured == StructuredOutputs(json=PARAMS) and named.scanner('{"x":3}', True).calls[0].name == "g"
    required = tool_plan(tools("f", parameters=PARAMS), "required", False, None, None, False)
    schema = json.loads(required.structured.json)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"] == {"name": {"type": "string", "enum": ["f"]}, "parameters": PARAMS}
    assert tool_plan(tools("f"), "auto", True, "llama3_json", None, False).scanner is llama3_json
    assert tool_plan(tools("f"), None, True, None, "<tool_call>", False).scanner is hermes  # auto by default, parser by template
    assert tool_plan(tools("f"), "none", True, None, None, False).scanner is None


BAD_TOOLS = {
    "unknown function": (tools("f"), p.NamedToolChoice(type="function", function=p.ToolName(name="h")), False,
                         "tool_choice names function 'h', which is not in tools (f).", "tool_choice"),
    "required without tools": (None, "required", False, "tool_choice='required' needs tools; give the functions in tools, or "
                               "drop tool_choice.", "tool_choice"),
    "auto without a parser": (tools("f"), "auto", False, "tool_choice 'auto' needs a tool-call parser", "tool_choice"),
    "duplicate name": (tools("f", "f"), "none", False, "tools.1.function.name='f' is given twice", "tools"),
    "parameters not an object schema": (tools("f", parameters={"type": "object", "properties": 5}), "none", False,
                                        "tools.0.function.parameters=", "tools"),
    "forced call with a format": (tools("f"), "required", True, "tool_choice 'required' or a named function constrains",
                                  "tool_choice"),
}


@pytest.mark.parametrize("case", BAD_TOOLS, ids=list(BAD_TOOLS))
def test_bad_tools_are_named_400s(case):
    given, choice, constrained, message, param = BAD_TOOLS[case]
    with pytest.raises(p.ApiError) as err:
        tool_plan(given, choice, True, None, "{{ messages }}", constrained)
    assert (err.value.status, err.value.param) == (400, param) and err.value.message.startswith(message)


def chat(**fields: object) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_structured_fields_map_to_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert structured_outputs(chat(response_format=fmt)) == (StructuredOutputs(json=schema), "response_format")
    assert structured_outputs(chat(response_format={"type": "json_object"}))[0] == StructuredOutputs(json_object=True)
    assert structured_outputs(chat(response_format={"type": "text"})) == (None, None)
    assert structured_outputs(chat(structured_outputs={"choice": ["yes", "no"]}))[0] == StructuredOutputs(choice=("yes", "no"))
    assert structured_outputs(chat(structured_outputs={"json": schema}))[0] == StructuredOutputs(json=schema)
    assert structured_outputs(chat(guided_regex="[0-9]+")) == (StructuredOutputs(regex="[0-9]+"), "guided_regex")
    with pytest.raises(p.ApiError, match="give at most one") as err:
        structured_outputs(chat(response_format={"type": "json_object"}, guided_choice=["a"]))
    assert err.value.param == "guided_choice"
    with pytest.raises(p.ApiError, match="must be a non-empty list") as err:
        structured_outputs(chat(structured_outputs={"choice": []}))
    assert err.value.param == "structured_outputs"


def test_responses_input_items_become_template_messages():
    """/v1/responses input items: consecutive function calls join one assistant message (their
    arguments parsed, as chat's tool_calls are), outputs become tool messages."""
    from neuronfx.server.responses_api import ResponsesRequest, input_messages

    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}], "max_output_tokens": 2})
    assert input_messages(req) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]


def test_response_store_is_bounded_and_404s_unknown_ids():
    from neuronfx.server.responses_api import ResponseStore

    store = ResponseStore(max_responses=2)
    for k in range(3):
        store.put(f"resp_{k}", [{"role": "user", "content": str(k)}])
    assert store.get("resp_2") == [{"role": "user", "content": "2"}] and store.get("resp_1")
    with pytest.raises(p.ApiError) as err:
        store.get("resp_0")  # the oldest was dropped
    assert (err.value.status, err.value.code, err.value.param) == (404, "previous_response_not_found", "previous_response_id")
