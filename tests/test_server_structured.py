"""Structured outputs, tool calling and the Responses API through ``neuronfx serve`` and the
official openai client (one server for the module): response_format (json_schema, json_object)
and vLLM's structured_outputs / guided_* extras, whole and streamed, always parse and validate;
tool_choice "required" and a named function always give arguments that validate (100 seeded
runs, batched); "auto" reads a Hermes call the model writes; a two-turn exchange with a tool
message; streamed deltas add up to the whole answer; /v1/responses with text, a JSON schema, a
function tool, streaming and previous_response_id.

The model is test_server.py's: a tiny random llama with SmolLM2's vocabulary and tokenizer
(eager), served with a Hermes tools chat template (``--chat-template``), so its text is random
but every constraint must hold.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from helpers import http_request, smollm2_vocab_model, start_server, stop_server

from neuronfx.io.checkpoints import load_tokenizer

NAME = "tiny"
PLAN = ["--backend", "eager", "--batch-size", "16", "--max-context-length", "384", "--sequence-length", "640"]
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "metric": {"type": "boolean"}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}, "hours": {"type": "array", "maxItems": 3,
                                                                                               "items": {"type": "number"}}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}, "sure": {"type": "boolean"},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "sure", "score"], "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-hermes")
    smollm2_vocab_model(path, seed=11)
    template = path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    server = start_server([str(path), *PLAN, "--served-model-name", NAME, "--chat-template", str(template)],
                          path / "server.log")
    yield server
    stop_server(server)
    assert server.proc.returncode == 0, server.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def batched(fn, args: list) -> list:
    """``fn`` over ``args`` from 16 threads: the server batches them."""
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, args))


def streamed_chat(client, **kwargs) -> tuple[str, dict[int, dict], str]:
    """(content, {index: {id, name, arguments}}, finish_reason) of a streamed chat, deltas concatenated."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=NAME, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.id is not None:
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


# --- structured outputs ---------------------------------------------------------------------------


def test_response_format_json_schema_whole_and_streamed(client):
    """Seeded samples at temperature 1 always parse and validate; the stream of a seed is its
    whole answer; finish_reason "stop" when the grammar completes."""

    def whole(seed: int) -> tuple[str, str]:
        out = client.chat.completions.create(model=NAME, messages=ASK, response_format=ANSWER_FORMAT, temperature=1.0, seed=seed,
                                             max_tokens=60)
        return out.choices[0].message.content, out.choices[0].finish_reason

    answers = batched(whole, list(range(8)))
    for text, reason in answers:
        jsonschema.validate(json.loads(text), ANSWER)
        assert reason == "stop"
    content, calls, reason = streamed_chat(client, messages=ASK, response_format=ANSWER_FORMAT, temperature=1.0, seed=3,
                                           max_tokens=60)
    assert (content, calls, reason) == (answers[3][0], {}, "stop")


def test_json_object_and_vllm_extras_on_both_endpoints(client):
    """json_object gives a JSON object; structured_outputs choice / regex and guided_choice on
    /v1/completions and /v1/chat/completions, whole and streamed."""
    out = client.chat.completions.create(model=NAME, messages=ASK, response_format={"type": "json_object"}, temperature=1.0,
                                         seed=1, max_tokens=60)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # a random model may write a long object: whatever there is starts one
        assert out.choices[0].message.content.startswith("{")
    choice = {"structured_outputs": {"choice": ["yes", "no", "maybe not"]}}
    texts = {client.completions.create(model=NAME, prompt="Is it?", max_tokens=8, seed=s, temperature=1.0,
                                       extra_body=choice).choices[0].text for s in range(6)}
    assert texts <= {"yes", "no", "maybe not"}
    regex = {"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}
    text = client.completions.create(model=NAME, prompt="Code:", max_tokens=10, seed=4, temperature=1.0, extra_body=regex).choices[0].text
    stream = "".join(c.choices[0].text for c in client.completions.create(model=NAME, prompt="Code:", max_tokens=10, seed=4,
                                                                            temperature=1.0, extra_body=regex, stream=True))
    assert stream == text and len(text) == 6 and text[:3].isdigit() and text[3] == "-" and set(text[4:]) <= set("abc")
    out = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=8, extra_body={"guided_choice": ["Paris", "Rome"]})
    assert out.choices[0].message.content in ("Paris", "Rome") and out.choices[0].finish_reason == "stop"


# --- tools ----------------------------------------------------------------------------------------


def test_forced_tool_calls_always_validate(client):
    """tool_choice "required" (50 seeds, parallel calls allowed) and a named function (50
    seeds): every answer's arguments parse and validate against the tool's schema;
    parallel_tool_calls false gives one call."""

    def call(seed: int) -> object:
        choice = "required" if seed % 2 else {"type": "function", "function": {"name": "get_time" if seed % 4 else "get_weather"}}
        return client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0,
                                              seed=seed, max_tokens=250, parallel_tool_calls=seed % 3 != 0)

    outs = batched(call, list(range(100)))
    for seed, out in enumerate(outs):
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, (seed, choice)
        calls = choice.message.tool_calls
        assert len(calls) >= 1 and (len(calls) == 1 or seed % 3 != 0)
        for c in calls:
            assert c.id.startswith("call_") and c.type == "function"
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        if seed % 2 == 0:
            assert [c.function.name for c in calls] == ["get_time" if seed % 4 else "get_weather"]


def test_auto_reads_the_call_the_model_writes_whole_and_streamed(client):
    """tool_choice "auto" (the default with tools): a Hermes call the model is made to write (a
    regex) comes back as tool_calls, with finish_reason "tool_calls"; the stream's deltas add
    up to the whole answer."""
    regex = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
    kwargs = {"messages": ASK, "tools": TOOLS, "temperature": 1.0, "seed": 5, "max_tokens": 60,
              "extra_body": {"structured_outputs": {"regex": regex}}}
    out = client.chat.completions.create(model=NAME, **kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
    content, calls, reason = streamed_chat(client, **kwargs)
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_named_call_streams_its_arguments(client):
    """A named call's stream: the id and name first, then argument fragments that add up to the
    whole answer's arguments (same seed)."""
    kwargs = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "temperature": 1.0, "seed": 8, "max_tokens": 60}
    whole = client.chat.completions.create(model=NAME, **kwargs).choices[0].message.tool_calls[0]
    content, calls, reason = streamed_chat(client, **kwargs)
    assert (content, reason, calls[0]["name"], calls[0]["arguments"]) == ("", "tool_calls", "get_weather", whole.function.arguments)


def test_two_turn_exchange_with_a_tool_message(server, client):
    """Turn 1 calls a tool; its tool_calls and a tool message go back through the template in
    turn 2 (the prompt is the template's rendering of the whole exchange, tools included)."""
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
                                           seed=2, max_tokens=120, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4,
                                            temperature=0.0)
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.tool_calls is None
    tokenizer = load_tokenizer(server.log.parent)
    tokenizer.chat_template = HERMES_TEMPLATE
    template_messages = messages[:1] + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        messages[2]]
    text = tokenizer.apply_chat_template(template_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert f'<tool_call>{{"name": "{call.function.name}"' in text and "<tool_response>sunny, 21 C</tool_response>" in text
    assert second.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- /v1/responses --------------------------------------------------------------------------------


RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather.", "parameters": WEATHER, "strict": True}]


def test_responses_text_json_schema_and_a_function_tool(client):
    text = client.responses.create(model=NAME, input="Say hi.", instructions="Be brief.", max_output_tokens=5, temperature=0.0)
    assert text.status == "incomplete" and text.incomplete_details.reason == "max_output_tokens"
    assert text.output[0].type == "message" and text.output_text and text.usage.output_tokens == 5
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    out = client.responses.create(model=NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": "Answer."}]}],
                                  text=fmt, temperature=1.0, max_output_tokens=60, extra_body={"seed": 1})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), ANSWER)
    called = client.responses.create(model=NAME, input="Weather in Rome?", tools=RESPONSE_TOOLS, tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=120, temperature=1.0, extra_body={"seed": 2})
    (item,) = [o for o in called.output if o.type == "function_call"]
    assert item.name == "get_weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    follow = client.responses.create(model=NAME, previous_response_id=called.id, max_output_tokens=3, temperature=0.0,
                                     tools=RESPONSE_TOOLS, input=[{"type": "function_call_output", "call_id": item.call_id,
                                                                   "output": "sunny"}])
    assert follow.previous_response_id == called.id and called.id.startswith("resp_")
    assert follow.usage.input_tokens > called.usage.input_tokens + called.usage.output_tokens


def test_responses_stream_events_and_previous_response_id(server, client):
    """The stream's events (the client's own accumulator reads them) give the whole answer;
    previous_response_id puts the first turn in the second prompt; store false keeps nothing;
    an unknown id is a 404."""
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    kwargs = {"model": NAME, "input": "Answer.", "text": fmt, "temperature": 1.0, "max_output_tokens": 60, "extra_body": {"seed": 7}}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.done",
            "response.content_part.done", "response.output_item.done"} <= set(kinds)
    with client.responses.stream(model=NAME, input="Weather?", tools=RESPONSE_TOOLS, tool_choice="required", temperature=1.0,
                                 parallel_tool_calls=False, max_output_tokens=120, extra_body={"seed": 2}) as stream:
        kinds = [event.type for event in stream]
        call = next(o for o in stream.get_final_response().output if o.type == "function_call")
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    first = client.responses.create(model=NAME, input="My name is Ada.", max_output_tokens=2, temperature=0.0)
    second = client.responses.create(model=NAME, input="What is my name?", previous_response_id=first.id, max_output_tokens=2,
                                     temperature=0.0)
    alone = client.responses.create(model=NAME, input="What is my name?", max_output_tokens=2, temperature=0.0, store=False)
    tokenizer = load_tokenizer(server.log.parent)
    tokenizer.chat_template = HERMES_TEMPLATE
    turns = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "What is my name?"}]
    expected = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert second.usage.input_tokens == len(expected) > alone.usage.input_tokens
    status, _, body = http_request(server, "POST", "/v1/responses", {"input": "hi", "previous_response_id": alone.id})
    assert status == 404 and body["error"]["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, input="hi", previous_response_id="resp_unknown")


def test_bad_tools_and_formats_are_400s_and_the_server_serves_on(server, client):
    """A library-rejected schema, regex or tool schema, an empty choice list, an unknown named
    function: each a 400 naming the field (the full table is test_server.py's BAD_INPUT)."""
    bad = [({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format"),
           ({"messages": ASK, "structured_outputs": {"regex": "a("}}, "structured_outputs"),
           ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
               "type": "object", "properties": {"x": {"type": "integr"}}}}}]}, "tools"),
           ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice")]
    for body, param in bad:
        status, _, answer = http_request(server, "POST", "/v1/chat/completions", body)
        assert (status, answer["error"]["param"]) == (400, param), answer
    status, _, answer = http_request(server, "POST", "/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}})
    assert (status, answer["error"]["param"]) == (400, "text"), answer
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0.0).usage.completion_tokens == 2


def test_docs_name_the_new_fields():
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    for word in ("response_format", "structured_outputs", "tool_choice", "--tool-call-parser", "--chat-template", "/v1/responses",
                 "previous_response_id"):
        assert word in text, word
