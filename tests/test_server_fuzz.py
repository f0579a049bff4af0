"""Random request bodies against every endpoint of the server's app, in this process (Starlette's
TestClient over the FastAPI app, an Engine over a tiny eager llama with SmolLM2's tokenizer):
none may get a 5xx, every 4xx body is OpenAI's error JSON, every 200 is valid JSON (or a stream
of JSON events ending with ``data: [DONE]``).

Bodies mix values a field takes with junk: null, lone UTF-16 surrogates (in values and field
names), wrong types, huge numbers (1e308, 2**70, inf, NaN), negative numbers, nested lists and
objects, empty strings and lists, unknown fields. Token counts stay small (max_tokens 1-3 when
valid, and huge values that must be refused) so that valid examples generate quickly.
"""

from __future__ import annotations

import json
import urllib.parse

import pytest
from helpers import smollm2_vocab_model
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

import neuronfx
from neuronfx import InferenceConfig, make_plan
from neuronfx.io.checkpoints import load_checkpoint, load_tokenizer
from neuronfx.server.app import make_app
from neuronfx.server.engine import Engine
from neuronfx.server.metrics import make_metrics
from neuronfx.server.served import Served

NAME = "tiny"
VOCAB = 49152  # SmolLM2's
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def http(tmp_path_factory) -> TestClient:
    """The app over an engine serving the tiny model (4 slots, prompts up to 64 tokens, 128 per
    slot), started (its lifespan) and ready."""
    path = tmp_path_factory.mktemp("fuzz-model")
    smollm2_vocab_model(path, seed=3)
    ckpt = load_checkpoint(path)
    inference = InferenceConfig(batch_size=4, max_context_length=64, sequence_length=128, backend="eager")
    runtime = neuronfx.compile(make_plan(ckpt.config, inference), ckpt.state_dict, progress=False)
    served = Served(runtime=runtime, tokenizer=load_tokenizer(path))
    engine = Engine(lambda: served, max_waiting=8, metrics=make_metrics())
    with TestClient(make_app(engine, NAME), raise_server_exceptions=False) as client:
        while client.get("/health").status_code != 200:
            pass  # the engine thread hands over the runtime built already: a few ms
        yield client


# --- strategies ---------------------------------------------------------------------------------
# A body is either a plausible request (each optional field absent, null or a value of its type,
# mostly in range), the same with one field replaced by junk, or junk through and through.

ODD_TEXT = st.sampled_from(["", "\ud800", "hi \udc00", "\udfff\ud800x", "\x00", "a" * 200])
GOOD_TEXT = st.sampled_from(["hi", "tiny", "🤖🔥 日本語", "<|im_end|>", " "]) | st.text(st.characters(exclude_categories=("Cs",)),
                                                                                      max_size=6)
NUMBER = st.sampled_from([0, 1, -1, 2, 2**31, 2**63, 2**70, -2**70, 1e308, -1e308, 0.5, -0.5, 1e-300, float("inf"), float("nan")])
SCALAR = st.none() | st.booleans() | NUMBER | st.integers(-3, 3) | st.floats() | ODD_TEXT | GOOD_TEXT
JUNK = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ODD_TEXT | GOOD_TEXT, inner, max_size=3),
                    max_leaves=6)
COUNT = st.integers(1, 3)  # a valid max_tokens: small, so that valid examples are quick
TOKEN_IDS = st.lists(st.integers(0, 300), max_size=4)


def optional(value: st.SearchStrategy) -> st.SearchStrategy:
    """An optional field's plausible value: null (its default) or a value."""
    return st.none() | value


SAMPLING = {
    "model": optional(st.just(NAME)), "temperature": optional(st.floats(0, 2)), "top_p": optional(st.floats(0.05, 1)),
    "seed": optional(st.integers(0, 9)), "stop": optional(GOOD_TEXT | st.lists(GOOD_TEXT, max_size=2)),
    "stream": optional(st.booleans()),
    "stream_options": optional(st.fixed_dictionaries({}, optional={"include_usage": optional(st.booleans()),
                                                                   "continuous_usage_stats": optional(st.booleans())})),
    "presence_penalty": optional(st.floats(-2, 2)), "frequency_penalty": optional(st.floats(-2, 2)), "n": optional(st.just(1)),
    "user": optional(GOOD_TEXT), "top_k": optional(st.integers(0, 50)), "min_p": optional(st.floats(0, 0.5)),
    "repetition_penalty": optional(st.floats(0.5, 2)), "min_tokens": optional(st.integers(0, 1)),
    "ignore_eos": optional(st.booleans()), "stop_token_ids": optional(TOKEN_IDS), "include_stop_str_in_output": optional(st.booleans()),
    "return_tokens_as_token_ids": optional(st.booleans()),
}
TOOL_CALL = st.fixed_dictionaries({"id": GOOD_TEXT, "type": st.just("function"),
                                   "function": st.fixed_dictionaries({"name": GOOD_TEXT, "arguments": GOOD_TEXT | st.just('{"a": 1}')})})
MESSAGE = (st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"])},
                                 optional={"content": optional(GOOD_TEXT | st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": GOOD_TEXT}), max_size=2)), "name": optional(GOOD_TEXT)})
           | st.fixed_dictionaries({"role": st.just("assistant"), "content": optional(GOOD_TEXT)},
                                   optional={"tool_calls": optional(st.lists(TOOL_CALL, max_size=2))})
           | st.fixed_dictionaries({"role": st.just("tool"), "content": GOOD_TEXT}, optional={"tool_call_id": optional(GOOD_TEXT)}))
MESSAGES = st.lists(MESSAGE, max_size=3)
PROMPT = GOOD_TEXT | TOKEN_IDS | st.lists(GOOD_TEXT, max_size=2) | st.lists(TOKEN_IDS, max_size=2)


def bodies(required: dict, optional_fields: dict) -> st.SearchStrategy:
    """Plausible bodies with these fields, the same with one field (or an unknown one) made junk,
    and junk bodies (any JSON value, or bytes that are not JSON)."""
    plausible = st.fixed_dictionaries(required, optional=optional_fields).map(_stream_options_with_stream)
    names = sorted(required) + sorted(optional_fields) + ["unknown_field"]
    one_junk = st.tuples(plausible, st.sampled_from(names), JUNK).map(lambda t: t[0] | {t[1]: t[2]})
    return plausible | one_junk | JUNK.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=24)


def _stream_options_with_stream(body: dict) -> dict:
    # stream_options without stream: true is a 400 of its own; a plausible body keeps them together
    return body if body.get("stream") is True else {k: v for k, v in body.items() if k != "stream_options"}


SCHEMA = st.sampled_from([{"type": "object"}, {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False},
                          {"type": "objekt"}, {"properties": 5}, {}])
STRUCTURED = {  # valid and invalid constraints (and two at once): a 200 or a 400, never a 5xx
    "response_format": optional(st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}])
                                | SCHEMA.map(lambda s: {"type": "json_schema", "json_schema": {"name": "a", "schema": s}})),
    "structured_outputs": optional(st.sampled_from([{"choice": ["a", "b"]}, {"choice": []}, {"regex": "[0-9]+"}, {"regex": "a("},
                                                    {"grammar": 'start: "x"'}, {"json_object": True}, {"json": {"type": "objekt"}},
                                                    {"regex": "a", "choice": ["a"]}])),
    "guided_choice": optional(st.lists(GOOD_TEXT, max_size=2)),
}
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"])}, optional={"parameters": optional(SCHEMA)})})
TOOL_CHOICE = st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}])
COMPLETION = bodies({"prompt": PROMPT, "max_tokens": COUNT},
                    SAMPLING | STRUCTURED | {"logprobs": optional(st.integers(0, 3)), "echo": optional(st.just(False)), "suffix": st.none(),
                                "best_of": optional(st.just(1))})
CHAT = bodies({"messages": MESSAGES, "max_completion_tokens": COUNT},  # always set: chat's default is the slot's room
              SAMPLING | STRUCTURED | {"max_tokens": COUNT, "logprobs": optional(st.booleans()), "top_logprobs": st.none(),
                                       "tools": optional(st.lists(TOOL, max_size=2)), "tool_choice": optional(TOOL_CHOICE),
                                       "parallel_tool_calls": optional(st.booleans())})
ITEM = (st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": GOOD_TEXT | st.lists(
    st.fixed_dictionaries({"type": st.just("input_text"), "text": GOOD_TEXT}), max_size=2)}, optional={"type": st.just("message")})
    | st.fixed_dictionaries({"type": st.just("function_call"), "call_id": GOOD_TEXT, "name": GOOD_TEXT,
                             "arguments": GOOD_TEXT | st.just('{"a": 1}')})
    | st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": GOOD_TEXT, "output": GOOD_TEXT}))
RESPONSES = bodies({"input": GOOD_TEXT | st.lists(ITEM, max_size=3), "max_output_tokens": COUNT},
                   {"model": optional(st.just(NAME)), "instructions": optional(GOOD_TEXT), "temperature": optional(st.floats(0, 2)),
                    "top_p": optional(st.floats(0.05, 1)), "stream": optional(st.booleans()), "store": optional(st.booleans()),
                    "previous_response_id": optional(st.just("resp_unknown")), "seed": optional(st.integers(0, 9)),
                    "tools": optional(st.lists(TOOL.map(lambda t: {"type": "function"} | t["function"]), max_size=2)),
                    "tool_choice": optional(TOOL_CHOICE.map(lambda c: c if isinstance(c, str) else {"type": "function", "name": "f"})),
                    "text": optional(SCHEMA.map(lambda s: {"format": {"type": "json_schema", "name": "a", "schema": s}})
                                     | st.just({"format": {"type": "json_object"}}))})
TOKENIZE = bodies({}, {"model": optional(st.just(NAME)), "prompt": optional(GOOD_TEXT), "messages": optional(MESSAGES),
                       "add_special_tokens": optional(st.booleans()), "add_generation_prompt": optional(st.booleans()),
                       "return_token_strs": optional(st.booleans())})
DETOKENIZE = bodies({"tokens": TOKEN_IDS}, {"model": optional(st.just(NAME))})


def body_of(value: object) -> bytes:
    """JSON as a client sends it (lone surrogates written as \\udxxx escapes, NaN and inf as
    Python's json writes them)."""
    return value if isinstance(value, bytes) else json.dumps(value).encode()


# --- what every answer must be ------------------------------------------------------------------


def check_answer(method: str, resp) -> None:
    """Never a 5xx; a 4xx is OpenAI's error JSON; a 200 is JSON or an SSE stream of JSON events
    ending with [DONE] and without error events."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    event(f"status {resp.status_code}")  # --hypothesis-show-statistics: how many were served
    if method == "HEAD":
        assert resp.content == b""
        return
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"] == "invalid_request_error", body
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
        return
    if resp.headers["content-type"].startswith("text/event-stream") and "event: " in resp.text:  # /v1/responses: typed events
        events = [json.loads(line.removeprefix("data: ")) for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    elif resp.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1]), events
    elif resp.headers["content-type"].startswith("application/json"):
        resp.json()


def post(http: TestClient, path: str, body: object) -> None:
    check_answer("POST", http.post(path, content=body_of(body), headers={"Content-Type": "application/json"}))


# --- the tests ----------------------------------------------------------------------------------


@FUZZ
@given(body=COMPLETION)
@example(body={"prompt": "\ud800", "max_tokens": 3})
@example(body={"prompt": "hi", "stop": ["\ud800"], "max_tokens": 3})
@example(body={"prompt": "hi", "max_tokens": 2**70})
@example(body={"prompt": "hi", "max_tokens": 1e308})
@example(body={"prompt": "hi", "max_tokens": 2, "top_p": None, "n": None, "logprobs": None, "frequency_penalty": None,
               "presence_penalty": None, "stream": None, "top_k": None, "min_p": None, "repetition_penalty": None,
               "min_tokens": None, "ignore_eos": None, "echo": None, "best_of": None, "include_stop_str_in_output": None})
@example(body={"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
@example(body={"prompt": "hi", "\ud800": 1})
def test_completions_never_5xx(http, body):
    post(http, "/v1/completions", body)


@FUZZ
@given(body=CHAT)
@example(body={"messages": [{"role": "user", "content": "hi \udc00"}], "max_tokens": 3})
@example(body={"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "x"}], "max_completion_tokens": 2})
@example(body={"messages": [{"role": "tool", "content": "42", "tool_call_id": "\ud800"}], "max_completion_tokens": 2})
@example(body={"messages": [{"role": "user", "content": "hi", "\udc00": None}], "max_completion_tokens": 2})
def test_chat_completions_never_5xx(http, body):
    post(http, "/v1/chat/completions", body)


@FUZZ
@given(body=RESPONSES)
@example(body={"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
                         {"type": "function_call_output", "call_id": "c", "output": "1"}], "max_output_tokens": 2, "stream": True})
@example(body={"input": "hi", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
               "stream": True})
def test_responses_never_5xx(http, body):
    post(http, "/v1/responses", body)


@FUZZ
@given(request=st.tuples(st.just("/tokenize"), TOKENIZE) | st.tuples(st.just("/detokenize"), DETOKENIZE))
@example(request=("/tokenize", {"prompt": "\ud800"}))
@example(request=("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]}))
@example(request=("/detokenize", {"tokens": [2**70]}))
def test_tokenize_detokenize_never_5xx(http, request):
    post(http, *request)


@FUZZ
@given(method=st.sampled_from(["GET", "HEAD", "POST", "DELETE"]),
       path=st.sampled_from(["/v1/models", "/health", "/metrics", "/v1/completions", "/nowhere"])
       | st.text(max_size=12).map(lambda s: "/v1/models/" + urllib.parse.quote(s, safe="", errors="surrogatepass")),
       body=st.none() | st.binary(max_size=24))
@example(method="GET", path="/v1/models/tiny", body=None)
@example(method="GET", path="/v1/models/%ED%A0%80", body=None)  # a lone surrogate's bytes in the path
@example(method="HEAD", path="/health", body=None)
def test_other_endpoints_never_5xx(http, method, path, body):
    check_answer(method, http.request(method, path, content=body))


def test_a_choice_the_tokenizer_cannot_spell_is_a_400(http):
    """Found by test_completions_never_5xx: llguidance allowed the first byte token of U+40000 and
    then refused it, and the request ended with no token (a 500); the choice is now checked at
    submit against the matcher."""
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "guided_choice": ["\U00040000"]})
    assert resp.status_code == 400, resp.text
    assert "cannot be generated with this tokenizer" in resp.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")
